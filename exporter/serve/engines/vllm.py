"""vLLM's /metrics page (V0, V1 and current releases) -> one Snapshot per (model_name, engine).

Facts and their sources: shared/reference/vllm_metrics/REPORT.md §a (names, renames, labels).
- `vllm:kv_cache_usage_perc` is a 0-1 fraction despite its name; before 0.9.2 it was
  `vllm:gpu_cache_usage_perc` (both exported 0.9.2-0.10.x, old one gone from 0.12).
- ITL histogram `vllm:inter_token_latency_seconds`; before 0.10.2 `vllm:time_per_output_token_seconds`
  (gone from 0.13). While both existed they held the same observations; ITL is preferred.
- Engine steps: the `_count` of the `vllm:iteration_tokens_total` histogram (one observation per step);
  each observation is the step's computed prompt tokens plus its sampled tokens (0.33.0
  vllm/v1/metrics/loggers.py l. 1273), so its buckets give the window's mix of step sizes.
- Prompt tokens: `vllm:prompt_tokens_total` counts a prompt's full length, prefix-cache hits included
  (loggers.py l. 1262; stats.py l. 501-503). The computed share is
  `vllm:prompt_tokens_by_source_total{source="local_compute"}` (l. 1266); `vllm:prompt_tokens_cached_total`
  is the cached share (l. 1269).
- Capacity: labels of `vllm:cache_config_info`, which has no `model_name` (one series per engine):
  `kv_cache_size_tokens` (0.24.0 on; kept per engine) where present, else `num_gpu_blocks * block_size`
  divided by the engines on the page: the front end sums every data-parallel engine's
  `num_gpu_blocks` into the one CacheConfig all engines' series are written from (0.23.0
  vllm/v1/engine/core_client.py l. 722-726; 0.33.0 l. 873-877; 0.10.2/0.11.0 vllm/v1/engine/utils.py
  l. 835-839). Label values are strings and may be "None".
- `cache_dtype` and `block_size` on `vllm:cache_config_info` are what the server runs with and win
  over the deployment config.
- 0.32.0 families (tests/data/vllm-0.32.0-cpu/, a real server's pages): `vllm:estimated_read_bytes_per_gpu_total`
  (with --enable-mfu-metrics) is vLLM's analytic bytes read per GPU, incremented once per engine step by that step's
  estimate (vllm/v1/metrics/perf.py l. 1535-1593 builds it from the scheduler output, l. 1799-1808 adds it;
  scheduler.py l. 2050-2052 asks for it each step; loggers.py l. 1207-1208 records it). What it counts and how it
  differs from our bytes: docs/model.md.
  `vllm:num_requests_waiting_by_reason{reason="capacity"}` is the waiting requests less the deferred ones
  (loggers.py l. 1148-1160; scheduler.py l. 2944-2948: deferred are requests skipped for a LoRA budget, an
  unknown external-KV match, stale output, or a blocked status, l. 904-910 and l. 2437-2442).
  `vllm:engine_sleep_state` and `vllm:admission_rejections_total`: see `sleep_state` and `_admission_rejections`.
- Speculative decoding: `vllm:spec_decode_num_draft_tokens_total` and `_num_accepted_tokens_total` (docs/engines.md;
  `_num_drafts_total` is not read: window.tokens_per_step). The ITL histogram then still has one
  observation per request per step, which carries 1 + accepted tokens (0.32.0 vllm/v1/metrics/stats.py
  l. 514 and 548-552).
"""

from __future__ import annotations

import math

from exporter.serve.engines.exposition import Labels, PageScan, parse_value
from exporter.serve.engines.families import (
    Adapter,
    EngineLabels,
    FamilySpec,
    Identity,
    Selection,
    engines_per_model,
)

CACHE_CONFIG = "vllm:cache_config_info"
SLEEP_STATE = "vllm:engine_sleep_state"
ADMISSION_REJECTIONS = "vllm:admission_rejections_total"

