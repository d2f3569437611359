"""Calibration against a running vLLM 0.32.0 (CPU backend): `stepbudget calibrate --url` as a user runs
it, this host described by its numbers (tests/support/real_vllm.py HOST_DEVICE).

One real server for the module. `calibrate --url` times one stream alone at a short and a long context;
its fit must then predict loads it never saw, against the gaps their clients observe: one stream at a
third context within 10%, and two streams at 5,000 tokens each within 15% (a second request's own
cost, which one stream cannot show, is ~5% of that step on this CPU). The daemon's online
calibration on the same kind of server, over a load that changes, is measured by
benchmarks/real_vllm_online.py (results in benchmarks/results/).
"""

from __future__ import annotations

import json
import statistics
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


def test_calibrate_url_predicts_loads_it_never_saw(server: VllmServer) -> None:
    # Both points long: this CPU reads the weights faster than the KV (benchmarks/results/
    # real_vllm_step_cost.md), so the shorter a point, the faster its one-bandwidth reading; at 1,500
    # and 7,000 tokens the points' bandwidths spread 19.1% in one run and calibrate refused the fit,
    # rightly. At 3,000 and 7,000 they agree within a few percent.
    calibration = _cli("calibrate", "--url", server.base_url, *SETUP_FLAGS, "--short-context", "3000",
                       "--long-context", "7000", "--tokens", "128")
    assert calibration["gpu"] == "custom"
    bandwidth = _number(calibration, "effective_bandwidth_bytes_per_second")
    overhead = _number(calibration, "step_overhead_seconds")
    assert 0 < bandwidth <= 27e9  # bounded by the peak given
    # Three runs of each load, one after the other, and their median: this VM's own speed moves by up to
    # 8% within a quarter of an hour (benchmarks/results/real_vllm_step_cost.md), and one CI run's single
    # pair of streams stepped in 57.8 ms where another run's took 46.8 ms.
    # One stream at 4,500 tokens: a context neither point had, and what calibrate's fit claims to predict.
    one = statistics.median(_mean_gap_seconds(server, seed, 1, 4500) for seed in (3, 4, 5))
    assert _predicted_step_seconds(bandwidth, overhead, "1x4560") == pytest.approx(one, rel=0.10), (one, calibration)
    # Two streams at 5,000 tokens each: past the long point in tokens in flight, and two requests per
    # step. One stream cannot show what a second request costs of its own on this CPU, about 2.5 ms
    # (the same benchmark: 2 x 3,000 tokens step in 34.4 ms, 1 x 6,000 in 31.9 ms), ~5% of this step,
    # so this load is held to 15%: the bandwidth's prediction plus that cost, which calibrate takes only
    # from `--itl` points at several batch sizes (a CI run read two streams at 3,000 10.6% over the
    # prediction; at 5,000, -2.0% and -6.3% in two runs here).
    two = statistics.median(_mean_gap_seconds(server, seed, 2, 5000) for seed in (6, 7, 8))
    assert _predicted_step_seconds(bandwidth, overhead, "2x5060") == pytest.approx(two, rel=0.15), (two, calibration)


def _predicted_step_seconds(bandwidth: float, overhead: float, load: str) -> float:
    """`plan` with the calibrated terms at `load` (requests x the context each held over the span
    measured: prompt + half the output)."""
    plan = _cli("plan", *SETUP_FLAGS, "--bandwidth", repr(bandwidth), "--step-overhead", repr(overhead),
                "--load", load)
    return _number(plan, "predicted_step_seconds")


def _mean_gap_seconds(server: VllmServer, seed: int, streams: int, prompt_tokens: int) -> float:
    """`streams` streams of `prompt_tokens` fresh prompt tokens (no prefix-cache hit) and 120 out,
    started together: their clients' mean gap while all of them decode."""
    load = LoadGenerator(server.base_url, "tiny", vocab_size=server.vocab_size, seed=seed)
    load.start(Phase("load", streams, prompt_tokens, 120))
    time.sleep(2.0)
    load.stop("load")
    assert load.join(300)
    assert not load.errors(), load.errors()
    assert len(load.streams) == streams
    start = max(s.arrivals[1][0] for s in load.streams)  # all past their prefill
    end = min(s.arrivals[-1][0] for s in load.streams)  # all still decoding
    measured, tokens = load.mean_gap_seconds(start, end)
    assert measured is not None and tokens >= 75 * streams
    return measured
