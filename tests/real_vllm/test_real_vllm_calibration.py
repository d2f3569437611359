"""Calibration against a running vLLM 0.32.0 (CPU backend): `stepbudget calibrate --url` as a user runs
it, this host described by its numbers (tests/support/real_vllm.py host_device).

One real server for the module. `calibrate --url` times one stream alone at a short and a long context;
its fit must then predict loads it never saw, run right after it, against the step their clients
observe: one stream at a third context within 10%, and two streams at 5,000 tokens each within 15% (a
second request's own cost, which one stream cannot show, is ~5% of that step on this CPU), each the
median over five rounds of calibration and loads where the host held still through the round (a drift
control after the loads repeats calibrate's short point). The daemon's online
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
from dataclasses import dataclass

import pytest

from exporter.real_vllm.loadgen import LoadGenerator, Phase
from exporter.real_vllm.server import VllmServer
from exporter.units import parse_bandwidth_bytes_per_second
from tests.support.real_vllm import MODEL_CONFIG, host_device, serving

pytestmark = pytest.mark.real_engine

# Rounds scored, each a calibration that held still; calibrations of any outcome (refused, the host moved,
# scored) before they are done.
ROUNDS = 5
MAX_CALIBRATIONS = 14
# How far the drift control's step may be from calibrate's short point's for a round to count: three
# quarters of the one stream's 10%, so a round scored cannot owe its error to the host alone. Each is a
# median of ~120 gaps; on 2026-12-04's host the scored rounds' controls read -3.8% to +4.2%, and 5 of
# 10 rounds moved by -14.2% to +66% (one at +7.0%): about 6 in 10 rounds count, and 5 of 14 fail to
# with a chance under 2%.
CONTROL_RATIO = 0.075


def _setup_flags() -> list[str]:
    """The model and this host by its numbers (measured once a session, before the first server)."""
    host = host_device()
    return ["--model", str(MODEL_CONFIG), "--weight-dtype", "float32", "--kv-cache-dtype", "float32",
            "--gpu", "custom", "--gpu-memory", host["memory"], "--gpu-bandwidth", host["peak_bandwidth"],
            "--gpu-flops", host["peak_flops"]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    with serving(tmp_path_factory.mktemp("real-vllm-calibration"), max_model_len=8192) as running:
        yield running


def _cli(*args: str, exit_codes: tuple[int, ...] = (0,)) -> tuple[dict[str, object], int]:
    """A `stepbudget` verb with `--json`, as a user runs it: its document and exit code (one of `exit_codes`)."""
    done = subprocess.run([sys.executable, "-m", "exporter.cli", *args, "--json"], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode in exit_codes, done.stderr
    # A verb that exits before its document (a CI run: calibrate's exit 2 with nothing on stdout) says why.
    assert done.stdout.strip(), f"{args[0]} exited {done.returncode} with no document: {done.stderr}"
    document: dict[str, object] = json.loads(done.stdout)
    return document, done.returncode


def _number(document: dict[str, object], key: str) -> float:
    value = document[key]
    assert isinstance(value, int | float), (key, value)
    return float(value)


def test_calibrate_url_predicts_loads_it_never_saw(server: VllmServer) -> None:
    # A server that has served before, as one calibrated in production is: on this CPU the first streams
    # after vLLM starts step slower (on one day's host a first 1 x 3,000 stream stepped in 30.0 ms, the
    # four after it in 25.6-27.6 ms; a first calibration took 21 s, the five after it 9-10 s), and a CI
    # run whose calibration came first fitted 17 ms of overhead and over-predicted two streams at 5,000
    # by 18%.
    for seed, (streams, context_tokens) in enumerate(((1, 3000), (1, 7000), (2, 5000))):
        _median_gap_seconds(server, 100 + seed, streams, context_tokens)
    # Five rounds, each calibrating and then running the loads at once, and the median of their errors:
    # this VM's speed for a load moves 10-16% within minutes (the same 4 x 3,000 load stepped in 58.7 to
    # 65.2 ms over five rounds; benchmarks/results/host_drift.md: its memory rate's half-minute means
    # span 12.4% with nothing of ours running), so a load is set beside the calibration just before it,
    # not one a minute older. And a round counts only where the host held still through it: after its
    # loads, one stream at calibrate's short context again (the drift control), whose step must match
    # calibrate's own short point within CONTROL_RATIO. A CI run with no control met a host that moved
    # within rounds: calibrations 20 s apart read 6.1 to 10.8 GB/s, and one stream at 4,500 tokens was
    # predicted +25.5%, -0.3%, -25.6%, +57.1% and +11.1% off its clients' gaps in five rounds.
    rounds: list[_Round] = []
    refused: list[dict[str, object]] = []
    moved: list[_Round] = []
    while len(rounds) < ROUNDS:
        calibration = _calibrate(server)
        if not calibration["agrees"]:
            # The same drift can move one point's few seconds of gaps and not the other's: calibrate then
            # sees bandwidths that disagree and refuses, as it must. Not a round. Refusals come in runs
            # while the host is slow or uneven (2 of 41 calibrations on one day's host, at 23.4% and 23.5%;
            # 1 of 12 on another's, at 16.3%, as its step for the same load rose by half; a CI run met 3
            # before its fifth round).
            refused.append(calibration)
        else:
            scored = _round(server, calibration, seed=1000 + 10 * (len(rounds) + len(moved)))
            (rounds if scored.held_still else moved).append(scored)
        # The rounds need ROUNDS steady fits within MAX_CALIBRATIONS calibrations, so a calibrate that
        # refuses most fits still fails, and so does a host that never holds still (said as such), as soon
        # as the calibrations left cannot make up the rounds.
        calibrations_left = MAX_CALIBRATIONS - len(rounds) - len(moved) - len(refused)
        assert ROUNDS - len(rounds) <= calibrations_left, _summaries(rounds, moved, refused)
    one_errors = [scored.one_error for scored in rounds]
    two_errors = [scored.two_error for scored in rounds]
    assert abs(statistics.median(one_errors)) <= 0.10, _summaries(rounds, moved, refused)
    assert abs(statistics.median(two_errors)) <= 0.15, _summaries(rounds, moved, refused)


@dataclass(frozen=True)
class _Round:
    """One calibration, the loads predicted from it, and the drift control after them."""

    calibration: dict[str, object]
    one_error: float  # predicted / observed - 1, one stream at 4,500 tokens
    two_error: float  # the same, two streams at 5,000 tokens each
    control_ratio: float  # the control's step / calibrate's short point's step - 1

    @property
    def held_still(self) -> bool:
        return abs(self.control_ratio) <= CONTROL_RATIO


def _round(server: VllmServer, calibration: dict[str, object], seed: int) -> _Round:
    assert calibration["gpu"] == "custom"
    bandwidth = _number(calibration, "effective_bandwidth_bytes_per_second")
    overhead = _number(calibration, "step_overhead_seconds")
    assert 0 < bandwidth <= parse_bandwidth_bytes_per_second(host_device()["peak_bandwidth"])  # the peak given
    # One stream at 4,500 tokens: a context neither point had, and what calibrate's fit claims to predict.
    one = _median_gap_seconds(server, seed + 1, 1, 4500)
    # Two streams at 5,000 tokens each: past the long point in tokens in flight, and two requests per
    # step. One stream cannot show what a second request costs of its own on this CPU, about 2.5 ms
    # (benchmarks/results/real_vllm_step_cost.md at commit 54bfaa1, its earliest run: 2 x 3,000 tokens
    # stepped in 34.4 ms, 1 x 6,000 in 31.9 ms, though its later runs moved each load 7-18%), ~5% of
    # this step, so this load is held to 15%: the bandwidth's prediction plus that cost, which calibrate
    # takes only from `--itl` points at several batch sizes.
    two = _median_gap_seconds(server, seed + 2, 2, 5000)
    # The control: calibrate's short point again (its context, its output length), measured as the loads
    # were, from the clients' gaps. The loads are set between the two; the first prompt token's context
    # is the same, and the 8 fewer output tokens move its mean context by 4 tokens of 3,000.
    short_point = _points(calibration)[0]
    control = _median_gap_seconds(server, seed + 3, 1, round(short_point["tokens_in_flight"]))
    return _Round(calibration,
                  _predicted_step_seconds(bandwidth, overhead, "1x4560") / one - 1,
                  _predicted_step_seconds(bandwidth, overhead, "2x5060") / two - 1,
                  control / short_point["itl_seconds"] - 1)


def _points(calibration: dict[str, object]) -> list[dict[str, float]]:
    points = calibration["points"]
    assert isinstance(points, list)
    return points


def _summaries(rounds: list[_Round], moved: list[_Round], refused: list[dict[str, object]]) -> str:
    """Each calibration in one short line (pytest cuts a long message short, and CI's log is all there is):
    its spread, bandwidth, overhead and its points' steps, and for a round its errors and control."""
    lines = [f"scored {len(rounds)} of {len(rounds) + len(moved) + len(refused)} calibrations "
             f"(the host moved in {len(moved)}, calibrate refused {len(refused)})"]
    for verdict, scored in [("scored", r) for r in rounds] + [("host moved", r) for r in moved]:
        lines.append(f"{verdict}: one stream {scored.one_error:+.1%}, two streams {scored.two_error:+.1%}, "
                     f"control {scored.control_ratio:+.1%}; {_fit(scored.calibration)}")
    lines += [f"refused: {_fit(calibration)}" for calibration in refused]
    return "\n" + "\n".join(lines)


def _fit(calibration: dict[str, object]) -> str:
    steps = " / ".join(f"{point['itl_seconds'] * 1e3:.2f} ms at {point['tokens_in_flight']:,.0f}"
                       for point in _points(calibration))
    return (f"spread {_number(calibration, 'spread_ratio'):.1%}, "
            f"{_number(calibration, 'effective_bandwidth_bytes_per_second') / 1e9:.2f} GB/s, "
            f"overhead {_number(calibration, 'step_overhead_seconds') * 1e3:.2f} ms, steps {steps}")


def _calibrate(server: VllmServer) -> dict[str, object]:
    """`calibrate --url` at 3,000 and 7,000 tokens: its JSON, also where it refused the fit (exit 2, the
    JSON printed first, with `agrees` false).

    Both points long: this CPU reads the weights faster than the KV (benchmarks/results/
    real_vllm_step_cost.md at commit 54bfaa1, its earlier runs), so the shorter a point, the faster its
    one-bandwidth reading; at 1,500 and 7,000 tokens the points' bandwidths spread 19.1% in one run and
    calibrate refused the fit, rightly. At 3,000 and 7,000 they agree within a few percent."""
    document, exit_code = _cli("calibrate", "--url", server.base_url, *_setup_flags(), "--short-context", "3000",
                               "--long-context", "7000", "--tokens", "128", exit_codes=(0, 2))
    assert document["agrees"] is (exit_code == 0), (exit_code, document)
    return document


def _predicted_step_seconds(bandwidth: float, overhead: float, load: str) -> float:
    """`plan` with the calibrated terms at `load` (requests x the context each held over the span
    measured: prompt + half the output)."""
    plan, _ = _cli("plan", *_setup_flags(), "--bandwidth", repr(bandwidth), "--step-overhead", repr(overhead),
                   "--load", load)
    return _number(plan, "predicted_step_seconds")


def _median_gap_seconds(server: VllmServer, seed: int, streams: int, prompt_tokens: int) -> float:
    """`streams` streams of `prompt_tokens` fresh prompt tokens (no prefix-cache hit) and 120 out,
    started together: the median of their clients' token gaps while all of them decode. The median, as
    calibrate takes of its points' gaps (`StreamMeasurement.itl_seconds`): the fit predicts a step, and
    this CPU's slow steps (a 4,500-token stream's gaps ran from 30 ms at the 5th percentile to 83 ms at
    the most) put the mean 1-4.5% over the median, stream by stream."""
    load = LoadGenerator(server.base_url, "tiny", vocab_size=server.vocab_size, seed=seed)
    load.start(Phase("load", streams, prompt_tokens, 120))
    time.sleep(2.0)
    load.stop("load")
    assert load.join(300)
    assert not load.errors(), load.errors()
    assert len(load.streams) == streams
    start = max(s.arrivals[1][0] for s in load.streams)  # all past their prefill
    end = min(s.arrivals[-1][0] for s in load.streams)  # all still decoding
    gaps = load.token_gaps_in(start, end)
    assert len(gaps) >= 75 * streams
    return statistics.median(gaps)