SPECS = (
    FamilySpec("requests_running", ("vllm:num_requests_running",), "gauge"),
    FamilySpec("requests_waiting", ("vllm:num_requests_waiting",), "gauge"),
    FamilySpec("requests_waiting_for_capacity", ("vllm:num_requests_waiting_by_reason",), "gauge",
               match=(("reason", "capacity"),), optional=True),
    FamilySpec("kv_cache_usage_ratio", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), "gauge"),
    FamilySpec(
        "inter_token_latency",
        ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        "histogram",
    ),
    FamilySpec("prompt_tokens_total", ("vllm:prompt_tokens_total",), "counter"),
    FamilySpec("prompt_tokens_computed_total", ("vllm:prompt_tokens_by_source_total",), "counter",
               match=(("source", "local_compute"),), optional=True),
    FamilySpec("prompt_tokens_cached_total", ("vllm:prompt_tokens_cached_total",), "counter", optional=True),
    FamilySpec("generation_tokens_total", ("vllm:generation_tokens_total",), "counter"),
    # What a prompt part-way through its prefill has computed (vllm_prefill._in_progress_change).
    FamilySpec("prompt_tokens_admitted_total", ("vllm:prefix_cache_queries_total",), "counter", optional=True),
    FamilySpec("prompt_tokens_admitted_cached_total", ("vllm:prefix_cache_hits_total",), "counter", optional=True),
    FamilySpec("prompt_tokens_local_cache_hit_total", ("vllm:prompt_tokens_by_source_total",), "counter",
               match=(("source", "local_cache_hit"),), optional=True),
    FamilySpec("finished_prompt_tokens_total", ("vllm:request_prompt_tokens_sum",), "counter", optional=True),
    FamilySpec("finished_generation_tokens_total", ("vllm:request_generation_tokens_sum",), "counter",
               optional=True),
    FamilySpec("finished_requests_total", ("vllm:request_prompt_tokens_count",), "counter", optional=True),
    FamilySpec("time_to_first_token", ("vllm:time_to_first_token_seconds",), "histogram", optional=True),
    FamilySpec("prompt_tokens_transferred_total", ("vllm:prompt_tokens_by_source_total",), "counter",
               match=(("source", "external_kv_transfer"),), optional=True),
    FamilySpec("prompt_tokens_admitted_external_total", ("vllm:external_prefix_cache_hits_total",), "counter",
               optional=True),
    FamilySpec("preemptions_total", ("vllm:num_preemptions_total",), "counter"),
    FamilySpec("engine_steps_total", ("vllm:iteration_tokens_total_count",), "counter"),
    FamilySpec("iteration_tokens", ("vllm:iteration_tokens_total",), "histogram", optional=True),
    FamilySpec("server_read_bytes_total", ("vllm:estimated_read_bytes_per_gpu_total",), "counter", optional=True),
    # Only with --speculative-config (0.32.0 vllm/v1/spec_decode/metrics.py l. 211-213: no family without it).
    FamilySpec("spec_decode_draft_tokens_total", ("vllm:spec_decode_num_draft_tokens_total",), "counter",
               optional=True),
    FamilySpec("spec_decode_accepted_tokens_total", ("vllm:spec_decode_num_accepted_tokens_total",), "counter",
               optional=True),
    # When the process created the engine's generation-token counter (prometheus_client's `_created`,
    # single-process mode): which process wrote the page (exporter/serve/process_identity.py).
    FamilySpec("created_seconds", ("vllm:generation_tokens_created",), "gauge", optional=True),
)


def _positive_number(labels: dict[str, str], name: str) -> float | None:
    raw = labels.get(name)
    value = parse_value(raw.strip()) if raw is not None else None
    return value if value is not None and 0 < value < float("inf") else None


def capacity_from_cache_config(labels: dict[str, str], engines: int = 1) -> tuple[float | None, int | None]:
    """(capacity tokens of one engine, block size) from one `vllm:cache_config_info` label set.

    `engines`: how many data-parallel engines' `num_gpu_blocks` the front end summed into it.
    The block size is the full-attention group's where the page says it
    (`effective_attention_block_size`, 0.33.0 vllm/v1/engine/core.py l. 418-431): on hybrid models
    `block_size` is the smallest group's (core.py l. 347).
    """
    block_size = _positive_number(labels, "effective_attention_block_size") or _positive_number(labels, "block_size")
    block_size_tokens = int(block_size) if block_size is not None and block_size.is_integer() else None
    size_tokens = _positive_number(labels, "kv_cache_size_tokens")
    if size_tokens is not None:
        return size_tokens, block_size_tokens
    blocks = _positive_number(labels, "num_gpu_blocks")
    if blocks is None or block_size is None:
        return None, block_size_tokens
    return blocks / engines * block_size, block_size_tokens


def _cache_dtype(labels: dict[str, str]) -> str | None:
    value = labels.get("cache_dtype", "").strip()
    return value if value and value != "None" else None


def _apply_cache_config(scan: PageScan, selection: Selection, who_all: list[Identity]) -> None:
    series = [labels for labels, value in scan.samples.get(CACHE_CONFIG, ())]
    engines = max(1, len({labels["engine"] for labels in series if "engine" in labels}))
    for who in who_all:
        engine = who[1]
        mine = [labels for labels in series if labels.get("engine") == engine]
        mine = mine or [labels for labels in series if "engine" not in labels]
        values, missing = selection.values[who], selection.missing[who]
        if not mine:
            missing["kv_cache_capacity_tokens"] = f"no {CACHE_CONFIG} for engine {engine} (engine not initialised yet?)"
            missing["block_size_tokens"] = missing["kv_cache_capacity_tokens"]
            continue
        readings = [capacity_from_cache_config(labels, engines) for labels in mine]
        if len(set(readings)) > 1:
            selection.problems.append(f"{CACHE_CONFIG} disagrees with itself for engine {engine}: took the first")
        capacity, block_size = readings[0]
        if capacity is None:
            missing["kv_cache_capacity_tokens"] = (
                f"{CACHE_CONFIG} for engine {engine} has neither kv_cache_size_tokens nor num_gpu_blocks and block_size"
            )
        else:
            values["kv_cache_capacity_tokens"] = capacity
        if block_size is None:
            missing["block_size_tokens"] = f"{CACHE_CONFIG} for engine {engine} has no integer block_size"
        else:
            values["block_size_tokens"] = block_size
        dtype = _cache_dtype(mine[0])
        if dtype is not None:
            values["kv_cache_dtype"] = dtype
        blocks = _positive_number(mine[0], "num_gpu_blocks")
        if blocks is not None:
            values["kv_cache_blocks"] = blocks / engines
        per_token = kv_bytes_per_token_from_cache_config(mine[0])
        if per_token is not None:
            values["kv_cache_bytes_per_token"] = per_token


