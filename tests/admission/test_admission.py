"""The admission book's rule, target choice, pools, leases, the HTTP handlers and the metrics.

Time is a ManualClock the test moves: no sleeps, no wall clock.
"""

from __future__ import annotations

import json
import re
import subprocess
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import CollectorRegistry

from exporter.admission.api import AdmissionApi
from exporter.admission.book import (
    MAX_REQUEST_TOKENS,
    AdmissionBook,
    AdmissionRequest,
    DeploymentPolicy,
    Pools,
    measurements_from_readings,
)
from exporter.admission.metrics import AdmissionCollector
from exporter.errors import InputError
from tests.support.clocks import ManualClock
from tests.support.tools import require_tool

CHAT_TPS = 50.0
SETTLE = 5.0
FLOOR = 100.0
FACTOR = 4.0
POLL = 15.0


def make_book(clock: ManualClock, pools: Pools | None = None) -> AdmissionBook:
    return AdmissionBook(
        [DeploymentPolicy("chat", CHAT_TPS), DeploymentPolicy("agents", 20.0)], pools,
        clock=clock, settle_seconds=SETTLE, poll_interval_seconds=POLL,
        lease_floor_seconds=FLOOR, lease_output_factor=FACTOR,
    )


def ask(book: AdmissionBook, prompt: int, output: int, **where: str):
    return book.admit(AdmissionRequest(prompt, output, **where))


# --- the accounting rule -------------------------------------------------------------------------


def test_admissions_add_up_and_a_request_that_no_longer_fits_is_refused() -> None:
    clock = ManualClock()
    book = make_book(clock)
    book.reconcile("chat", "a:8000", budget_tokens=10_000, measured_tokens_in_flight=0)
    first = ask(book, 3000, 1000, deployment="chat")
    second = ask(book, 4000, 1000, deployment="chat")
    assert first.admitted and second.admitted
    assert second.tokens_left == 10_000 - 4000 - 5000
    third = ask(book, 1000, 500, deployment="chat")  # 1,500 > the 1,000 left
    assert third.decision == "refused"
    assert third.retry_after_seconds == POLL  # polled just now: the next poll is a whole interval away
    assert book.accounted_tokens("chat", "a:8000") == 4000 + 5000


def test_a_release_frees_its_tokens_at_once_even_before_the_next_poll() -> None:
    clock = ManualClock()
    book = make_book(clock)
    book.reconcile("chat", "a:8000", 10_000, 0)
    first = ask(book, 5000, 1000, deployment="chat")
    clock.now += 30
    book.reconcile("chat", "a:8000", 10_000, measured_tokens_in_flight=2500)  # the server holds less than reserved
    assert book.accounted_tokens("chat", "a:8000") == 6000  # the reservation, not 6,000 + 2,500
    assert first.admission is not None and book.release(first.admission.id) is not None
    assert book.accounted_tokens("chat", "a:8000") == 0  # its 2,500 measured tokens were its own
    assert book.release(first.admission.id) is None  # a second release is not counted twice


def test_churn_between_polls_is_not_counted_twice() -> None:
    """Chats finish and new ones start between two polls: the measurement still holds the finished
    ones, but their reservations were settled at the poll, so the new ones do not stack on them."""
    clock = ManualClock()
    book = make_book(clock)
    book.reconcile("chat", "a:8000", 10_000, 0)
    old = [ask(book, 1500, 500, deployment="chat").admission for _ in range(4)]
    clock.now += SETTLE
    book.reconcile("chat", "a:8000", 10_000, measured_tokens_in_flight=4 * 1800)
    for admission in old:
        assert admission is not None and book.release(admission.id) is not None
    new = [ask(book, 1500, 500, deployment="chat") for _ in range(5)]
    assert all(decision.admitted for decision in new)
    assert book.accounted_tokens("chat", "a:8000") == 5 * 2000


