"""The admission book: per-target accounts of open admissions against each token budget, and the
daemon's readings turned into one measurement per target (the accounting rule: see the package docstring)."""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from exporter.errors import InputError
from exporter.suggest import close_names

DECISIONS = ("admitted", "refused", "redirected")
POOL_NAMES = ("short", "long", "auto")

# A request is "absurd" beyond this many tokens: no served model's context window is larger
# (the longest advertised windows are 10M tokens).
MAX_REQUEST_TOKENS = 10_000_000
DEFAULT_SETTLE_SECONDS = 5.0
DEFAULT_LEASE_FLOOR_SECONDS = 120.0
DEFAULT_LEASE_OUTPUT_FACTOR = 4.0
DEFAULT_POLL_INTERVAL_SECONDS = 15.0
MIN_RETRY_AFTER_SECONDS = 1
# The most admissions the book holds open at once, over every deployment. Each costs ~440 B (the
# Admission, its id, its entries in three dicts and in the lease heap; tracemalloc over 20,000), so the
# book stays under ~45 MB whatever gateways do; past it an admission is refused ("the book is full") with a
# Retry-After, as when no target has the tokens. Token budgets keep real books far below it: each open
# admission holds its whole context against one target's budget.
DEFAULT_MAX_OPEN_ADMISSIONS = 100_000


@dataclass(frozen=True)
class Pools:
    """Two deployments by context size: requests above `split_tokens` belong to the long pool,
    where slower streaming is expected, so they never crowd the chats of the short pool."""

    short_deployment: str
    long_deployment: str
    split_tokens: int

    def deployment_of(self, pool: str) -> str:
        return self.short_deployment if pool == "short" else self.long_deployment

    def pool_of_context(self, context_tokens: int) -> str:
        return "long" if context_tokens > self.split_tokens else "short"


@dataclass(frozen=True)
class AdmissionRequest:
    """What a gateway asks: one request's prompt and output limit, for a deployment or a pool."""

    prompt_tokens: int
    max_output_tokens: int
    deployment: str | None = None
    pool: str | None = None

    @property
    def context_tokens(self) -> int:
        """The most the request can hold in the KV cache: its prompt plus its whole output."""
        return self.prompt_tokens + self.max_output_tokens


@dataclass(frozen=True)
class Admission:
    """One open reservation of `tokens` on one target."""

    id: str
    deployment: str
    target: str
    tokens: int
    admitted_at_seconds: float
    expires_at_seconds: float


@dataclass(frozen=True)
class Decision:
    decision: str  # one of DECISIONS
    deployment: str
    pool: str | None
    context_tokens: int
    reason: str
    admission: Admission | None = None
    # Admitted: tokens left on the chosen target after this admission. Otherwise: the most any
    # target of the deployment has left.
    tokens_left: float = 0.0
    # None when waiting cannot help (the request exceeds every target's whole budget, or it was
    # redirected to the long-context pool).
    retry_after_seconds: int | None = None
    long_context_pool: str | None = None  # the long pool's deployment, when one is configured

    @property
    def admitted(self) -> bool:
        return self.decision == "admitted"


@dataclass(frozen=True)
class TargetAccount:
    """One target's state for metrics and the HTTP answer."""

    deployment: str
    target: str
    budget_tokens: float
    measured_tokens_in_flight: float
    accounted_tokens: float
    open_admissions: int

    @property
    def tokens_left(self) -> float:
        return self.budget_tokens - self.accounted_tokens


@dataclass
class _Target:
    deployment: str
    target: str
    budget_tokens: float
    measured_tokens_in_flight: float
    measured_at_seconds: float
    admissions: dict[str, Admission] = field(default_factory=dict)
    open_tokens: int = 0  # the sum of `admissions`' tokens, kept as they come and go
    # Reserved tokens of the admissions open and settled when `measured_tokens_in_flight` was taken.
    settled_at_poll_tokens: float = 0.0
    # False while the target is down or its last poll lacked the values: no new admissions, but
    # the open ones stay (their requests may still be running there).
    eligible: bool = True


