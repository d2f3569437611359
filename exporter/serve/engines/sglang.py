"""SGLang's /metrics page -> one Snapshot per (model_name, dp rank).

Facts and sources: shared/reference/vllm_metrics/REPORT.md §d.1 and the SGLang captures beside it.
- `sglang:token_usage` is a 0-1 fraction; `sglang:max_total_num_tokens` is the KV pool size in tokens;
  `sglang:num_used_tokens` (newer also `sglang:kv_used_tokens`) gives tokens in flight directly.
- SGLang runs prometheus_client in multiprocess mode: no `_created` series; gauges declared without a
  multiprocess mode carry a `pid` label. With data parallelism every scheduler series has `dp_rank`,
  which is the engine index here. Tokenizer-side families (ITL histogram, token counters) carry no
  `dp_rank`: they are server-wide and apply to every rank of their model.
- The first SGLang release with metrics (2024-11) labelled the model `name`, not `model_name`.
- Tokenizer-side counters carry `is_streaming`: each request is counted under its own value, so the
  two series are partitions and are summed.
- With priority scheduling (0.5.23), scheduler-side families carry `priority=""` (a total), while the
  tokenizer-side ones (ITL histogram, token counters) carry each request's own priority and have no
  `priority=""` series: there the per-priority series are partitions and are summed.
- Retractions (requests evicted from the running batch to free KV cache) are SGLang's preemptions.
  `sglang:num_retracted_requests_total` appears at a rank's first retraction: absent reads as 0.
- The tokenizer-side ITL histogram has no `dp_rank`: under --dp-size it is one server-wide figure,
  flagged in `Snapshot.server_wide` so it is compared with a server-wide prediction only.
- Speculative decoding: the ITL histogram counts every token, each output's interval divided by its
  tokens (0.5.23 observability/metrics_collector.py l. 2161-2183; the caller passes the output's new
  tokens, managers/tokenizer_manager.py l. 3248-3253), so its mean is the step / `sglang:spec_accept_length`.
"""

from __future__ import annotations

from exporter.serve.engines.exposition import PageScan
from exporter.serve.engines.families import Adapter, EngineLabels, FamilySpec, Identity, Selection

SPECS = (
    FamilySpec("requests_running", ("sglang:num_running_reqs",), "gauge"),
    FamilySpec("requests_waiting", ("sglang:num_queue_reqs",), "gauge"),
    FamilySpec("kv_cache_usage_ratio", ("sglang:token_usage",), "gauge"),
    FamilySpec("kv_cache_capacity_tokens", ("sglang:max_total_num_tokens",), "gauge"),
    # kv_used_tokens is the full-attention pool's used tokens; num_used_tokens is the larger of the
    # full and sliding-window pools' on hybrid SWA models (0.5.23 observability/pool_stats_observer.py
    # l. 84-91, 169), whose capacity max_total_num_tokens is the full pool's: kv_used_tokens first.
    FamilySpec("kv_cache_used_tokens", ("sglang:kv_used_tokens", "sglang:num_used_tokens"), "gauge"),
    # What the decode batch reads: the sum of its requests' seq_lens, a RadixAttention prefix shared by
    # several counted once for each (0.5.23 managers/scheduler_components/metrics_reporter.py
    # `_decode_total_seq_lens`, set with num_running_reqs and num_used_tokens at each decode log). Older
    # releases lack it: the reading then falls back to the used tokens, marked as an estimate.
    FamilySpec("tokens_in_flight", ("sglang:decode_sum_seq_lens",), "gauge", optional=True),
    FamilySpec(
        "inter_token_latency",
        ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
        "histogram",
    ),
    FamilySpec("prompt_tokens_total", ("sglang:prompt_tokens_total",), "counter"),
    FamilySpec("generation_tokens_total", ("sglang:generation_tokens_total",), "counter"),
    # Created at a rank's first retraction (0.5.23 observability/metrics_collector.py l. 1513-1525).
    FamilySpec("preemptions_total", ("sglang:num_retracted_requests_total",), "counter", absent_means_zero=True),
    FamilySpec("block_size_tokens", ("sglang:page_size",), "gauge"),
    # 0 without speculative decoding; tokens per request per forward with it (docs/engines.md).
    FamilySpec("spec_accept_length", ("sglang:spec_accept_length",), "gauge", optional=True),
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
    roles=EngineLabels(model=("model_name", "name"), engine="dp_rank", totals=(("priority", ""),),
                       partitions=("is_streaming",)),
    # sglang:cuda_graph_passes_total counts prefill and decode batches apart (0.5.23
    # observability/metrics_collector.py l. 1527-1533): separate passes, not vLLM's mixed steps.
    not_offered=(("engine_steps_total", "SGLang counts prefill and decode passes apart, not mixed steps"),),
    finish=_page_size_as_int,
)
