"""A restart picks the online fit up where it was, for the setup it serves now.

The history is made the way a daemon makes it: the simulator's page read, windowed and derived by
the daemon's pipeline (tests/support/simulated_polls.py) at 15 s polls, each poll's /metrics page
rendered by the daemon's collector, and those pages put into a real Prometheus at the moments they
were exported (tests/support/prometheus_history.py). The restarted daemon then seeds its fit with
online_seed, through Prometheus's range queries.

The server: Qwen3-8B answering document questions (40 users, ~3,000-token prompts, ~300-token answers:
prefill chunks in a good share of the steps), joined by 6 long agent sessions for a while, then 32
users again. The simulated GPU's truth is set by hand, as in tests/serve/test_online_calibration_dtype.py:
bandwidth 0.8 x peak on weights and KV alike, 4 ms per step plus 40 us per scheduled sequence, so a
decode-only step's truth is computed here from the preset's numbers, not from the model under test.

Before the fix the windows read back had no prefill mix: the chunks' cost, spread evenly over every
step, read as a fast GPU with a long overhead (bandwidth at the peak, overhead ~7 ms) and decode-only
steps were predicted ~15% slow for as long as the seeded windows made the fit. And every window of
the deployment was read back, so after the move from an A100 the old GPU's windows were fitted to
the new one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import pytest
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from exporter.capacity import model
from exporter.capacity.presets import get_gpu, get_model_preset
from exporter.serve import online_seed
from exporter.serve.collector import make_registry
from exporter.serve.config import Deployment, config_from_mapping
from exporter.serve.online_calibration import ONLINE_SOURCE, OnlineCalibrator, windows_from_readings
from exporter.serve.online_fit import fit_windows
from exporter.serve.online_fit_types import Bounds, FitWindow, Parameters, setup_key
from exporter.simulator import ServerSpec, Simulator
from exporter.simulator.hardware import HardwareTruth
from exporter.simulator.scenarios import ClosedLoopGroup, Scenario, ScriptedGroup, TokenCount
from tests.support.prometheus_history import openmetrics_history, prometheus_with_history
from tests.support.simulated_polls import TARGET_URL, simulated_polls

POLL_SECONDS = 15.0
RUN_SECONDS = 1080.0
HOLDOUT = "16m"  # the default drift `for` (15m) + 2 polls: the shortest holdout the config accepts
TRUTH = HardwareTruth(launch_overhead_seconds=4e-3, per_sequence_overhead_seconds=40e-6, bandwidth_efficiency=0.8,
                      kv_read_efficiency=1.0, kv_read_long_context_drop=0.0, noise_ratio=0.02)
KV_BYTES_PER_TOKEN = 2 * 36 * 8 * 128 * 2  # Qwen3-8B, bf16 cache
WEIGHT_BYTES = get_model_preset("qwen3-8b").params * 2.0
LOADS = ((8, 2_000), (40, 2_000), (16, 25_000))  # (running requests, context per request): decode-only steps
NOW = 2_000_000_000.0  # the restart, in unix seconds; the history lies before it
H100_START = NOW - 3_000.0  # the H100 runs from 50 to 32 minutes before the restart
A100_START = NOW - 7_200.0  # the A100 ran two hours before


def true_step_seconds(gpu: str, running: int, context: int) -> float:
    bandwidth = 0.8 * get_gpu(gpu).peak_bandwidth_bytes_per_second
    return 4e-3 + 40e-6 * running + (WEIGHT_BYTES + KV_BYTES_PER_TOKEN * running * context) / bandwidth


def test_the_hand_truth() -> None:
    # 8 x 2,000 on an H100: (16.38 GB + 2.36 GB) / 2.68 TB/s = 6.99 ms, + 4 ms + 0.32 ms.
    assert true_step_seconds("h100-sxm", 8, 2_000) == pytest.approx(11.31e-3, rel=1e-3)
    # The same on an A100 (2.04 TB/s peak): 18.74 GB / 1.63 TB/s = 11.48 ms, + 4.32 ms.
    assert true_step_seconds("a100-80gb", 8, 2_000) == pytest.approx(15.80e-3, rel=2e-3)


def _deployment(gpu: str, **online: Any) -> Deployment:
    return config_from_mapping({
        "defaults": {"online_calibration": {"history": "6h", "holdout": HOLDOUT, **online}},
        "deployments": [{"name": "pool", "model": "qwen3-8b", "gpu": gpu, "targets": {"static": [TARGET_URL]}}],
    }).deployments[0]


@dataclass(frozen=True)
class Served:
    """One setup's run: the pages its daemon exported (unix time, text) and the windows it fitted live."""

    pages: list[tuple[float, str]]
    windows: list[FitWindow]


