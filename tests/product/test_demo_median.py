"""The demo's view says the measured median as the daemon exports it: a bucket where the ITL
histogram is coarse (vLLM's defaults), a number only where the daemon exported one."""

from __future__ import annotations

from exporter.demo import TargetView, render_view


def _step_line(values: dict[str, float]) -> str:
    view = TargetView("chat-pool", "127.0.0.1:8001", {"measured_step_seconds": 0.0214, "step_budget_seconds": 0.018,
                                                      **values})
    (line,) = [line for line in render_view([view], {}, {}, "http://x/metrics").splitlines() if "step time" in line]
    return line


def test_a_median_inside_a_coarse_bucket_is_shown_as_the_bucket() -> None:
    line = _step_line({"measured_step_median_lower_seconds": 0.010, "measured_step_median_upper_seconds": 0.025})
    assert "measured   21.4 ms (median 10.0-25.0 ms)" in line
    assert "17.5" not in line


def test_a_resolved_median_is_shown_as_a_number_and_the_inf_bucket_as_a_floor() -> None:
    assert "(median 20.3 ms)" in _step_line({"measured_step_median_seconds": 0.0203,
                                              "measured_step_median_lower_seconds": 0.020,
                                              "measured_step_median_upper_seconds": 0.021})
    assert "(median > 50.0 ms)" in _step_line({"measured_step_median_lower_seconds": 0.05})
    assert "(median -)" in _step_line({})
