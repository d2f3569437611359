"""The simulator's data: how the server is set up (`ServerSpec`), a request inside it (`SimRequest`), and one
step an engine ran (`StepRecord`).

One job: the shapes the engine, the server around it, the HTTP wrapper and the tests all pass around.
Why apart: they are read by every other simulator module, so they live in none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from exporter.simulator.hardware import HardwareTruth
from exporter.simulator.vllm_metrics import DEFAULT_VERSION


@dataclass(frozen=True)
class ServerSpec:
    """How the simulated server is set up (the public side: what `vllm serve` flags would say)."""

    model: str = "qwen3-8b"
    gpu: str = "h100-sxm"
    served_model_name: str | None = None  # default: the model preset's name
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float = 3.0e9  # vLLM profiles peak activations + CUDA graphs; fixed here
    block_size_tokens: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 131072
    kv_cache_dtype: str = "auto"
    weight_bytes_per_param: float = 2.0
    vllm_version: str = DEFAULT_VERSION
    engine_index: str = "0"  # the first engine's label; data-parallel engines count on from it
    data_parallel_size: int = 1
    enable_prefix_caching: bool = True  # vLLM V1's default
    enable_mfu_metrics: bool = False  # vLLM's --enable-mfu-metrics: count the steps' FLOPs and bytes on the page
    # Speculative decoding (--speculative-config num_speculative_tokens): every decoding request-step
    # verifies this many draft tokens beside its own, and yields 1 + the accepted ones, whose mean is
    # `spec_acceptance_length` - 1 (vLLM's "mean acceptance length" 1 + accepted / drafts).
    num_speculative_tokens: int = 0
    spec_acceptance_length: float = 1.0
    seed: int = 0
    truth: HardwareTruth = field(default_factory=HardwareTruth)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def fit_context(self, prompt_tokens: int, output_tokens: int) -> tuple[int, int]:
        """A scenario draw clipped to the context window rather than rejected."""
        prompt_tokens = min(prompt_tokens, self.max_model_len - 1)
        return prompt_tokens, max(1, min(output_tokens, self.max_model_len - prompt_tokens))


@dataclass
class SimRequest:
    """One request inside the simulated engine."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrival_seconds: float
    group: str = "http"
    user: int | None = None
    leave_at_seconds: float | None = None
    finish_reason_at_max: str = "length"  # "stop" for scenario requests: they model a natural end
    on_token: Callable[[SimRequest], None] | None = None
    on_finish: Callable[[SimRequest], None] | None = None
    cached_prefix_tokens: int = 0  # of the prompt, already in this engine's prefix cache
    shared_prefix_tokens: int = 0  # of the prompt, its group's common prefix (one system prompt for all)
    engine: int = 0  # index into Simulator.engines
    output_tokens: int = 0
    computed_tokens: int = 0
    blocks: int = 0  # its whole block table (shared prefix blocks included): what its attention reads
    shared_blocks: int = 0  # of those, leading blocks that are its group's cached shared-prefix blocks
    preemptions: int = 0
    prefix_hit_tokens: int = 0  # the hit at its first admission (vLLM's PrefillStats.num_local_cached_tokens)
    reported_cached_tokens: int = 0  # the hit reported with the first token (OutputProcessor's num_cached_tokens)
    first_scheduled_seconds: float | None = None
    first_token_seconds: float | None = None
    last_token_seconds: float | None = None
    finished_seconds: float | None = None
    finish_reason: str | None = None

    @property
    def known_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepRecord:
    """One engine step, for tests and benchmarks (not on the page)."""

    start_seconds: float
    end_seconds: float
    seconds: float
    decode_tokens: int
    prefill_tokens: int  # prompt (and recomputed) tokens computed in the step; cache hits excluded
    running: int
    waiting: int
    held_tokens: int  # block-rounded tokens the cache holds after the step (used blocks: a shared one once)
    used_blocks: int
    memory_seconds: float
    compute_seconds: float
    engine: int = 0
    sampled_tokens: int = 0  # tokens generated in the step (first tokens included)
    reported_prompt_tokens: int = 0  # prompt tokens vLLM reports with this step's first tokens
    iteration_tokens: int = 0  # what vLLM's iteration_tokens_total observes for the step
    read_tokens: int = 0  # block-rounded tokens the step's attention read: every scheduled block table, whole
