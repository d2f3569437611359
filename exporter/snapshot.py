"""What an engine adapter reads off one model server's /metrics page at one poll.

This is the contract between the engine adapters (exporter/engines/) and everything downstream
(window, model, reading, collector, alert loop). A value the page does not offer is None, never a
guess; `missing` says which and why, so the daemon can log it and export only what it knows.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Histogram:
    """A classic Prometheus histogram at one instant: cumulative bucket counts by upper bound.

    `buckets` is sorted by upper bound and ends with +Inf (whose count equals `count`). Bucket
    edges come from the page; servers may override the defaults.
    """

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float


@dataclass(frozen=True)
class Snapshot:
    """One engine (one `model_name` on one target page) at one poll."""

    kind: str  # "vllm" | "sglang" | "tgi"
    model_name: str
    # The server's own engine index: vLLM's `engine` label (its data-parallel engine-core index),
    # SGLang's dp rank; "0" where the page has none. Each engine has its own batch and KV cache,
    # so each is its own reading and the exported `engine` label carries this value.
    engine: str
    requests_running: float | None = None
    requests_waiting: float | None = None
    kv_cache_usage_ratio: float | None = None  # 0–1
    kv_cache_capacity_tokens: float | None = None
    # Engines that report used tokens directly (SGLang's num_used_tokens) fill this; otherwise
    # the reading derives it as usage ratio x capacity.
    tokens_in_flight: float | None = None
    inter_token_latency: Histogram | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    preemptions_total: float | None = None
    # Engine steps so far (vLLM: the count of the iteration-tokens histogram), for prefill per step.
    engine_steps_total: float | None = None
    block_size_tokens: int | None = None
    missing: tuple[str, ...] = field(default_factory=tuple)
