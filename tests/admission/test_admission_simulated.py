"""`agents-join` behind admission, in simulated time: the simulator's engines, the daemon's real
poll pipeline and the admission book on one simulated clock (no wall clock, no sleeps).

The expected slowdown without admission comes from the capacity model (exporter.capacity.model), whose
physics the simulator does not share: agreement is a result, not a tautology.
"""

from __future__ import annotations

import pytest

from exporter.admission.integrations.simulated_gateway import (
    AGENTS_TARGET,
    CHAT_TARGET,
    CHAT_TARGET_TOKENS_PER_SECOND,
    GatewayRun,
    run_agents_join,
    scenario_groups,
)
from exporter.capacity import model
from exporter.capacity.deployment import build_setup
from exporter.capacity.presets import get_model_preset
from exporter.simulator import load_scenario

pytestmark = pytest.mark.slow  # a 6 s simulated run shared by the module


@pytest.fixture(scope="module")
def runs() -> dict[str, GatewayRun]:
    return {mode: run_agents_join(mode) for mode in ("shared", "pools", "one-pool")}


def predicted_slowdown_ratio() -> float:
    """Per-user speed with the agents over speed without, by the capacity model: 40 chats at their
    mean context against the same plus two agent sessions at their prompt (they grow from there)."""
    chats, agents = scenario_groups(load_scenario("agents-join"))
    setup = build_setup(get_model_preset("qwen3-8b"), "h100-sxm").setup
    chat_context = chats.prompt_tokens.mean + chats.output_tokens.mean / 2
    chat_load = [model.RequestGroup(chats.users, chat_context)]
    alone = model.predict_step(setup, chat_load).user_tokens_per_second
    with_agents = model.predict_step(
        setup, [*chat_load, model.RequestGroup(agents.count, agents.prompt_tokens.mean)]).user_tokens_per_second
    return with_agents / alone


def test_without_admission_the_agents_halve_the_chats(runs: dict[str, GatewayRun]) -> None:
    shared = runs["shared"]
    ratio = shared.chat_tokens_per_second_during / shared.chat_tokens_per_second_before
    expected = predicted_slowdown_ratio()
    assert 0.4 < expected < 0.6  # "about half", by the model
    assert ratio == pytest.approx(expected, abs=0.12)
    assert shared.chat_tokens_per_second_during < CHAT_TARGET_TOKENS_PER_SECOND
    assert set(shared.agent_targets) == {CHAT_TARGET}


def test_with_pools_the_chats_keep_their_speed_and_the_agents_go_to_the_long_context_pool(
        runs: dict[str, GatewayRun]) -> None:
    pools = runs["pools"]
    assert pools.chat_tokens_per_second_before >= CHAT_TARGET_TOKENS_PER_SECOND
    assert pools.chat_tokens_per_second_during >= CHAT_TARGET_TOKENS_PER_SECOND
    assert pools.chat_requests_during > 100
    assert pools.agent_targets == (AGENTS_TARGET, AGENTS_TARGET)
    assert pools.decisions[("agents", "admitted")] == 2
    assert pools.decisions[("chat", "admitted")] > 0 and pools.decisions[("chat", "refused")] == 0
    assert pools.longest_chat_wait_seconds == 0


def test_admission_on_one_pool_keeps_the_chats_fast_by_queueing_the_agents(runs: dict[str, GatewayRun]) -> None:
    one_pool = runs["one-pool"]
    assert one_pool.chat_tokens_per_second_during >= CHAT_TARGET_TOKENS_PER_SECOND
    assert one_pool.agent_targets == ()  # both sessions still wait at the gateway
    assert one_pool.decisions[("chat", "refused")] > 0
