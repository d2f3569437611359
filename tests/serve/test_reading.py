"""derive_reading: a Snapshot, its Window and the deployment's model -> one Reading. Each number is
worked out by hand here from the inputs (the bytes formula written out), and every value that
cannot be derived is None (left out of the export), never 0.
"""

from __future__ import annotations

import math

import pytest

from exporter.capacity import model
from exporter.serve.config import Deployment, config_from_mapping
from exporter.serve.derivation import IDLE_CONTEXT_TOKENS, derive_reading
from exporter.serve.discovery import Target
from exporter.serve.online_calibration import windows_from_readings
from exporter.serve.snapshot import Snapshot
from exporter.serve.window import Window

TARGET = Target("chat", "http://10.0.0.5:8000/metrics", "10.0.0.5:8000", namespace="llm", pod="vllm-0")


def deployment(tmp_path=None, **keys: object) -> Deployment:
    return config_from_mapping({"deployments": [{
        "name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "effective_bandwidth": 2e12,
        "targets": {"static": ["http://10.0.0.5:8000/metrics"]}, **keys}]}).deployments[0]


def snapshot(**values: object) -> Snapshot:
    return Snapshot(kind="vllm", model_name="Qwen/Qwen3-8B", engine="0", **values)  # type: ignore[arg-type]  # values: any Snapshot field


def window(mean: float | None = None, median: float | None = None, prefill: float | None = None) -> Window:
    return Window(measured_step_mean_seconds=mean, measured_step_median_seconds=median,
                  prefill_tokens_per_step=prefill, tokens_generated=None, counter_reset=False, notes=())


# Qwen3-8B: 36 layers, 8 KV heads x 128, 8.19e9 params; bf16 weights and cache.
KV_PER_TOKEN = 2 * 36 * 8 * 128 * 2
WEIGHTS = 8.19e9 * 2
COMPUTE = 0.5 * 989.4e12  # half the H100 SXM dense bf16 peak


def test_reading_by_hand() -> None:
    d = deployment(target_tokens_per_second=40, headroom=0.8)
    tokens = 0.5 * 2000 * 16
    reading = derive_reading(d, TARGET, snapshot(requests_running=10, requests_waiting=1, kv_cache_usage_ratio=0.5,
                                                 kv_cache_capacity_tokens=2000 * 16, preemptions_total=7),
                             window(mean=0.02, median=0.019, prefill=100), now_seconds=1000.0,
                             scrape_duration_seconds=0.3)
    memory = (WEIGHTS + KV_PER_TOKEN * tokens) / 2e12
    gemm = 2 * 8.19e9 * (10 + 100) / COMPUTE
    # 10 decode tokens attend to their 16,000 tokens; the prefill's chunks (context unknown) are not counted.
    attention = 4 * 36 * 32 * 128 * tokens / COMPUTE
    compute = gemm + attention
    # By phase: memory-bound GEMMs (weights), then memory-bound attention (KV).
    step = max(WEIGHTS / 2e12, gemm) + max(KV_PER_TOKEN * tokens / 2e12, attention)
    budget = 0.8 / 40
    token_budget = (budget * 2e12 - WEIGHTS) / KV_PER_TOKEN
    assert reading.labels == {"deployment": "chat", "target": "10.0.0.5:8000", "model_name": "Qwen/Qwen3-8B",
                              "engine": "0", "namespace": "llm", "pod": "vllm-0"}
    assert reading.tokens_in_flight == tokens
    assert reading.step_read_bytes == pytest.approx(WEIGHTS + KV_PER_TOKEN * tokens)
    assert reading.predicted_memory_step_seconds == pytest.approx(memory)
    assert reading.predicted_compute_step_seconds == pytest.approx(compute)
    assert step == pytest.approx(memory)
    assert reading.predicted_step_seconds == pytest.approx(step)
    assert reading.prediction_error_ratio == pytest.approx((step - 0.02) / 0.02)
    assert reading.step_budget_seconds == pytest.approx(budget)
    assert reading.token_budget_tokens == pytest.approx(token_budget)
    assert reading.token_budget_utilization_ratio == pytest.approx(tokens / token_budget)
    assert reading.preemptions_total == 7 and reading.requests_waiting == 1
    assert (reading.last_success_timestamp_seconds, reading.scrape_duration_seconds) == (1000.0, 0.3)
    assert (reading.effective_bandwidth_bytes_per_second, reading.bandwidth_source) == (2e12, "configured")


def test_direct_token_count_wins_over_ratio_times_capacity() -> None:
    """SGLang reports used tokens itself; the ratio (rounded by the server) is not used for it."""
    reading = derive_reading(deployment(), TARGET, snapshot(requests_running=2, tokens_in_flight=12345,
                                                            kv_cache_usage_ratio=0.5, kv_cache_capacity_tokens=100000),
                             None, now_seconds=0, scrape_duration_seconds=0)
    assert reading.tokens_in_flight == 12345