@cache
def _served(gpu: str, start: float) -> Served:
    deployment = _deployment(gpu)
    calibrator = OnlineCalibrator([deployment])
    scenario = Scenario("documents", "document questions, long agents for a while, then fewer users", (
        ClosedLoopGroup("docs", 40, TokenCount(3000, 0.3), TokenCount(300, 0.3), stop_seconds=600.0),
        ScriptedGroup("agent", 300.0, TokenCount(18_000, 0.05), TokenCount(30_000), count=6, leave_at_seconds=750.0),
        ClosedLoopGroup("chat", 32, TokenCount(1500, 0.2), TokenCount(1000, 0.2), start_seconds=780.0)))
    sim = Simulator(ServerSpec(gpu=gpu, truth=TRUTH), scenario, record_steps=True)
    pages, windows = [], []
    for sampled in simulated_polls(sim, deployment, POLL_SECONDS, RUN_SECONDS,
                                   setups_in_use=calibrator.setups_in_use):
        moment = start + sampled.seconds
        reading = replace(sampled.reading, last_success_timestamp_seconds=moment)
        calibrator.observe([reading], moment)
        windows += [window for pairs in windows_from_readings([reading], moment).values() for _, window in pairs]
        pages.append((moment, generate_latest(make_registry(lambda r=reading: [r], [deployment],
                                                              setups_in_use=calibrator.setups_in_use)).decode()))
    return Served(pages, windows)


def _prometheus_history() -> str:
    return openmetrics_history(_served("a100-80gb", A100_START).pages + _served("h100-sxm", H100_START).pages)


def _errors(parameters: Parameters, seed: model.ServingSetup) -> list[float]:
    setup = parameters.applied_to(seed)
    return [model.predict_step(setup, model.groups_from_total(running * context, running)).step_seconds
            / true_step_seconds("h100-sxm", running, context) - 1 for running, context in LOADS]


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The restarted H100 daemon, seeded from a real Prometheus holding both setups' history."""
    work = tmp_path_factory.mktemp("history")
    with prometheus_with_history(_prometheus_history(), work) as url:
        deployment = _deployment("h100-sxm", prometheus_url=url)
        calibrator = OnlineCalibrator([deployment])
        with capture_logs() as logs:
            read = online_seed.seed_deployment(calibrator, "pool", now_seconds=NOW)
        history = online_seed.windows_from_prometheus(url, "pool", NOW - 6 * 3600, NOW,
                                                      setup=setup_key(deployment.resolved))
        everything = online_seed.windows_from_prometheus(url, "pool", NOW - 6 * 3600, NOW,
                                                         setup=setup_key(_deployment("a100-80gb").resolved))
    yield deployment, calibrator, read, history, everything, logs


@pytest.mark.e2e
def test_the_windows_read_back_are_the_ones_the_daemon_fitted(restarted: Any) -> None:
    _, _, read, history, _, _ = restarted
    live = _served("h100-sxm", H100_START).windows
    assert read == len(history.windows) == len(live) >= 0.9 * RUN_SECONDS / POLL_SECONDS
    by_time = {window.end_seconds: window for _, window in history.windows}
    for window in live:
        back = by_time[window.end_seconds]
        assert back.prefill_mix is not None and window.prefill_mix is not None
        assert [value for part in back.prefill_mix for value in part] == pytest.approx(
            [value for part in window.prefill_mix for value in part], rel=1e-9)
        assert (back.kv_cache_dtype, back.block_size_tokens) == (window.kv_cache_dtype, window.block_size_tokens)
        assert back.measured_step_seconds == pytest.approx(window.measured_step_seconds, rel=1e-9)


