"""The accuracy benchmark scores what each published table measured, and a refused series still counts.

The bench's figures are the issue's acceptance numbers, so how they are scored is tested here: a
Databricks row's per-token time is its batch time per output token straight from the table, a
refused calibration cannot drop its rows from the score, and the calibration rows are the only ones
left out. Every expected number is worked out below from the CSV rows, not read from the output.
"""

from __future__ import annotations

import csv
import math
from collections import Counter

from benchmarks import accuracy

DATA = accuracy.DATA_DIR


def _table(name: str) -> list[dict[str, str]]:
    with (DATA / name).open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_databricks_per_token_time_is_the_measured_batch_time_per_output_token() -> None:
    predictions, _, _ = accuracy.run(DATA)
    row = next(p for p in predictions if p.series == "Databricks MPT-7B 1xA10 512/64" and p.batch == 16)
    # The table: 1xA10, batch 16, 512 in / 64 out, 3.5 requests/s -> the batch takes 16 / 3.5 s.
    assert math.isclose(row.measured_per_token_seconds, 16 / 3.5 / 64, rel_tol=1e-12)
    # The predicted side is the same quantity: B / predicted throughput, per output token.
    assert math.isclose(row.predicted_per_token_seconds, 16 / row.predicted_throughput / 64, rel_tol=1e-9)
    # ...so its error is the batch-time error, the inverse of the throughput error.
    assert math.isclose(1 + row.per_token_error_ratio, 1 / (1 + row.throughput_error_ratio), rel_tol=1e-9)


def test_lmdeploy_per_token_time_is_the_printed_latency_against_the_decode_step() -> None:
    predictions, _, _ = accuracy.run(DATA)
    raw = next(r for r in _table(accuracy.LMDEPLOY_TABLE)
               if r["model"] == "llama2-13b" and r["input_len_tokens"] == "128" and r["output_len_tokens"] == "128"
               and r["batch_size"] == "64")
    row = next(p for p in predictions if p.series == "LMDeploy llama2-13b 1xA100-80GB 128/128" and p.batch == 64)
    assert row.measured_per_token_seconds == float(raw["token_latency_p50_s"])
    assert row.predicted_per_token_seconds == row.predicted_decode_step_seconds


def test_every_usable_row_but_the_two_calibration_rows_of_each_series_is_scored_refused_or_not() -> None:
    databricks = [r for r in _table(accuracy.DATABRICKS_TABLE) if r["throughput_req_per_s"]]
    lmdeploy = [r for r in _table(accuracy.LMDEPLOY_TABLE) if r["all_requests_fit_in_kv_cache"] == "True"]
    rows_per_series = Counter((r["hardware"], r["num_gpus"]) for r in databricks) + Counter(
        (r["model"], r["input_len_tokens"], r["output_len_tokens"]) for r in lmdeploy)
    # A series calibrates on its two smallest batches; one with a single usable row calibrates on it alone.
    expected_scored = sum(count - min(count, 2) for count in rows_per_series.values())

    predictions, summaries, _ = accuracy.run(DATA)
    overall = next(s for s in summaries if s.scope == "overall" and s.metric == accuracy.PER_TOKEN)
    assert overall.count == expected_scored
    refused = [p for p in predictions if p.refused and not p.calibration_row]
    assert refused, "the bench's data holds a series whose calibration is refused (Databricks 2xA100)"
    worst = max(abs(p.per_token_error_ratio) for p in predictions if not p.calibration_row)
    assert overall.worst_abs_error_ratio == worst


def test_the_prefill_check_is_one_compute_bound_step_split_over_the_gpus() -> None:
    mpt = next(r for r in _table(accuracy.ARCHITECTURES_TABLE) if r["model"] == "MPT-7B")
    a100 = next(r for r in _table(accuracy.GPU_TABLE) if r["gpu"] == "A100 SXM4 40GB")
    compute = 0.5 * float(a100["peak_dense_bf16_fp16_tensor_TFLOPS"]) * 1e12
    measured = {int(r["num_gpus_tp"]): float(r["time_to_first_token_ms"]) / 1e3
                for r in _table(accuracy.TTFT_TABLE) if r["model"] == "MPT-7B" and r["time_to_first_token_ms"]}
    checks = accuracy.prefill_checks(DATA, accuracy.architectures(DATA), accuracy.gpu_peaks(DATA))
    assert {c.gpus: c.measured_seconds for c in checks} == measured
    for check in checks:  # 2 FLOPs per weight per prompt token, each GPU multiplying its share
        flops = 2 * float(mpt["approx_params_computed"]) * 512 / check.gpus
        assert math.isclose(check.predicted_seconds, flops / compute, rel_tol=1e-9)
