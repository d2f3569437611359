"""Calibration against a running vLLM 0.32.0 (CPU backend): `stepbudget calibrate --url` as a user runs
it, this host described by its numbers (tests/support/real_vllm.py HOST_DEVICE).

One real server for the module. `calibrate --url` times one stream alone at a short and a long context;
its fit must then predict a load it never saw (two streams at 5,000 tokens each) within 10% of the gaps
those clients observe. The daemon's online calibration on the same kind of server, over a load that
changes, is measured by benchmarks/real_vllm_online.py (results in benchmarks/results/).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from exporter.real_vllm.loadgen import LoadGenerator, Phase
from exporter.real_vllm.server import VllmServer
from tests.support.real_vllm import HOST_DEVICE, MODEL_CONFIG, serving

pytestmark = pytest.mark.real_engine

HOST_FLAGS = ["--gpu", "custom", "--gpu-memory", str(HOST_DEVICE["memory"]),
              "--gpu-bandwidth", str(HOST_DEVICE["peak_bandwidth"]), "--gpu-flops", str(HOST_DEVICE["peak_flops"])]
SETUP_FLAGS = ["--model", str(MODEL_CONFIG), "--weight-dtype", "float32", "--kv-cache-dtype", "float32", *HOST_FLAGS]


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
    # Both points long: with two points calibrate fits the bandwidth alone, and this CPU's per-step cost
    # of a few ms skews a short one (at 256 and 6,000 tokens the points' bandwidths spread 15.4% here,
    # and calibrate refused the fit, rightly); past 1,500 tokens the bytes explain the gaps.
    calibration = _cli("calibrate", "--url", server.base_url, *SETUP_FLAGS, "--short-context", "1500",
                       "--long-context", "7000", "--tokens", "48")
    assert calibration["gpu"] == "custom"
    bandwidth = _number(calibration, "effective_bandwidth_bytes_per_second")
    overhead = _number(calibration, "step_overhead_seconds")
    assert 0 < bandwidth <= 27e9  # bounded by the peak given
    # Two streams at 5,000 tokens each: neither the short nor the long point, past the long one in tokens
    # in flight, and two requests per step. One stream cannot show what a second request costs of its own
    # on this CPU, about 2-3 ms (1 x 6,000 tokens steps in 32.8 ms here, 2 x 3,000 in 34.8 ms, and a CI
    # run read 36.2 ms: -10.6% for two streams at 3,000); at 10,000 tokens in flight that is ~5% of a
    # step, and the test holds the bandwidth's prediction, not that cost (calibrate takes it from
    # `--itl` points at several batch sizes).
    load = LoadGenerator(server.base_url, "tiny", vocab_size=server.vocab_size, seed=3)
    load.start(Phase("two", 2, 5000, 120))
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
                "--load", "2x5060")
    predicted = _number(plan, "predicted_step_seconds")
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured, calibration)
