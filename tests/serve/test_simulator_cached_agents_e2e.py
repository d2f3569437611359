"""End to end with prefix caching: 40 chats plus two tool-calling agents whose ~100,000-token
prompts are 99% cached (the `agents-cached` scenario: Qwen3-8B on an H100, vLLM 0.33's page), read
over real HTTP on 127.0.0.1 by the daemon's own poller, its readings evaluated by the daemon's own
alert loop (the rules of rules/stepbudget.alerts.yaml, exporter/serve/alerting.py).

Each agent turn re-sends its whole conversation, so `vllm:prompt_tokens_total` grows by ~200,000
tokens a turn pair although the engine computes only ~2,000 of them; the rest are prefix-cache hits
(`vllm:prompt_tokens_by_source_total{source="local_cache_hit"}`). The claim checked here: with the
pool's step budget of 45 ms (20 tokens/s per user) and the measured step well inside it, the page
alert StepBudgetPredictedStepOverBudget never fires, and the predicted step stays within 10% of the
measured one. A reader that takes every prompt token as prefill work predicts steps of ~70 ms here
and pages for nothing.

Simulated time is driven by the test (`paced=False`): the server runs to each poll instant, then
the poller fetches its page. "Measured" is the simulator's ground truth, as in
tests/serve/test_simulator_tracking.py: the mean of the ITL observations (every decoding request's step
time) in each poll window. Polls taken while an agent is between turns (its next turn queued or in
its prefill step, so the page shows one agent fewer than the window saw) are transitions, not a
steady state, and are not held to the 10%.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from exporter.serve.alerting import PAGE_ALERT, AlertLoop
from exporter.serve.config import Config, config_from_mapping
from exporter.serve.reading import Reading
from exporter.simulator import ServerHandle, ServerSpec, load_scenario, start_server
from tests.support.clocks import ManualClock
from tests.support.pollers import MakePoller
from tests.support.simulator import simulated_calibration, true_mean_step_seconds

POLL_SECONDS = 15.0
POLLS = 40  # 10 simulated minutes: twice the alert's `for`
TARGET_TOKENS_PER_SECOND = 20.0  # step budget 0.9 / 20 = 45 ms
AGENTS = 2
TOLERANCE = 0.10


@dataclass(frozen=True)
class Poll:
    end_seconds: float
    reading: Reading
    true_mean_seconds: float | None
    agents_decoding: int  # agent requests past their first token at poll time
    page_alert_firing: bool


@pytest.fixture
def server() -> Iterator[ServerHandle]:
    handle = start_server(scenario=load_scenario("agents-cached"), spec=ServerSpec(seed=0), paced=False,
                          record_steps=True)
    yield handle
    handle.stop()


def _config(url: str) -> Config:
    calibration = simulated_calibration()
    return config_from_mapping({"poll_interval": "15s", "timeout": "5s", "deployments": [{
        "name": "agents", "model": "qwen3-8b", "gpu": "h100-sxm",
        "effective_bandwidth": calibration.effective_bandwidth_bytes_per_second,
        "step_overhead": calibration.step_overhead_seconds,
        "target_tokens_per_second": TARGET_TOKENS_PER_SECOND,
        "targets": {"static": [url]}}]})


def _run(server: ServerHandle, make_poller: MakePoller) -> tuple[list[Poll], Config]:
    config = _config(f"{server.url}/metrics")
    clock = ManualClock()
    poller = make_poller(config, clock)
    alerts = AlertLoop(config.alerting, poll_interval_seconds=POLL_SECONDS, clock=clock)
    poller.add_listener(alerts.on_poll)
    simulator = server.simulator
    assert simulator.steps is not None
    polls: list[Poll] = []
    seen_steps = 0
    for number in range(1, POLLS + 1):
        t = number * POLL_SECONDS
        server.run_until(t)
        clock.advance(POLL_SECONDS)
        (reading,) = poller.poll_once().readings
        steps = simulator.steps[seen_steps:]
        seen_steps = len(simulator.steps)
        decoding = sum(1 for r in simulator.running if r.group == "agent" and r.output_tokens > 0)
        firing = any(alert["alertname"] == PAGE_ALERT for alert in alerts.firing())
        polls.append(Poll(t, reading, true_mean_step_seconds(steps), decoding, firing))
    return polls, config


@pytest.mark.e2e
def test_cached_agent_prompts_do_not_page_and_the_prediction_tracks(server: ServerHandle,
                                                                     make_poller: MakePoller) -> None:
    polls, config = _run(server, make_poller)
    budget = config.deployments[0].step_budget_seconds
    assert budget == pytest.approx(0.045)
    assert all(p.reading.target_up for p in polls)
    windows = polls[1:]  # the first poll has no window yet
    # The premise: the measured step (the daemon's mean over each window) stays inside the budget.
    measured = [p.reading.measured_step_seconds for p in windows]
    assert all(m is not None and m < budget for m in measured), measured
    predicted = [(p.end_seconds, p.reading.predicted_step_seconds) for p in polls]
    assert not any(p.page_alert_firing for p in polls), f"{PAGE_ALERT} fired; predicted steps: {predicted}"
    steady = [p for p in windows if p.agents_decoding == AGENTS]
    assert len(steady) >= len(windows) * 3 // 4
    for poll in steady:
        assert poll.reading.predicted_step_seconds is not None and poll.true_mean_seconds is not None
        error = (poll.reading.predicted_step_seconds - poll.true_mean_seconds) / poll.true_mean_seconds
        assert abs(error) <= TOLERANCE, (
            f"t={poll.end_seconds:.0f}s: predicted {poll.reading.predicted_step_seconds * 1000:.1f} ms, measured "
            f"mean {poll.true_mean_seconds * 1000:.1f} ms ({error:+.1%}); prefill per step read from the page: "
            f"{poll.reading.prefill_tokens_per_step}")