class LeaseHeap:
    """The open admissions' lease ends, earliest first, with removal by id: a released admission leaves
    at once (a heap that skipped released entries only when they came up held each one for its whole
    lease: at 100 admissions/s and 131,072-token leases of 26,334 s, 404 MiB).

    A binary min-heap of (expires_at, id) and each id's position in it, kept in step by every move."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._positions: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, expires_at_seconds: float, admission_id: str) -> None:
        if admission_id in self._positions:
            raise ValueError(f"lease {admission_id!r} is already in the heap")
        self._heap.append((expires_at_seconds, admission_id))
        self._positions[admission_id] = len(self._heap) - 1
        self._up(len(self._heap) - 1)

    def remove(self, admission_id: str) -> bool:
        """Take the id's lease out; False when it is not in the heap."""
        index = self._positions.pop(admission_id, None)
        if index is None:
            return False
        last = self._heap.pop()
        if index < len(self._heap):  # the removed entry was not the last: the last one fills its place
            self._heap[index] = last
            self._positions[last[1]] = index
            self._up(index)
            self._down(self._positions[last[1]])
        return True

    def pop_due(self, now_seconds: float) -> list[str]:
        """The ids whose lease ends at or before `now_seconds`, taken out, earliest first."""
        due = []
        while self._heap and self._heap[0][0] <= now_seconds:
            admission_id = self._heap[0][1]
            self.remove(admission_id)
            due.append(admission_id)
        return due

    def _up(self, index: int) -> None:
        heap, positions = self._heap, self._positions
        entry = heap[index]
        while index > 0:
            parent = (index - 1) // 2
            if heap[parent] <= entry:
                break
            heap[index] = heap[parent]
            positions[heap[index][1]] = index
            index = parent
        heap[index] = entry
        positions[entry[1]] = index

    def _down(self, index: int) -> None:
        heap, positions = self._heap, self._positions
        size = len(heap)
        entry = heap[index]
        while True:
            child = 2 * index + 1
            if child >= size:
                break
            if child + 1 < size and heap[child + 1] < heap[child]:
                child += 1
            if entry <= heap[child]:
                break
            heap[index] = heap[child]
            positions[heap[index][1]] = index
            index = child
        heap[index] = entry
        positions[entry[1]] = index


@dataclass(frozen=True)
class BookSizes:
    """How many entries each of the book's structures holds (exported, so their bounds can be watched)."""

    open_admissions: int  # the id index; equal to the lease heap's and the per-target dicts' sums
    leases: int
    targets: int
    max_open_admissions: int


@dataclass(frozen=True)
class DeploymentPolicy:
    """What the book needs to know about a deployment to set leases."""

    name: str
    target_tokens_per_second: float


