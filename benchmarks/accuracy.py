"""How well the capacity model predicts published static-batch benchmarks.

Two tables from shared/reference/validation/:
  * Databricks "LLM inference performance engineering" Table 2: MPT-7B, static batches of B
    requests with 512 prompt and 64 output tokens, throughput in requests/s, on 1-2 A10 and 1-4 A100.
  * LMDeploy TurboMind A100-80GB static inference (v0.1.0 docs): Llama-2-7B/13B/70B and
    InternLM-20B, batches 1-64, prompt/output lengths 1-2048, output tokens/s and p50 per-token latency.

Method, per series (same model, hardware, GPU count, prompt and output lengths):
  1. Calibrate on the two smallest batches of the series (exporter.capacity.fit.calibrate, least squares):
     with two batch sizes the fit gives the effective bandwidth and a per-request cost (the step
     model by phase: overhead + per-request cost x running + GEMM phase + attention phase).
     Every fitted term is bounded to physically sane values (fit.FitBounds): bandwidth and compute
     at most the GPU's datasheet peak, a per-step overhead at most 50 ms, a per-request cost at most
     300 us (published per-request slopes are 30-130 us). A term the two points put past its bound,
     or negative, is one they cannot separate reliably: it is not fitted and the rest is refitted
     (the fit's notes are listed below). A compute rate is fitted only with a point to spare, so never
     from two points.
  2. A series whose fitted terms miss one of its own calibration points by more than 15% (the
     calibrate agreement tolerance) is flagged refused, as `stepbudget calibrate` refuses points that
     disagree, and is still scored with what its fit predicts: a refusal must not hide a miss.
  3. Predict every larger batch with exporter.capacity.model and compare with the table; the two
     calibration rows are not scored.

What is scored is what each table measured:
  * LMDeploy prints the p50 token latency of each batch: the decode step, measured. Per-token time
    is that latency against the predicted decode step.
  * Databricks prints requests/s only. A static batch of B requests takes T = B / (requests/s), the
    prefill of its B*I prompt tokens and O decode steps. Per-token time is T / O, the batch's wall
    time per output token, against the predicted T / O. A decode step alone is not measured: taking
    (T - prefill) / O would score the prefill the model assumes as if it had been measured (at
    2xA10 it makes batch 16's "measured" step 22.1 ms, faster than batch 8's 24.4 ms, while the
    published batch times grow, 2.00 s to 2.29 s). That derived step is still what calibration
    fits (calibrate takes decode steps), and its errors are listed as "decode step (derived)".

Conversions and assumptions (also written into the results):
  * A static batch of B requests with prompt I and output O holds on average I + O/2 tokens per
    request over its decode; bytes are linear in context, so the mean-context step is the mean step.
  * The batch's prefill is one compute-bound step of B*I prompt tokens (the compute term of
    exporter.capacity.model's step with a prefill chunk and no decode), at the default compute efficiency
    (0.5 of the datasheet dense peak).
  * Batch time T = prefill + O * decode step; predicted throughput is B / T (Databricks, req/s) or
    B * O / T (LMDeploy, output tokens/s). LMDeploy's latencies are printed to 2 significant digits.
  * Rows whose requests did not all fit in the KV cache (LMDeploy marks them) queue, so a static-batch
    model does not apply: they are listed and excluded. Databricks' OOM rows have no number.

    .venv/bin/python benchmarks/accuracy.py [--data-dir benchmarks/data/validation]

Writes benchmarks/results/accuracy.md and accuracy.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from exporter.capacity import fit, model
from exporter.capacity.architecture import Architecture
from exporter.capacity.model import RequestGroup, ServingSetup

DATA_DIR = REPO / "benchmarks" / "data" / "validation"  # vendored from shared/reference/validation
RESULTS = REPO / "benchmarks" / "results"
DATABRICKS_TABLE = "databricks_blog_table2_mpt7b_static_batch_throughput.csv"
TTFT_TABLE = "databricks_blog_table1_ttft.csv"
LMDEPLOY_TABLE = "lmdeploy_turbomind_a100_static_inference.csv"
ARCHITECTURES_TABLE = "model_architectures.csv"
GPU_TABLE = "gpu_datasheet_peaks.csv"
CALIBRATION_ROWS = 2  # each series is calibrated from its two smallest batches

# Table names -> rows of model_architectures.csv and gpu_datasheet_peaks.csv.
MODEL_ROWS = {"MPT-7B": "MPT-7B", "llama2-7b": "Llama-2-7B", "llama2-13b": "Llama-2-13B",
              "llama2-70b": "Llama-2-70B", "internlm-20b": "InternLM-20B"}
GPU_ROWS = {"A10": "A10 (24GB)", "A100": "A100 SXM4 40GB", "A100-80GB": "A100 SXM4 80GB"}


@dataclass(frozen=True)
class Row:
    """One batch of one series, reduced to what the comparison needs."""

    source: str
    series: str
    model: str
    gpu: str
    gpus: int
    batch: int
    prompt_tokens: int
    output_tokens: int
    measured_per_token_seconds: float  # what is scored (see "What is scored" above)
    measured_throughput: float
    throughput_unit: str
    excluded: str = ""
    # The decode step calibration fits: LMDeploy's measured latency, Databricks' (T - prefill) / O.
    calibration_step_seconds: float = 0.0


@dataclass(frozen=True)
class Prediction:
    series: str
    batch: int
    measured_per_token_seconds: float
    predicted_per_token_seconds: float
    measured_decode_step_seconds: float  # derived from an assumed prefill for Databricks
    predicted_decode_step_seconds: float
    measured_throughput: float
    predicted_throughput: float
    throughput_unit: str
    calibration_row: bool
    calibrated_bandwidth_bytes_per_second: float
    bandwidth_efficiency: float  # of the datasheet peak per GPU
    per_request_seconds: float = 0.0
    step_overhead_seconds: float = 0.0
    refused: str = ""  # why the series' calibration was refused (not scored), "" when accepted
    notes: tuple[str, ...] = ()

    @property
    def per_token_error_ratio(self) -> float:
        return (self.predicted_per_token_seconds - self.measured_per_token_seconds) / self.measured_per_token_seconds

    @property
    def throughput_error_ratio(self) -> float:
        return (self.predicted_throughput - self.measured_throughput) / self.measured_throughput

    @property
    def decode_step_error_ratio(self) -> float:
        return ((self.predicted_decode_step_seconds - self.measured_decode_step_seconds)
                / self.measured_decode_step_seconds)


PER_TOKEN, THROUGHPUT, DERIVED_STEP = "per-token time", "throughput", "decode step (derived)"
METRICS = (PER_TOKEN, THROUGHPUT)


def error_ratio(prediction: Prediction, metric: str) -> float:
    return {PER_TOKEN: prediction.per_token_error_ratio, THROUGHPUT: prediction.throughput_error_ratio,
            DERIVED_STEP: prediction.decode_step_error_ratio}[metric]


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def architectures(data_dir: Path) -> dict[str, Architecture]:
    found = {}
    for row in read_csv(data_dir / ARCHITECTURES_TABLE):
        found[row["model"]] = Architecture(
            name=row["model"], layers=int(row["layers"]), hidden_size=int(row["hidden"]),
            attention_heads=int(row["q_heads"]), kv_heads=int(row["kv_heads"]), head_dim=int(row["head_dim"]),
            params=float(row["approx_params_computed"]), source=ARCHITECTURES_TABLE)
    return found


def gpu_peaks(data_dir: Path) -> dict[str, tuple[float, float]]:
    """GPU row -> (peak bandwidth bytes/s, dense bf16 FLOP/s)."""
    return {row["gpu"]: (float(row["peak_memory_bandwidth_GBps"]) * 1e9,
                         float(row["peak_dense_bf16_fp16_tensor_TFLOPS"]) * 1e12)
            for row in read_csv(data_dir / GPU_TABLE) if row["peak_memory_bandwidth_GBps"]}


# --- reading the tables ----------------------------------------------------------------------


def databricks_rows(data_dir: Path, arches: dict[str, Architecture],
                    peaks: dict[str, tuple[float, float]]) -> list[Row]:
    rows = []
    for raw in read_csv(data_dir / DATABRICKS_TABLE):
        batch, prompt, output = int(raw["batch_size"]), int(raw["input_len_tokens"]), int(raw["output_len_tokens"])
        gpus = int(raw["num_gpus"])
        series = f"Databricks MPT-7B {gpus}x{raw['hardware']} {prompt}/{output}"
        if not raw["throughput_req_per_s"]:
            rows.append(Row("databricks", series, "MPT-7B", raw["hardware"], gpus, batch, prompt, output, 0, 0,
                            "req/s", excluded=raw["note"] or "no number"))
            continue
        batch_seconds = batch / float(raw["throughput_req_per_s"])
        setup = _setup(arches["MPT-7B"], peaks[GPU_ROWS[raw["hardware"]]], gpus, bandwidth=1.0)
        derived_step = (batch_seconds - prefill_seconds(setup, batch, prompt)) / output
        rows.append(Row("databricks", series, "MPT-7B", raw["hardware"], gpus, batch, prompt, output,
                        batch_seconds / output, float(raw["throughput_req_per_s"]), "req/s",
                        calibration_step_seconds=derived_step))
    return rows


def lmdeploy_rows(data_dir: Path) -> list[Row]:
    rows = []
    for raw in read_csv(data_dir / LMDEPLOY_TABLE):
        batch, prompt, output, gpus = (int(raw[k])
                                       for k in ("batch_size", "input_len_tokens", "output_len_tokens", "tp"))
        series = f"LMDeploy {raw['model']} {gpus}xA100-80GB {prompt}/{output}"
        excluded = ("" if raw["all_requests_fit_in_kv_cache"] == "True"
                    else "requests did not all fit in the KV cache (queueing)")
        latency = float(raw["token_latency_p50_s"])
        rows.append(Row("lmdeploy", series, raw["model"], "A100-80GB", gpus, batch, prompt, output,
                        latency, float(raw["throughput_out_tok_per_s"]), "out tok/s",
                        excluded=excluded, calibration_step_seconds=latency))
    return rows


# --- the model -------------------------------------------------------------------------------


def _setup(arch: Architecture, peak: tuple[float, float], gpus: int, bandwidth: float) -> ServingSetup:
    """fp16 weights and KV, per GPU; compute at the default 0.5 of the dense peak."""
    return ServingSetup(architecture=arch, gpu_memory_bytes=80e9, effective_bandwidth_bytes_per_second=bandwidth,
                        effective_compute_flops_per_second=model.DEFAULT_COMPUTE_EFFICIENCY * peak[1],
                        tensor_parallel=gpus)


def prefill_seconds(setup: ServingSetup, batch: int, prompt_tokens: int) -> float:
    """The batch's prompts as one step of B*I prompt tokens and no decoding requests, compute-bound:
    at 512 prompt tokens per request its compute time already exceeds one read of the weights."""
    return model.predict_step(setup, [], prefill_tokens_per_step=batch * prompt_tokens).compute_seconds


@dataclass(frozen=True)
class PrefillCheck:
    """The prefill assumption against a measured time to first token (Databricks Table 1)."""

    gpus: int
    prompt_tokens: int
    measured_seconds: float
    predicted_seconds: float


def prefill_checks(data_dir: Path, arches: dict[str, Architecture],
                   peaks: dict[str, tuple[float, float]]) -> list[PrefillCheck]:
    """MPT-7B's batch-1 time to first token on A100-40GB at TP 1/2/4, against one compute-bound step:
    not scored (the table's backend is not stated), shown so the assumption can be judged."""
    checks = []
    for raw in read_csv(data_dir / TTFT_TABLE):
        if raw["model"] != "MPT-7B" or not raw["time_to_first_token_ms"] or raw["batch_size"] != "1":
            continue
        gpus, prompt = int(raw["num_gpus_tp"]), int(raw["input_len_tokens"])
        setup = _setup(arches["MPT-7B"], peaks[GPU_ROWS["A100"]], gpus, bandwidth=1.0)
        checks.append(PrefillCheck(gpus, prompt, float(raw["time_to_first_token_ms"]) / 1e3,
                                   prefill_seconds(setup, 1, prompt)))
    return checks


def mean_context(row: Row) -> float:
    return row.prompt_tokens + row.output_tokens / 2


def predict_series(rows: list[Row], arch: Architecture, peak: tuple[float, float]) -> list[Prediction]:
    usable = sorted((r for r in rows if not r.excluded), key=lambda r: r.batch)
    if not usable:
        return []
    calibration_rows = usable[:CALIBRATION_ROWS]
    probe = _setup(arch, peak, usable[0].gpus, bandwidth=1.0)
    calibration = fit.calibrate([
        model.calibration_point(probe, r.calibration_step_seconds, r.batch * mean_context(r), r.batch)
        for r in calibration_rows], bounds=fit.FitBounds(max_bandwidth_bytes_per_second=peak[0],
                                                           max_compute_flops_per_second=peak[1]))
    refused = "" if calibration.agrees else (  # two batch sizes: agreement is the fit's largest miss
        f"calibration refused: the fit misses its own points by up to "
        f"{max(abs(r) for r in calibration.residual_ratios):.0%} (tolerance {calibration.tolerance:.0%})")
    setup = replace(_setup(arch, peak, usable[0].gpus, calibration.effective_bandwidth_bytes_per_second),
                    step_overhead_seconds=calibration.step_overhead_seconds,
                    per_request_seconds=calibration.per_request_seconds)
    predictions = []
    for row in usable:
        step = model.predict_step(setup, [RequestGroup(row.batch, mean_context(row))]).step_seconds
        batch_seconds = prefill_seconds(setup, row.batch, row.prompt_tokens) + row.output_tokens * step
        databricks = row.source == "databricks"
        per_second = row.batch / batch_seconds if databricks else row.batch * row.output_tokens / batch_seconds
        per_token = batch_seconds / row.output_tokens if databricks else step
        predictions.append(Prediction(row.series, row.batch, row.measured_per_token_seconds, per_token,
                                      row.calibration_step_seconds, step,
                                      row.measured_throughput, per_second, row.throughput_unit,
                                      row in calibration_rows,
                                      setup.effective_bandwidth_bytes_per_second,
                                      setup.effective_bandwidth_bytes_per_second / peak[0],
                                      calibration.per_request_seconds, calibration.step_overhead_seconds,
                                      refused, calibration.notes))
    return predictions


# --- summary ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ErrorSummary:
    scope: str
    metric: str
    count: int
    median_abs_error_ratio: float
    mean_abs_error_ratio: float
    worst_abs_error_ratio: float
    worst_signed_error_ratio: float
    worst_batch: int


def summarise(scope: str, metric: str, predictions: list[Prediction]) -> ErrorSummary | None:
    scored = [p for p in predictions if not p.calibration_row]  # refused series too: see step 2
    if not scored:
        return None
    errors = [(error_ratio(p, metric), p.batch) for p in scored]
    worst = max(errors, key=lambda e: abs(e[0]))
    absolute = [abs(e) for e, _ in errors]
    return ErrorSummary(scope, metric, len(errors), statistics.median(absolute), statistics.fmean(absolute),
                        abs(worst[0]), worst[0], worst[1])


def run(data_dir: Path) -> tuple[list[Prediction], list[ErrorSummary], list[Row]]:
    arches, peaks = architectures(data_dir), gpu_peaks(data_dir)
    rows = databricks_rows(data_dir, arches, peaks) + lmdeploy_rows(data_dir)
    predictions: list[Prediction] = []
    summaries: list[ErrorSummary] = []
    series_names = list(dict.fromkeys(r.series for r in rows))
    for name in series_names:
        members = [r for r in rows if r.series == name]
        first = members[0]
        predicted = predict_series(members, arches[MODEL_ROWS[first.model]], peaks[GPU_ROWS[first.gpu]])
        predictions += predicted
        summaries += [s for metric in METRICS if (s := summarise(name, metric, predicted))]
    for source, label in (("Databricks", "Databricks (all series)"), ("LMDeploy", "LMDeploy (all series)"),
                          ("", "overall")):
        chosen = [p for p in predictions if p.series.startswith(source)]
        summaries += [s for metric in METRICS if (s := summarise(label, metric, chosen))]
    derived = summarise("Databricks (all series)", DERIVED_STEP,
                        [p for p in predictions if p.series.startswith("Databricks")])
    summaries += [derived] if derived else []
    return predictions, summaries, [r for r in rows if r.excluded]


def write(predictions: list[Prediction], summaries: list[ErrorSummary], excluded: list[Row], data_dir: Path,
          prefill: list[PrefillCheck]) -> str:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "accuracy.json").write_text(json.dumps({
        "data_dir": str(data_dir.relative_to(REPO)) if data_dir.is_relative_to(REPO) else str(data_dir),
        "summaries": [asdict(s) for s in summaries],
        "predictions": [{**asdict(p), "per_token_error_ratio": p.per_token_error_ratio,
                         "throughput_error_ratio": p.throughput_error_ratio,
                         "decode_step_error_ratio": p.decode_step_error_ratio} for p in predictions],
        "excluded": [{"series": r.series, "batch": r.batch, "reason": r.excluded} for r in excluded],
        "prefill_checks": [asdict(c) for c in prefill],
    }, indent=2) + "\n")
    doc = __doc__ or ""
    method = doc[doc.index("Method"):doc.index("    .venv")].rstrip()
    lines = ["# Accuracy of the capacity model against published static-batch benchmarks", "",
             "Command: `make bench` (`.venv/bin/python benchmarks/accuracy.py`). "
             "Errors are (predicted - measured) / measured;",
             "the two calibration rows of each series (its two smallest batches) are not scored; refused "
             "series are.",
             "", "```", method, "```", "",
             "## Summary", "", "| scope | metric | n | median abs err | mean abs err | worst abs err (signed, batch) |",
             "|---|---|---:|---:|---:|---|"]
    lines += [f"| {s.scope} | {s.metric} | {s.count} | {s.median_abs_error_ratio:.1%} | "
              f"{s.mean_abs_error_ratio:.1%} | "
              f"{s.worst_abs_error_ratio:.1%} ({s.worst_signed_error_ratio:+.1%}, B={s.worst_batch}) |"
              for s in summaries]
    lines += ["", "## Calibration per series (from its two smallest batches)", "",
              "| series | per GPU TB/s | of datasheet peak | per-request us | overhead ms | notes |",
              "|---|---:|---:|---:|---:|---|"]
    firsts: dict[str, Prediction] = {}
    for prediction in predictions:
        firsts.setdefault(prediction.series, prediction)
    lines += [f"| {p.series} | {p.calibrated_bandwidth_bytes_per_second / 1e12:.3f} | {p.bandwidth_efficiency:.0%} | "
              f"{p.per_request_seconds * 1e6:.0f} | {p.step_overhead_seconds * 1e3:.2f} | "
              f"{'; '.join((p.refused,) * bool(p.refused) + p.notes)} |" for p in firsts.values()]
    lines += ["", "## Every prediction", "",
              "Per-token time is the measured p50 token latency (LMDeploy) or the batch time per output token "
              "(Databricks); the decode step columns differ from it only for Databricks, where the measured "
              "step is derived with the prefill the model assumes.", "",
              "| series | batch | per-token measured ms | predicted ms | err | decode step derived ms | "
              "predicted ms | err | throughput measured | predicted | err |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in predictions:
        mark = " (calibration)" if p.calibration_row else " (refused calibration, scored)" if p.refused else ""
        lines.append(f"| {p.series}{mark} | {p.batch} | {p.measured_per_token_seconds * 1e3:.2f} | "
                     f"{p.predicted_per_token_seconds * 1e3:.2f} | {p.per_token_error_ratio:+.1%} | "
                     f"{p.measured_decode_step_seconds * 1e3:.2f} | {p.predicted_decode_step_seconds * 1e3:.2f} | "
                     f"{p.decode_step_error_ratio:+.1%} | "
                     f"{p.measured_throughput:,.1f} {p.throughput_unit} | {p.predicted_throughput:,.1f} | "
                     f"{p.throughput_error_ratio:+.1%} |")
    lines += ["", "## Excluded rows", ""] + [f"- {r.series}, batch {r.batch}: {r.excluded}" for r in excluded]
    lines += ["", "## The prefill assumption against a measured time to first token (not scored)", "",
              "Databricks' Table 1: MPT-7B, one 512-token prompt, A100-40GB. The bench takes a batch's prefill as one",
              "compute-bound step at 0.5 of the dense peak, split evenly over the GPUs. On one GPU that matches;",
              "with tensor parallelism a lone prompt gains far less than the split assumes (communication and",
              "launch latency), so at TP 2-4 the assumption is optimistic for small prefills.", "",
              "| GPUs | prompt tokens | measured ms | predicted ms | err |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {c.gpus} | {c.prompt_tokens} | {c.measured_seconds * 1e3:.0f} | {c.predicted_seconds * 1e3:.1f} | "
              f"{(c.predicted_seconds - c.measured_seconds) / c.measured_seconds:+.0%} |" for c in prefill]
    text = "\n".join(lines) + "\n"
    (RESULTS / "accuracy.md").write_text(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description="Accuracy of the capacity model against published benchmarks")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR, help=f"validation CSVs (default {DATA_DIR})")
    data_dir = parser.parse_args().data_dir.resolve()
    if not (data_dir / LMDEPLOY_TABLE).exists():
        print(f"accuracy: no validation tables in {data_dir}; give --data-dir", file=sys.stderr)
        return 2
    predictions, summaries, excluded = run(data_dir)
    prefill = prefill_checks(data_dir, architectures(data_dir), gpu_peaks(data_dir))
    text = write(predictions, summaries, excluded, data_dir, prefill)
    print(text[text.index("## Summary"):text.index("## Every prediction")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
