"""The page never resolves because its evidence went missing.

An overloaded vLLM whose /metrics stops answering in time is marked down, and after `stale_after` its
predicted step series is gone; a DNS name of a headless Service drops a pod that fails readiness.
Either way the page must stay firing (same alert, same labels: no "resolved" reaches the pager) until
the target reads under budget again; a target gone from discovery is held at most
PAGE_HOLD_SECONDS after its last reading, so a pod scaled down while over budget does not page forever.

Driven in simulated time: a ManualClock for the poller and the loop, a fetch that answers a vLLM page
or times out, and (for discovery) a list of targets the test edits. The Prometheus side of the same
sequence is in tests/rules/stepbudget.alerts_test.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from exporter.serve.alerting import PAGE_ALERT, PAGE_HOLD_SECONDS, AlertLoop
from exporter.serve.config import Alerting, Config, Tls, config_from_mapping
from exporter.serve.discovery import Target
from exporter.serve.fetch import FetchError
from exporter.serve.poller import Poller
from exporter.serve.reading import Reading
from tests.support.clocks import ManualClock, SteppingClock
from tests.support.pages import VllmState, vllm_page
from tests.support.pollers import MakePoller

URL = "http://10.0.0.5:8000/metrics"
POLL_SECONDS = 15.0
STALE_AFTER_SECONDS = 60.0
PAGE_FOR_SECONDS = 300.0
# Qwen3-8B (bf16, 144 KiB of KV per token) with 16384 blocks of 16 = 262,144 tokens of capacity, on an
# H100 SXM at the default 60% of 3.35 TB/s = 2.01e12 B/s; budget 0.9 / 50 tok/s = 18 ms.
# 90% full: 235,930 tokens x 147,456 B = 34.8 GB -> 17.3 ms, plus 16.4 GB of weights -> 8.1 ms: ~25 ms, over.
# 10% full: 26,214 tokens -> 1.9 ms + 8.1 ms: ~10 ms, under.
OVER = vllm_page(VllmState(running=32, kv_usage_ratio=0.9, num_gpu_blocks=16384))
UNDER = vllm_page(VllmState(running=4, kv_usage_ratio=0.1, num_gpu_blocks=16384))
BUDGET_SECONDS = 0.9 / 50
# The same busy page with the engine put to sleep (level 1, as vLLM 0.11+ writes it: docs/engines.md).
ASLEEP = OVER.rstrip("\n") + "\n" + "".join(
    f'vllm:engine_sleep_state{{engine="0",model_name="Qwen/Qwen3-8B",sleep_state="{state}"}} {value}\n'
    for state, value in (("awake", "0.0"), ("weights_offloaded", "1.0"), ("discard_all", "0.0")))


def _config() -> Config:
    return config_from_mapping({
        "poll_interval": "15s", "stale_after": "60s", "timeout": "5s",
        "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": [URL]}}],
    })


@dataclass
class Server:
    """What the model server answers: a page, or nothing in time (the fetch's own timeout reason)."""

    page: str | None = OVER

    def __call__(self, url: str, *, bearer_token: str | None, tls: Tls) -> str:
        if self.page is None:
            raise FetchError("timed out after 5s")
        return self.page


@dataclass
class Rig:
    """A poller and the alert loop listening to it, on one simulated clock."""

    clock: ManualClock
    poller: Poller
    alerts: AlertLoop

    def poll_for(self, seconds: float) -> None:
        """Poll every POLL_SECONDS for `seconds` (the first poll one interval from now)."""
        for _ in range(round(seconds / POLL_SECONDS)):
            self.clock.advance(POLL_SECONDS)
            self.poller.poll_once()

    def page(self) -> list[str]:
        """The page's state per alert of it: "firing" or "pending"."""
        return [str(alert["state"]) for alert in _page_alerts(self.alerts)]

    def firing(self) -> set[str]:
        return {alert["alertname"] for alert in self.alerts.firing()}


def _page_alerts(alerts: AlertLoop) -> list[dict[str, object]]:
    """The page's entries of `active()` (pending or firing)."""
    return [alert for alert in alerts.active()
            if isinstance(labels := alert["labels"], dict) and labels["alertname"] == PAGE_ALERT]


def _rig(poller: Poller, clock: ManualClock) -> Rig:
    alerts = AlertLoop(Alerting(), poll_interval_seconds=POLL_SECONDS, clock=clock)
    poller.add_listener(alerts.on_poll)
    return Rig(clock, poller, alerts)


def _predicted(poller: Poller) -> float | None:
    (reading,) = poller.readings()
    return reading.predicted_step_seconds


def test_a_target_that_stops_answering_while_over_budget_keeps_the_page_until_it_reads_under(
        clock: ManualClock, make_poller: MakePoller) -> None:
    server = Server(OVER)
    rig = _rig(make_poller(_config(), clock, fetch=server), clock)
    rig.poller.poll_once()
    predicted = _predicted(rig.poller)
    assert predicted is not None and predicted > BUDGET_SECONDS
    rig.poll_for(PAGE_FOR_SECONDS)
    assert rig.page() == ["firing"]

    # The server stops answering in time: down at once, its values kept for stale_after, then dropped.
    server.page = None
    rig.poll_for(STALE_AFTER_SECONDS + POLL_SECONDS)
    assert _predicted(rig.poller) is None, "past stale_after the predicted series is gone"
    assert rig.page() == ["firing"], "the page resolved because its evidence went missing"
    rig.poll_for(PAGE_FOR_SECONDS)  # past 5 minutes down: the warning joins the page, never replaces it
    assert rig.firing() == {PAGE_ALERT, "StepBudgetTargetDown"}
    rig.poll_for(PAGE_HOLD_SECONDS)  # down longer than a dropped target is held: still polled, still down
    assert rig.page() == ["firing"]

    # It answers again, still over budget: the page goes on (not re-raised: no new pending 5 minutes).
    server.page = OVER
    rig.poll_for(POLL_SECONDS)
    assert rig.page() == ["firing"] and rig.firing() == {PAGE_ALERT}
    # It reads under budget: now, and only now, the page resolves.
    server.page = UNDER
    rig.poll_for(POLL_SECONDS)
    predicted = _predicted(rig.poller)
    assert predicted is not None and predicted <= BUDGET_SECONDS
    assert rig.page() == []


def test_a_target_down_while_under_budget_raises_only_the_warning(clock: ManualClock,
                                                                  make_poller: MakePoller) -> None:
    server = Server(UNDER)
    rig = _rig(make_poller(_config(), clock, fetch=server), clock)
    rig.poll_for(PAGE_FOR_SECONDS)
    server.page = None
    rig.poll_for(STALE_AFTER_SECONDS + PAGE_FOR_SECONDS + POLL_SECONDS)
    assert rig.firing() == {"StepBudgetTargetDown"}


@dataclass
class Headless:
    """A headless Service's DNS name: the ready pods' addresses, which the test edits."""

    targets: list[Target] = field(default_factory=lambda: [Target(deployment="chat", url=URL,
                                                                  target="10.0.0.5:8000")])

    def discover(self) -> list[Target]:
        return list(self.targets)


def _discovered_rig(clock: ManualClock, server: Server, dns: Headless) -> Rig:
    poller = Poller(_config(), dns, server, clock=clock, monotonic=SteppingClock(0.125))  # type: ignore[arg-type]  # a Discovery in all that the poller calls
    return _rig(poller, clock)


def test_a_pod_dropped_by_discovery_while_over_budget_is_held_for_the_hold_then_forgotten(
        clock: ManualClock) -> None:
    dns, server = Headless(), Server(OVER)
    rig = _discovered_rig(clock, server, dns)
    rig.poll_for(PAGE_FOR_SECONDS + POLL_SECONDS)
    assert rig.page() == ["firing"]
    last_read = clock.now
    dns.targets = []  # fails readiness (or is deleted): DNS no longer has it
    rig.poll_for(POLL_SECONDS)
    assert rig.poller.readings() == ()
    assert rig.page() == ["firing"], "the page resolved because the pod left DNS"
    rig.poll_for(PAGE_HOLD_SECONDS - 2 * POLL_SECONDS)
    assert clock.now - last_read == PAGE_HOLD_SECONDS - POLL_SECONDS
    assert rig.page() == ["firing"]
    rig.poll_for(2 * POLL_SECONDS)  # at the hold's end still held (as last_over_time's closed range), then gone
    # What stays is the deployment's own warning: its only pod left DNS half an hour ago, so it watches nothing.
    assert rig.page() == [] and rig.firing() == {"StepBudgetNoTargets"}


def test_a_pod_back_in_dns_that_reads_under_budget_resolves_the_held_page(clock: ManualClock) -> None:
    dns, server = Headless(), Server(OVER)
    rig = _discovered_rig(clock, server, dns)
    rig.poll_for(PAGE_FOR_SECONDS + POLL_SECONDS)
    ready = dns.targets
    dns.targets = []
    rig.poll_for(10 * 60.0)
    assert rig.page() == ["firing"]
    dns.targets, server.page = ready, UNDER  # ready again, the load drained
    rig.poll_for(POLL_SECONDS)
    assert rig.page() == []


# --- the loop alone, on readings: the hold's edges ------------------------------------------------


def _reading(**values: object) -> Reading:
    base = dict(deployment="chat", target="10.0.0.5:8000", model_name="Qwen/Qwen3-8B", engine="0",
                target_up=True, predicted_step_seconds=0.025, step_budget_seconds=0.018)
    return Reading(**{**base, **values})  # type: ignore[arg-type]  # fields given as object: each test overrides a few


DOWN = _reading(target_up=False, predicted_step_seconds=None, step_budget_seconds=None)


def _loop(clock: ManualClock) -> AlertLoop:
    return AlertLoop(Alerting(), poll_interval_seconds=60, clock=clock)


def _feed(alerts: AlertLoop, clock: ManualClock, readings: list[Reading], minutes: int) -> None:
    for _ in range(minutes):
        clock.advance(60)
        alerts.evaluate(readings, clock.now)


def _page(alerts: AlertLoop) -> list[tuple[str, str]]:
    return [(str(alert["state"]), str(alert["value"])) for alert in _page_alerts(alerts)]


def test_the_held_page_shows_the_last_reading_value(clock: ManualClock) -> None:
    alerts = _loop(clock)
    _feed(alerts, clock, [_reading()], 6)
    _feed(alerts, clock, [DOWN], 120)
    assert _page(alerts) == [("firing", "0.025")]


def test_going_down_while_pending_keeps_counting_toward_for(clock: ManualClock) -> None:
    """Over budget for 2 minutes, then silent: the last word is "over", so the 5 minutes run on."""
    alerts = _loop(clock)
    alerts.evaluate([_reading()], clock.now)
    _feed(alerts, clock, [_reading()], 2)
    _feed(alerts, clock, [DOWN], 2)
    assert _page(alerts) == [("pending", "0.025")]
    _feed(alerts, clock, [DOWN], 1)
    assert _page(alerts) == [("firing", "0.025")]


def test_an_answering_page_without_the_figures_is_held_only_for_the_hold(clock: ManualClock) -> None:
    """Up but no prediction (the page lost its KV figures): held like a dropped target, then released."""
    alerts = _loop(clock)
    _feed(alerts, clock, [_reading()], 6)
    blind = _reading(predicted_step_seconds=None, step_budget_seconds=None)
    _feed(alerts, clock, [blind], int(PAGE_HOLD_SECONDS // 60) - 1)
    assert _page(alerts) == [("firing", "0.025")]
    _feed(alerts, clock, [blind], 2)
    assert _page(alerts) == []
    _feed(alerts, clock, [DOWN], 1)  # released is released: a later outage does not bring it back
    assert _page(alerts) == []


def test_an_engine_put_to_sleep_while_over_budget_resolves_the_page_at_once(
        clock: ManualClock, make_poller: MakePoller) -> None:
    """A sleeping engine serves nothing, so it slows nobody: its reading (still up, no predicted step)
    releases the page's memory at the first poll that sees it, not PAGE_HOLD_SECONDS later."""
    server = Server(OVER)
    rig = _rig(make_poller(_config(), clock, fetch=server), clock)
    rig.poller.poll_once()
    rig.poll_for(PAGE_FOR_SECONDS)
    assert rig.page() == ["firing"]

    server.page = ASLEEP
    rig.poll_for(POLL_SECONDS)
    (reading,) = rig.poller.readings()
    assert (reading.target_up, reading.engine_sleeping, reading.predicted_step_seconds) == (True, 1.0, None)
    assert rig.page() == [], "a sleeping engine kept the page"
    rig.poll_for(PAGE_HOLD_SECONDS)
    assert rig.page() == []


def test_a_sleeping_engine_releases_the_page_and_a_later_outage_does_not_bring_it_back(clock: ManualClock) -> None:
    """Firing, then asleep (the step budget kept, no prediction): resolved at that evaluation; the
    target then stops answering: nothing held (the rule's last_over_time of the sleep gauge agrees)."""
    alerts = _loop(clock)
    alerts.evaluate([_reading()], clock.now)
    _feed(alerts, clock, [_reading()], 5)
    assert _page(alerts) == [("firing", "0.025")]
    asleep = _reading(predicted_step_seconds=None, sleep_state="weights_offloaded")
    _feed(alerts, clock, [asleep], 1)
    assert _page(alerts) == []
    _feed(alerts, clock, [DOWN], 10)
    assert _page(alerts) == []


@pytest.mark.parametrize("minutes_down", [1, 45])
def test_a_target_dropped_after_being_down_is_held_from_its_last_reading(minutes_down: int,
                                                                         clock: ManualClock) -> None:
    """Gone from discovery: held PAGE_HOLD_SECONDS after its last predicted reading, not after the drop
    (Prometheus's last_over_time looks back from the last sample the same way)."""
    alerts = _loop(clock)
    _feed(alerts, clock, [_reading()], 6)
    _feed(alerts, clock, [DOWN], minutes_down)
    _feed(alerts, clock, [], 1)
    held_minutes = PAGE_HOLD_SECONDS / 60
    assert _page(alerts) == ([("firing", "0.025")] if minutes_down + 1 < held_minutes else [])
