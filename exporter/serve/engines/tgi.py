"""Hugging Face TGI's /metrics page -> one Snapshot (TGI serves one model, no engine index).

Facts and sources: shared/reference/vllm_metrics/REPORT.md §d.2 (TGI @ db931fcf, maintenance mode).
TGI's page is thinner than vLLM's, and some fields mean something slightly different:
- tokens in flight: `tgi_batch_current_max_tokens` is the token budget the running batch has
  *reserved* (every request's prompt + max_new_tokens; the router admits new requests against
  `max_batch_total_tokens - batch_max_tokens`). It is an upper bound on the KV cache held now.
- KV usage ratio: not a TGI metric; derived here as reserved / `tgi_batch_max_total_tokens`, which is
  exactly the fullness TGI's own admission control sees.
- measured step: `tgi_batch_inference_duration{method="decode"}` has one observation per decode
  forward (every running request gets one token from it), so its count is decode steps, not tokens.
  TGI runs prefill as separate forward passes; their pauses are not in this histogram.
- engine steps: `tgi_batch_inference_count{method="decode"}` (decode forward passes), so prefill
  tokens per step reads as prompt tokens per decode step.
- prompt / generated tokens: the `_sum` of the per-request `tgi_request_input_length` and
  `tgi_request_generated_tokens` histograms (observed when a request finishes).
- no preemption metric, no block size.
Counters from the Rust exporter appear without `_total` on older releases; both spellings are read.
"""

from __future__ import annotations

from exporter.serve.engines.exposition import PageScan
from exporter.serve.engines.families import Adapter, EngineLabels, FamilySpec, Identity, Selection

DECODE = (("method", "decode"),)

SPECS = (
    FamilySpec("requests_running", ("tgi_batch_current_size",), "gauge"),
    FamilySpec("requests_waiting", ("tgi_queue_size",), "gauge"),
    FamilySpec("kv_cache_capacity_tokens", ("tgi_batch_max_total_tokens",), "gauge"),
    FamilySpec("tokens_in_flight", ("tgi_batch_current_max_tokens",), "gauge"),
    FamilySpec("inter_token_latency", ("tgi_batch_inference_duration",), "histogram", match=DECODE),
    FamilySpec("prompt_tokens_total", ("tgi_request_input_length_sum",), "counter"),
    FamilySpec("generation_tokens_total", ("tgi_request_generated_tokens_sum",), "counter"),
    FamilySpec(
        "engine_steps_total", ("tgi_batch_inference_count", "tgi_batch_inference_count_total"), "counter", match=DECODE
    ),
)


def _reserved_ratio(scan: PageScan, selection: Selection, who_all: list[Identity]) -> None:
    for who in who_all:
        values = selection.values[who]
        reserved, capacity = values.get("tokens_in_flight"), values.get("kv_cache_capacity_tokens")
        if isinstance(reserved, float) and isinstance(capacity, float) and capacity > 0:
            values["kv_cache_usage_ratio"] = reserved / capacity
        else:
            selection.missing[who]["kv_cache_usage_ratio"] = (
                "TGI has no KV usage metric; derived from tgi_batch_current_max_tokens / "
                "tgi_batch_max_total_tokens, and one of them is missing"
            )


ADAPTER = Adapter(
    kind="tgi",
    specs=SPECS,
    roles=EngineLabels(model=(), engine=None),
    not_offered=(
        ("preemptions_total", "TGI exports no preemption metric"),
        ("block_size_tokens", "TGI exports no block size"),
    ),
    finish=_reserved_ratio,
)
