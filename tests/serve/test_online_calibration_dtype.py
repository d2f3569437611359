"""The online fit counts a window's bytes with the KV dtype its engine's page reports, as the reading
predicts with.

A server whose page says `cache_dtype="fp8"` under a config that says `kv_cache_dtype: auto` (and the
reverse) runs the daemon's pipeline in simulated time (tests/support/simulated_polls.py) through
four phases: 40 chats; the chats plus long agent sessions; the agents alone; then 32 chats. The
simulated GPU's truth is set by hand: bandwidth 0.8 x the H100's 3.35 TB/s peak on weights and KV
alike, 4 ms per step plus 40 us per scheduled sequence, so the truth at a load is computed here from
the preset's numbers (Qwen3-8B: 8.19e9 parameters at 2 bytes; 2 x 36 layers x 8 KV heads x 128 =
73,728 KV elements per token), not from the model under test.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import cache

import pytest

from exporter.capacity import model
from exporter.capacity.presets import get_model_preset
from exporter.serve.alerting import AlertLoop
from exporter.serve.config import Alerting, Deployment, config_from_mapping
from exporter.serve.online_calibration import ONLINE_SOURCE, OnlineCalibrator
from exporter.serve.reading import Reading, page_setup
from exporter.serve.setups_in_use import SetupsInUse
from exporter.simulator import ServerSpec, Simulator
from exporter.simulator.hardware import HardwareTruth
from exporter.simulator.scenarios import ClosedLoopGroup, Scenario, ScriptedGroup, TokenCount
from tests.support.simulated_polls import TARGET_URL, simulated_polls

pytestmark = pytest.mark.slow  # about 11 s each: long simulated runs

POLL_SECONDS = 5.0
PAGE_FOR_SECONDS = 60.0  # the page's `for`, scaled down with the run (the product's: 5 min)
PEAK_BANDWIDTH = 3.35e12  # H100 SXM
TRUE_BANDWIDTH = 0.8 * PEAK_BANDWIDTH
TRUE_OVERHEAD_SECONDS = 4e-3
TRUE_PER_REQUEST_SECONDS = 40e-6
KV_ELEMENTS_PER_TOKEN = 2 * 36 * 8 * 128
WEIGHT_BYTES = get_model_preset("qwen3-8b").params * 2.0
BUDGET_SECONDS = 0.9 / 50.0  # the default target (50 tok/s) and headroom (0.9): 18 ms
TRUTH = HardwareTruth(launch_overhead_seconds=TRUE_OVERHEAD_SECONDS,
                      per_sequence_overhead_seconds=TRUE_PER_REQUEST_SECONDS, bandwidth_efficiency=0.8,
                      kv_read_efficiency=1.0, kv_read_long_context_drop=0.0, noise_ratio=0.02)
AGENTS_JOIN, CHATS_STOP, AGENTS_LEAVE, CHATS_AGAIN, END = 300.0, 600.0, 750.0, 780.0, 1080.0
PAGE_BYTES = {"fp8": 1.0, "auto": 2.0}  # auto: the model's own dtype, bf16


def true_step_seconds(page_dtype: str, requests: int, context_tokens: int) -> float:
    kv_bytes = KV_ELEMENTS_PER_TOKEN * PAGE_BYTES[page_dtype] * requests * context_tokens
    return TRUE_OVERHEAD_SECONDS + TRUE_PER_REQUEST_SECONDS * requests + (WEIGHT_BYTES + kv_bytes) / TRUE_BANDWIDTH


def test_the_hand_truth() -> None:
    # 40 x 2,000 on an fp8 cache: (16.38 GB + 5.90 GB) / 2.68 TB/s = 8.31 ms, + 4 ms + 1.6 ms.
    assert true_step_seconds("fp8", 40, 2_000) == pytest.approx(13.91e-3, rel=1e-3)
    # 16 x 25,000 on an fp8 cache: (16.38 GB + 29.49 GB) / 2.68 TB/s = 17.12 ms, + 4 ms + 0.64 ms: over 18 ms.
    assert true_step_seconds("fp8", 16, 25_000) == pytest.approx(21.76e-3, rel=1e-3)
    assert true_step_seconds("auto", 40, 2_000) == pytest.approx(16.11e-3, rel=1e-3)


@dataclass(frozen=True)
class Run:
    deployment: Deployment
    polls: list[tuple[float, Reading, float | None]]  # (seconds, reading, the simulator's mean ITL)
    firing_at: list[float]  # the polls at which the page was firing
    setups_in_use: SetupsInUse  # what the online calibration published


@cache
def _run(page_dtype: str, config_dtype: str, agents: int) -> Run:
    deployment = config_from_mapping({
        "poll_interval": "5s", "alerting": {"drift_for": "30s"},  # scaled down, as the page's `for`
        "defaults": {"online_calibration": {"history": "20m", "holdout": "1m", "min_windows": 30}},
        "deployments": [{"name": "pool", "model": "qwen3-8b", "gpu": "h100-sxm", "kv_cache_dtype": config_dtype,
                         "targets": {"static": [TARGET_URL]}}]}).deployments[0]
    calibrator = OnlineCalibrator([deployment])
    alerts = AlertLoop(Alerting(for_seconds=PAGE_FOR_SECONDS), poll_interval_seconds=POLL_SECONDS)
    scenario = Scenario("dtype", "chats, chats and agents, agents, chats", (
        ClosedLoopGroup("chat", 40, TokenCount(1500, 0.2), TokenCount(1000, 0.2), stop_seconds=CHATS_STOP),
        ScriptedGroup("agent", AGENTS_JOIN, TokenCount(18_000, 0.05), TokenCount(30_000), count=agents,
                      leave_at_seconds=AGENTS_LEAVE),
        ClosedLoopGroup("chat-again", 32, TokenCount(1500, 0.2), TokenCount(1000, 0.2), start_seconds=CHATS_AGAIN)))
    sim = Simulator(ServerSpec(kv_cache_dtype=page_dtype, truth=TRUTH), scenario, record_steps=True)
    polls, firing_at = [], []
    for sampled in simulated_polls(sim, deployment, POLL_SECONDS, END, setups_in_use=calibrator.setups_in_use):
        observations = [s.seconds for s in sampled.steps for _ in range(s.decode_tokens)]
        polls.append((sampled.seconds, sampled.reading, statistics.fmean(observations) if observations else None))
        calibrator.observe([sampled.reading], sampled.seconds)
        alerts.evaluate([sampled.reading], sampled.seconds)
        if any(alert["alertname"] == "StepBudgetPredictedStepOverBudget" for alert in alerts.firing()):
            firing_at.append(sampled.seconds)
    return Run(deployment, polls, firing_at, calibrator.setups_in_use)


# (page's cache_dtype, config's kv_cache_dtype, agent sessions): bf16 holds fewer of them on 80 GB.
CASES = [("fp8", "auto", 12), ("auto", "fp8", 6)]


@pytest.mark.parametrize(("page_dtype", "config_dtype", "agents"), CASES)
def test_the_fitted_prediction_is_within_5_percent_of_the_truth_at_both_loads(
        page_dtype: str, config_dtype: str, agents: int) -> None:
    run = _run(page_dtype, config_dtype, agents)
    in_use = run.setups_in_use.get(run.deployment.name)
    assert in_use is not None and in_use.source == ONLINE_SOURCE
    assert run.polls[-1][1].kv_cache_dtype == page_dtype  # the page's word reached the reading
    # What the reading predicts with: the fitted setup under the page's dtype.
    predicting = page_setup(in_use.setup, page_dtype, 16)
    for requests, context in ((40, 2_000), (16, 25_000)):
        predicted = model.predict_step(predicting, model.groups_from_total(requests * context, requests)).step_seconds
        truth = true_step_seconds(page_dtype, requests, context)
        assert predicted == pytest.approx(truth, rel=0.05), (requests, context, predicted, truth)


@pytest.mark.parametrize(("page_dtype", "config_dtype", "agents"), CASES)
def test_the_page_fires_while_the_truth_is_over_budget_and_only_then(
        page_dtype: str, config_dtype: str, agents: int) -> None:
    run = _run(page_dtype, config_dtype, agents)
    agents_alone = [(t, truth) for t, _, truth in run.polls if CHATS_STOP + 60 < t <= AGENTS_LEAVE and truth]
    assert agents_alone and all(truth > BUDGET_SECONDS * 1.05 for _, truth in agents_alone)
    # Over budget for longer than the page's `for` (and a poll to evaluate it): firing at every poll.
    firing = set(run.firing_at)
    due = [t for t, _, _ in run.polls if agents_alone[0][0] + PAGE_FOR_SECONDS + POLL_SECONDS <= t <= AGENTS_LEAVE]
    assert due and [t for t in due if t not in firing] == [], "the agents' steps are over budget"
    chats_again = [(t, truth) for t, _, truth in run.polls if CHATS_AGAIN + 120 < t and truth]
    assert chats_again and max(truth for _, truth in chats_again) < BUDGET_SECONDS
    assert not [t for t in run.firing_at if t > CHATS_AGAIN + 120], "32 chats at ~2,000 tokens fit the budget"
    # The exported prediction follows the truth through both phases.
    for t, reading, truth in run.polls:
        if truth and reading.predicted_step_seconds and (CHATS_STOP + 60 < t <= AGENTS_LEAVE or t > CHATS_AGAIN + 120):
            assert reading.predicted_step_seconds == pytest.approx(truth, rel=0.08), t


@pytest.mark.parametrize(("page_dtype", "config_dtype", "agents"), CASES)
def test_the_token_budget_is_the_truths(page_dtype: str, config_dtype: str, agents: int) -> None:
    """The truth's budget at context c: the N with overhead + per_request x N / c + (weights + kv x N) / bw
    equal to the 18 ms budget."""
    run = _run(page_dtype, config_dtype, agents)
    reading = run.polls[-1][1]
    assert reading.tokens_in_flight and reading.requests_running and reading.token_budget_tokens
    context = reading.tokens_in_flight / reading.requests_running
    kv_bytes_per_token = KV_ELEMENTS_PER_TOKEN * PAGE_BYTES[page_dtype]
    truth = (BUDGET_SECONDS - TRUE_OVERHEAD_SECONDS - WEIGHT_BYTES / TRUE_BANDWIDTH) / (
        TRUE_PER_REQUEST_SECONDS / context + kv_bytes_per_token / TRUE_BANDWIDTH)
    assert reading.token_budget_tokens == pytest.approx(truth, rel=0.10)
