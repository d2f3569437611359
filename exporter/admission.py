"""Admission by tokens in flight: the budget a gateway asks before it sends a request.

Per-user speed falls with the tokens in flight on a server, not with its request count, so a
request-count cap (`--max-num-seqs`) cannot keep chats fast when a few long agent sessions join.
Before it forwards a request a gateway asks: does this request's context (prompt + output limit)
still fit the token budget of some server in the pool? `AdmissionBook` answers, thread-safe, and
keeps every open admission until the gateway releases it.

Accounting rule (docs/admission.md explains why), per target, at every decision:

    accounted = open + max(0, measured - settled_at_poll)

  * open: the tokens of every open admission (prompt + the whole output limit: the most each
    request can come to hold), whether or not the server has started it.
  * measured: the daemon's tokens in flight at the last poll (KV usage x capacity).
  * settled_at_poll: the tokens of the admissions that were open at the last poll and old enough
    (`settle_seconds`) for the server to have started them. Their work is inside `measured` and
    never above their reservation, so `measured - settled_at_poll` is the work no admission
    accounts for: requests sent by gateways that do not ask, or straight to the server, or whose
    lease ran out. It stays counted until the next poll says otherwise.
  A release frees its tokens at once; a burst of admissions between two polls adds to the
  unaccounted work rather than hiding in it; the measurement catches what reservations miss.

Every admission holds a lease of `lease_floor_seconds + lease_output_factor * max_output_tokens /
target_tokens_per_second` (the time its whole output takes at the target speed, with slack).
A lease that runs out is dropped: a gateway that crashed before its release cannot hold budget
forever, and if the request is in fact still running, the measurement still counts it.

What is here, in data-flow order: `AdmissionBook` (pure apart from its lock; time comes from an
injected clock, so tests drive it in simulated time), `measurements_from_readings` (the daemon's
Readings -> one budget and one measurement per target), `AdmissionApi` (the two POST handlers,
independent of the HTTP server), `AdmissionCollector` (the two metric families), the `admission`
and `pools` config sections, and `install`, the daemon extension hook that wires them together.
"""

from __future__ import annotations

