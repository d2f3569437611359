"""Online calibration stays bounded on a large fleet: a thousand engines add a thousand windows a
poll, so the windows kept per deployment are capped (thinned, keeping their span in time) and a
refit runs at most once per REFIT_INTERVAL_SECONDS (or a quarter of the holdout, if shorter)."""

from __future__ import annotations

import pytest

from exporter.serve import online_calibration
from exporter.serve.config import config_from_mapping
from exporter.serve.online_calibration import DeploymentCalibration, FitWindow, OnlineCalibrator


def _calibration(holdout: str = "30m") -> DeploymentCalibration:
    config = config_from_mapping({"defaults": {"online_calibration": {"holdout": holdout}}, "deployments": [{
        "name": "pool", "model": "qwen3-8b", "gpu": "h100-sxm",
        "targets": {"static": ["http://127.0.0.1:8000/metrics"]}}]})
    return OnlineCalibrator(config.deployments).deployments["pool"]


def _window(t: float) -> FitWindow:
    return FitWindow(end_seconds=t, tokens_in_flight=50_000.0, running=20.0, prefill_tokens_per_step=0.0,
                     measured_step_seconds=0.02)


def test_the_windows_kept_are_capped_and_keep_their_span(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(online_calibration, "MAX_WINDOWS_PER_DEPLOYMENT", 100)
    calibration = _calibration()
    now = 999.0 + 1800.0  # every window inside the history and outside the holdout
    for t in range(1000):
        calibration.add((f"engine-{t}",), _window(float(t)))
        # Each time the 101st arrives, the older half (50) is halved to 25, leaving 76; 25 more and it
        # happens again: never more than 100 kept, checked after every window, not only at the end.
        assert len(calibration.windows_for_fit(now)) == (t + 1 if t < 100 else 76 + (t - 100) % 25)
    kept = calibration.windows_for_fit(now_seconds=now)
    assert 50 <= len(kept) <= 100
    assert kept[0].end_seconds == 0.0 and kept[-1].end_seconds == 999.0  # the span in time is kept
    ends = [window.end_seconds for window in kept]
    assert ends == sorted(ends)
    assert ends[-10:] == [float(t) for t in range(990, 1000)]  # the newest stay dense


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