def test_work_admitted_elsewhere_counts_through_the_measurement() -> None:
    clock = ManualClock()
    book = make_book(clock)
    book.reconcile("chat", "a:8000", 10_000, measured_tokens_in_flight=7000)  # unmanaged work
    assert ask(book, 2000, 500, deployment="chat").admitted
    # Fresh admissions add to the measurement: a burst between two polls cannot overfill it.
    assert book.accounted_tokens("chat", "a:8000") == 7000 + 2500
    assert ask(book, 400, 200, deployment="chat").decision == "refused"


def test_an_admission_the_poll_has_seen_counts_once_not_twice() -> None:
    clock = ManualClock()
    book = make_book(clock)
    book.reconcile("chat", "a:8000", 10_000, 0)
    ask(book, 3000, 1000, deployment="chat")
    clock.now += SETTLE + 1
    book.reconcile("chat", "a:8000", 10_000, measured_tokens_in_flight=3500)
    assert book.accounted_tokens("chat", "a:8000") == max(3500, 4000)
    clock.now += 1
    book.reconcile("chat", "a:8000", 10_000, measured_tokens_in_flight=8000)  # others joined
    assert book.accounted_tokens("chat", "a:8000") == 8000


def test_an_admission_younger_than_the_settle_time_stays_fresh_after_a_poll() -> None:
    clock = ManualClock()
    book = make_book(clock)
    book.reconcile("chat", "a:8000", 10_000, 0)
    ask(book, 3000, 1000, deployment="chat")
    clock.now += SETTLE / 2  # the server may not have started it yet
    book.reconcile("chat", "a:8000", 10_000, measured_tokens_in_flight=5000)
    assert book.accounted_tokens("chat", "a:8000") == 5000 + 4000


def test_a_leaked_release_holds_budget_only_until_its_lease_runs_out() -> None:
    clock = ManualClock()
    book = make_book(clock)
    book.reconcile("chat", "a:8000", 10_000, 0)
    decision = ask(book, 2000, 1000, deployment="chat")
    assert decision.admission is not None
    lease = FLOOR + FACTOR * 1000 / CHAT_TPS  # the whole output at the target speed, with slack
    assert decision.admission.expires_at_seconds - decision.admission.admitted_at_seconds == pytest.approx(lease)
    clock.now += lease - 1
    assert book.accounted_tokens("chat", "a:8000") == 3000
    clock.now += 1
    assert book.accounted_tokens("chat", "a:8000") == 0
    assert book.expired_total == 1
    assert book.release(decision.admission.id) is None


# --- target choice, refusals, pools ----------------------------------------------------------------


def test_the_target_with_the_most_budget_left_is_chosen() -> None:
    clock = ManualClock()
    book = make_book(clock)
    book.reconcile("chat", "a:8000", 10_000, measured_tokens_in_flight=6000)  # 4,000 left
    book.reconcile("chat", "b:8000", 12_000, measured_tokens_in_flight=5000)  # 7,000 left
    decision = ask(book, 1000, 1000, deployment="chat")
    assert decision.admission is not None and decision.admission.target == "b:8000"
    assert decision.tokens_left == 7000 - 2000
    # b now has 5,000 left, a 4,000: b again; then a (4,000 > 3,000).
    assert ask(book, 1000, 1000, deployment="chat").admission.target == "b:8000"
    assert ask(book, 1000, 1000, deployment="chat").admission.target == "a:8000"


def test_a_request_larger_than_every_whole_budget_gets_no_retry_after() -> None:
    clock = ManualClock()
    book = make_book(clock)
    book.reconcile("chat", "a:8000", 10_000, 0)
    decision = ask(book, 9000, 2000, deployment="chat")
    assert decision.decision == "refused" and decision.retry_after_seconds is None
    assert "whole token budget" in decision.reason


def test_a_deployment_without_readings_refuses_and_a_suspended_target_takes_nothing() -> None:
    clock = ManualClock()
    book = make_book(clock)
    assert ask(book, 10, 10, deployment="chat").decision == "refused"
    book.reconcile("chat", "a:8000", 10_000, 0)
    book.suspend("chat", "a:8000")
    assert ask(book, 10, 10, deployment="chat").decision == "refused"
    book.reconcile("chat", "a:8000", 10_000, 0)
    assert ask(book, 10, 10, deployment="chat").admitted