def test_capacity_from_the_model_when_the_page_lacks_it() -> None:
    reading = derive_reading(deployment(), TARGET, snapshot(requests_running=1, kv_cache_usage_ratio=0.25),
                             None, now_seconds=0, scrape_duration_seconds=0)
    # (80 GB x 0.9 utilization - weights) / KV bytes per token, floored to whole blocks of 16.
    capacity = math.floor((80e9 * 0.9 - WEIGHTS) / (KV_PER_TOKEN * 16)) * 16
    assert reading.kv_cache_capacity_tokens == capacity
    assert reading.tokens_in_flight == pytest.approx(0.25 * capacity)
    assert any("from the model" in note for note in reading.notes)


def test_usage_ratio_from_direct_tokens_when_the_page_has_no_ratio() -> None:
    reading = derive_reading(deployment(), TARGET, snapshot(requests_running=1, kv_cache_used_tokens=5000,
                                                            kv_cache_capacity_tokens=20000),
                             None, now_seconds=0, scrape_duration_seconds=0)
    assert reading.kv_cache_usage_ratio == pytest.approx(5000 / 20000)


@pytest.mark.parametrize("field, bad", [
    ("kv_cache_usage_ratio", float("nan")), ("kv_cache_usage_ratio", 1.7), ("kv_cache_usage_ratio", -0.1),
    ("requests_running", float("inf")), ("tokens_in_flight", float("-inf")),
])
def test_untrustworthy_values_are_left_out_with_a_note(field: str, bad: float) -> None:
    values: dict[str, object] = {"requests_running": 3, "kv_cache_capacity_tokens": 10000}
    values[field] = bad
    reading = derive_reading(deployment(), TARGET, snapshot(**values), None, now_seconds=0, scrape_duration_seconds=0)
    assert getattr(reading, field) is None
    assert reading.predicted_step_seconds is None and reading.token_budget_utilization_ratio is None
    assert any(field in note and "unusable" in note for note in reading.notes)


def test_no_measurement_means_no_error_ratio() -> None:
    for w in (None, window(mean=None), window(mean=0.0)):
        reading = derive_reading(deployment(), TARGET, snapshot(requests_running=1, kv_cache_usage_ratio=0.1,
                                                                kv_cache_capacity_tokens=1000), w,
                                 now_seconds=0, scrape_duration_seconds=0)
        assert reading.prediction_error_ratio is None and reading.measured_step_seconds is None
        assert reading.predicted_step_seconds is not None


def test_model_alone_over_budget_means_zero_budget_and_no_utilization() -> None:
    """At 1,000 tok/s the budget (0.9 ms) is under the weight read alone (8.2 ms): budget 0."""
    assert WEIGHTS / 2e12 > 0.9 / 1000
    reading = derive_reading(deployment(target_tokens_per_second=1000), TARGET,
                             snapshot(requests_running=1, kv_cache_usage_ratio=0.1, kv_cache_capacity_tokens=1000),
                             None, now_seconds=0, scrape_duration_seconds=0)
    assert reading.token_budget_tokens == 0
    assert reading.token_budget_utilization_ratio is None


def test_calibration_file_sets_bandwidth_overhead_and_source(tmp_path) -> None:
    calibration = tmp_path / "calibration.json"
    calibration.write_text('{"effective_bandwidth_bytes_per_second": 2.5e12, "step_overhead_seconds": 0.004, '
                           '"points": [], '
                           '"agrees": true, "spread_ratio": 0.02, "tolerance_ratio": 0.15}')
    d = config_from_mapping({"deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                                              "calibration": str(calibration),
                                              "targets": {"static": ["http://10.0.0.5:8000/metrics"]}}]}).deployments[0]
    reading = derive_reading(d, TARGET,
                             snapshot(requests_running=4, kv_cache_usage_ratio=0.5, kv_cache_capacity_tokens=8000),
                             None, now_seconds=0, scrape_duration_seconds=0)
    memory = (WEIGHTS + KV_PER_TOKEN * 4000) / 2.5e12
    assert reading.predicted_step_seconds == pytest.approx(0.004 + memory)
    assert reading.bandwidth_source == "calibrated" and reading.effective_bandwidth_bytes_per_second == 2.5e12
    # Closed-form budget with the overhead taken off the step first.
    assert reading.token_budget_tokens == pytest.approx(((0.9 / 50 - 0.004) * 2.5e12 - WEIGHTS) / KV_PER_TOKEN)


def test_tensor_parallel_splits_weights_and_kv_heads() -> None:
    reading = derive_reading(deployment(tensor_parallel=2), TARGET,
                             snapshot(requests_running=2, kv_cache_usage_ratio=0.5, kv_cache_capacity_tokens=20000),
                             None, now_seconds=0, scrape_duration_seconds=0)
    assert reading.step_read_bytes == pytest.approx(WEIGHTS / 2 + KV_PER_TOKEN / 2 * 10000)


