"""What an engine adapter reads off one model server's /metrics page at one poll.

This is the contract between the engine adapters (exporter/serve/engines/) and everything downstream
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
    # The waiting requests held back by scheduling capacity (batch slots, token budget, KV blocks),
    # as opposed to those deferred by a transient constraint (LoRA budget, a KV transfer, a grammar
    # being compiled): vLLM's num_requests_waiting_by_reason{reason="capacity"} (0.32.0
    # vllm/v1/metrics/loggers.py l. 1155-1160; the deferred share is scheduler.py's deferred_waiting).
    requests_waiting_for_capacity: float | None = None
    kv_cache_usage_ratio: float | None = None  # 0-1
    kv_cache_capacity_tokens: float | None = None
    # Blocks in this engine's KV pool (vLLM: num_gpu_blocks, which the front end sums over
    # data-parallel engines, divided back). Hybrid-KV models need it: there usage counts blocks
    # across KV groups, not tokens.
    kv_cache_blocks: float | None = None
    # What the running requests' decode steps read: the sum of each one's whole context, a prefix
    # several of them share counted once for each. Engines that report it fill it (SGLang's
    # decode_sum_seq_lens, the running batch's summed seq_lens: 0.5.23
    # managers/scheduler_components/metrics_reporter.py `_decode_total_seq_lens`); on vLLM the reading
    # derives it from the request counters (exporter/serve/open_context.py).
    tokens_in_flight: float | None = None
    # The tokens the KV cache holds, a shared block counted once (SGLang's kv_used_tokens /
    # num_used_tokens); vLLM's is derived from its usage ratio and blocks.
    kv_cache_used_tokens: float | None = None
    # Tokens the running batch has reserved KV for, not those it holds (TGI's tgi_batch_current_max_tokens:
    # each request's prompt + max_new_tokens, in whole blocks). Engines that say what is held leave it None.
    kv_cache_reserved_tokens: float | None = None
    inter_token_latency: Histogram | None = None
    # Every prompt token the server took in, prefix-cache hits included (vLLM counts a prompt's
    # full length when its prefill finishes: vllm/v1/metrics/loggers.py, 0.33.0 l. 1262).
    prompt_tokens_total: float | None = None
    # Prompt tokens the engine computed itself: vLLM's prompt_tokens_by_source_total{source=
    # "local_compute"} (0.33.0 loggers.py l. 1266). Cache hits and KV received from another instance
    # (external_kv_transfer) cost no prefill compute and are not in it.
    prompt_tokens_computed_total: float | None = None
    # Prompt tokens served from a cache, local or external (vllm:prompt_tokens_cached_total).
    prompt_tokens_cached_total: float | None = None
    generation_tokens_total: float | None = None
    # Prompt tokens the scheduler admitted, and the cache hits among them, counted when a request is
    # first scheduled, before its first chunk runs (vllm:prefix_cache_queries_total and _hits_total:
    # 0.32.0 vllm/v1/core/sched/scheduler.py l. 1314-1316, vllm/v1/core/kv_cache_manager.py l. 253-262);
    # none while prefix caching is off. Beside the prompt counters above, which move only when a
    # prompt's last chunk finishes, they say how much prompt is part-way through its prefill.
    prompt_tokens_admitted_total: float | None = None
    prompt_tokens_admitted_cached_total: float | None = None
    # The local cache hits of the prompts counted so far (prompt_tokens_by_source_total{source=
    # "local_cache_hit"}, counted with the prompt: 0.32.0 vllm/v1/metrics/loggers.py l. 1266).
    prompt_tokens_local_cache_hit_total: float | None = None
    # Prompt and sampled tokens of the requests that finished (the _sum of vllm:request_prompt_tokens and
    # vllm:request_generation_tokens, observed once per finished request: loggers.py l. 1318-1323).
    finished_prompt_tokens_total: float | None = None
    finished_generation_tokens_total: float | None = None
    # Requests that finished (the _count of vllm:request_prompt_tokens) and requests that got their first
    # token (vllm:time_to_first_token_seconds, one observation per request when its prefill ends:
    # 0.32.0 vllm/v1/metrics/stats.py l. 517-522): their difference is the requests open past their prefill.
    finished_requests_total: float | None = None
    time_to_first_token: Histogram | None = None
    # Prompt tokens whose KV arrived from another instance (P/D disaggregation; vLLM's
    # prompt_tokens_by_source_total{source="external_kv_transfer"}, 0.32.0 vllm/v1/metrics/stats.py
    # PromptTokenStats): no prefill ran for them here.
    prompt_tokens_transferred_total: float | None = None
    # Of the prompt tokens admitted, those a KV connector will load from another instance, counted at
    # admission with the local lookups (vllm:external_prefix_cache_hits_total: 0.32.0
    # vllm/v1/core/sched/scheduler.py l. 1294-1311): admitted, yet never computed here.
    prompt_tokens_admitted_external_total: float | None = None
    preemptions_total: float | None = None
    # Engine steps so far (vLLM: the count of the iteration-tokens histogram), for prefill per step.
    engine_steps_total: float | None = None
    # Tokens each engine step scheduled (vllm:iteration_tokens_total: computed prompt tokens plus
    # sampled tokens, one observation per step), for predicting the mean over the step mix.
    iteration_tokens: Histogram | None = None
    # The server's own analytic bytes read per GPU, summed over its steps (vLLM with
    # --enable-mfu-metrics: vllm:estimated_read_bytes_per_gpu_total; 0.32.0 vllm/v1/metrics/perf.py).
    server_read_bytes_total: float | None = None
    # Requests the server's front end refused at its queue limits (vllm:admission_rejections_total,
    # summed over its reasons): they never reached the engine, so they hold no KV and take no steps.
    admission_rejections_total: float | None = None
    # What the server says of the engine's sleep (vllm:engine_sleep_state): "awake", or asleep as
    # "weights_offloaded" (level 1), "discard_all" (level 2) or "kv_cache_released" (KV memory only).
    sleep_state: str | None = None
    # Speculative decoding (vLLM: vllm:spec_decode_num_*_total, 0.32.0 vllm/v1/spec_decode/metrics.py
    # l. 41-49 and 266-279; vllm/v1/core/sched/scheduler.py l. 2110-2134): accepted tokens are the drafts'
    # tokens the target model kept; a request-step yields its accepted tokens plus one. The drafts count
    # (vllm:spec_decode_num_drafts_total) is not read: it leaves out request-steps that proposed nothing
    # (window.tokens_per_step says why the ITL count is the divisor).
    spec_decode_draft_tokens_total: float | None = None
    spec_decode_accepted_tokens_total: float | None = None
    # SGLang's sglang:spec_accept_length: tokens per request per forward (accepted drafts + the bonus
    # token) over its last decode log interval, 0 without speculative decoding (0.5.23
    # managers/scheduler_components/metrics_reporter.py l. 966-973).
    spec_accept_length: float | None = None
    block_size_tokens: int | None = None
    # The KV cache dtype the server runs with (vllm:cache_config_info's cache_dtype): "auto" follows
    # the model dtype, "fp8*" is one byte per element. It wins over the deployment config.
    kv_cache_dtype: str | None = None
    # KV bytes per token the server allocated, where its page says both the KV memory and the tokens it
    # holds (vLLM's cache_config_info kv_cache_memory_bytes / kv_cache_size_tokens): what it really runs.
    kv_cache_bytes_per_token: float | None = None
    # Which process wrote the page (exporter/serve/process_identity.py): the page's
    # process_start_time_seconds, and the `_created` value of this engine's generation-token counter
    # (when the process created it; prometheus_client writes it in single-process mode). Unix seconds,
    # the server's clock; None where the page has neither (SGLang, TGI, multiprocess mode).
    process_start_seconds: float | None = None
    created_seconds: float | None = None
    missing: tuple[str, ...] = field(default_factory=tuple)
    # Fields that hold one server-wide figure rather than this engine's own (SGLang's tokenizer-side
    # ITL histogram and token counters under --dp-size carry no dp_rank).
    server_wide: tuple[str, ...] = field(default_factory=tuple)

    @property
    def used_block_tokens(self) -> float | None:
        """The token slots of the KV blocks in use, from a vLLM page's usage and its blocks: the usage is
        1 - free / (num_gpu_blocks - 1), as the null block is never handed out (0.32.0
        vllm/v1/core/block_pool.py l. 884-888). None where the page does not give both."""
        usage, blocks, block = self.kv_cache_usage_ratio, self.kv_cache_blocks, self.block_size_tokens
        if usage is None or not blocks or blocks < 2 or not block:
            return None
        return usage * (blocks - 1) * block


def counter_delta(previous: Snapshot, current: Snapshot, name: str) -> float | None:
    """A Snapshot field's change between two polls of one engine; None where either lacks it."""
    before, now = getattr(previous, name), getattr(current, name)
    return None if before is None or now is None else now - before