def test_retry_after_points_at_the_next_poll() -> None:
    clock = ManualClock()
    book = make_book(clock)
    book.reconcile("chat", "a:8000", 100, 100)
    clock.now += 4.5
    assert ask(book, 10, 10, deployment="chat").retry_after_seconds == 11  # ceil(15 - 4.5)


def test_pools_route_by_context_and_redirect_long_requests_from_the_short_pool() -> None:
    clock = ManualClock()
    pools = Pools("chat", "agents", split_tokens=32_000)
    book = make_book(clock, pools)
    book.reconcile("chat", "a:8000", 130_000, 0)
    book.reconcile("agents", "x:8000", 400_000, 0)
    chat = ask(book, 1500, 500)  # no pool given: auto
    assert chat.admitted and chat.deployment == "chat" and chat.pool == "short"
    agent = ask(book, 95_000, 5000, pool="auto")
    assert agent.admitted and agent.deployment == "agents" and agent.pool == "long"
    redirected = ask(book, 95_000, 5000, pool="short")
    assert redirected.decision == "redirected" and redirected.long_context_pool == "agents"
    assert ask(book, 95_000, 5000, deployment="chat").decision == "redirected"
    # A refusal in the short pool names the long pool too; one in the long pool names none.
    book.reconcile("chat", "a:8000", 2000, 2000)
    refused = ask(book, 1000, 1000, pool="short")
    assert refused.decision == "refused" and refused.long_context_pool == "agents"
    book.reconcile("agents", "x:8000", 2000, 2000)
    assert ask(book, 50_000, 1000, pool="long").long_context_pool is None


def test_bad_questions_are_input_errors_not_decisions() -> None:
    clock = ManualClock()
    book = make_book(clock)
    with pytest.raises(InputError, match=r"unknown deployment 'chta'.*did you mean: chat"):
        ask(book, 10, 10, deployment="chta")
    with pytest.raises(InputError, match="no pools are configured"):
        ask(book, 10, 10)
    with pytest.raises(InputError, match="either 'deployment' or 'pool'"):
        ask(book, 10, 10, deployment="chat", pool="short")
    assert sum(book.decision_counts().values()) == 0


def test_pools_must_name_configured_deployments() -> None:
    with pytest.raises(InputError, match="pools: deployment 'nope'"):
        AdmissionBook([DeploymentPolicy("chat", 50.0)], Pools("chat", "nope", 1000))


# --- readings -> measurements -------------------------------------------------------------------------


