"""Properties of the admission book: a hypothesis state machine over admit/release/reconcile/time,
and threads hammering one book.

Checked after every step: accounted tokens are never negative; never fewer than the open
admissions; never more than the open admissions plus the measurement; equal to the open admissions
when no measurement raised them; never fewer than the measurement while every admission the poll
counted as settled is still open; and an admission never takes a target past its budget, while a
refusal means no target had room.
"""

from __future__ import annotations

import random
import sys
import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from exporter.admission.book import (
    Admission,
    AdmissionBook,
    AdmissionRequest,
    DeploymentPolicy,
)
from tests.support.clocks import ManualClock

TARGETS = ("a:8000", "b:8000")
TPS = 50.0
FLOOR_SECONDS = 60.0
FACTOR = 2.0
SETTLE_SECONDS = 3.0



class AdmissionMachine(RuleBasedStateMachine):
    admissions = Bundle("admissions")

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock(0.0)
        self.book = AdmissionBook([DeploymentPolicy("chat", TPS)], clock=self.clock, settle_seconds=SETTLE_SECONDS,
                                  lease_floor_seconds=FLOOR_SECONDS, lease_output_factor=FACTOR)
        self.budget = {target: 20_000.0 for target in TARGETS}
        self.measured = {target: 0.0 for target in TARGETS}
        self.settled_at_poll: dict[str, set[str]] = {target: set() for target in TARGETS}
        self.open: dict[str, Admission] = {}
        for target in TARGETS:
            self.book.reconcile("chat", target, self.budget[target], 0.0)

    def _open_tokens(self, target: str) -> int:
        return sum(a.tokens for a in self.open.values() if a.target == target and a.expires_at_seconds > self.clock.now)

    @rule(target=admissions, prompt=st.integers(1, 12_000), output=st.integers(1, 4000))
    def admit(self, prompt: int, output: int) -> str | None:
        before = {t: self.book.accounted_tokens("chat", t) for t in TARGETS}
        decision = self.book.admit(AdmissionRequest(prompt, output, deployment="chat"))
        context = prompt + output
        if decision.admission is None:
            assert all(before[t] + context > self.budget[t] for t in TARGETS), "refused although a target had room"
            assert {t: self.book.accounted_tokens("chat", t) for t in TARGETS} == before
            return None
        admission = decision.admission
        assert admission.tokens == context
        lease = admission.expires_at_seconds - admission.admitted_at_seconds
        assert lease == pytest.approx(FLOOR_SECONDS + FACTOR * output / TPS)
        most_left = max(self.budget[t] - before[t] for t in TARGETS)
        assert self.budget[admission.target] - before[admission.target] == most_left, "not the target with most left"
        assert self.book.accounted_tokens("chat", admission.target) <= self.budget[admission.target]
        self.open[admission.id] = admission
        return admission.id

    @rule(admission_id=consumes(admissions))
    def release(self, admission_id: str | None) -> None:
        if admission_id is None:
            return
        admission = self.open.pop(admission_id)
        released = self.book.release(admission_id)
        if admission.expires_at_seconds > self.clock.now:
            assert released == admission
        else:
            assert released is None, "an expired lease was released again"

    @rule(server=st.sampled_from(TARGETS), measured=st.sampled_from([0.0, 0.0, 5000.0, 19_000.0, 30_000.0]),
          budget=st.sampled_from([20_000.0, 20_000.0, 8000.0]))
    def poll(self, server: str, measured: float, budget: float) -> None:
        self.budget[server], self.measured[server] = budget, measured
        self.book.reconcile("chat", server, budget, measured)
        self.settled_at_poll[server] = {
            a.id for a in self.open.values()
            if a.target == server and a.expires_at_seconds > self.clock.now
            and a.admitted_at_seconds <= self.clock.now - SETTLE_SECONDS}

    @rule(seconds=st.floats(0.5, 200.0))
    def wait(self, seconds: float) -> None:
        self.clock.now += seconds

    @invariant()
    def accounted_is_bounded_by_the_open_admissions_and_the_measurement(self) -> None:
        for target in TARGETS:
            accounted = self.book.accounted_tokens("chat", target)
            open_tokens = self._open_tokens(target)
            assert accounted >= 0
            assert open_tokens <= accounted <= open_tokens + self.measured[target]
            if self.measured[target] == 0:
                assert accounted == open_tokens
            still_open = {a.id for a in self.open.values() if a.expires_at_seconds > self.clock.now}
            if self.settled_at_poll[target] <= still_open:
                assert accounted >= self.measured[target]


AdmissionMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAdmissionMachine = AdmissionMachine.TestCase


def test_threads_admitting_and_releasing_never_overbook_and_leave_nothing_behind() -> None:
    budget, threads_count, rounds = 50_000.0, 8, 400
    book = AdmissionBook([DeploymentPolicy("chat", TPS)], clock=ManualClock(0.0))
    book.reconcile("chat", "a:8000", budget, 0.0)
    start = threading.Barrier(threads_count)
    held_by_thread: list[list[Admission]] = [[] for _ in range(threads_count)]
    overbooked: list[float] = []
    admits = [0] * threads_count
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            run_rounds(index)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    def run_rounds(index: int) -> None:
        chooser = random.Random(index)
        start.wait()
        for _ in range(rounds):
            held = held_by_thread[index]
            if held and chooser.random() < 0.45:
                assert book.release(held.pop(chooser.randrange(len(held))).id) is not None
                continue
            decision = book.admit(AdmissionRequest(chooser.randint(100, 3000), chooser.randint(1, 2000),
                                                   deployment="chat"))
            admits[index] += 1
            if decision.admission is not None:
                held.append(decision.admission)
                if decision.tokens_left < 0:
                    overbooked.append(decision.tokens_left)

    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to provoke races
    try:
        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads_count)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        assert not any(worker.is_alive() for worker in workers)
    finally:
        sys.setswitchinterval(switch_interval)
    assert not errors, errors[:3]
    assert not overbooked
    still_held = [admission for held in held_by_thread for admission in held]
    assert book.accounted_tokens("chat", "a:8000") == sum(a.tokens for a in still_held) <= budget
    assert len({a.id for a in still_held}) == len(still_held)
    counts = book.decision_counts()
    assert counts[("chat", "admitted")] + counts[("chat", "refused")] == sum(admits)
    for admission in still_held:
        assert book.release(admission.id) is not None
    assert book.accounted_tokens("chat", "a:8000") == 0