def test_moe_budget_uses_the_current_mean_context_or_2000_when_idle() -> None:
    """Qwen3-30B-A3B is not linear in tokens (experts touched grow with the batch): its budget is
    quoted at the live mean context, and at 2,000 tokens per request when the server is idle."""
    d = deployment(model="qwen3-30b-a3b")
    busy = derive_reading(d, TARGET,
                          snapshot(requests_running=8, kv_cache_usage_ratio=0.5, kv_cache_capacity_tokens=64000),
                          None, now_seconds=0, scrape_duration_seconds=0)
    idle = derive_reading(d, TARGET,
                          snapshot(requests_running=0, kv_cache_usage_ratio=0.0, kv_cache_capacity_tokens=64000),
                          None, now_seconds=0, scrape_duration_seconds=0)
    setup, budget = d.resolved.setup, d.step_budget_seconds
    assert busy.token_budget_tokens == pytest.approx(model.token_budget_tokens(setup, budget, 32000 / 8))
    assert idle.token_budget_tokens == pytest.approx(model.token_budget_tokens(setup, budget, IDLE_CONTEXT_TOKENS))
    # The budget really depends on the context here, so the choice above matters.
    assert busy.token_budget_tokens != pytest.approx(idle.token_budget_tokens)


def test_down_reading_drops_values_when_stale() -> None:
    good = derive_reading(deployment(), TARGET, snapshot(requests_running=1, kv_cache_usage_ratio=0.1,
                                                         kv_cache_capacity_tokens=1000), None,
                          now_seconds=50, scrape_duration_seconds=0.1)
    kept = good.down(scrape_duration_seconds=2.0, keep_values=True)
    dropped = good.down(scrape_duration_seconds=2.0, keep_values=False)
    assert not kept.target_up and kept.tokens_in_flight == good.tokens_in_flight
    assert not dropped.target_up and dropped.tokens_in_flight is None and dropped.step_budget_seconds is None
    assert dropped.labels == good.labels and dropped.last_success_timestamp_seconds == 50


def test_replace_reading_builds_what_dataclasses_replace_builds() -> None:
    """The poll's copy-with-changes of a Reading is dataclasses.replace's answer, as long as Reading
    keeps what makes that so: every field an init field, no __post_init__ to run again."""
    import dataclasses

    from exporter.serve.reading import Reading, replace_reading

    assert all(item.init for item in dataclasses.fields(Reading)) and not hasattr(Reading, "__post_init__")
    reading = derive_reading(deployment(), TARGET, snapshot(requests_running=3, kv_cache_usage_ratio=0.25,
                                                            kv_cache_capacity_tokens=4096),
                             window(mean=0.02, median=0.02, prefill=10), now_seconds=5.0, scrape_duration_seconds=0.1)
    changes: dict[str, object] = {"target_up": False, "notes": ("a note",), "measured_step_seconds": 0.5}
    copied = replace_reading(reading, **changes)
    assert copied == dataclasses.replace(reading, **changes)  # type: ignore[arg-type]  # the changes are Reading fields
    assert copied is not reading and reading.target_up is True and reading.notes != ("a note",)
    with pytest.raises(TypeError, match="no_such_field"):
        replace_reading(reading, no_such_field=1)


def test_error_compares_the_measured_mean_with_the_windows_load_not_its_end() -> None:
    """Long sessions finish mid-window: the measured mean is over steps that mostly held the start's
    tokens, the poll reads the end's. The exported prediction is the end's (the next steps' load);
    the error is for the window's load, the mean of its two ends. The online fit's window keeps the
    end's load, as a window read back from Prometheus after a restart has it."""
    d = deployment()
    start = snapshot(requests_running=20, tokens_in_flight=40000)
    end = snapshot(requests_running=10, tokens_in_flight=10000)
    window_of = Window(measured_step_mean_seconds=0.05, measured_step_median_seconds=None,
                       prefill_tokens_per_step=0.0, tokens_generated=None, counter_reset=False, notes=(),
                       start=start)
    reading = derive_reading(d, TARGET, end, window_of, now_seconds=1000.0, scrape_duration_seconds=0.1)
    # Memory-bound at both ends (20 decode tokens are far under the H100's compute roof).
    at_start = (WEIGHTS + KV_PER_TOKEN * 40000) / 2e12
    at_end = (WEIGHTS + KV_PER_TOKEN * 10000) / 2e12
    assert reading.predicted_step_seconds == pytest.approx(at_end)
    assert reading.window_predicted_step_seconds == pytest.approx((at_start + at_end) / 2)
    assert reading.prediction_error_ratio == pytest.approx(((at_start + at_end) / 2 - 0.05) / 0.05)
    (window,) = [w for _, w in windows_from_readings([reading], 1000.0)["chat"]]
    assert (window.tokens_in_flight, window.running) == (10000, 10)


def test_a_first_window_without_its_start_is_predicted_at_the_end() -> None:
    reading = derive_reading(deployment(), TARGET, snapshot(requests_running=10, tokens_in_flight=10000),
                             window(mean=0.02), now_seconds=1000.0, scrape_duration_seconds=0.1)
    at_end = (WEIGHTS + KV_PER_TOKEN * 10000) / 2e12
    assert reading.window_predicted_step_seconds == pytest.approx(at_end)
    assert reading.prediction_error_ratio == pytest.approx((at_end - 0.02) / 0.02)