def reading(deployment: str, target: str, up: bool, tokens: float | None, budget: float | None,
            capacity: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(deployment=deployment, target=target, target_up=up, tokens_in_flight=tokens,
                           token_budget_tokens=budget, kv_cache_capacity_tokens=capacity)


def test_engines_of_one_target_add_up_and_one_unusable_engine_suspends_the_target() -> None:
    usable, unusable = measurements_from_readings([
        reading("chat", "a:8000", True, 1000.0, 5000.0),
        reading("chat", "a:8000", True, 2000.0, 6000.0),
        reading("chat", "b:8000", True, 1000.0, 5000.0),
        reading("chat", "b:8000", False, None, None),
    ])
    assert [(m.target, m.budget_tokens, m.tokens_in_flight) for m in usable] == [("a:8000", 11_000.0, 3000.0)]
    assert unusable == {("chat", "b:8000")}


def test_the_budget_is_capped_by_what_the_kv_cache_holds() -> None:
    usable, _ = measurements_from_readings([
        reading("agents", "x:8000", True, 0.0, budget=502_000.0, capacity=377_000.0),  # a slow target
        reading("chat", "a:8000", True, 0.0, budget=134_000.0, capacity=377_000.0),
    ])
    assert {m.target: m.budget_tokens for m in usable} == {"x:8000": 377_000.0, "a:8000": 134_000.0}


def test_sync_suspends_unusable_targets_and_forgets_vanished_ones() -> None:
    clock = ManualClock()
    book = make_book(clock)
    book.sync(*measurements_from_readings([reading("chat", "a:8000", True, 0.0, 1000.0),
                                           reading("chat", "b:8000", True, 0.0, 5000.0)]))
    held = ask(book, 100, 100, deployment="chat")
    assert held.admission is not None and held.admission.target == "b:8000"
    book.sync(*measurements_from_readings([reading("chat", "a:8000", True, 0.0, 1000.0),
                                           reading("chat", "b:8000", False, None, None)]))
    assert ask(book, 100, 100, deployment="chat").admission.target == "a:8000"
    assert book.accounted_tokens("chat", "b:8000") == 200  # kept while the target is down
    book.sync(*measurements_from_readings([reading("chat", "a:8000", True, 0.0, 1000.0)]))
    assert [account.target for account in book.targets()] == ["a:8000"]
    assert book.release(held.admission.id) is None


# --- the HTTP handlers (no socket: the server-facing functions) ------------------------------------

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def make_api(clock: ManualClock) -> AdmissionApi:
    book = make_book(clock, Pools("chat", "agents", 32_000))
    book.reconcile("chat", "a:8000", 10_000, 0)
    book.reconcile("agents", "x:8000", 300_000, 0)
    return AdmissionApi(book, TOKEN)


def post(api: AdmissionApi, body: object, headers: dict[str, str] = AUTH, path: str = "admission"):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (api.admission if path == "admission" else api.release)(headers, raw)


def test_the_api_admits_refuses_with_retry_after_and_releases() -> None:
    clock = ManualClock()
    api = make_api(clock)
    ok = post(api, {"deployment": "chat", "prompt_tokens": 6000, "max_output_tokens": 2000})
    assert ok.status == 200
    assert ok.body["decision"] == "admitted" and ok.body["target"] == "a:8000" and ok.body["tokens_left"] == 2000
    assert ok.body["lease_seconds"] == pytest.approx(FLOOR + FACTOR * 2000 / CHAT_TPS)
    refused = post(api, {"pool": "short", "prompt_tokens": 2000, "max_output_tokens": 1000})
    assert refused.status == 429 and refused.body["decision"] == "refused"
    assert refused.body["retry_after_seconds"] == POLL  # polled just now: the next poll is a whole interval away
    assert dict(refused.headers)["Retry-After"] == str(refused.body["retry_after_seconds"])
    assert refused.body["long_context_pool"] == "agents"
    redirected = post(api, {"pool": "short", "prompt_tokens": 40_000, "max_output_tokens": 1000})
    assert redirected.status == 429 and redirected.body["decision"] == "redirected"
    assert "Retry-After" not in dict(redirected.headers)
    released = post(api, {"id": ok.body["id"]}, path="release")
    assert released.status == 200 and released.body["tokens"] == 8000
    again = post(api, {"id": ok.body["id"]}, path="release")
    assert again.status == 404 and "unknown, already released" in again.body["error"]
    assert api.book.decision_counts()[("chat", "admitted")] == 1
    assert api.book.decision_counts()[("chat", "refused")] == 1
    assert api.book.decision_counts()[("chat", "redirected")] == 1


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                                     {"authorization": f"Basic {TOKEN}"}])
def test_requests_without_the_right_bearer_token_get_401(headers: dict[str, str]) -> None:
    api = make_api(ManualClock())
    for path in ("admission", "release"):
        response = post(api, {"deployment": "chat", "prompt_tokens": 1, "max_output_tokens": 1}, headers, path)
        assert response.status == 401 and "bearer token" in response.body["error"]
        assert dict(response.headers)["WWW-Authenticate"].startswith("Bearer")
    assert sum(api.book.decision_counts().values()) == 0


