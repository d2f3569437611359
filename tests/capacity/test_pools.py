"""`plan --pools`: per-user speed of each class, shared pool vs long sessions on their own GPUs.

Expected numbers are worked out here by hand from the preset's published figures (Qwen3-8B:
36 layers, 8 KV heads of 128, 8.19e9 params in bf16; H100 SXM: 3.35 TB/s at the default 60%).
"""

from __future__ import annotations

import argparse
import json

import pytest

from exporter.capacity.deployment import build_setup
from exporter.capacity.model import RequestGroup
from exporter.capacity.pools import (
    DEFAULT_SPLIT_TOKENS,
    parse_split,
    plan_pools,
    pools_to_json,
    run_if_asked,
    split_loads,
)
from exporter.capacity.presets import get_model_preset
from exporter.cli import main
from exporter.errors import InputError

KV_BYTES_PER_TOKEN = 2 * 36 * 8 * 128 * 2  # K and V, layers, KV heads, head dim, bf16
WEIGHT_BYTES = 8.19e9 * 2
BANDWIDTH = 0.6 * 3.35e12
STEP_BUDGET_SECONDS = 0.9 / 50
CHATS, AGENTS = RequestGroup(40, 2000), RequestGroup(2, 100_000)


def speed(tokens_in_flight: float) -> float:
    """Memory-bound decode (compute is ~1 ms at these batch sizes): one token per step."""
    return BANDWIDTH / (WEIGHT_BYTES + KV_BYTES_PER_TOKEN * tokens_in_flight)


@pytest.fixture(scope="module")
def setup():
    return build_setup(get_model_preset("qwen3-8b"), "h100-sxm").setup


def test_the_reference_mix_shared_and_split(setup) -> None:
    pools = plan_pools(setup, [CHATS, AGENTS], 32_000, target_tokens_per_second=50)
    assert pools.shared.user_tokens_per_second == pytest.approx(speed(280_000), rel=1e-9)
    assert pools.short is not None and pools.long is not None
    assert pools.short.user_tokens_per_second == pytest.approx(speed(80_000), rel=1e-9)
    assert pools.long.user_tokens_per_second == pytest.approx(speed(200_000), rel=1e-9)
    # DESIGN §1's worked example: ~35 tok/s shared, ~71 for the chats alone.
    assert round(pools.shared.user_tokens_per_second) == 35 and round(pools.short.user_tokens_per_second) == 71
    assert not pools.shared.meets_target and pools.short.meets_target and not pools.long.meets_target
    budget_tokens = (STEP_BUDGET_SECONDS * BANDWIDTH - WEIGHT_BYTES) / KV_BYTES_PER_TOKEN
    assert pools.token_budget_tokens == pytest.approx(budget_tokens, rel=1e-9)


def test_replicas_to_hold_the_target(setup) -> None:
    pools = plan_pools(setup, [CHATS, AGENTS], 32_000, target_tokens_per_second=50)
    budget_tokens = (STEP_BUDGET_SECONDS * BANDWIDTH - WEIGHT_BYTES) / KV_BYTES_PER_TOKEN  # ~134,000
    # Shared: 2 replicas -> the busiest holds 20 chats + 1 agent; 3 -> 14 chats + 1 agent.
    assert 20 * 2000 + 100_000 > budget_tokens >= 14 * 2000 + 100_000
    assert pools.shared.replicas_for_target == 3
    assert pools.short.replicas_for_target == 1  # 80,000 fits
    assert 2 * 100_000 > budget_tokens >= 100_000
    assert pools.long.replicas_for_target == 2
    assert pools.split_replicas_for_target == 3


def test_a_request_that_misses_alone_needs_no_number_of_replicas(setup) -> None:
    too_long = RequestGroup(1, 300_000)  # 300,000 tokens alone exceed the ~134,000 budget
    pools = plan_pools(setup, [CHATS, too_long], 32_000, target_tokens_per_second=50)
    assert pools.long is not None and pools.long.replicas_for_target is None
    assert pools.shared.replicas_for_target is None and pools.split_replicas_for_target is None


