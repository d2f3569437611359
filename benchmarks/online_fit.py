"""What an online refit costs on the poll thread, now that each deployment's windows are thinned by time.

Synthetic windows (Qwen3-8B on an H100, the truth 0.8 x peak bandwidth, 4 ms per step, 40 us per
request, 1% noise), one per engine per 15 s poll over 6 h, fed to a deployment's calibration as the
poller would; then one refit at the end, timed in CPU seconds (time.process_time, the refit alone).
Two kinds of window: decode only, and with a prefill mix of six step kinds (what vLLM's
iteration_tokens histogram gives: the fit then tries five compute rates). For comparison, the same
fit over 5,000 windows (the old cap, which a large fleet always filled). Last, eight deployments of
32 engines each polled for 6 h through OnlineCalibrator.observe: the most refit CPU on one poll and
how many polls carried more than one refit (the staggered phases).

    .venv/bin/python benchmarks/online_fit.py [--engines 1,32,512]

Writes benchmarks/results/online_fit.json and online_fit.md.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from exporter.capacity import model
from exporter.serve.config import Deployment, config_from_mapping
from exporter.serve.online_calibration import DeploymentCalibration, OnlineCalibrator
from exporter.serve.online_fit import fit_windows
from exporter.serve.online_fit_types import FitWindow, Parameters

RESULTS = REPO / "benchmarks" / "results"
POLL_SECONDS = 15.0
POLLS = int(6 * 3600 / POLL_SECONDS)
OLD_CAP_WINDOWS = 5_000
PREFILL_MIX = ((0.0, 0.70), (256.0, 0.12), (512.0, 0.08), (1024.0, 0.05), (1536.0, 0.03), (2048.0, 0.02))
URL = "http://127.0.0.1:8000/metrics"


def _deployments(count: int) -> list[Deployment]:
    config = config_from_mapping({"deployments": [
        {"name": f"pool-{index}", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": [URL]}}
        for index in range(count)]})
    return list(config.deployments)


SEED = _deployments(1)[0].resolved.setup
TRUE_SETUP = Parameters(0.8 * 3.35e12, 4e-3, 40e-6, SEED.effective_compute_flops_per_second).applied_to(SEED)


@cache
def _true_step_seconds(tokens: float, running: float, mixed: bool) -> float:
    groups = model.groups_from_total(tokens, running)
    if mixed:
        return model.predict_mean_step(TRUE_SETUP, groups, PREFILL_MIX)
    return model.predict_step(TRUE_SETUP, groups).step_seconds


def _window(engine: int, poll: int, rng: random.Random, mixed: bool) -> FitWindow:
    pattern = engine % 16
    hours = poll * POLL_SECONDS / 3600
    running = float(round(8 + 40 * (0.5 + 0.5 * math.sin(2 * math.pi * (hours / 6 + pattern / 16)))))
    tokens = running * (1000 + 500 * ((poll * 7 + pattern * 3) % 15))
    step = _true_step_seconds(tokens, running, mixed) * (1 + rng.gauss(0, 0.01))
    prefill = sum(chunk * share for chunk, share in PREFILL_MIX) if mixed else 0.0
    return FitWindow((poll + 1) * POLL_SECONDS, tokens, running, prefill, step, PREFILL_MIX if mixed else None)


def _feed(calibration: DeploymentCalibration, engines: int, mixed: bool) -> None:
    rngs = [random.Random(engine) for engine in range(engines)]
    for poll in range(POLLS):
        for engine in range(engines):
            calibration.add((f"e{engine}",), _window(engine, poll, rngs[engine], mixed))


@dataclass(frozen=True)
class RefitCost:
    case: str
    engines: int
    windows_fitted: int
    refit_cpu_seconds: float
    bandwidth_ratio_of_truth: float


def _refit(engines: int, mixed: bool) -> RefitCost:
    calibration = OnlineCalibrator(_deployments(1)).deployments["pool-0"]
    _feed(calibration, engines, mixed)
    now = POLLS * POLL_SECONDS
    start = time.process_time()
    fit = calibration.refit(now)
    cpu = time.process_time() - start
    bandwidth = fit.parameters.bandwidth_bytes_per_second if fit.parameters else float("nan")
    return RefitCost("prefill mix" if mixed else "decode only", engines, fit.windows, cpu,
                     bandwidth / TRUE_SETUP.effective_bandwidth_bytes_per_second)


def _old_cap(mixed: bool) -> RefitCost:
    rng = random.Random(0)
    windows = [_window(index % 512, index * POLLS // OLD_CAP_WINDOWS, rng, mixed) for index in range(OLD_CAP_WINDOWS)]
    bounds = OnlineCalibrator(_deployments(1)).deployments["pool-0"].bounds
    start = time.process_time()
    fit = fit_windows(SEED, windows, bounds)
    cpu = time.process_time() - start
    bandwidth = fit.parameters.bandwidth_bytes_per_second if fit.parameters else float("nan")
    return RefitCost(("prefill mix" if mixed else "decode only") + ", 5,000 windows (the old cap)", 0, fit.windows,
                     cpu, bandwidth / TRUE_SETUP.effective_bandwidth_bytes_per_second)


@dataclass(frozen=True)
class Stagger:
    deployments: int
    engines_each: int
    refits: int
    polls_with_more_than_one_refit: int
    max_refit_cpu_seconds_on_one_poll: float


def _stagger(deployments: int, engines: int) -> Stagger:
    calibrator = OnlineCalibrator(_deployments(deployments))
    rngs = [random.Random(engine) for engine in range(engines)]
    busiest, crowded, refits = 0.0, 0, 0
    for poll in range(POLLS):
        for calibration in calibrator.deployments.values():
            for engine in range(engines):
                calibration.add((f"e{engine}",), _window(engine, poll, rngs[engine], True))
        before = {name: c.fit for name, c in calibrator.deployments.items()}
        start = time.process_time()
        calibrator.observe([], (poll + 1) * POLL_SECONDS)
        cpu = time.process_time() - start
        refitted = sum(1 for name, c in calibrator.deployments.items() if c.fit is not before[name])
        refits += refitted
        crowded += refitted > 1
        busiest = max(busiest, cpu)
    return Stagger(deployments, engines, refits, crowded, busiest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="1,32,512")
    args = parser.parse_args()
    engine_counts = [int(value) for value in args.engines.split(",")]
    costs = [_refit(engines, mixed) for mixed in (False, True) for engines in engine_counts]
    costs += [_old_cap(False), _old_cap(True)]
    stagger = _stagger(8, 32)
    machine = f"{platform.system()} {platform.machine()}, Python {platform.python_version()}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "online_fit.json").write_text(json.dumps(
        {"machine": machine, "refits": [asdict(cost) for cost in costs], "stagger": asdict(stagger)}, indent=2) + "\n")
    lines = ["# Online calibration: a refit's CPU on the poll thread", "",
             f"Command: `.venv/bin/python benchmarks/online_fit.py --engines {args.engines}`. Machine: {machine}.",
             "One refit at the end of 6 h of 15 s polls (history 6 h, holdout 30 min).", "",
             "| windows | engines | windows fitted | refit CPU s | fitted bandwidth / truth |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {c.case} | {c.engines or '-'} | {c.windows_fitted} | {c.refit_cpu_seconds:.3f} | "
              f"{c.bandwidth_ratio_of_truth:.4f} |" for c in costs]
    lines += ["", f"{stagger.deployments} deployments of {stagger.engines_each} engines (prefill mix), 6 h through "
              f"OnlineCalibrator.observe: {stagger.refits} refits, {stagger.polls_with_more_than_one_refit} polls "
              f"with more than one, at most {stagger.max_refit_cpu_seconds_on_one_poll:.3f} CPU s of refits on "
              "one poll.",
              ""]
    (RESULTS / "online_fit.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
