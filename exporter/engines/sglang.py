"""SGLang's /metrics page -> one Snapshot per (model_name, dp rank).

Facts and sources: shared/reference/vllm_metrics/REPORT.md §d.1 and the SGLang captures beside it.
- `sglang:token_usage` is a 0-1 fraction; `sglang:max_total_num_tokens` is the KV pool size in tokens;
  `sglang:num_used_tokens` (newer also `sglang:kv_used_tokens`) gives tokens in flight directly.
- SGLang runs prometheus_client in multiprocess mode: no `_created` series; gauges declared without a
  multiprocess mode carry a `pid` label. With data parallelism every scheduler series has `dp_rank`,
  which is the engine index here. Tokenizer-side families (ITL histogram, token counters) carry no
  `dp_rank`: they are server-wide and apply to every rank of their model.
- The first SGLang release with metrics (2024-11) labelled the model `name`, not `model_name`.
- With priority scheduling, totals are the series with `priority=""`; per-priority series are skipped.
- Retractions (requests evicted from the running batch to free KV cache) are SGLang's preemptions.
"""

from __future__ import annotations

from exporter.engines.exposition import PageScan
from exporter.engines.families import Adapter, EngineLabels, FamilySpec, Identity, Selection

SPECS = (
    FamilySpec("requests_running", ("sglang:num_running_reqs",), "gauge"),
    FamilySpec("requests_waiting", ("sglang:num_queue_reqs",), "gauge"),
    FamilySpec("kv_cache_usage_ratio", ("sglang:token_usage",), "gauge"),
    FamilySpec("kv_cache_capacity_tokens", ("sglang:max_total_num_tokens",), "gauge"),
    FamilySpec("tokens_in_flight", ("sglang:num_used_tokens", "sglang:kv_used_tokens"), "gauge"),
    FamilySpec(
        "inter_token_latency",
        ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
        "histogram",
    ),
    FamilySpec("prompt_tokens_total", ("sglang:prompt_tokens_total",), "counter"),
    FamilySpec("generation_tokens_total", ("sglang:generation_tokens_total",), "counter"),
    FamilySpec("preemptions_total", ("sglang:num_retracted_requests_total",), "counter"),
    FamilySpec("block_size_tokens", ("sglang:page_size",), "gauge"),
)


def _page_size_as_int(scan: PageScan, selection: Selection, who_all: list[Identity]) -> None:
    for who in who_all:
        values = selection.values[who]
        page_size = values.get("block_size_tokens")
        if isinstance(page_size, float):
            if page_size.is_integer() and page_size > 0:
                values["block_size_tokens"] = int(page_size)
            else:
                del values["block_size_tokens"]
                selection.missing[who]["block_size_tokens"] = f"sglang:page_size {page_size} is not a whole number"


ADAPTER = Adapter(
    kind="sglang",
    specs=SPECS,
    roles=EngineLabels(model=("model_name", "name"), engine="dp_rank", totals=(("priority", ""),)),
    not_offered=(("engine_steps_total", "SGLang exports no engine step counter"),),
    finish=_page_size_as_int,
)