@pytest.mark.e2e
def test_the_seeded_fit_predicts_decode_steps_within_5_percent(restarted: Any) -> None:
    deployment, calibrator, _, history, _, _ = restarted
    in_use = calibrator.setups_in_use.get(deployment.name)
    assert in_use is not None and in_use.source == ONLINE_SOURCE and in_use.held == ()
    seeded = calibrator.deployments["pool"].in_use
    assert all(abs(error) <= 0.05 for error in _errors(seeded, deployment.resolved.setup)), \
        _errors(seeded, deployment.resolved.setup)
    # The windows as they were read back before: no mix, no engine KV dtype or block size.
    bare = [replace(window, prefill_mix=None, kv_cache_dtype=None, block_size_tokens=None)
            for _, window in history.windows]
    before = fit_windows(deployment.resolved.setup, bare, Bounds.of_setup(deployment.resolved))
    assert before.parameters is not None
    errors = _errors(before.parameters, deployment.resolved.setup)
    assert abs(errors[0]) > 0.10, errors  # decode-only steps predicted >10% off
    # These windows drove the bandwidth to the peak (before the rule, exported as fitted, and decode-only
    # steps predicted >10% slow); now it is held at the seed, named, and the windows still mislead the rest.
    assert [h.reason for h in before.held if h.parameter == "bandwidth_bytes_per_second"] == ["bandwidth_at_peak"]
    seed_bandwidth = deployment.resolved.setup.effective_bandwidth_bytes_per_second
    assert before.parameters.bandwidth_bytes_per_second == seed_bandwidth


@pytest.mark.e2e
def test_windows_of_the_old_setup_are_not_fitted_to_the_new_one(restarted: Any) -> None:
    deployment, _, _, history, everything, logs = restarted
    old = len(_served("a100-80gb", A100_START).windows)
    assert history.other_setup == old and history.unknown_setup == 0
    assert len(everything.windows) == old and everything.other_setup == len(history.windows)
    seeded = [entry for entry in logs if entry["event"] == "online_calibration_seeded"]
    assert seeded and seeded[0]["other_setup_windows"] == old
    # Fitted together, as before, the A100's windows pull the H100's terms off.
    both = [window for _, window in history.windows + everything.windows]
    mixed = fit_windows(deployment.resolved.setup, both, Bounds.of_setup(deployment.resolved))
    assert mixed.parameters is not None
    assert max(abs(error) for error in _errors(mixed.parameters, deployment.resolved.setup)) > 0.10


@pytest.mark.slow  # about 7 s
def test_the_setup_is_on_the_export_and_another_setup_hashes_apart() -> None:
    page = _served("h100-sxm", H100_START).pages[-1][1]
    key = setup_key(_deployment("h100-sxm").resolved)
    assert f'setup="{key}"' in page and "stepbudget_window_setup_info{" in page
    keys = {setup_key(config_from_mapping({"deployments": [{
        "name": "pool", "model": "qwen3-8b", "gpu": gpu, "targets": {"static": [TARGET_URL]}, **extra}]})
        .deployments[0].resolved)
        for gpu, extra in (("h100-sxm", {}), ("a100-80gb", {}), ("h100-sxm", {"tensor_parallel": 2}),
                           ("h100-sxm", {"weight_dtype": "fp8"}), ("h100-sxm", {"kv_cache_dtype": "fp8"}),
                           ("h100-sxm", {"effective_bandwidth": "2.5TB/s"}))}
    # GPU, TP and weights change the key; the KV dtype (each window carries its engine's) and the
    # rates (what the fit finds) do not.
    assert len(keys) == 4
