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
"""

from __future__ import annotations

from exporter.serve.engines.exposition import PageScan, parse_value
from exporter.serve.engines.families import Adapter, EngineLabels, FamilySpec, Identity, Selection

CACHE_CONFIG = "vllm:cache_config_info"

SPECS = (
    FamilySpec("requests_running", ("vllm:num_requests_running",), "gauge"),
    FamilySpec("requests_waiting", ("vllm:num_requests_waiting",), "gauge"),
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
    FamilySpec("preemptions_total", ("vllm:num_preemptions_total",), "counter"),
    FamilySpec("engine_steps_total", ("vllm:iteration_tokens_total_count",), "counter"),
    FamilySpec("iteration_tokens", ("vllm:iteration_tokens_total",), "histogram", optional=True),
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


ADAPTER = Adapter(
    kind="vllm",
    specs=SPECS,
    roles=EngineLabels(model=("model_name",), engine="engine"),
    not_offered=(("tokens_in_flight", "vLLM reports no used-token count: usage ratio x capacity"),),
    extra_names=(CACHE_CONFIG,),
    finish=_apply_cache_config,
)