def test_the_header_name_is_case_insensitive() -> None:
    api = make_api(ManualClock())
    response = post(api, {"deployment": "chat", "prompt_tokens": 1, "max_output_tokens": 1},
                    {"authorization": f"bearer {TOKEN}"})
    assert response.status == 200


@pytest.mark.parametrize(("body", "message"), [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({"deployment": "chat", "max_output_tokens": 10}, "missing 'prompt_tokens'"),
    ({"deployment": "chat", "prompt_tokens": -5, "max_output_tokens": 10}, "'prompt_tokens' must be at least 1"),
    ({"deployment": "chat", "prompt_tokens": 10, "max_output_tokens": 0}, "'max_output_tokens' must be at least 1"),
    ({"deployment": "chat", "prompt_tokens": 10.5, "max_output_tokens": 10}, "whole number"),
    ({"deployment": "chat", "prompt_tokens": True, "max_output_tokens": 10}, "whole number"),
    ({"deployment": "chat", "prompt_tokens": "10", "max_output_tokens": 10}, "whole number"),
    ({"deployment": "chat", "prompt_tokens": MAX_REQUEST_TOKENS + 1, "max_output_tokens": 10}, "absurd"),
    ({"deployment": "chta", "prompt_tokens": 10, "max_output_tokens": 10}, "unknown deployment 'chta'"),
    ({"deployment": 7, "prompt_tokens": 10, "max_output_tokens": 10}, "'deployment' must be a string"),
    ({"pool": "medium", "prompt_tokens": 10, "max_output_tokens": 10}, "unknown pool 'medium'"),
    ({"deployment": "chat", "prompt_tokens": 10, "max_tokens": 10}, "unknown key 'max_tokens'.*max_output_tokens"),
    (b"{" + b'"x": "' + b"a" * 70_000 + b'"}', "over the 65,536-byte limit"),
])
def test_bad_admission_requests_get_400_with_a_message(body: object, message: str) -> None:
    api = make_api(ManualClock())
    response = post(api, body)
    assert response.status == 400
    assert sum(api.book.decision_counts().values()) == 0
    assert re.search(message, response.body["error"]), response.body["error"]


@pytest.mark.parametrize(("body", "message"), [
    ({}, "'id' must be the admission id"),
    ({"id": 5}, "'id' must be the admission id"),
    ({"id": "x", "tokens": 5}, "unknown key 'tokens'"),
])
def test_bad_release_requests_get_400_with_a_message(body: object, message: str) -> None:
    response = post(make_api(ManualClock()), body, path="release")
    assert response.status == 400 and message in response.body["error"]


# --- metrics ---------------------------------------------------------------------------------------


def test_the_collector_exports_decisions_from_zero_and_accounted_tokens() -> None:
    clock = ManualClock()
    book = make_book(clock)
    registry = CollectorRegistry()
    registry.register(AdmissionCollector(book))
    labels = {"deployment": "chat", "decision": "admitted"}
    assert registry.get_sample_value("stepbudget_admission_decisions_total", labels) == 0
    book.reconcile("chat", "a:8000", 10_000, 1234)
    ask(book, 100, 50, deployment="chat")
    ask(book, 100_000, 50, deployment="chat")
    assert registry.get_sample_value("stepbudget_admission_decisions_total", labels) == 1
    assert registry.get_sample_value("stepbudget_admission_decisions_total",
                                     {"deployment": "chat", "decision": "refused"}) == 1
    assert registry.get_sample_value("stepbudget_admitted_tokens",
                                     {"deployment": "chat", "target": "a:8000"}) == 1234 + 150


def test_promtool_finds_nothing_to_lint_in_the_admission_metrics() -> None:
    book = make_book(ManualClock())
    book.reconcile("chat", "a:8000", 10_000, 0)
    ask(book, 100, 50, deployment="chat")
    registry = CollectorRegistry()
    registry.register(AdmissionCollector(book))
    result = subprocess.run([require_tool("promtool"), "check", "metrics"], input=generate_latest(registry),
                            capture_output=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
