"""SGLang under --dp-size calibrates online.

Its ITL histogram is the tokenizer's, one for the whole server (no dp_rank), so no engine reading
has a measured step and the server-wide reading has no tokens of its own: before, the online fit
got no window at all from such a server and kept the seed for ever. Now each engine comes with its
share of the server-wide measured step (derivation.server_wide_reading), which the fit learns from.
"""

from __future__ import annotations

import json
import random

import pytest

from exporter.capacity import model
from exporter.serve.config import config_from_mapping
from exporter.serve.derivation import server_wide_reading
from exporter.serve.online_calibration import windows_from_readings
from exporter.serve.online_fit import fit_windows
from exporter.serve.online_fit_types import Bounds, FitWindow, Parameters
from exporter.serve.reading import Reading, page_setup
from exporter.serve.window import Window
from tests.support.clocks import ManualClock
from tests.support.pollers import MakePoller
from tests.support.servers import PageServer
from tests.support.tools import DATA

GENUINE = DATA / "genuine"
NAME = "sglang-0.5.23_GENUINE_multiprocess_dp2"


def _deployment_config(url: str) -> dict[str, object]:
    return {"poll_interval": "15s", "deployments": [{
        "name": "genuine", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": [url]}}]}


def test_a_genuine_dp2_page_gives_the_fit_one_window_per_rank(page_server: PageServer, clock: ManualClock,
                                                                make_poller: MakePoller) -> None:
    """SGLang 0.5.23's own page, two ranks (40 and 24 running): each rank becomes a window whose steps,
    combined as the histogram combines them (R / sum(running / step)), give the measured mean."""
    config = config_from_mapping(_deployment_config(page_server.url))
    poller = make_poller(config, clock)
    for number in (0, 1):
        page_server.serve_text((GENUINE / f"{NAME}_t{number}.prom").read_bytes())
        poller.poll_once()
        clock.advance(15)
    readings = {reading.engine: reading for reading in poller.readings()}
    fed = json.loads((GENUINE / f"{NAME}.expected.json").read_text())
    before, after = (phase["tokenizer"] for phase in fed["phases"])
    mean = (after["itl_sum"] - before["itl_sum"]) / (after["itl_count"] - before["itl_count"])
    assert readings[""].measured_step_seconds == pytest.approx(mean, rel=1e-9)

    windows = dict(windows_from_readings(poller.readings(), clock())["genuine"])
    assert sorted(identity[3] for identity in windows) == ["0", "1"]  # before: no window at all
    engines = fed["phases"][1]["engines"]
    for engine, values in engines.items():
        window = windows[readings[engine].identity]
        assert (window.tokens_in_flight, window.running) == (values["tokens_in_flight"], values["requests_running"])
    running = sum(values["requests_running"] for values in engines.values())
    combined = running / sum(window.running / window.measured_step_seconds for window in windows.values())
    assert combined == pytest.approx(mean, rel=1e-9)
    # Shared in the ratio of the engines' own predictions: 233,854 tokens on 40 requests against
    # 154,645 on 24 is the longer step.
    share = {identity[3]: window.measured_step_seconds for identity, window in windows.items()}
    first, second = (readings[engine].predicted_step_seconds or 0.0 for engine in ("0", "1"))
    assert share["0"] / share["1"] == pytest.approx(first / second, rel=1e-9) and first > second
    # The engines' own series still export no measured step (the histogram is not theirs).
    assert all(readings[engine].measured_step_seconds is None for engine in engines)

    # The server-wide error is for the window's load, as an engine's own is: each rank predicted at the
    # first page's tokens and requests and at the second's (what was fed), the mean of the two,
    # combined as the histogram combines the ranks' steps.
    setup = config.deployments[0].resolved.setup  # no online calibration here: the seed
    starts = fed["phases"][0]["engines"]

    def at(values: dict[str, float], engine: str) -> float:
        reading = readings[engine]
        ends_setup = page_setup(setup, reading.kv_cache_dtype, reading.block_size_tokens)
        groups = model.groups_from_total(values["tokens_in_flight"], values["requests_running"])
        return model.predict_step(ends_setup, groups, reading.prefill_tokens_per_step or 0.0).step_seconds

    assert all(readings[engine].prefill_mix is None for engine in engines)
    windows_steps = {engine: (at(starts[engine], engine) + at(values, engine)) / 2
                     for engine, values in engines.items()}
    assert all(windows_steps[e] < at(engines[e], e) for e in engines)  # both ranks grew over the window
    whole_window = running / sum(engines[e]["requests_running"] / windows_steps[e] for e in engines)
    assert readings[""].prediction_error_ratio == pytest.approx((whole_window - mean) / mean, rel=1e-9)


def _window(measured_step_seconds: float) -> Window:
    return Window(measured_step_mean_seconds=measured_step_seconds, measured_step_median_seconds=None,
                  prefill_tokens_per_step=None, tokens_generated=None, counter_reset=False, notes=())


def test_a_rank_without_a_prediction_gives_no_shares() -> None:
    """A rank that generates tokens but has no prediction (its page lacks its tokens): its tokens are
    in the measured mean, and no share can be told for the others."""
    ranks = [Reading("d", "t", "m", "0", target_up=True, requests_running=10, tokens_in_flight=20_000,
                     predicted_step_seconds=0.02),
             Reading("d", "t", "m", "1", target_up=True, requests_running=10)]
    whole = server_wide_reading(ranks, _window(0.02))
    assert whole is not None and whole.measured_step_seconds == 0.02 and whole.ranks == ()


# --- the fit from such windows --------------------------------------------------------------------

SEED = config_from_mapping(_deployment_config("http://127.0.0.1:1/metrics")).deployments[0].resolved.setup
BOUNDS = Bounds.of(3.35e12, 989e12)
# The truth: a slower GPU than the seed's (0.6 x its bandwidth), a 5 ms overhead and a 60 us cost per request.
TRUTH = Parameters(0.6 * SEED.effective_bandwidth_bytes_per_second, 5e-3, 60e-6,
                   SEED.effective_compute_flops_per_second)


def _step(parameters: Parameters, tokens: float, running: float) -> float:
    groups = model.groups_from_total(tokens, running)
    return model.predict_step(parameters.applied_to(SEED), groups).step_seconds


def _server_windows(believed: Parameters, loads: list[list[tuple[float, float]]]) -> list[FitWindow]:
    """Each poll's windows as the daemon builds them: the truth makes the server-wide mean, the
    parameters the daemon predicts with (`believed`) make the engines' predictions."""
    windows = []
    for t, ranks in enumerate(loads):
        true = [(running, _step(TRUTH, tokens, running)) for tokens, running in ranks]
        measured = sum(r for r, _ in true) / sum(r / step for r, step in true)
        readings = [Reading("pool", "t", "m", str(i), target_up=True, last_success_timestamp_seconds=15.0 * t,
                            tokens_in_flight=tokens, requests_running=running,
                            predicted_step_seconds=_step(believed, tokens, running))
                    for i, (tokens, running) in enumerate(ranks)]
        whole = server_wide_reading(readings, _window(measured))
        assert whole is not None
        windows += [window for _, window in windows_from_readings([*readings, whole], 15.0 * t)["pool"]]
    return windows


def test_imbalanced_ranks_converge_on_the_true_steps_within_2_percent() -> None:
    """Two ranks, one up to three times as loaded as the other, poll after poll: the daemon refits
    from the shares its current prediction gives, as it does live (the prediction follows the fit).
    After a few refits the fitted step is within 2% of the truth at every load, imbalanced or not,
    while the seed was off by far more."""
    rng = random.Random(7)
    loads = []
    for _ in range(300):
        ranks = []
        for _ in range(2):
            running = rng.uniform(4, 60)
            ranks.append((running * rng.uniform(500, 6_000), running))
        loads.append(ranks)
    checks = [(10_000.0, 5.0), (80_000.0, 40.0), (240_000.0, 48.0), (30_000.0, 60.0)]
    seed = Parameters.of(SEED)
    assert max(abs(_step(seed, *c) / _step(TRUTH, *c) - 1) for c in checks) > 0.2
    believed = seed
    for _ in range(4):
        fit = fit_windows(SEED, _server_windows(believed, loads), BOUNDS)
        assert fit.parameters is not None, fit.reason
        believed = fit.parameters
    for tokens, running in checks:
        assert _step(believed, tokens, running) == pytest.approx(_step(TRUTH, tokens, running), rel=0.02)
