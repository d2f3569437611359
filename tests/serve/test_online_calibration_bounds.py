"""Online calibration stays bounded on a large fleet: a thousand engines add a thousand windows a
poll, so the windows kept per deployment are capped per slice of time (keeping the history's whole
span) and a refit runs at most once per REFIT_INTERVAL_SECONDS (or a quarter of the holdout, if
shorter), each deployment at its own phase."""

from __future__ import annotations

import itertools

import pytest

from exporter.serve import online_calibration
from exporter.serve.config import config_from_mapping
from exporter.serve.online_calibration import DeploymentCalibration, OnlineCalibrator
from exporter.serve.online_fit_types import Fit, FitWindow


def _calibration(holdout: str = "30m") -> DeploymentCalibration:
    config = config_from_mapping({"poll_interval": "1s", "alerting": {"drift_for": "10s"},  # a holdout outlasts it
                                  "defaults": {"online_calibration": {"holdout": holdout}}, "deployments": [{
        "name": "pool", "model": "qwen3-8b", "gpu": "h100-sxm",
        "targets": {"static": ["http://127.0.0.1:8000/metrics"]}}]})
    return OnlineCalibrator(config.deployments).deployments["pool"]


def _window(t: float) -> FitWindow:
    return FitWindow(end_seconds=t, tokens_in_flight=50_000.0, running=20.0, prefill_tokens_per_step=0.0,
                     measured_step_seconds=0.02)


def test_the_windows_kept_are_capped_per_slice_of_time_and_keep_their_span() -> None:
    calibration = _calibration()  # history 6 h: 360 slices of 60 s, at most 8 windows each
    per_slice, slice_seconds = online_calibration.WINDOWS_PER_SLICE, 6 * 3600 / online_calibration.HISTORY_SLICES
    assert (per_slice, slice_seconds) == (8, 60.0)
    now = 3 * 3600.0 + 1800.0  # every window below inside the history and outside the holdout
    for t in range(3 * 3600):  # 3 h, a window a second, each from its own engine: 60 a slice
        calibration.add((f"engine-{t}",), _window(float(t)))
        assert len(calibration.windows) <= (t // 60 + 1) * per_slice  # checked all along, not only at the end
    kept = calibration.windows_for_fit(now)
    assert len(kept) == 180 * per_slice == len(calibration.windows)
    ends = [window.end_seconds for window in kept]
    assert ends == sorted(ends)
    assert ends[0] < slice_seconds and ends[-1] >= 3 * 3600 - slice_seconds  # the whole span
    for minute in range(180):  # every slice alike: 8 of its 60
        assert sum(1 for end in ends if minute * 60 <= end < (minute + 1) * 60) == per_slice


def test_the_kept_windows_do_not_depend_on_arrival_order() -> None:
    """Engines finish their fetches in any order; a slice keeps the same sample of them."""
    windows = [((f"engine-{e}",), _window(t + e / 100)) for t in range(0, 600, 15) for e in range(40)]
    forward, backward = _calibration(), _calibration()
    for identity, window in windows:
        forward.add(identity, window)
    for identity, window in reversed(windows):
        backward.add(identity, window)
    assert forward.windows_for_fit(3600.0) == backward.windows_for_fit(3600.0)
    assert len(forward.windows_for_fit(3600.0)) == 10 * online_calibration.WINDOWS_PER_SLICE


def test_windows_older_than_the_history_are_dropped() -> None:
    calibration = _calibration()
    for t in range(0, 8 * 3600, 15):
        calibration.add(("engine-0",), _window(float(t)))
    now = 8 * 3600.0
    kept = calibration.windows_for_fit(now)
    assert kept[0].end_seconds == 2 * 3600.0 and kept[-1].end_seconds == now - 1800.0
    # What stays stored: the 6 h of history (the holdout's too), 4 windows a minute.
    assert len(calibration.windows) == 6 * 60 * 4


def test_a_refit_runs_at_most_once_per_interval() -> None:
    calibration = _calibration()  # holdout 30 min: the interval is REFIT_INTERVAL_SECONDS
    for t in range(30):
        calibration.add((f"e{t}",), _window(float(t)))
    assert calibration.due(100.0)
    calibration.refit(100.0)
    for t in range(30, 60):
        calibration.add((f"e{t}",), _window(float(t)))
    interval = online_calibration.REFIT_INTERVAL_SECONDS
    assert interval <= 1800.0 / 4  # the default holdout's quarter is not the shorter one
    assert not calibration.due(100.0 + interval - 1.0)
    assert calibration.due(100.0 + interval)


def test_a_short_holdout_refits_more_often() -> None:
    calibration = _calibration(holdout="20s")  # a quarter of the holdout: 5 s
    for t in range(30):
        calibration.add((f"e{t}",), _window(float(t)))
    calibration.refit(100.0)
    for t in range(30, 60):
        calibration.add((f"e{t}",), _window(float(t)))
    assert not calibration.due(104.0) and calibration.due(105.0)


def test_deployments_refit_on_different_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four deployments fed alike at 15 s polls: after their first refit (a young, cheap history) each
    refits every 300 s at its own quarter of the interval, never two on one poll."""
    config = config_from_mapping({"deployments": [{
        "name": name, "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": ["http://127.0.0.1:8000/metrics"]}}
        for name in ("a", "b", "c", "d")]})
    calibrator = OnlineCalibrator(config.deployments)
    refits: list[tuple[float, str]] = []
    original = DeploymentCalibration.refit

    def recording(self: DeploymentCalibration, now_seconds: float) -> Fit:
        refits.append((now_seconds, self.deployment.name))
        return original(self, now_seconds)

    monkeypatch.setattr(DeploymentCalibration, "refit", recording)
    for poll in range(1, 241):  # 1 h
        now = poll * 15.0
        for calibration in calibrator.deployments.values():
            for engine in range(4):
                calibration.add((f"e{engine}",), _window(now))
        calibrator.observe([], now)
    first = [name for t, name in refits if t == refits[0][0]]
    assert sorted(first) == ["a", "b", "c", "d"]  # the first poll with windows enough (30 // 3 = 10)
    later = [(t, name) for t, name in refits if t > refits[0][0]]
    polls = [t for t, _ in later]
    assert len(polls) == len(set(polls))  # one refit a poll at most
    for name, phase in (("a", 0.0), ("b", 0.25), ("c", 0.5), ("d", 0.75)):
        times = [t for t, who in later if who == name]
        assert times[0] == refits[0][0] + 300.0 * (1 - phase)
        assert {b - a for a, b in itertools.pairwise(times)} == {300.0}
