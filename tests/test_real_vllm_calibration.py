"""Calibration against a running vLLM 0.32.0 (CPU backend): `stepbudget calibrate --url` as a user runs
it, and the daemon's online calibration starting from an uncalibrated description of this host.

One real server for the module. `calibrate --url` times one stream alone at a short and a long context;
its fit must then predict a load it never saw (two streams at a middle context) within 10% of the gaps
those clients observe. The online run is the real `stepbudget serve` process, seeded only with the
host's peaks (tests/support/real_vllm.py HOST_DEVICE), watching a load that changes: 1, 4 and 16 chat
streams, then long sessions join, then longer ones. The fit absorbs windows older than the holdout, and
the holdout is as long as the last phase, so the last phase is predicted by a fit that never saw it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from exporter.demo import read_metrics, stop_daemon, target_views, wait_until_ready
from exporter.real_vllm.loadgen import LoadGenerator, Phase
from exporter.real_vllm.server import VllmServer
from tests.support.real_vllm import HOST_DEVICE, MODEL_CONFIG, serving, vocab_size
from tests.support.servers import free_port

pytestmark = pytest.mark.real_engine

HOST_FLAGS = ["--gpu", "custom", "--gpu-memory", str(HOST_DEVICE["memory"]),
              "--gpu-bandwidth", str(HOST_DEVICE["peak_bandwidth"]), "--gpu-flops", str(HOST_DEVICE["peak_flops"])]
SETUP_FLAGS = ["--model", str(MODEL_CONFIG), "--weight-dtype", "float32", "--kv-cache-dtype", "float32", *HOST_FLAGS]
POLL_SECONDS = 3.0
HOLDOUT_SECONDS = 45.0
# (phase, its clients, seconds); the last is evaluated.
ONLINE_PHASES: list[tuple[str, list[Phase], float]] = [
    ("1 stream", [Phase("s1", 1, 128, 400, spread_ratio=0.5)], 15.0),
    ("4 streams", [Phase("s4", 4, 128, 400, spread_ratio=0.5)], 15.0),
    ("16 streams", [Phase("s16", 16, 128, 400, spread_ratio=0.5)], 24.0),
    ("16 + 2 long", [Phase("s16", 16, 128, 400, spread_ratio=0.5), Phase("long", 2, 2500, 300)], 36.0),
    ("16 + 2 longer", [Phase("s16", 16, 128, 400, spread_ratio=0.5), Phase("longer", 2, 5000, 300)],
     HOLDOUT_SECONDS),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    with serving(tmp_path_factory.mktemp("real-vllm-calibration"), max_model_len=8192) as running:
        yield running


def _cli(*args: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-m", "exporter.cli", *args, "--json"], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    document: dict[str, object] = json.loads(done.stdout)
    return document


def _number(document: dict[str, object], key: str) -> float:
    value = document[key]
    assert isinstance(value, int | float), (key, value)
    return float(value)


def test_calibrate_url_predicts_a_load_it_never_saw_within_ten_percent(server: VllmServer) -> None:
    calibration = _cli("calibrate", "--url", server.base_url, *SETUP_FLAGS, "--short-context", "256",
                       "--long-context", "6000", "--tokens", "48")
    assert calibration["gpu"] == "custom"
    bandwidth = _number(calibration, "effective_bandwidth_bytes_per_second")
    overhead = _number(calibration, "step_overhead_seconds")
    assert 0 < bandwidth <= 27e9  # bounded by the peak given
    # Two streams at 3,000 tokens each: neither the short nor the long point, and two requests per step.
    load = LoadGenerator(server.base_url, "tiny", vocab_size=vocab_size(), seed=3)
    load.start(Phase("two", 2, 3000, 120))
    time.sleep(2.0)
    load.stop("two")
    assert load.join(300)
    assert not load.errors(), load.errors()
    (first, second) = load.streams
    start = max(s.arrivals[1][0] for s in (first, second))  # both past their prefill
    end = min(s.arrivals[-1][0] for s in (first, second))  # both still decoding
    measured, tokens = load.mean_gap_seconds(start, end)
    assert measured is not None and tokens >= 150
    # The context each held in that span, averaged: prompt + half the output so far.
    plan = _cli("plan", *SETUP_FLAGS, "--bandwidth", repr(bandwidth), "--step-overhead", repr(overhead),
                "--load", "2x3060")
    predicted = _number(plan, "predicted_step_seconds")
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured, calibration)


@dataclass(frozen=True)
class DaemonPoll:
    at_seconds: float
    phase: str
    values: dict[str, float]


@pytest.fixture(scope="module")
def online_run(server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonPoll]]:
    workdir: Path = tmp_path_factory.mktemp("online")
    port = free_port()
    config = {
        "listen": f"127.0.0.1:{port}", "poll_interval": f"{POLL_SECONDS:g}s", "timeout": "10s",
        "deployments": [{
            "name": "tiny", "model": str(MODEL_CONFIG), "gpu": HOST_DEVICE, "weight_dtype": "float32",
            "online_calibration": {"history": "1h", "holdout": f"{HOLDOUT_SECONDS:g}s", "min_windows": 12},
            "targets": {"static": [server.metrics_url]}}],
    }
    config_path = workdir / "stepbudget.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = workdir / "daemon.log"
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "exporter.cli", "serve", "--config", str(config_path)],
                                  stdout=log, stderr=subprocess.STDOUT)
    load = LoadGenerator(server.base_url, "tiny", vocab_size=vocab_size(), seed=11)
    url = f"http://127.0.0.1:{port}"
    polls: list[DaemonPoll] = []
    try:
        wait_until_ready(url, daemon, log_path)
        running: set[str] = set()
        for label, phases, seconds in ONLINE_PHASES:
            for name in running - {phase.name for phase in phases}:
                load.stop(name)
            for phase in phases:
                if phase.name not in running:
                    load.start(phase)
            running = {phase.name for phase in phases}
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                time.sleep(POLL_SECONDS)
                samples = read_metrics(url + "/metrics")
                (view,) = target_views(samples)
                fit_windows = [s.value for s in samples if s.name == "stepbudget_online_fit_windows"]
                polls.append(DaemonPoll(time.time(), label, {**view.values, "online_fit_windows": sum(fit_windows)}))
        assert not load.errors(), load.errors()[:3]
        (workdir / "polls.json").write_text(json.dumps([p.__dict__ for p in polls]))
        yield polls
    finally:
        load.stop_all()
        load.join(120)
        stop_daemon(daemon)


def test_online_calibration_from_the_hosts_peaks_predicts_the_last_phase_within_five_percent(
        online_run: list[DaemonPoll]) -> None:
    last = ONLINE_PHASES[-1][0]
    evaluated = [p for p in online_run if p.phase == last]
    # The fit replaced the seed before the evaluated phase began, from the phases before it.
    before = [p for p in online_run if p.phase != last]
    assert before[-1].values["online_fit_windows"] >= 12
    errors = [abs(p.values["prediction_error_ratio"]) for p in evaluated if "prediction_error_ratio" in p.values]
    assert len(errors) >= 10
    assert statistics.median(errors) <= 0.05, sorted(errors)