def kv_bytes_per_token_from_cache_config(labels: dict[str, str]) -> float | None:
    """The KV bytes per token the server allocated: `kv_cache_memory_bytes` (the KV memory per worker,
    0.32.0 vllm/config/cache.py l. 257-265; the CPU backend sets it from VLLM_CPU_KVCACHE_SPACE,
    vllm/platforms/cpu.py l. 327) over `kv_cache_size_tokens` (the tokens its blocks hold,
    vllm/v1/core/kv_cache_utils.py l. 2300-2321). None where either is "None" (on GPUs the memory is
    unset unless --kv-cache-memory-bytes is given) or the block count was overridden
    (--num-gpu-blocks-override), which sizes the cache apart from the memory."""
    if _positive_number(labels, "num_gpu_blocks_override") is not None:
        return None
    memory, tokens = _positive_number(labels, "kv_cache_memory_bytes"), _positive_number(labels, "kv_cache_size_tokens")
    return memory / tokens if memory is not None and tokens is not None else None


def sleep_state(flags: dict[str, float]) -> str | None:
    """The engine's sleep state from its `vllm:engine_sleep_state` series (sleep_state label -> value).

    vLLM writes all three at once (0.32.0 vllm/v1/metrics/loggers.py l. 1335-1352): awake=1 when awake
    (the value set at start, l. 617); asleep, awake=0 with weights_offloaded=1 at sleep level 1 or
    discard_all=1 at level 2 (AsyncLLM.sleep, vllm/v1/engine/async_llm.py l. 1154-1160), or both 0 when
    only the KV cache memory was released (release_kv_cache_memory, l. 1162-1167). A sleeping engine
    runs no steps: its empty batch is not spare capacity.
    """
    awake = flags.get("awake")
    if awake is None:
        return None
    if awake == 1:
        return "awake"
    if flags.get("discard_all") == 1:
        return "discard_all"
    if flags.get("weights_offloaded") == 1:
        return "weights_offloaded"
    return "kv_cache_released"


def _usable(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def _apply_sleep_state(scan: PageScan, selection: Selection, who_all: list[Identity]) -> None:
    series = scan.samples.get(SLEEP_STATE, ())
    for who in who_all:
        flags = {labels["sleep_state"]: value for labels, value in series
                 if "sleep_state" in labels and _usable(value) and _is_of(labels, who)}
        state = sleep_state(flags)
        if state is not None:
            selection.values[who]["sleep_state"] = state


def _is_of(labels: Labels, who: Identity) -> bool:
    """A series of this identity: its model's, and its engine's or engine-less (the whole server's)."""
    return labels.get("model_name", "") == who[0] and labels.get("engine", who[1]) == who[1]


def _apply_admission_rejections(scan: PageScan, selection: Selection, who_all: list[Identity]) -> None:
    """Requests the front end refused at --max-num-queued-reqs / --max-num-queued-tokens, summed over
    the `reason` label, whose values split the refusals (0.32.0 vllm/v1/engine/async_llm.py l. 343-379,
    loggers.py l. 847-859). The counter is the API server's, with no engine label: under data
    parallelism it is one server-wide figure on every engine."""
    series = scan.samples.get(ADMISSION_REJECTIONS, ())
    engines_of = engines_per_model(who_all)
    for who in who_all:
        mine = [value for labels, value in series if _is_of(labels, who)]
        if not mine:
            continue
        if not all(_usable(value) for value in mine):
            selection.problems.append(f"{ADMISSION_REJECTIONS} for {who} has an unusable value: left out")
            continue
        selection.values[who]["admission_rejections_total"] = sum(mine) + 0.0
        if engines_of[who[0]] > 1:
            selection.server_wide[who].add("admission_rejections_total")


def _finish(scan: PageScan, selection: Selection, who_all: list[Identity]) -> None:
    _apply_cache_config(scan, selection, who_all)
    _apply_sleep_state(scan, selection, who_all)
    _apply_admission_rejections(scan, selection, who_all)


ADAPTER = Adapter(
    kind="vllm",
    specs=SPECS,
    roles=EngineLabels(model=("model_name",), engine="engine"),
    not_offered=(("tokens_in_flight", "vLLM reports no context sum: derived from its request counters"),
                 ("kv_cache_used_tokens", "vLLM reports no used-token count: usage ratio x its blocks")),
    extra_names=(CACHE_CONFIG, SLEEP_STATE, ADMISSION_REJECTIONS),
    finish=_finish,
)
