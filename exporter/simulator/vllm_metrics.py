"""The simulated server's /metrics page, rendered the way vLLM renders it.

vLLM declares prometheus_client Counters/Gauges/Histograms in `vllm/v1/metrics/loggers.py`; the
page is prometheus_client's text format (`_created` series included in single-process mode).
Names, HELP strings, types, label names and default bucket edges below are copied from
shared/reference/vllm_metrics/REPORT.md §a.2–a.5 (loggers.py @5b846bf6, buckets.py @139b1c3f and
the older versions it lists). The simulator keeps its own plain-number counters (a step updates
dozens of requests at once) and a custom collector turns them into prometheus_client families on a
PRIVATE CollectorRegistry, so `generate_latest` renders them exactly like vLLM's own objects:
counters get `_total` and a separate `_created` family, `le` values print as floats.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

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
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # one child pre-created per reason
FINISH_REASONS_0_8 = ("stop", "length", "abort")


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
    buckets: str = ""  # "ttft" | "itl" | "reqlat" | "iter" | "125" | "preempt"


_H_RUNNING = "Number of requests in model execution batches."
_H_WAITING = "Number of requests waiting to be processed."
_H_WAITING_BY_REASON = ("Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
                        "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
                        "status). Sum of all reasons equals vllm:num_requests_waiting.")

_CURRENT: tuple[Family, ...] = (
    Family("running", "vllm:num_requests_running", _H_RUNNING, "gauge"),
    Family("waiting", "vllm:num_requests_waiting", _H_WAITING, "gauge"),
    Family("waiting_by_reason", "vllm:num_requests_waiting_by_reason", _H_WAITING_BY_REASON, "gauge", ("reason",)),
    Family("kv_usage", "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "gauge"),
    Family("prefix_queries", "vllm:prefix_cache_queries",
           "Prefix cache queries, in terms of number of queried tokens.", "counter"),
    Family("prefix_hits", "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
           "counter"),
    Family("preemptions", "vllm:num_preemptions", "Cumulative number of preemption from the engine.", "counter"),
    Family("prompt_tokens", "vllm:prompt_tokens", "Number of prefill tokens processed.", "counter"),
    Family("generation_tokens", "vllm:generation_tokens", "Number of generation tokens processed.", "counter"),
    Family("request_success", "vllm:request_success", "Count of successfully processed requests.", "counter",
           ("finished_reason",)),
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


def _replace(families: tuple[Family, ...], key: str, *replacements: Family) -> tuple[Family, ...]:
    out: list[Family] = []
    for family in families:
        out.extend(replacements if family.key == key else (family,))
    return tuple(out)


def _drop(families: tuple[Family, ...], *keys: str) -> tuple[Family, ...]:
    return tuple(f for f in families if f.key not in keys)


@dataclass(frozen=True)
class VersionLayout:
    """What one vLLM release line exposes (REPORT.md §a.5 rename table)."""

    families: tuple[Family, ...]
    engine_label: bool
    finish_reasons: tuple[str, ...]
    cache_config_labels: tuple[str, ...]


_CACHE_LABELS_CURRENT = ("block_size", "gpu_memory_utilization", "cache_dtype", "enable_prefix_caching",
                         "prefix_caching_hash_algo", "num_gpu_blocks", "num_cpu_blocks", "kv_cache_size_tokens",
                         "kv_cache_max_concurrency", "kv_cache_memory_bytes")
_CACHE_LABELS_OLD = ("block_size", "gpu_memory_utilization", "cache_dtype", "enable_prefix_caching",
                     "num_gpu_blocks", "num_cpu_blocks", "sliding_window", "is_attention_free")

_BASE_0_11 = _drop(_CURRENT, "request_tpot", "request_preemptions", "waiting_by_reason")

VERSIONS: dict[str, VersionLayout] = {
    # current main / 0.12 and later: kv_cache_usage_perc and inter_token_latency_seconds only.
    "latest": VersionLayout(_CURRENT, True, FINISH_REASONS, _CACHE_LABELS_CURRENT),
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
        for edge, count in zip(self.edges + (float("inf"),), self.counts):
            running += count
            out.append((floatToGoString(edge), running))
        return out


@dataclass
class EngineCounters:
    """Everything the page shows, as plain numbers the engine updates."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage_ratio: float = 0.0
    preemptions: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    request_success: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, HistogramValue] = field(default_factory=dict)


class VllmPage:
    """Renders one simulated engine's counters as vLLM's /metrics page."""

    def __init__(self, version: str, model_name: str, max_model_len: int, cache_config: dict[str, str],
                 engine_index: str = "0", created_unix_seconds: float | None = None) -> None:
        self.layout = version_layout(version)
        self.model_name = model_name
        self.engine_index = engine_index
        self.created_unix_seconds = time.time() if created_unix_seconds is None else created_unix_seconds
        self.cache_config = {key: cache_config.get(key, "None") for key in self.layout.cache_config_labels}
        edges = {"ttft": TTFT_BUCKETS_SECONDS, "itl": ITL_BUCKETS_SECONDS, "reqlat": REQUEST_LATENCY_BUCKETS_SECONDS,
                 "iter": tuple(float(b) for b in ITERATION_TOKEN_BUCKETS), "125": buckets_1_2_5(max_model_len),
                 "preempt": tuple(float(b) for b in PREEMPTION_BUCKETS)}
        self.counters = EngineCounters(request_success={reason: 0.0 for reason in self.layout.finish_reasons})
        for family in _CURRENT + (_TPOT_DEPRECATED,):
            if family.kind == "histogram":
                self.counters.histograms[family.key] = HistogramValue(edges[family.buckets])
        self.registry = CollectorRegistry(auto_describe=False)
        # A real vLLM page carries the process's own python_*/process_* families.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(_PageCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def base_labels(self) -> dict[str, str]:
        labels = {"model_name": self.model_name}
        if self.layout.engine_label:
            labels["engine"] = self.engine_index
        return labels

    def families(self) -> Iterator[Metric]:
        counters = self.counters
        base = self.base_labels()
        gauge_values = {"running": counters.running, "waiting": counters.waiting,
                        "kv_usage": counters.kv_usage_ratio, "kv_usage_deprecated": counters.kv_usage_ratio}
        counter_values = {"preemptions": counters.preemptions, "prompt_tokens": counters.prompt_tokens,
                          "generation_tokens": counters.generation_tokens, "prefix_queries": 0.0,
                          "prefix_hits": 0.0}
        for family in self.layout.families:
            metric = Metric(family.name, family.help, family.kind)
            if family.kind == "gauge" and family.key == "waiting_by_reason":
                metric.add_sample(family.name, {**base, "reason": "capacity"}, counters.waiting)
                metric.add_sample(family.name, {**base, "reason": "deferred"}, 0.0)
            elif family.kind == "gauge":
                metric.add_sample(family.name, base, gauge_values[family.key])
            elif family.key == "request_success":
                for reason, value in counters.request_success.items():
                    self._counter_samples(metric, {**base, "finished_reason": reason}, value)
            elif family.kind == "counter":
                self._counter_samples(metric, base, counter_values[family.key])
            else:
                key = "itl" if family.key == "tpot_deprecated" else family.key
                self._histogram_samples(metric, base, counters.histograms[key])
            yield metric
        info = Metric("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge")
        info_labels = dict(self.cache_config)
        if self.layout.engine_label:
            info_labels["engine"] = self.engine_index
        info.add_sample("vllm:cache_config_info", info_labels, 1.0)
        yield info

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