import heapq
import hmac
import json
import math
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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
    ) -> None:
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
        self._lock = threading.Lock()
        self._targets: dict[tuple[str, str], _Target] = {}
        self._by_id: dict[str, _Target] = {}
        # (expires_at, id) of every admission; released ones are skipped when they come up.
        self._leases: list[tuple[float, str]] = []
        self._decisions: dict[tuple[str, str], int] = {
            (name, decision): 0 for name in self._policies for decision in DECISIONS
        }
        self.expired_total = 0
        self._version = 0  # bumped by every change the metrics show (exporter/server.py's page cache)

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

    def sync(self, measurements: Iterable["TargetMeasurement"], unusable: Iterable[tuple[str, str]]) -> None:
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
                raise InputError(f"unknown deployment {request.deployment!r}{close_names(request.deployment, self._policies)}; "
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
        heapq.heappush(self._leases, (admission.expires_at_seconds, admission_id))
        self._version += 1
        return admission

    def _close(self, state: _Target, admission_id: str) -> Admission:
        del self._by_id[admission_id]
        admission = state.admissions.pop(admission_id)
        state.open_tokens -= admission.tokens
        self._version += 1
        return admission

    def _expire(self, now: float) -> None:
        """Drop admissions whose lease ran out: O(log n) each, nothing when none is due."""
        while self._leases and self._leases[0][0] <= now:
            _, admission_id = heapq.heappop(self._leases)
            state = self._by_id.get(admission_id)
            if state is not None:  # else released before its lease ran out
                self._close(state, admission_id)
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

    Takes `exporter.reading.Reading`s (deployment, target, target_up, tokens_in_flight,
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


# --- the HTTP API: POST /v1/admission, POST /v1/release ------------------------------------------

MAX_BODY_BYTES = 64 * 1024
ADMISSION_KEYS = ("deployment", "pool", "prompt_tokens", "max_output_tokens")
RELEASE_KEYS = ("id",)


@dataclass(frozen=True)
class ApiResponse:
    """What the daemon's HTTP server sends: a status, extra headers and a JSON body."""

    status: int
    body: Mapping[str, Any]
    headers: tuple[tuple[str, str], ...] = ()

    def encoded(self) -> bytes:
        return json.dumps(self.body, separators=(",", ":")).encode("utf-8")


class BadRequest(InputError):
    """The request's JSON is wrong: 400 with this message."""


def read_token_file(path: str) -> str:
    """The bearer token gateways must send; an empty or unreadable file is a config error."""
    try:
        with open(path, encoding="utf-8") as handle:
            token = handle.read().strip()
    except OSError as error:
        raise InputError(f"admission.token_file {path!r}: cannot read it: {error.strerror or error}") from None
    if not token:
        raise InputError(f"admission.token_file {path!r}: the file is empty; put the bearer token in it")
    return token


class AdmissionApi:
    """The two POST handlers, independent of the HTTP server that carries them.

    Every request needs `Authorization: Bearer <token>` (the token from `admission.token_file`):
    anyone who can admit can also starve the pool, so the API is never open.
    """

    def __init__(self, book: AdmissionBook, token: str) -> None:
        if not token:
            raise InputError("the admission API needs a non-empty bearer token")
        self.book = book
        self._token = token.encode("utf-8")

    def admission(self, headers: Mapping[str, str], body: bytes) -> ApiResponse:
        return self._guarded(headers, body, self._admit)

    def release(self, headers: Mapping[str, str], body: bytes) -> ApiResponse:
        return self._guarded(headers, body, self._release)

    def _guarded(self, headers: Mapping[str, str], body: bytes,
                 handler: Callable[[Mapping[str, Any]], ApiResponse]) -> ApiResponse:
        if not self._authorized(headers):
            return ApiResponse(401, {"error": "missing or invalid bearer token (Authorization: Bearer <token>)"},
                               (("WWW-Authenticate", 'Bearer realm="stepbudget admission"'),))
        try:
            return handler(parse_json_object(body))
        except InputError as error:
            return ApiResponse(400, {"error": str(error)})

    def _authorized(self, headers: Mapping[str, str]) -> bool:
        value = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
        scheme, _, token = value.strip().partition(" ")
        # Constant-time comparison: the token must not leak through response timing.
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8"), self._token)

    def _admit(self, document: Mapping[str, Any]) -> ApiResponse:
        decision = self.book.admit(parse_admission_request(document))
        return decision_response(decision)

    def _release(self, document: Mapping[str, Any]) -> ApiResponse:
        _reject_unknown_keys(document, RELEASE_KEYS)
        admission_id = document.get("id")
        if not isinstance(admission_id, str) or not admission_id:
            raise BadRequest("'id' must be the admission id string from POST /v1/admission")
        admission = self.book.release(admission_id)
        if admission is None:
            return ApiResponse(404, {"error": f"admission {admission_id!r} is unknown, already released, "
                                              "or its lease ran out", "released": False})
        return ApiResponse(200, {"released": True, "id": admission.id, "deployment": admission.deployment,
                                 "target": admission.target, "tokens": admission.tokens})


def parse_json_object(body: bytes) -> Mapping[str, Any]:
    if len(body) > MAX_BODY_BYTES:
        raise BadRequest(f"body of {len(body):,} bytes is over the {MAX_BODY_BYTES:,}-byte limit")
    try:
        document = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise BadRequest(f"body is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise BadRequest(f"body must be a JSON object, got {type(document).__name__}")
    return document


def _reject_unknown_keys(document: Mapping[str, Any], known: tuple[str, ...]) -> None:
    for name in document:
        if name not in known:
            raise BadRequest(f"unknown key {name!r}{close_names(str(name), known)}; known: {', '.join(known)}")


def _token_count(document: Mapping[str, Any], name: str, minimum: int) -> int:
    value = document.get(name)
    if value is None:
        raise BadRequest(f"missing {name!r}: a whole number of tokens")
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name!r} must be a whole number of tokens, got {value!r}")
    if value < minimum:
        raise BadRequest(f"{name!r} must be at least {minimum}, got {value}")
    if value > MAX_REQUEST_TOKENS:
        raise BadRequest(f"{name!r} of {value:,} is absurd: no model serves more than {MAX_REQUEST_TOKENS:,} tokens")
    return value


def parse_admission_request(document: Mapping[str, Any]) -> AdmissionRequest:
    _reject_unknown_keys(document, ADMISSION_KEYS)
    for name in ("deployment", "pool"):
        if name in document and not isinstance(document[name], str):
            raise BadRequest(f"{name!r} must be a string, got {document[name]!r}")
    return AdmissionRequest(
        prompt_tokens=_token_count(document, "prompt_tokens", 1),
        max_output_tokens=_token_count(document, "max_output_tokens", 1),
        deployment=document.get("deployment"),
        pool=document.get("pool"),
    )


def decision_response(decision: Decision) -> ApiResponse:
    body: dict[str, Any] = {
        "decision": decision.decision, "deployment": decision.deployment, "pool": decision.pool,
        "tokens": decision.context_tokens, "tokens_left": round(decision.tokens_left, 1), "reason": decision.reason,
    }
    if decision.admission is not None:
        admission = decision.admission
        body.update(id=admission.id, target=admission.target,
                    lease_seconds=round(admission.expires_at_seconds - admission.admitted_at_seconds, 3))
        return ApiResponse(200, body)
    body.update(retry_after_seconds=decision.retry_after_seconds, long_context_pool=decision.long_context_pool)
    headers = (("Retry-After", str(decision.retry_after_seconds)),) if decision.retry_after_seconds else ()
    return ApiResponse(429, body, headers)


# --- metrics -------------------------------------------------------------------------------------


class AdmissionCollector(Collector):
    """Decisions and accounted tokens, fresh families at every scrape.

    # HELP stepbudget_admission_decisions_total Admission decisions ...
    # TYPE stepbudget_admission_decisions_total counter
    stepbudget_admission_decisions_total{decision="admitted",deployment="chat"} 42.0
    # HELP stepbudget_admitted_tokens Tokens the admission budget counts on the target ...
    # TYPE stepbudget_admitted_tokens gauge
    stepbudget_admitted_tokens{deployment="chat",target="10.0.0.5:8000"} 81234.0
    """

    def __init__(self, book: AdmissionBook) -> None:
        self._book = book

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def generation(self) -> int:
        """The book's version: the cached /metrics page is rebuilt only after an admission change."""
        return self._book.version()

    def collect(self) -> Iterator[Metric]:
        yield from self._families()

    def _families(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily(
            "stepbudget_admission_decisions",
            "Admission decisions by the daemon's admission API: admitted, refused (no target has the tokens "
            "left; retry later) or redirected (context above the pools' split: use the long-context pool)",
            labels=["deployment", "decision"])
        for (deployment, decision), count in sorted(self._book.decision_counts().items()):
            decisions.add_metric([deployment, decision], count)
        yield decisions
        accounted = GaugeMetricFamily(
            "stepbudget_admitted_tokens",
            "Tokens the admission budget counts on the target: open admissions (prompt + output limit) plus the "
            "measured tokens in flight no admission accounts for; compare with stepbudget_token_budget_tokens",
            labels=["deployment", "target"])
        for account in sorted(self._book.targets(), key=lambda a: (a.deployment, a.target)):
            accounted.add_metric([account.deployment, account.target], account.accounted_tokens)
        yield accounted


# --- config: the `admission` and `pools` sections --------------------------------------------------


def _check_admission_section(result: Mapping[str, Any], where: Any) -> None:
    if result["enabled"] and not result["token_file"]:
        raise InputError("enabled: true needs token_file (a file holding the bearer token gateways send)")
    if result["enabled"]:
        read_token_file(result["token_file"])


def _check_pools_section(result: Mapping[str, Any], where: Any) -> None:
    if result["short"] == result["long"]:
        raise InputError(f"short and long name the same deployment {result['short']!r}; "
                         "the long-context pool must be its own deployment")


def register_config_sections() -> None:
    """Add `admission` and `pools` to the daemon's config table (config.py's extension point)."""
    from exporter import config

    config.register_section("admission", {
        "enabled": config.Key(config._bool, False, "serve POST /v1/admission and /v1/release (off by default)"),
        "token_file": config.Key(config._existing_file, None,
                                 "file holding the bearer token gateways must send; required when enabled"),
    }, "admission by tokens in flight (docs/admission.md)", check=_check_admission_section)
    config.register_section("pools", {
        "short": config.Key(config._string, config.REQUIRED, "deployment serving contexts up to split_tokens"),
        "long": config.Key(config._string, config.REQUIRED,
                           "deployment serving longer contexts, where slower streaming is expected"),
        "split_tokens": config.Key(config._whole_positive, config.REQUIRED,
                                   "context (prompt + output limit) above which a request belongs to the long pool"),
    }, "short- and long-context pools for admission and `plan --pools`", check=_check_pools_section)
    config.register_config_check(_check_pools_deployments)


def pools_from_config(config: Any) -> Pools | None:
    """The `pools` section as Pools, its deployments checked against `deployments[]` (also run by
    the config's own validation, so `check-config` reports a pool naming no deployment)."""
    from exporter.config import ConfigError

    raw = config.sections.get("pools")
    if not raw:
        return None
    names = [deployment.name for deployment in config.deployments]
    lines = getattr(raw, "key_lines", {})
    for key in ("short", "long"):
        if raw[key] not in names:
            place = f"{config.source}:{lines.get(key, getattr(raw, 'line', 0))}: " if config.source else ""
            raise ConfigError(f"{place}pools.{key}: deployment {raw[key]!r} is not in deployments"
                             f"{close_names(raw[key], names)}; known: {', '.join(names)}")
    return Pools(raw["short"], raw["long"], raw["split_tokens"])


def _check_pools_deployments(config: Any) -> None:
    pools_from_config(config)


def api_from_config(config: Any, *, clock: Callable[[], float] = time.monotonic) -> AdmissionApi | None:
    """The admission API for a daemon config, or None when `admission.enabled` is off."""
    raw = config.sections.get("admission")
    if not raw or not raw["enabled"]:
        return None
    return AdmissionApi(book_from_config(config, clock=clock), read_token_file(raw["token_file"]))


def book_from_config(config: Any, *, clock: Callable[[], float] = time.monotonic,
                     with_pools: bool = True) -> AdmissionBook:
    """An empty book for a daemon config's deployments (and its `pools`, unless `with_pools` is off)."""
    return AdmissionBook(
        [DeploymentPolicy(d.name, d.target_tokens_per_second) for d in config.deployments],
        pools_from_config(config) if with_pools else None, clock=clock,
        poll_interval_seconds=config.poll_interval_seconds,
    )


def sync_at_every_poll(book: AdmissionBook, poller: Any) -> None:
    """Feed each of the poller's results to the book: reconcile, suspend, forget (`AdmissionBook.sync`)."""
    poller.add_listener(lambda result: book.sync(*measurements_from_readings(result.readings)))


# --- the daemon: routes, poll listener, metrics ------------------------------------------------------


def install(daemon: Any) -> AdmissionApi | None:
    """Daemon extension hook: with `admission.enabled`, serve the API, reconcile at every poll and
    export the admission metrics on the daemon's registry. Off by default: nothing is added.
    Returns the installed API (its `book` is the live state), for tests and embedders."""
    from exporter.server import Response

    api = api_from_config(daemon.config)
    if api is None:
        return None

    def route(handler: Callable[[Mapping[str, str], bytes], ApiResponse]) -> Callable[[Any], Any]:
        def handle(request: Any) -> Any:
            answer = handler(request.headers, request.body)
            return Response(answer.status, answer.encoded(), "application/json", dict(answer.headers))

        return handle

    daemon.server.register_route("POST", "/v1/admission", route(api.admission))
    daemon.server.register_route("POST", "/v1/release", route(api.release))
    sync_at_every_poll(api.book, daemon.poller)
    daemon.server.registry.register(AdmissionCollector(api.book))
    return api


register_config_sections()


def _register_with_daemon() -> None:
    from exporter import daemon

    daemon.register_extension(install)


_register_with_daemon()