class AdmissionBook:
    """Thread-safe token accounting for every target the daemon polls.

    `reconcile` is called at every poll with a target's token budget and measured tokens in
    flight; `admit` and `release` are called by the HTTP API for gateways.
    """

    def __init__(
        self,
        deployments: Iterable[DeploymentPolicy],
        pools: Pools | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        settle_seconds: float = DEFAULT_SETTLE_SECONDS,
        poll_interval_seconds: float = DEFAULT_POLL_INTERVAL_SECONDS,
        lease_floor_seconds: float = DEFAULT_LEASE_FLOOR_SECONDS,
        lease_output_factor: float = DEFAULT_LEASE_OUTPUT_FACTOR,
        new_id: Callable[[], str] = lambda: secrets.token_hex(12),
        max_open_admissions: int = DEFAULT_MAX_OPEN_ADMISSIONS,
    ) -> None:
        if max_open_admissions < 1:
            raise InputError(f"max_open_admissions must be at least 1, got {max_open_admissions}")
        self._policies: dict[str, DeploymentPolicy] = {policy.name: policy for policy in deployments}
        if pools is not None:
            for name in (pools.short_deployment, pools.long_deployment):
                if name not in self._policies:
                    raise InputError(f"pools: deployment {name!r} is not one of the configured deployments")
        self.pools = pools
        self._clock = clock
        self._settle_seconds = settle_seconds
        self._poll_interval_seconds = poll_interval_seconds
        self._lease_floor_seconds = lease_floor_seconds
        self._lease_output_factor = lease_output_factor
        self._new_id = new_id
        self.max_open_admissions = max_open_admissions
        self._lock = threading.Lock()
        self._targets: dict[tuple[str, str], _Target] = {}
        self._by_id: dict[str, _Target] = {}
        self._leases = LeaseHeap()  # every open admission's lease end, and nothing else
        self._decisions: dict[tuple[str, str], int] = {
            (name, decision): 0 for name in self._policies for decision in DECISIONS
        }
        self.expired_total = 0
        self._version = 0  # bumped by every change the metrics show (exporter/serve/server.py's page cache)

    @property
    def deployments(self) -> tuple[str, ...]:
        return tuple(self._policies)

    # --- the daemon's side: reconcile at every poll -------------------------------------------

    def reconcile(
        self, deployment: str, target: str, budget_tokens: float, measured_tokens_in_flight: float,
        measured_at_seconds: float | None = None,
    ) -> None:
        """Take a poll's token budget and measured tokens in flight for one target."""
        if deployment not in self._policies:
            raise InputError(f"reconcile: unknown deployment {deployment!r}")
        if budget_tokens < 0 or measured_tokens_in_flight < 0:
            raise InputError(f"reconcile {deployment}/{target}: budget and tokens in flight must not be negative")
        with self._lock:
            now = self._clock() if measured_at_seconds is None else measured_at_seconds
            self._expire(self._clock())
            state = self._targets.get((deployment, target))
            if state is None:
                state = self._targets[(deployment, target)] = _Target(
                    deployment, target, budget_tokens, measured_tokens_in_flight, now)
            state.budget_tokens = budget_tokens
            state.measured_tokens_in_flight = measured_tokens_in_flight
            state.measured_at_seconds = now
            state.settled_at_poll_tokens = float(sum(
                a.tokens for a in state.admissions.values() if a.admitted_at_seconds <= now - self._settle_seconds))
            state.eligible = True
            self._version += 1

    def suspend(self, deployment: str, target: str) -> None:
        """The target's poll failed or lacked tokens in flight: admit nothing there until it is back."""
        with self._lock:
            state = self._targets.get((deployment, target))
            if state is not None:
                state.eligible = False
                self._version += 1

    def sync(self, measurements: Iterable[TargetMeasurement], unusable: Iterable[tuple[str, str]]) -> None:
        """One whole poll: reconcile the measured targets, suspend the unusable ones, forget the
        targets discovery no longer lists (and their admissions)."""
        measured = list(measurements)
        present = {(m.deployment, m.target) for m in measured} | set(unusable)
        for measurement in measured:
            if measurement.deployment in self._policies:
                self.reconcile(measurement.deployment, measurement.target,
                               measurement.budget_tokens, measurement.tokens_in_flight)
        for deployment, target in present - {(m.deployment, m.target) for m in measured}:
            self.suspend(deployment, target)
        with self._lock:
            gone = [key for key in self._targets if key not in present]
        for deployment, target in gone:
            self.forget(deployment, target)

    def forget(self, deployment: str, target: str) -> None:
        """A target that is down or gone takes no new admissions; its open ones are dropped."""
        with self._lock:
            state = self._targets.pop((deployment, target), None)
            if state is not None:
                self._version += 1
                for admission_id in state.admissions:
                    self._by_id.pop(admission_id, None)
                    self._leases.remove(admission_id)

    def targets(self) -> list[TargetAccount]:
        with self._lock:
            self._expire(self._clock())
            return [self._account(state) for state in self._targets.values()]

    def version(self) -> int:
        """Changes whenever the decision counts or any target's accounted tokens may have changed
        (leases that ran out are dropped first, so an expiry counts as a change)."""
        with self._lock:
            self._expire(self._clock())
            return self._version

    def sizes(self) -> BookSizes:
        """Entries in each structure now (leases that ran out dropped first)."""
        with self._lock:
            self._expire(self._clock())
            return BookSizes(len(self._by_id), len(self._leases), len(self._targets), self.max_open_admissions)

    def open_admissions(self) -> dict[str, int]:
        """Open admissions per deployment (every configured deployment, 0 included)."""
        with self._lock:
            self._expire(self._clock())
            counts = dict.fromkeys(self._policies, 0)
            for state in self._targets.values():
                counts[state.deployment] += len(state.admissions)
            return counts

    def decision_counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._decisions)

    # --- the gateway's side: admit and release --------------------------------------------------

    def admit(self, request: AdmissionRequest) -> Decision:
        deployment, pool = self._resolve(request)
        context = request.context_tokens
        long_pool = self._long_pool_for(deployment)
        with self._lock:
            now = self._clock()
            self._expire(now)
            if self.pools is not None and pool == "short" and context > self.pools.split_tokens:
                return self._count(Decision(
                    "redirected", deployment, pool, context, long_context_pool=long_pool,
                    tokens_left=self._most_left(deployment),
                    reason=(f"context {context:,} tokens is above the pools' split of "
                            f"{self.pools.split_tokens:,}: send it to the long-context pool"),
                ))
            candidates = [state for state in self._targets.values()
                          if state.deployment == deployment and state.eligible]
            if not candidates:
                return self._count(Decision(
                    "refused", deployment, pool, context, long_context_pool=long_pool,
                    retry_after_seconds=self._retry_after(now),
                    reason=f"deployment {deployment!r} has no target with a current reading",
                ))
            best = max(candidates, key=lambda state: state.budget_tokens - self._accounted(state))
            left = best.budget_tokens - self._accounted(best)
            if context <= left and len(self._by_id) >= self.max_open_admissions:
                return self._count(Decision(
                    "refused", deployment, pool, context, long_context_pool=long_pool, tokens_left=left,
                    retry_after_seconds=self._retry_after(now),
                    reason=(f"the admission book is full: {len(self._by_id):,} admissions are open, its maximum "
                            "(release admissions when their requests finish)"),
                ))
            if context <= left:
                admission = self._open(best, request, now)
                return self._count(Decision(
                    "admitted", deployment, pool, context, admission=admission,
                    tokens_left=left - context, reason=f"fits on {best.target}",
                ))
            never_fits = all(context > state.budget_tokens for state in candidates)
            reason = (f"context {context:,} tokens exceeds the whole token budget of every target of {deployment!r}"
                      if never_fits else
                      f"no target of {deployment!r} has {context:,} tokens left (most left: {max(left, 0.0):,.0f})")
            return self._count(Decision(
                "refused", deployment, pool, context, long_context_pool=long_pool, tokens_left=left,
                retry_after_seconds=None if never_fits else self._retry_after(now), reason=reason,
            ))

    def release(self, admission_id: str) -> Admission | None:
        """Close an admission; None when the id is unknown, already released, or its lease ran out."""
        with self._lock:
            self._expire(self._clock())
            state = self._by_id.get(admission_id)
            return None if state is None else self._close(state, admission_id)

    def accounted_tokens(self, deployment: str, target: str) -> float:
        with self._lock:
            self._expire(self._clock())
            state = self._targets.get((deployment, target))
            return 0.0 if state is None else self._accounted(state)

    # --- internals (called with the lock held) --------------------------------------------------

    def _resolve(self, request: AdmissionRequest) -> tuple[str, str | None]:
        """Which deployment a request asks for, and which pool that is (None: not a pool)."""
        if request.deployment is not None and request.pool is not None:
            raise InputError("give either 'deployment' or 'pool', not both")
        if request.deployment is not None:
            if request.deployment not in self._policies:
                suggestion = close_names(request.deployment, self._policies)
                raise InputError(f"unknown deployment {request.deployment!r}{suggestion}; "
                                 f"known: {', '.join(self._policies)}")
            return request.deployment, self._pool_of_deployment(request.deployment)
        if self.pools is None:
            if request.pool is not None:
                raise InputError("'pool' needs `pools` in the daemon's config; ask for a 'deployment' instead")
            raise InputError("give 'deployment' (no pools are configured)")
        pool = request.pool or "auto"
        if pool not in POOL_NAMES:
            raise InputError(f"unknown pool {pool!r}; pools: {', '.join(POOL_NAMES)}")
        if pool == "auto":
            pool = self.pools.pool_of_context(request.context_tokens)
        return self.pools.deployment_of(pool), pool

    def _pool_of_deployment(self, deployment: str) -> str | None:
        if self.pools is None:
            return None
        if deployment == self.pools.short_deployment:
            return "short"
        return "long" if deployment == self.pools.long_deployment else None

    def _long_pool_for(self, deployment: str) -> str | None:
        if self.pools is None or deployment == self.pools.long_deployment:
            return None
        return self.pools.long_deployment

    def _accounted(self, state: _Target) -> float:
        unaccounted = max(0.0, state.measured_tokens_in_flight - state.settled_at_poll_tokens)
        return state.open_tokens + unaccounted

    def _account(self, state: _Target) -> TargetAccount:
        return TargetAccount(state.deployment, state.target, state.budget_tokens,
                             state.measured_tokens_in_flight, self._accounted(state), len(state.admissions))

    def _most_left(self, deployment: str) -> float:
        lefts = [s.budget_tokens - self._accounted(s) for s in self._targets.values()
                 if s.deployment == deployment and s.eligible]
        return max(lefts, default=0.0)

    def _open(self, state: _Target, request: AdmissionRequest, now: float) -> Admission:
        policy = self._policies[state.deployment]
        output_seconds = request.max_output_tokens / policy.target_tokens_per_second
        lease = self._lease_floor_seconds + self._lease_output_factor * output_seconds
        admission_id = self._new_id()
        while admission_id in self._by_id:
            admission_id = self._new_id()
        admission = Admission(admission_id, state.deployment, state.target, request.context_tokens, now, now + lease)
        state.admissions[admission_id] = admission
        state.open_tokens += admission.tokens
        self._by_id[admission_id] = state
        self._leases.push(admission.expires_at_seconds, admission_id)
        self._version += 1
        return admission

    def _close(self, state: _Target, admission_id: str) -> Admission:
        """Take an admission out of every structure: the id index, its target's, the lease heap."""
        del self._by_id[admission_id]
        self._leases.remove(admission_id)
        admission = state.admissions.pop(admission_id)
        state.open_tokens -= admission.tokens
        self._version += 1
        return admission

    def _expire(self, now: float) -> None:
        """Drop admissions whose lease ran out: O(log n) each, nothing when none is due."""
        for admission_id in self._leases.pop_due(now):
            self._close(self._by_id[admission_id], admission_id)
            self.expired_total += 1

    def _retry_after(self, now: float) -> int:
        """Budget frees at a release (any moment) or at the next poll, whichever comes first;
        the next poll is the one moment the book can name."""
        last_poll = max((s.measured_at_seconds for s in self._targets.values()), default=now)
        until_next_poll = last_poll + self._poll_interval_seconds - now
        return max(MIN_RETRY_AFTER_SECONDS, math.ceil(until_next_poll))

    def _count(self, decision: Decision) -> Decision:
        key = (decision.deployment, decision.decision)
        self._decisions[key] = self._decisions.get(key, 0) + 1
        self._version += 1
        return decision


