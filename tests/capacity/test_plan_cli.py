"""`stepbudget plan` through the real CLI entry point: output, JSON keys, plots, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from exporter.capacity.deployment import build_setup
from exporter.capacity.model import RequestGroup
from exporter.capacity.planner import build_plan, curve_points, parse_load, predict_loads
from exporter.capacity.presets import get_model_preset
from exporter.cli import main
from tests.support.tools import DATA

CONFIGS = DATA / "hf_configs"
QWEN3_KV = 2 * 36 * 8 * 128 * 2
QWEN3_WEIGHTS = 8.19e9 * 2
H100_EFFECTIVE = 0.6 * 3.35e12


def plan_json(capsys: pytest.CaptureFixture[str], *flags: str) -> dict:
    assert main(["plan", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def bad_input(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run and return the single stderr line of a bad-input exit."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_plan_json_has_the_design_keys_with_the_reference_values(capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(capsys, "--load", "40x2000", "--load", "2x100000", "--context", "2000", "--context", "8000")
    assert out["kv_bytes_per_token"] == QWEN3_KV
    assert out["weight_bytes"] == QWEN3_WEIGHTS
    assert out["kv_capacity_tokens"] == math.floor((80e9 * 0.9 - QWEN3_WEIGHTS) / (QWEN3_KV * 16)) * 16
    assert out["effective_bandwidth_bytes_per_second"] == pytest.approx(H100_EFFECTIVE)
    assert out["bandwidth_source"] == "default"
    assert out["step_budget_seconds"] == pytest.approx(0.9 / 50)
    assert out["token_budget_tokens"] == pytest.approx((0.9 / 50 * H100_EFFECTIVE - QWEN3_WEIGHTS) / QWEN3_KV)
    tokens = 40 * 2000 + 2 * 100_000
    assert out["tokens_in_flight"] == tokens
    step = (QWEN3_WEIGHTS + tokens * QWEN3_KV) / H100_EFFECTIVE
    assert out["predicted_step_seconds"] == pytest.approx(step)
    assert out["predicted_tokens_per_second_per_user"] == pytest.approx(1 / step)
    assert out["meets_target"] is False
    cache = 80e9 * 0.9 - QWEN3_WEIGHTS
    assert out["max_concurrency"] == [
        {"context_tokens": 2000, "sequences": math.floor(cache / (2000 * QWEN3_KV))},
        {"context_tokens": 8000, "sequences": math.floor(cache / (8000 * QWEN3_KV))},
    ]
    assert "upper bound" in out["kv_capacity_note"]


def test_plan_table_states_the_capacity_bound_and_the_bandwidth_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--load", "40x2000"]) == 0
    out = capsys.readouterr().out
    assert "upper bound" in out
    assert "(default)" in out
    budget = (0.9 / 50 * H100_EFFECTIVE - QWEN3_WEIGHTS) / QWEN3_KV
    assert f"{budget:,.0f} tokens in flight" in out
    assert main(["plan", "--bandwidth", "2.5e12"]) == 0
    assert "2.500 TB/s (configured)" in capsys.readouterr().out


def test_flags_change_what_they_say(capsys: pytest.CaptureFixture[str]) -> None:
    base = plan_json(capsys)
    fp8 = plan_json(capsys, "--kv-cache-dtype", "fp8")
    assert fp8["kv_bytes_per_token"] == base["kv_bytes_per_token"] / 2
    tp2 = plan_json(capsys, "--tp", "2", "--weight-dtype", "fp8")
    assert tp2["weight_bytes"] == 8.19e9 * 1 / 2
    mig = plan_json(capsys, "--gpu-memory", "40GiB", "--reserved-memory", "2GiB", "--gpu-memory-utilization", "0.8")
    assert mig["kv_cache_bytes"] == pytest.approx(40 * 2**30 * 0.8 - QWEN3_WEIGHTS - 2 * 2**30)
    slower = plan_json(capsys, "--bandwidth-efficiency", "0.5", "--step-overhead", "2ms", "--target-tps", "30",
                       "--headroom", "0.8")
    assert slower["effective_bandwidth_bytes_per_second"] == pytest.approx(0.5 * 3.35e12)
    assert slower["step_overhead_seconds"] == pytest.approx(0.002)
    assert slower["step_budget_seconds"] == pytest.approx(0.8 / 30)
    params = plan_json(capsys, "--params", "8B")
    assert params["weight_bytes"] == 16e9


def test_prefill_chunk_slows_every_stream(capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(capsys, "--load", "40x2000", "--prefill-chunk", "2048", "--compute-efficiency", "0.5")
    # By phase: the GEMMs are compute-bound, then the 40 chats' KV is read (60% of 3.35 TB/s).
    gemm = 2 * 8.19e9 * (40 + 2048) / (0.5 * 989.4e12)
    kv = 40 * 2000 * 2 * 36 * 8 * 128 * 2 / (0.6 * 3.35e12)
    assert out["predicted_step_seconds"] == pytest.approx(gemm + kv)


def test_moe_budget_assumes_the_mean_load_context_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(capsys, "--model", "qwen3-30b-a3b", "--load", "10x1000", "--load", "10x3000")
    assert out["budget_context_tokens"] == 2000
    assert "mean context" in out["budget_context_reason"]
    out = plan_json(capsys, "--model", "gemma-3-27b", "--gpu", "h200", "--context", "4000")
    assert out["budget_context_tokens"] == 4000 and "--context" in out["budget_context_reason"]
    out = plan_json(capsys, "--model", "mistral-7b")
    assert out["budget_context_tokens"] == 2000 and "default" in out["budget_context_reason"]


def test_a_config_json_path_works_as_model(capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(capsys, "--model", str(CONFIGS / "Llama-3.1-8B" / "config.json"))
    assert out["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert out["model"] == "Llama-3.1-8B"


def test_plot_writes_a_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "plan.png"
    assert main(["plan", "--load", "40x2000", "--load", "2x100000", "--plot", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_curve_is_the_per_user_speed_at_each_tokens_in_flight() -> None:
    plan = build_plan(build_setup(get_model_preset("qwen3-8b"), "h100-sxm"))
    xs, ys = curve_points(plan)
    assert xs[0] == 0 and xs[-1] >= plan.kv_capacity_tokens
    for x, y in zip(xs, ys, strict=True):  # memory-bound all along: weights plus every token's KV, read once per step
        assert y == pytest.approx(H100_EFFECTIVE / (QWEN3_WEIGHTS + QWEN3_KV * x), rel=1e-9)


def test_predict_loads_adds_all_loads_into_one_step() -> None:
    setup = build_setup(get_model_preset("qwen3-8b"), "h100-sxm").setup
    together = predict_loads(setup, [RequestGroup(40, 2000), RequestGroup(2, 100_000)])
    assert together.step.kv_read_bytes == (40 * 2000 + 2 * 100_000) * QWEN3_KV
    assert together.step.decode_tokens == 42
    plan = build_plan(build_setup(get_model_preset("qwen3-8b"), "h100-sxm"), loads=[parse_load("40x2000")])
    assert plan.load_prediction is not None and plan.load_prediction.tokens_in_flight == 80_000


# --- bad input: exit 2 and one line naming the problem ---------------------------------------


def test_unknown_preset_suggests_close_names(capsys: pytest.CaptureFixture[str]) -> None:
    err = bad_input(capsys, "plan", "--model", "qwen3-8bb")
    assert "unknown model preset 'qwen3-8bb'" in err and "did you mean: qwen3-8b" in err
    err = bad_input(capsys, "plan", "--gpu", "h100sxm")
    assert "unknown GPU preset" in err and "h100-sxm" in err


def test_config_missing_a_key_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(CONFIGS / "broken" / "missing-layers" / "config.json")
    err = bad_input(capsys, "plan", "--model", path)
    assert "num_hidden_layers" in err and path in err


def test_ssm_hybrid_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = bad_input(capsys, "plan", "--model", str(CONFIGS / "unsupported" / "Jamba-v0.1" / "config.json"))
    assert "unsupported model" in err and "jamba" in err


@pytest.mark.parametrize("flags, expected", [
    (["--gpu-memory=0GB"], "--gpu-memory: must be greater than zero"),
    (["--gpu-memory=-5GB"], "--gpu-memory"),
    (["--reserved-memory=-1GiB"], "--reserved-memory"),
    (["--bandwidth=0"], "--bandwidth: must be greater than zero"),
    (["--params=0"], "--params"),
    (["--tp", "0"], "--tp"),
    (["--target-tps", "0"], "--target-tps"),
    (["--headroom", "1.5"], "--headroom"),
    (["--context", "0"], "--context"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--load", "0x100"], "--load '0x100'"),
    (["--kv-cache-dtype", "fp7"], "kv cache dtype"),
])
def test_bad_sizes_and_values_name_the_flag(capsys: pytest.CaptureFixture[str], flags: list[str],
                                            expected: str) -> None:
    assert expected in bad_input(capsys, "plan", *flags)


def test_load_in_the_wrong_form_says_the_expected_form(capsys: pytest.CaptureFixture[str]) -> None:
    err = bad_input(capsys, "plan", "--load", "40*2000")
    assert "--load '40*2000'" in err and "COUNTxTOKENS" in err


def test_weights_that_do_not_fit_are_flagged(capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(capsys, "--model", "deepseek-v3")  # 671e9 x 2 bytes on one 80 GB GPU
    assert out["weights_fit"] is False and out["kv_capacity_tokens"] == 0
    assert plan_json(capsys, "--model", "deepseek-v3", "--gpu", "h200", "--tp", "8",
                     "--weight-dtype", "fp8")["weights_fit"]
    assert main(["plan", "--model", "deepseek-v3"]) == 0
    assert "weights do not fit" in capsys.readouterr().out



# --- inputs the tools accepted but should not (and one they refused but should not) --


def test_a_zero_step_overhead_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    """`calibrate` emits an overhead of 0 when the fit finds none; plan must take it back."""
    for zero in ("0", "0ms", "0.0"):
        out = plan_json(capsys, "--step-overhead", zero, "--load", "40x2000")
        assert out["step_overhead_seconds"] == 0
        assert out["predicted_step_seconds"] == pytest.approx((QWEN3_WEIGHTS + 40 * 2000 * QWEN3_KV) / H100_EFFECTIVE)


@pytest.mark.parametrize("value, expected", [
    ("-1ms", "--step-overhead: cannot read '-1ms' as a duration"),
    ("nan", "--step-overhead: cannot read 'nan'"),
    ("inf", "--step-overhead: cannot read 'inf'"),
    ("1e999", "--step-overhead: must be a finite number, got '1e999'"),
])
def test_a_negative_or_non_finite_step_overhead_is_refused(capsys: pytest.CaptureFixture[str], value: str,
                                                           expected: str) -> None:
    assert expected in bad_input(capsys, "plan", f"--step-overhead={value}")


def test_a_tensor_parallel_size_vllm_refuses_is_refused_with_vllms_reason(capsys: pytest.CaptureFixture[str]) -> None:
    err = bad_input(capsys, "plan", "--tp", "3")  # Qwen3-8B: 32 attention heads
    assert "--tp 3 does not fit model 'qwen3-8b'" in err
    assert "Total number of attention heads (32) must be divisible by tensor parallel size (3)." in err
    qwen2 = str(CONFIGS / "Qwen2-7B" / "config.json")  # 28 attention heads, 4 KV heads
    err = bad_input(capsys, "plan", "--model", qwen2, "--tp", "7")  # 28 % 7 == 0, but 7 GPUs and 4 KV heads
    assert "--tp 7" in err and '"7 is not divisible by 4"' in err


def test_more_gpus_than_kv_heads_replicate_them(capsys: pytest.CaptureFixture[str]) -> None:
    qwen2 = str(CONFIGS / "Qwen2-7B" / "config.json")  # 28 layers, head_dim 3584 / 28 = 128
    out = plan_json(capsys, "--model", qwen2, "--tp", "28")  # each of the 4 KV heads on 7 GPUs
    assert out["kv_bytes_per_token"] == 2 * 28 * 1 * 128 * 2
    assert plan_json(capsys, "--model", qwen2, "--tp", "2")["kv_bytes_per_token"] == 2 * 28 * 2 * 128 * 2


def test_a_preset_name_stays_the_preset_whatever_the_working_directory_holds(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen3-8b").mkdir()  # e.g. a checkout of the model's weights
    out = plan_json(capsys, "--model", "qwen3-8b")
    assert out["model"] == "qwen3-8b" and out["kv_bytes_per_token"] == QWEN3_KV


def test_a_bare_name_that_is_a_file_here_must_be_written_as_a_path(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama").write_text((CONFIGS / "Llama-3.1-8B" / "config.json").read_text())
    err = bad_input(capsys, "plan", "--model", "llama")
    assert "model 'llama' is not a model preset" in err and "write it as a path: ./llama" in err
    assert plan_json(capsys, "--model", "./llama")["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    (tmp_path / "weights").mkdir()
    assert "write it as a path: ./weights/config.json" in bad_input(capsys, "plan", "--model", "weights")
    assert "unknown model preset 'nothing-here'" in bad_input(capsys, "plan", "--model", "nothing-here")


# --- a calibration's per-request cost reaches plan ---------------------------------


def test_a_per_request_cost_from_calibrate_reaches_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """What `calibrate` prints after `use: stepbudget plan`: the cost is paid once per running request."""
    per_request = 90e-6
    out = plan_json(capsys, "--per-request-cost", "0.09ms", "--load", "40x2000")
    assert out["per_request_seconds"] == pytest.approx(per_request)
    step = (QWEN3_WEIGHTS + 40 * 2000 * QWEN3_KV) / H100_EFFECTIVE + 40 * per_request
    assert out["predicted_step_seconds"] == pytest.approx(step)
    # The budget now depends on how tokens split into requests: it assumes the --load's 2,000 tokens each.
    # n requests fit while weights + n*cost + (n-1)*2000 tokens of KV stay under 18 ms; the last is partial.
    per_request_kv = 2000 * QWEN3_KV / H100_EFFECTIVE
    weights = QWEN3_WEIGHTS / H100_EFFECTIVE
    requests = math.ceil((0.018 - weights + per_request_kv) / (per_request + per_request_kv)) - 1
    at_start = weights + requests * per_request + (requests - 1) * per_request_kv
    budget = min(requests * 2000.0, (requests - 1) * 2000 + (0.018 - at_start) * H100_EFFECTIVE / QWEN3_KV)
    assert out["token_budget_tokens"] == pytest.approx(budget)
    assert out["budget_context_tokens"] == 2000
    main(["plan", "--per-request-cost", "0.09ms", "--load", "40x2000"])
    assert f"per-request {40 * per_request * 1e3:,.2f} ms" in capsys.readouterr().out


def test_a_negative_per_request_cost_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--per-request-cost: cannot read '-1'" in bad_input(capsys, "plan", "--per-request-cost=-1")
