"""A large deployment learns like a small one.

Every engine adds a window per poll. When the windows kept were capped by halving the older half at
each overflow, history decayed with the engine count: at 15 s polls over 6 h, 32 engines kept about
the last hour and 512 kept a window or two, so the fit never left the seed. Thinned by time instead,
the fit spans the history at any engine count and lands on the same parameters.

Synthetic windows in simulated time, from a hand-chosen truth (bandwidth 0.8 x the H100's 3.35 TB/s,
4 ms per step, 40 us per running request) through the model itself (decode-only steps of Qwen3-8B:
memory-bound, so a step is overhead + per-request x running + bytes / bandwidth), with 1% seeded
noise per engine. Each engine's load follows one of 16 patterns: running requests on a 6 h wave
between 8 and 48, phase-shifted by pattern, and the context per request stepping through 1,000 to
8,000 tokens.
"""

from __future__ import annotations

import math
import random
from functools import cache

import pytest

from exporter.capacity import model
from exporter.serve.config import config_from_mapping
from exporter.serve.online_calibration import DeploymentCalibration, OnlineCalibrator
from exporter.serve.online_fit_types import FitWindow, Parameters

POLL_SECONDS = 15.0
HISTORY_SECONDS = 6 * 3600.0
HOLDOUT_SECONDS = 1800.0
PATTERNS = 16
NOISE_RATIO = 0.01
POLLS = int(HISTORY_SECONDS / POLL_SECONDS)  # 1,440
NOW_SECONDS = POLLS * POLL_SECONDS


def _calibration() -> DeploymentCalibration:
    config = config_from_mapping({"deployments": [{
        "name": "pool", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": ["http://127.0.0.1:8000/metrics"]}}]})
    return OnlineCalibrator(config.deployments).deployments["pool"]  # defaults: history 6 h, holdout 30 min


SEED = _calibration().seed
TRUTH = Parameters(0.8 * 3.35e12, 4e-3, 40e-6, SEED.effective_compute_flops_per_second)
TRUE_SETUP = TRUTH.applied_to(SEED)


@cache
def _true_step_seconds(tokens: float, running: float) -> float:
    return model.predict_step(TRUE_SETUP, model.groups_from_total(tokens, running)).step_seconds


def _load(pattern: int, poll: int) -> tuple[float, float]:
    hours = poll * POLL_SECONDS / 3600
    running = round(8 + 40 * (0.5 + 0.5 * math.sin(2 * math.pi * (hours / 6 + pattern / PATTERNS))))
    context = 1000 + 500 * ((poll * 7 + pattern * 3) % 15)
    return float(running * context), float(running)


@cache
def _fleet(engines: int) -> DeploymentCalibration:
    """6 h of `engines` engines' windows, refitted at the end."""
    calibration = _calibration()
    noise = [random.Random(engine) for engine in range(engines)]
    identities = [(f"10.0.{engine // 256}.{engine % 256}:8000", "qwen3-8b", "0") for engine in range(engines)]
    for poll in range(POLLS):
        end = (poll + 1) * POLL_SECONDS
        for engine in range(engines):
            tokens, running = _load(engine % PATTERNS, poll)
            step = _true_step_seconds(tokens, running) * (1 + noise[engine].gauss(0, NOISE_RATIO))
            calibration.add(identities[engine], FitWindow(end, tokens, running, 0.0, step))
    calibration.refit(NOW_SECONDS)
    return calibration


def test_the_truth_through_the_model_by_hand() -> None:
    """40 requests x 2,000 tokens: the weights the model reads, 80,000 x 144 KiB of KV, at 2.68 TB/s,
    + 4 ms + 40 x 40 us."""
    step = model.predict_step(TRUE_SETUP, model.groups_from_total(80_000, 40))
    assert step.kv_read_bytes == 80_000 * 147_456
    assert step.step_seconds == pytest.approx(4e-3 + 1.6e-3 + (step.weight_read_bytes + step.kv_read_bytes) / 2.68e12,
                                              rel=1e-9)


def test_one_engine_fits_the_truth() -> None:
    fit = _fleet(1).fit
    assert fit is not None and fit.parameters is not None, fit
    assert fit.windows == POLLS - HOLDOUT_SECONDS / POLL_SECONDS  # 1,320: one engine keeps every window
    fitted = fit.parameters
    assert fitted.bandwidth_bytes_per_second == pytest.approx(TRUTH.bandwidth_bytes_per_second, rel=0.02)
    assert fitted.step_overhead_seconds == pytest.approx(TRUTH.step_overhead_seconds, rel=0.05)
    assert fitted.per_request_seconds == pytest.approx(TRUTH.per_request_seconds, rel=0.05)


@pytest.mark.slow  # 3.5 s at 512
@pytest.mark.parametrize("engines", [32, 512])
def test_a_fleet_fits_the_same_parameters_as_one_engine(engines: int) -> None:
    one, fleet = _fleet(1).fit, _fleet(engines).fit
    assert one is not None and one.parameters is not None
    assert fleet is not None and fleet.parameters is not None, fleet.reason if fleet else None
    for name, value in fleet.parameters.as_dict().items():
        assert value == pytest.approx(one.parameters.as_dict()[name], rel=0.01), name


@pytest.mark.parametrize("engines", [1, 32, pytest.param(512, marks=pytest.mark.slow)])  # 512: 3 s
def test_the_fit_spans_the_history_and_weighs_each_hour_alike(engines: int) -> None:
    windows = _fleet(engines).windows_for_fit(NOW_SECONDS)
    oldest = NOW_SECONDS - HISTORY_SECONDS
    assert windows[0].end_seconds < oldest + 60  # from the history's first minute
    fitted_span = HISTORY_SECONDS - HOLDOUT_SECONDS  # 5.5 h
    for hour in range(5):
        share = sum(1 for w in windows if oldest + 3600 * hour < w.end_seconds <= oldest + 3600 * (hour + 1))
        assert share / len(windows) == pytest.approx(3600 / fitted_span, rel=0.02), hour
