"""A vLLM V1 /metrics page builder: the numbers one engine shows, and the page for several engines."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class VllmState:
    """The numbers a vLLM V1 server's /metrics page shows for one engine."""

    model_name: str = "Qwen/Qwen3-8B"
    engine: str = "0"
    running: float = 0
    waiting: float = 0
    kv_usage_ratio: float = 0.0
    num_gpu_blocks: int = 4096
    block_size: int = 16
    preemptions: float = 0
    prompt_tokens: float = 0
    generation_tokens: float = 0
    engine_steps: float = 0  # count of vllm:iteration_tokens_total
    iteration_tokens_sum: float = 0
    # vllm:iteration_tokens_total's cumulative counts per finite upper bound (vLLM's edges); none: +Inf only.
    iteration_buckets: dict[float, float] = field(default_factory=dict)
    # vllm:prompt_tokens_by_source_total{source="local_compute"} (0.16 on); None: the family is absent.
    prompt_tokens_computed: float | None = None
    cache_dtype: str = "auto"
    # ITL histogram: cumulative counts per upper bound (the +Inf count is itl_count).
    itl_buckets: dict[float, float] = field(default_factory=lambda: {0.01: 0, 0.025: 0, 0.05: 0, 0.1: 0})
    itl_count: float = 0
    itl_sum: float = 0.0
    # The request counters (vllm:time_to_first_token_seconds, request_prompt_tokens, request_generation_tokens):
    # absent where first_tokens is None, as on pages built before the reading counted contexts by them.
    first_tokens: float | None = None
    finished_requests: float = 0
    finished_prompt_tokens: float = 0
    finished_generation_tokens: float = 0


def _number(value: float) -> str:
    if value != value:
        return "NaN"
    if abs(value) == float("inf"):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def vllm_page(*states: VllmState) -> str:
    """A vLLM V1 page (current-era names, `engine` label, `_created` series) for the given engines."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, dict[str, str], float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for sample_name, labels, value in samples:
            text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            lines.append(f"{sample_name}{{{text}}} {_number(value)}")

    def ids(state: VllmState) -> dict[str, str]:
        return {"model_name": state.model_name, "engine": state.engine}

    family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
           [("vllm:num_requests_running", ids(s), s.running) for s in states])
    family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
           [("vllm:num_requests_waiting", ids(s), s.waiting) for s in states])
    family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           [("vllm:kv_cache_usage_perc", ids(s), s.kv_usage_ratio) for s in states])
    family("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
           [("vllm:num_preemptions_total", ids(s), s.preemptions) for s in states])
    family("vllm:num_preemptions_created", "gauge", "Cumulative number of preemption from the engine.",
           [("vllm:num_preemptions_created", ids(s), 1.7959705e9) for s in states])
    family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
           [("vllm:prompt_tokens_total", ids(s), s.prompt_tokens) for s in states])
    family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
           [("vllm:generation_tokens_total", ids(s), s.generation_tokens) for s in states])
    computed = [s for s in states if s.prompt_tokens_computed is not None]
    if computed:
        family("vllm:prompt_tokens_by_source_total", "counter", "Number of prompt tokens by source.",
               [("vllm:prompt_tokens_by_source_total", {**ids(s), "source": source}, value) for s in computed
                for source, value in (("local_compute", s.prompt_tokens_computed),
                                      ("local_cache_hit", s.prompt_tokens - (s.prompt_tokens_computed or 0)),
                                      ("external_kv_transfer", 0.0))])
    iteration: list[tuple[str, dict[str, str], float]] = []
    for s in states:
        iteration += [("vllm:iteration_tokens_total_bucket", {**ids(s), "le": repr(float(le))}, count)
                      for le, count in sorted(s.iteration_buckets.items())]
        iteration += [("vllm:iteration_tokens_total_bucket", {**ids(s), "le": "+Inf"}, s.engine_steps),
                      ("vllm:iteration_tokens_total_count", ids(s), s.engine_steps),
                      ("vllm:iteration_tokens_total_sum", ids(s), s.iteration_tokens_sum)]
    family("vllm:iteration_tokens_total", "histogram", "Histogram of number of tokens per engine_step.", iteration)
    itl: list[tuple[str, dict[str, str], float]] = []
    for s in states:
        for bound, count in sorted(s.itl_buckets.items()):
            itl.append(("vllm:inter_token_latency_seconds_bucket", {**ids(s), "le": repr(float(bound))}, count))
        itl += [("vllm:inter_token_latency_seconds_bucket", {**ids(s), "le": "+Inf"}, s.itl_count),
                ("vllm:inter_token_latency_seconds_count", ids(s), s.itl_count),
                ("vllm:inter_token_latency_seconds_sum", ids(s), s.itl_sum)]
    family("vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.", itl)
    counted = [s for s in states if s.first_tokens is not None]
    if counted:
        family("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
               [row for s in counted for row in (
                   ("vllm:time_to_first_token_seconds_bucket", {**ids(s), "le": "+Inf"}, s.first_tokens or 0.0),
                   ("vllm:time_to_first_token_seconds_count", ids(s), s.first_tokens or 0.0),
                   ("vllm:time_to_first_token_seconds_sum", ids(s), 0.1 * (s.first_tokens or 0.0)))])
        for name, what in (("request_prompt_tokens", "finished_prompt_tokens"),
                           ("request_generation_tokens", "finished_generation_tokens")):
            family(f"vllm:{name}", "histogram", f"Number of {name.split('_')[1]} tokens processed.",
                   [row for s in counted for row in (
                       (f"vllm:{name}_bucket", {**ids(s), "le": "+Inf"}, s.finished_requests),
                       (f"vllm:{name}_count", ids(s), s.finished_requests),
                       (f"vllm:{name}_sum", ids(s), getattr(s, what)))])
    # vLLM's front end sums num_gpu_blocks over its data-parallel engines and writes the sum on every
    # engine's series (0.33.0 vllm/v1/engine/core_client.py l. 873-877).
    summed_blocks = sum(s.num_gpu_blocks for s in states)
    family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
           [("vllm:cache_config_info", {"block_size": str(s.block_size), "cache_dtype": s.cache_dtype,
                                            "engine": s.engine, "num_gpu_blocks": str(summed_blocks),
                                            "gpu_memory_utilization": "0.9"}, 1.0)
            for s in states])
    return "\n".join(lines) + "\n"

