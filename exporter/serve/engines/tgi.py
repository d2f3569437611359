"""Hugging Face TGI's /metrics page -> one Snapshot (TGI serves one model, no engine index).

Facts and sources: shared/reference/vllm_metrics/REPORT.md §d.2 (TGI @ db931fcf, maintenance mode).
TGI's page is thinner than vLLM's, and some fields mean something slightly different:
- tokens in flight: TGI's page has none. `tgi_batch_current_max_tokens` is the KV the running batch
  has *reserved*: the batch's blocks x block size (server/text_generation_server/models/
  flash_causal_lm.py l. 215 at db931fcf), each request allocated blocks for its prompt +
  max_new_tokens + speculate - 1 when the router admits it (backends/v3/src/queue.rs l. 315-321), and
  set per decode loop in backends/v3/src/backend.rs l. 171. The tokens held (prompt + generated so far)
  are in no metric (`current_tokens`, l. 216, is the step's input ids and is not exported). So the
  reservation is read as `kv_cache_reserved_tokens`, and the reading predicts with it as an upper
  bound on the tokens in flight (marked an estimate).
- KV usage ratio: none. reserved / `tgi_batch_max_total_tokens` nears 1 whenever the router packs a
  batch (it admits against `max_batch_total_tokens - batch_max_tokens`, backend.rs l. 173), with the
  cache far from full of tokens: no usage ratio is derived, so no KV-full alert looks at the
  reservation.
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

from exporter.serve.engines.families import Adapter, EngineLabels, FamilySpec

DECODE = (("method", "decode"),)

SPECS = (
    FamilySpec("requests_running", ("tgi_batch_current_size",), "gauge"),
    FamilySpec("requests_waiting", ("tgi_queue_size",), "gauge"),
    FamilySpec("kv_cache_capacity_tokens", ("tgi_batch_max_total_tokens",), "gauge"),
    FamilySpec("kv_cache_reserved_tokens", ("tgi_batch_current_max_tokens",), "gauge"),
    FamilySpec("inter_token_latency", ("tgi_batch_inference_duration",), "histogram", match=DECODE),
    FamilySpec("prompt_tokens_total", ("tgi_request_input_length_sum",), "counter"),
    FamilySpec("generation_tokens_total", ("tgi_request_generated_tokens_sum",), "counter"),
    FamilySpec(
        "engine_steps_total", ("tgi_batch_inference_count", "tgi_batch_inference_count_total"), "counter", match=DECODE
    ),
)


ADAPTER = Adapter(
    kind="tgi",
    specs=SPECS,
    roles=EngineLabels(model=(), engine=None),
    not_offered=(
        ("preemptions_total", "TGI exports no preemption metric"),
        ("block_size_tokens", "TGI exports no block size"),
        ("tokens_in_flight", "TGI reports the tokens its batch reserved (tgi_batch_current_max_tokens), not those "
                             "held: predicted with the reservation, an upper bound"),
        ("kv_cache_used_tokens", "TGI reports the tokens its batch reserved, not those held"),
        ("kv_cache_usage_ratio", "TGI has no KV usage metric, and its reservation over tgi_batch_max_total_tokens "
                                 "nears 1 whenever the router packs a batch: left out"),
    ),
)