# --- the daemon's poll: readings -> measurements ------------------------------------------------


@dataclass(frozen=True)
class TargetMeasurement:
    """One target's poll, summed over its engines: each data-parallel engine has its own cache and
    budget, and a gateway sends to the target, whose server spreads requests over its engines."""

    deployment: str
    target: str
    budget_tokens: float
    tokens_in_flight: float


def measurements_from_readings(readings: Iterable[Any]) -> tuple[list[TargetMeasurement], set[tuple[str, str]]]:
    """Usable measurements, and the targets present but unusable (down, or a value missing).

    Takes `exporter.serve.reading.Reading`s (deployment, target, target_up, tokens_in_flight,
    token_budget_tokens, kv_cache_capacity_tokens). The budget is the speed budget capped by the
    KV cache: at a slow target (a long-context pool) the speed budget can exceed what the cache
    holds, and admitting past it means preemptions, not slower streams. A target with one
    unusable engine is unusable as a whole: admitting on a partial sum could overfill the engine
    that went unseen."""
    sums: dict[tuple[str, str], tuple[float, float]] = {}
    unusable: set[tuple[str, str]] = set()
    for reading in readings:
        key = (reading.deployment, reading.target)
        tokens, budget = reading.tokens_in_flight, reading.token_budget_tokens
        if not reading.target_up or tokens is None or budget is None:
            unusable.add(key)
            continue
        capacity = getattr(reading, "kv_cache_capacity_tokens", None)
        if capacity:
            budget = min(budget, capacity)
        budget_sum, tokens_sum = sums.get(key, (0.0, 0.0))
        sums[key] = (budget_sum + budget, tokens_sum + tokens)
    usable = [TargetMeasurement(deployment, target, budget, tokens)
              for (deployment, target), (budget, tokens) in sums.items() if (deployment, target) not in unusable]
    return usable, unusable