def test_a_load_exactly_at_the_split_is_short() -> None:
    at, above = RequestGroup(3, 32_000), RequestGroup(1, 32_001)
    assert split_loads([at, above], 32_000) == ([at], [above])


def test_a_mix_without_long_sessions_has_no_long_pool(setup) -> None:
    pools = plan_pools(setup, [CHATS], 32_000, target_tokens_per_second=50)
    assert pools.long is None and pools.short is not None
    assert pools.short.user_tokens_per_second == pools.shared.user_tokens_per_second
    assert pools_to_json(pools)["long"] is None


def test_bad_input_names_the_flag(setup) -> None:
    with pytest.raises(InputError, match="--pools needs the mix"):
        plan_pools(setup, [], 32_000, target_tokens_per_second=50)
    for text in ("lots", "-5", "0", "inf"):
        with pytest.raises(InputError, match="--split"):
            parse_split(text)
    assert parse_split("32,000") == 32_000 and parse_split(None) == DEFAULT_SPLIT_TOKENS
    with pytest.raises(InputError, match="--split only applies with --pools"):
        run_if_asked(None, argparse.Namespace(split="1000", pools=False))
    assert run_if_asked(None, argparse.Namespace(split=None, pools=False)) is None


def run_plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_output_carries_each_class(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_plan(["--pools", "--split", "32000", "--load", "40x2000", "--load", "2x100000", "--json"],
                            capsys)
    assert code == 0
    document = json.loads(out)
    assert document["split_tokens"] == 32_000
    assert document["shared"]["predicted_tokens_per_second_per_user"] == pytest.approx(speed(280_000), rel=1e-9)
    assert document["short"]["loads"] == [{"count": 40, "context_tokens": 2000.0}]
    assert document["long"]["predicted_tokens_per_second_per_user"] == pytest.approx(speed(200_000), rel=1e-9)
    assert document["long"]["replicas_for_target"] == 2


def test_text_output_is_a_table_per_class(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_plan(["--pools", "--load", "40x2000", "--load", "2x100000"], capsys)
    assert code == 0
    short_row = next(line for line in out.splitlines() if line.startswith("short (<= 32,000)"))
    assert "40x2,000" in short_row and f"{speed(280_000):,.1f} tok/s" in short_row
    assert f"{speed(80_000):,.1f} tok/s" in short_row
    assert "replicas to hold 50 tok/s: shared pool 3, split pools 3" in out


def test_at_a_slow_target_the_kv_cache_not_the_speed_sets_the_replicas(setup) -> None:
    agents = RequestGroup(4, 100_000)
    pools = plan_pools(setup, [agents], 32_000, target_tokens_per_second=20)
    capacity_tokens = (0.9 * 80e9 - WEIGHT_BYTES) // (KV_BYTES_PER_TOKEN * 16) * 16  # whole 16-token blocks
    budget_tokens = (0.9 / 20 * BANDWIDTH - WEIGHT_BYTES) / KV_BYTES_PER_TOKEN  # ~502,000
    assert budget_tokens > 400_000 > capacity_tokens  # four sessions meet 20 tok/s but do not fit
    assert pools.kv_capacity_tokens == capacity_tokens
    assert pools.long is not None and pools.long.replicas_for_target == 2


@pytest.mark.parametrize(("argv", "message"), [
    (["--split", "32000", "--load", "40x2000"], "--split only applies with --pools"),
    (["--pools"], "--pools needs the mix"),
    (["--pools", "--split", "many", "--load", "40x2000"], "--split 'many': expected a number of tokens"),
])
def test_plan_pools_bad_input_exits_2_with_one_line(argv: list[str], message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_plan(argv, capsys)
    assert code == 2 and out == ""
    assert err.startswith("stepbudget plan: error: ") and message in err and err.count("\n") == 1


def test_plan_without_pools_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_plan(["--load", "40x2000", "--json"], capsys)
    assert code == 0 and "shared" not in json.loads(out) and "predicted_tokens_per_second_per_user" in json.loads(out)
