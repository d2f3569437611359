"""The admission book's memory is bounded: a released admission leaves every structure at once, a target
that leaves discovery takes its admissions' leases with it, the book holds at most `max_open_admissions`,
and the sizes are exported. Simulated time throughout (tests/support/clocks.py)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from exporter.admission.book import (
    DEFAULT_MAX_OPEN_ADMISSIONS,
    AdmissionBook,
    AdmissionRequest,
    BookSizes,
    DeploymentPolicy,
    LeaseHeap,
    TargetMeasurement,
)
from exporter.admission.metrics import AdmissionCollector
from exporter.errors import InputError
from tests.support.clocks import ManualClock

CONTEXT_WINDOW = 131_072
TPS = 50.0
# The lease of an admission whose output limit is the whole context window, by the book's rule:
# floor + factor x output / target speed = 120 + 4 x 131,071 / 50 = 10,605.68 s.
CONTEXT_LEASE_SECONDS = 120.0 + 4.0 * (CONTEXT_WINDOW - 1) / TPS


def book_with(clock: ManualClock, targets: int = 2, budget: float = 1e12, **options: int) -> AdmissionBook:
    book = AdmissionBook([DeploymentPolicy("chat", TPS)], clock=clock, **options)
    book.sync([TargetMeasurement("chat", f"t{i}", budget, 0.0) for i in range(targets)], [])
    return book


def context_request() -> AdmissionRequest:
    return AdmissionRequest(prompt_tokens=1, max_output_tokens=CONTEXT_WINDOW - 1, deployment="chat")


def test_the_context_lease_is_what_the_rule_gives() -> None:
    clock = ManualClock()
    decision = book_with(clock).admit(context_request())
    assert decision.admission is not None
    lease = decision.admission.expires_at_seconds - decision.admission.admitted_at_seconds
    assert lease == pytest.approx(10_605.68)
    assert lease == pytest.approx(CONTEXT_LEASE_SECONDS)


def test_a_released_admission_leaves_every_structure_at_once() -> None:
    clock = ManualClock()
    book = book_with(clock)
    ids = []
    for _ in range(1000):
        decision = book.admit(context_request())
        assert decision.admission is not None
        ids.append(decision.admission.id)
        clock.advance(0.01)  # 100 admissions a second
    assert book.sizes() == BookSizes(1000, 1000, 2, DEFAULT_MAX_OPEN_ADMISSIONS)
    for admission_id in ids[:999]:
        assert book.release(admission_id) is not None
    # Released 10 s after the first, each lease had ~10,600 s to run: none is left anywhere.
    assert book.sizes() == BookSizes(1, 1, 2, DEFAULT_MAX_OPEN_ADMISSIONS)
    assert sum(account.open_admissions for account in book.targets()) == 1
    assert book.release(ids[999]) is not None
    assert book.sizes() == BookSizes(0, 0, 2, DEFAULT_MAX_OPEN_ADMISSIONS)


@pytest.mark.slow  # 2 s
def test_admit_and_release_for_half_an_hour_at_100_per_second_holds_only_whats_open() -> None:
    """The soak in simulated time: 100 admissions a second with context-length leases for 30 minutes,
    each released 2 s after it was admitted: the book never holds more than the 200 open ones, against
    the 180,000 a lease-long memory would have kept (the whole half hour is within one lease)."""
    clock = ManualClock()
    book = book_with(clock)
    open_ids: list[tuple[int, str]] = []
    most = 0
    for tick in range(30 * 60 * 100):  # 180,000 admissions, one each 10 ms
        clock.now = 1_800_000_000.0 + tick / 100
        decision = book.admit(context_request())
        assert decision.admission is not None
        open_ids.append((tick, decision.admission.id))
        while open_ids and open_ids[0][0] <= tick - 200:  # admitted 2 s (200 ticks) ago or earlier
            assert book.release(open_ids.pop(0)[1]) is not None
        if tick % 1000 == 0:
            sizes = book.sizes()
            assert sizes.open_admissions == sizes.leases == len(open_ids)
            most = max(most, sizes.open_admissions)
    assert most == 200  # those admitted in the last 2 s: 2 s x 100/s
    assert book.expired_total == 0


def test_leases_that_run_out_leave_every_structure() -> None:
    clock = ManualClock()
    book = book_with(clock)
    for _ in range(10):
        book.admit(context_request())
    clock.advance(CONTEXT_LEASE_SECONDS - 1)
    assert book.sizes().leases == 10
    clock.advance(1)
    assert book.sizes() == BookSizes(0, 0, 2, DEFAULT_MAX_OPEN_ADMISSIONS)
    assert book.expired_total == 10


def test_a_target_that_leaves_discovery_takes_its_leases_with_it() -> None:
    clock = ManualClock()
    book = book_with(clock, targets=1)
    for _ in range(5):
        book.admit(context_request())
    book.sync([TargetMeasurement("chat", "t9", 1e12, 0.0)], [])  # t0 gone, t9 new
    assert book.sizes() == BookSizes(0, 0, 1, DEFAULT_MAX_OPEN_ADMISSIONS)


def test_1000_targets_flapping_leave_nothing_behind() -> None:
    """1,000 targets, each half of them gone from discovery every other poll, admissions open on all of
    them: after 100 polls the book holds the targets and admissions of the last poll, nothing older."""
    clock = ManualClock()
    book = AdmissionBook([DeploymentPolicy("chat", TPS)], clock=clock)
    for poll in range(100):
        present = [TargetMeasurement("chat", f"t{i}", 1e9, 0.0) for i in range(1000) if (i + poll) % 2 == 0]
        down = [("chat", f"t{i}") for i in range(1000) if (i + poll) % 4 == 1]  # polled, unusable
        book.sync(present, down)
        for _ in range(50):
            book.admit(AdmissionRequest(1000, 1000, deployment="chat"))
        clock.advance(15)
    sizes = book.sizes()
    assert sizes.targets == 500 + 250  # the last poll's usable half and its unusable quarter
    # The 50 admissions of the last poll: earlier ones left with their targets or their 200-s leases
    # (120 + 4 x 1000 / 50 = 200 s, under 14 polls of 15 s).
    assert sizes.open_admissions == sizes.leases <= 50 * 14


def test_the_book_refuses_past_its_maximum_and_admits_again_after_a_release() -> None:
    clock = ManualClock()
    book = book_with(clock, max_open_admissions=3)
    ids = [book.admit(AdmissionRequest(10, 10, deployment="chat")).admission for _ in range(3)]
    refused = book.admit(AdmissionRequest(10, 10, deployment="chat"))
    assert refused.decision == "refused" and "the admission book is full" in refused.reason
    assert refused.retry_after_seconds is not None and refused.retry_after_seconds >= 1
    assert book.sizes().open_admissions == 3
    first = ids[0]
    assert first is not None and book.release(first.id) is not None
    assert book.admit(AdmissionRequest(10, 10, deployment="chat")).admitted


def test_a_maximum_below_one_is_refused() -> None:
    with pytest.raises(InputError, match="max_open_admissions"):
        AdmissionBook([DeploymentPolicy("chat", TPS)], max_open_admissions=0)


def test_the_sizes_are_exported() -> None:
    clock = ManualClock()
    book = book_with(clock, max_open_admissions=500)
    for _ in range(7):
        book.admit(AdmissionRequest(10, 10, deployment="chat"))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AdmissionCollector(book))
    page = generate_latest(registry).decode()
    assert 'stepbudget_admission_open_admissions{deployment="chat"} 7.0' in page
    assert "stepbudget_admission_max_open_admissions 500.0" in page


# --- the lease heap itself ---------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "remove", "pop"]), st.integers(0, 40),
                          st.integers(0, 100)), max_size=200))
def test_the_lease_heap_matches_a_plain_dict(operations: list[tuple[str, int, int]]) -> None:
    heap = LeaseHeap()
    model: dict[str, float] = {}
    for operation, key, value in operations:
        name = f"a{key}"
        if operation == "push" and name not in model:
            heap.push(float(value), name)
            model[name] = float(value)
        elif operation == "remove":
            assert heap.remove(name) == (name in model)
            model.pop(name, None)
        elif operation == "pop":
            due = heap.pop_due(float(value))
            expected = sorted((expires, n) for n, expires in model.items() if expires <= value)
            assert due == [n for _, n in expected]
            for n in due:
                del model[n]
        assert len(heap) == len(model)


def test_the_lease_heap_refuses_an_id_twice() -> None:
    heap = LeaseHeap()
    heap.push(1.0, "a")
    with pytest.raises(ValueError):
        heap.push(2.0, "a")


def test_the_lease_heap_pops_in_order_after_random_removals() -> None:
    rng = random.Random(7)
    heap = LeaseHeap()
    ends = {f"a{i}": rng.uniform(0, 1000) for i in range(2000)}
    for name, end in ends.items():
        heap.push(end, name)
    removed = set(rng.sample(sorted(ends), 1000))
    for name in removed:
        assert heap.remove(name)
    due = heap.pop_due(1000.0)
    assert due == sorted((n for n in ends if n not in removed), key=lambda n: (ends[n], n))
    assert len(heap) == 0
