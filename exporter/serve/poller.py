"""The poll loop: every `poll_interval`, discover targets, fetch every /metrics concurrently, read
each page, and publish the latest Readings for the collector and the alert loop.

Why a poll loop and not fetch-on-scrape: measured step time and prefill per step are deltas
between two readings of a server's counters; every scraper must see the same deltas (DESIGN §2).

Failure handling: a fetch is bounded in time and in size (exporter/serve/fetch.py says how). A
target that fails exports `stepbudget_target_up 0`, logs one line with the reason, and keeps its
last good values only until `stale_after`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

import structlog

from exporter.redaction import redact
from exporter.serve.config import Config, Deployment, Tls
from exporter.serve.derivation import OpenContexts, derive_reading, server_wide_reading
from exporter.serve.discovery import Discovery, NotReadyPod, Target
from exporter.serve.engines import PageReading, read_page
from exporter.serve.fetch import MAX_FETCH_WORKERS, AuthorizedFetch, Fetch, FetchedPage, FetchError
from exporter.serve.open_context import OpenContext, open_context
from exporter.serve.process_identity import ProcessWatch
from exporter.serve.reading import Reading, count_decode_tokens
from exporter.serve.setups_in_use import SetupsInUse
from exporter.serve.snapshot import Snapshot
from exporter.serve.window import Window, compute_window, mixed_processes_window

if TYPE_CHECKING:
    from apscheduler.schedulers.background import BackgroundScheduler

log = structlog.get_logger("stepbudget.poller")

# A poll starts this many fetch workers and adds more only where waiting, not CPU, is what holds it
# up: a fetch running past SLOW_FETCH_SECONDS (a slow or dead target) gets a worker to cover for it,
# and a pace that would make the poll last over POLL_BUDGET_SHARE of the interval (high-latency
# targets) doubles them, up to MAX_FETCH_WORKERS. Why not 32 from the start: reading pages is CPU
# work under one interpreter lock, and 32 threads contending for it cost ~0.08 ms more CPU per
# target-poll than 2 to 8 (benchmarks/results/scale.md).
FAST_FETCH_WORKERS = 4
SLOW_FETCH_SECONDS = 0.25
POLL_BUDGET_SHARE = 0.25
WORKER_CHECK_SECONDS = 0.05


@dataclass(frozen=True)
class BasicCredential:
    """A deployment's basic auth, read for this poll: the `Authorization` header's value."""

    header: str = field(repr=False)


# What a deployment's targets are fetched with this poll: a bearer token, basic auth, none, or why not.
Credential = str | BasicCredential | Exception | None


def shown_target(target: Target) -> Target:
    """The target as labels and logs show it: its URL and label without credentials (exporter/redaction.py)."""
    url, label = redact(target.url), redact(target.target)
    return target if (url, label) == (target.url, target.target) else replace(target, url=url, target=label)


class SourceOutcome(Protocol):
    """One target's part of a source's answer (exporter/serve/prometheus_source.py's TargetOutcome)."""

    @property
    def target(self) -> Target: ...
    @property
    def page(self) -> PageReading | None: ...
    @property
    def error(self) -> str | None: ...
    @property
    def unchanged(self) -> bool: ...


class SourceAnswer(Protocol):
    @property
    def outcomes(self) -> Sequence[SourceOutcome]: ...
    @property
    def duration_seconds(self) -> float: ...


class Source(Protocol):
    """A deployment read as a whole (`targets.prometheus`) instead of one page fetch per target:
    one call per poll names the targets and gives each its page reading or its failure."""

    def read(self) -> SourceAnswer: ...


@dataclass
class TargetState:
    """What the poller remembers about one target between polls."""

    target: Target
    kind: str | None = None
    last_error: str | None = None
    last_success_seconds: float | None = None
    # Last good snapshot per (model_name, engine), the window's previous reading.
    previous: dict[tuple[str, str], Snapshot] = field(default_factory=dict)
    # The vLLM request ledger per (model_name, engine) at the last good poll (exporter/serve/open_context.py).
    open_contexts: dict[tuple[str, str], OpenContext] = field(default_factory=dict)
    readings: list[Reading] = field(default_factory=list)
    # What was last logged about the page, so a lasting condition is logged once per change.
    problems: tuple[str, ...] = ()
    # (engine, KV dtype, block size, setup disagreements) as last logged
    page_settings: tuple[tuple[str, str, int, tuple[tuple[str, str, str], ...]], ...] = ()
    # Whether its pages come from more than one process (exporter/serve/process_identity.py).
    processes: ProcessWatch = field(default_factory=ProcessWatch)


@dataclass(frozen=True)
class PollResult:
    readings: tuple[Reading, ...]
    finished_at_seconds: float
    # Every configured deployment with the targets this poll found for it (0: it watches nothing).
    deployment_targets: tuple[tuple[str, int], ...] = ()
    # The Kubernetes pods discovery found not Ready (not polled): StepBudgetTargetNotReady's evidence.
    not_ready: tuple[NotReadyPod, ...] = ()


PollListener = Callable[[PollResult], None]
_CRASHED: list[Reading] = []  # (this very object) a target whose poll raised: logged, no readings
ReadPage = Callable[[str, str], PageReading]  # (page text, server kind) -> what the page says
ComputeWindow = Callable[[Snapshot | None, Snapshot], Window]  # (previous, current) -> the window


class Poller:
    """Owns the targets' state; `poll_once` is the whole cycle, called by the scheduler or by tests."""

    def __init__(self, config: Config, discovery: Discovery, fetch: Fetch, *,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 read_page: ReadPage = read_page,
                 compute_window: ComputeWindow = compute_window,
                 sources: Sequence[Source] = (), setups_in_use: SetupsInUse | None = None) -> None:
        self.config = config
        # The setups predicted with: the online calibration's, handed in where it runs (else the seeds).
        self.setups_in_use = SetupsInUse() if setups_in_use is None else setups_in_use
        self._deployments = {deployment.name: deployment for deployment in config.deployments}
        self._discovery = discovery
        self._fetch = fetch
        self._clock = clock
        self._monotonic = monotonic
        self._read_page = read_page
        self._compute_window = compute_window
        self._sources = tuple(sources)
        self._states: dict[tuple[str, str], TargetState] = {}
        self._lock = threading.Lock()
        self._readings: tuple[Reading, ...] = ()
        self._deployment_targets: tuple[tuple[str, int], ...] = ()
        self._not_ready: tuple[NotReadyPod, ...] = ()
        self._mixed: frozenset[tuple[str, str]] = frozenset()
        self._polls_done = 0
        self._listeners: list[PollListener] = []
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=MAX_FETCH_WORKERS,
                                                               thread_name_prefix="stepbudget-fetch")
        self._stopping = False
        self._scheduler: BackgroundScheduler | None = None

    # --- what others read -----------------------------------------------------------------------

    def add_listener(self, listener: PollListener) -> None:
        self._listeners.append(listener)

    @property
    def ready(self) -> bool:
        return self._polls_done > 0

    def readings(self) -> tuple[Reading, ...]:
        return self._readings

    def deployment_targets(self) -> tuple[tuple[str, int], ...]:
        """Each configured deployment and the targets the last poll found for it (empty before one)."""
        return self._deployment_targets

    def not_ready(self) -> tuple[NotReadyPod, ...]:
        """The pods the last poll's discovery found not Ready (empty before one, or without Kubernetes)."""
        return self._not_ready

    def mixed_targets(self) -> frozenset[tuple[str, str]]:
        """(deployment, target label) of every target whose pages come from more than one process."""
        return self._mixed

    def target_states(self) -> list[TargetState]:
        with self._lock:
            return list(self._states.values())

    # --- the cycle ------------------------------------------------------------------------------

    def poll_once(self) -> PollResult:
        targets = self._discovery.discover()
        not_ready = tuple(getattr(self._discovery, "not_ready", tuple)())  # a test's discovery may have none
        answers = self._read_sources()
        found = [*targets, *(outcome.target for answer in answers for outcome in answer.outcomes)]
        self._forget_gone(found)
        retain = getattr(self._fetch, "retain", None)  # HttpFetcher; a test's fetch may have none
        if retain is not None:
            retain({target.url for target in targets})
        counts = dict.fromkeys(self._deployments, 0)
        for target in found:
            counts[target.deployment] += 1
        tokens = self._bearer_tokens(targets)
        polled = self._poll_targets(targets, tokens)
        readings: list[Reading] = [reading for answer in answers for reading in self._source_readings(answer)]
        abandoned = 0
        for target in targets:
            outcome = polled.get(target.key)
            if outcome is None:
                abandoned += 1  # stop() came first: the daemon is shutting down
            elif outcome is not _CRASHED:
                readings.extend(outcome)
        if abandoned:
            # One line, not a traceback per target: a half-finished cycle at shutdown is routine.
            log.info("poll_cycle_abandoned", reason="stopping", targets_not_polled=abandoned)
            return PollResult(self._readings, self._clock(), self._deployment_targets)
        result = PollResult(tuple(readings), self._clock(), tuple(counts.items()), not_ready)
        with self._lock:
            mixed = frozenset((state.target.deployment, state.target.target)
                              for state in self._states.values() if state.processes.mixed)
        self._readings, self._deployment_targets = result.readings, result.deployment_targets
        self._not_ready, self._mixed = not_ready, mixed
        self._polls_done += 1
        for listener in self._listeners:
            try:
                listener(result)
            except Exception:
                log.exception("poll_listener_failed", listener=getattr(listener, "__qualname__", repr(listener)))
        return result

    def _poll_targets(self, targets: Sequence[Target],
                      tokens: dict[str, Credential]) -> dict[tuple[str, str], list[Reading]]:
        """Every target's readings (_CRASHED for a bug, logged), from workers that take targets off one
        queue; a target missing from the answer was never polled (stop() came first)."""
        queue = collections.deque(targets)
        polled: dict[tuple[str, str], list[Reading]] = {}
        fetching: dict[int, float] = {}  # worker -> when its current target started (real time: scheduling)

        def work(worker: int) -> None:
            while not self._stopping:
                try:
                    target = queue.popleft()
                except IndexError:
                    return
                fetching[worker] = time.monotonic()
                try:
                    polled[target.key] = self._poll_target(target, tokens[target.deployment])
                except Exception:
                    log.exception("poll_target_crashed", deployment=target.deployment, target=target.target)
                    polled[target.key] = _CRASHED
                finally:
                    del fetching[worker]

        workers: list[concurrent.futures.Future[None]] = []

        def add(count: int) -> None:
            for _ in range(min(count, MAX_FETCH_WORKERS - len(workers), len(queue))):
                try:
                    workers.append(self._executor.submit(work, len(workers)))
                except RuntimeError:  # stop() shut the pool down
                    return

        started = grown = time.monotonic()
        cpu_started = time.process_time()  # the whole process's CPU, every thread
        budget_seconds = POLL_BUDGET_SHARE * self.config.poll_interval_seconds
        covered: set[tuple[int, float]] = set()  # slow fetches already given a worker to cover for them
        add(FAST_FETCH_WORKERS)
        while queue and not self._stopping:
            _, pending = concurrent.futures.wait(workers, timeout=WORKER_CHECK_SECONDS)
            if not pending:
                break
            now = time.monotonic()
            slow = {(worker, since) for worker, since in list(fetching.items()) if now - since > SLOW_FETCH_SECONDS}
            new = slow - covered
            covered |= new
            add(len(new))
            done, elapsed = len(polled), now - started
            # Late at this pace, and waiting rather than computing (more threads cannot speed up a
            # process that already keeps its one interpreter busy): double, then judge the new pace.
            if (done and elapsed * len(targets) / done > budget_seconds and now - grown > SLOW_FETCH_SECONDS
                    and time.process_time() - cpu_started < 0.8 * elapsed):
                add(len(workers))
                grown = now
        for worker in workers:
            # Each future's own result, not concurrent.futures.wait(): stop() cancels the workers still
            # queued for a thread (shutdown(cancel_futures=True), CPython 3.11 Lib/concurrent/futures/
            # thread.py l. 216-228), and wait() counts a future done only once a worker has dequeued it
            # and marked it CANCELLED_AND_NOTIFIED (_base.py l. 290-291, 521-524), which never comes to
            # one drained from the queue. A poll in flight at shutdown then waited forever, and held the
            # process's exit with it (CI, 2026-12-02). result() wakes on cancel() (_base.py l. 377-378).
            with contextlib.suppress(concurrent.futures.CancelledError):
                worker.result()
        return polled

    def _read_sources(self) -> list[SourceAnswer]:
        """Every source's answer, read concurrently; a source never raises (its failures are its
        targets' failures), but a bug in one is logged and costs only its own targets this poll."""
        futures = []
        for source in self._sources:
            try:
                futures.append((source, self._executor.submit(source.read)))
            except RuntimeError:  # stop() shut the pool down
                return []
        answers = []
        for source, future in futures:
            try:
                answers.append(future.result())
            except concurrent.futures.CancelledError:
                continue
            except Exception:
                log.exception("source_crashed", source=type(source).__name__)
        return answers

    def _source_readings(self, answer: SourceAnswer) -> list[Reading]:
        """Each outcome through the same bookkeeping as a fetched page: up/down, windows, logs."""
        readings: list[Reading] = []
        for outcome in answer.outcomes:
            state = self._states[outcome.target.key]
            try:
                if outcome.error is not None or (outcome.page is None and not outcome.unchanged):
                    readings += self._failed(state, outcome.error or "no answer", answer.duration_seconds)
                elif outcome.unchanged and state.last_error is None and state.readings:
                    readings += state.readings  # no newer scrape: the last window still stands
                elif outcome.page is not None:
                    deployment = self._deployments[outcome.target.deployment]
                    readings += self._succeeded(state, deployment, outcome.page, answer.duration_seconds)
                else:
                    readings += self._failed(state, "no newer scrape since a failed read", answer.duration_seconds)
            except Exception:
                log.exception("poll_target_crashed", deployment=outcome.target.deployment, target=outcome.target.target)
        return readings

    def _forget_gone(self, targets: Sequence[Target]) -> None:
        current = {target.key for target in targets}
        with self._lock:
            for key in [key for key in self._states if key not in current]:
                gone = self._states.pop(key)
                log.info("target_removed", deployment=gone.target.deployment, target=gone.target.target)
            for target in targets:
                state = self._states.get(target.key)
                shown = shown_target(target)  # what labels and logs carry: no credential
                if state is not None and state.target != shown:
                    # Another pod at the same URL (a new pod given an old one's IP): a new target, with its
                    # own name on every series and alert, and no window from the old pod's counters.
                    log.info("target_replaced", deployment=target.deployment, target=target.target,
                             pod=target.pod, replaced_pod=state.target.pod)
                    state = None
                if state is None:
                    self._states[target.key] = TargetState(shown)

    def _bearer_tokens(self, targets: Sequence[Target]) -> dict[str, Credential]:
        """Each deployment's bearer token or basic auth (or why it cannot be read), read once per poll: a
        token or password file is one file for all of a deployment's targets, not one read per target."""
        tokens: dict[str, Credential] = {}
        for name in {target.deployment for target in targets}:
            auth = self._deployments[name].auth
            try:
                tokens[name] = BasicCredential(auth.authorization() or "") if auth.basic_auth else auth.bearer_token()
            except Exception as error:
                tokens[name] = error
        return tokens

    def _poll_target(self, target: Target, bearer_token: Credential) -> list[Reading]:
        deployment = self._deployments[target.deployment]
        state = self._states[target.key]
        started = self._monotonic()
        if isinstance(bearer_token, Exception):
            return self._failed(state, _reason(bearer_token), self._monotonic() - started)
        try:
            text = self._fetch_page(target.url, bearer_token, deployment.tls)
            page = self._read_fetched(text, deployment.kind)
        except Exception as error:
            return self._failed(state, _reason(error), self._monotonic() - started)
        duration = self._monotonic() - started
        return self._succeeded(state, deployment, page, duration)

    def _fetch_page(self, url: str, credential: str | BasicCredential | None, tls: Tls) -> str:
        if not isinstance(credential, BasicCredential):
            return self._fetch(url, bearer_token=credential, tls=tls)
        if not isinstance(self._fetch, AuthorizedFetch):
            raise FetchError("basic_auth needs a fetch that sends any Authorization header (HttpFetcher)")
        return self._fetch.fetch_authorized(url, authorization=credential.header, tls=tls)

    def _read_fetched(self, text: str, kind: str) -> PageReading:
        """The page read, with what the fetch left out (FetchedPage.notes) among its problems, or in the
        reason when what is left cannot be read."""
        notes = text.notes if isinstance(text, FetchedPage) else ()
        try:
            page = self._read_page(text, kind)
        except Exception as error:
            if notes:
                raise FetchError(f"{_reason(error)} ({'; '.join(notes)})") from None
            raise
        return replace(page, problems=(*page.problems, *notes)) if notes else page

    def _failed(self, state: TargetState, reason: str, duration_seconds: float) -> list[Reading]:
        now = self._clock()
        reason = redact(reason)  # an error's text may hold the URL's query (urllib3 words it so)
        if reason != state.last_error:
            # One line per change of state, not one per poll: a target down for hours is not log spam.
            log.warning("target_down", deployment=state.target.deployment, target=state.target.target,
                        url=state.target.url, reason=reason)
        state.last_error = reason
        fresh = (state.last_success_seconds is not None
                 and now - state.last_success_seconds < self.config.stale_after_seconds)
        if state.readings:
            state.readings = [reading.down(scrape_duration_seconds=duration_seconds, keep_values=fresh)
                              for reading in state.readings]
        else:
            target = state.target
            state.readings = [Reading(deployment=target.deployment, target=target.target, namespace=target.namespace,
                                      pod=target.pod, target_up=False, scrape_duration_seconds=duration_seconds)]
        return state.readings

    def _succeeded(self, state: TargetState, deployment: Deployment, page: PageReading,
                   duration_seconds: float) -> list[Reading]:
        now = self._clock()
        kind = page.kind
        target = state.target
        if kind != state.kind:
            log.info("kind_detected", deployment=deployment.name, target=target.target, kind=kind,
                     engines=[f"{s.model_name}/{s.engine}" for s in page.snapshots])
        if state.last_error is not None:
            log.info("target_up", deployment=deployment.name, target=target.target, after=state.last_error)
        problems = page.problems
        if problems != state.problems:
            # Once per change: a page that stays truncated or odd for hours is one line, not one a poll.
            for problem in problems:
                log.warning("page_problem", deployment=deployment.name, target=target.target, reason=problem)
            if state.problems and not problems:
                log.info("page_problems_cleared", deployment=deployment.name, target=target.target)
            state.problems = problems
        readings: list[Reading] = []
        previous: dict[tuple[str, str], Snapshot] = {}
        contexts: dict[tuple[str, str], OpenContext] = {}
        server_wide: dict[str, tuple[list[Reading], Window]] = {}
        # The window's time: from the last good poll, which every engine's previous snapshot is of.
        window_seconds = now - state.last_success_seconds if state.last_success_seconds is not None else None
        mixed = self._watch_processes(state, page, now)
        predicting = self.setups_in_use.predicting_setup(deployment)  # one setup for the whole page
        for snapshot in page.snapshots:
            identity = (snapshot.model_name, snapshot.engine)
            window = (mixed_processes_window(state.processes.reason) if mixed
                      else self._compute_window(state.previous.get(identity), snapshot))
            if window.counter_reset:
                log.info("counter_reset", deployment=deployment.name, target=target.target,
                         model_name=snapshot.model_name, engine=snapshot.engine, notes=list(window.notes))
            start_context = state.open_contexts.get(identity) if identity in state.previous and not mixed else None
            end_context = open_context(snapshot, None if window.counter_reset else start_context)
            if end_context is not None:
                contexts[identity] = end_context
            reading = derive_reading(deployment, target, snapshot, window, now_seconds=now,
                                     scrape_duration_seconds=duration_seconds,
                                     contexts=OpenContexts(start_context, end_context), window_seconds=window_seconds,
                                     predicting=predicting)
            readings.append(reading)
            previous[identity] = snapshot
            if "inter_token_latency" in snapshot.server_wide:
                server_wide.setdefault(snapshot.model_name, ([], window))[0].append(reading)
        for ranks, window in server_wide.values():
            whole = server_wide_reading(ranks, window)
            if whole is not None:
                readings.append(whole)
        priors = {reading.identity: reading for reading in state.readings}
        readings = [count_decode_tokens(reading, priors.get(reading.identity), deployment.target_tokens_per_second)
                    for reading in readings]
        self._log_page_settings(state, deployment, readings)
        self._log_partial(state, readings)
        state.kind, state.last_error, state.last_success_seconds = kind, None, now
        state.previous, state.readings, state.open_contexts = previous, readings, contexts
        return readings

    def _watch_processes(self, state: TargetState, page: PageReading, now: float) -> bool:
        """Whether the target's pages come from more than one process (a load-balanced URL): then no
        window is computed. Logged once per change, not once a poll."""
        was_mixed = state.processes.mixed
        mixed = state.processes.observe(state.previous, page.snapshots, state.last_success_seconds)
        if mixed and not was_mixed:
            log.warning("target_mixed_processes", deployment=state.target.deployment, target=state.target.target,
                        reason=state.processes.reason)
        elif was_mixed and not mixed:
            log.info("target_single_process", deployment=state.target.deployment, target=state.target.target)
        return mixed

    def _log_page_settings(self, state: TargetState, deployment: Deployment, readings: Iterable[Reading]) -> None:
        """The page's KV dtype, block size and allocated KV bytes per token win over the config
        (reading.page_setup, which decides what counts as different): say so once when they differ, with
        what the config should say."""
        settings = tuple(sorted({
            (reading.engine, reading.kv_cache_dtype or "", reading.block_size_tokens or 0,
             reading.setup_disagreements)
            for reading in readings if reading.engine or reading.kv_cache_dtype
        }))
        if settings == state.page_settings:
            return
        state.page_settings = settings
        configured = deployment.resolved.setup
        for engine, dtype, block_size, disagreements in settings:
            if disagreements or (block_size and block_size != configured.block_size_tokens):
                log.warning("page_overrides_config", deployment=deployment.name, target=state.target.target,
                            engine=engine, page_kv_cache_dtype=dtype or None,
                            configured_kv_cache_dtype=deployment.kv_cache_dtype,
                            page_block_size=block_size or None,
                            configured_block_size=configured.block_size_tokens,
                            disagreements={quantity: {"configured": mine, "page": theirs}
                                           for quantity, mine, theirs in disagreements},
                            using="the page's settings",
                            change=_what_to_change(disagreements))

    def _log_partial(self, state: TargetState, readings: Iterable[Reading]) -> None:
        """Log the values a page does not allow, and the values exported as estimates, once per change,
        so a partial or estimated reading is never silent; the routine gaps of a window (first poll,
        idle) are not logged."""
        for reading in readings:
            previous = next((r for r in state.readings if r.identity == reading.identity and r.target_up), None)
            before = (previous.lacking, previous.estimated) if previous is not None else ((), ())
            if (reading.lacking, reading.estimated) != before:
                log.info("reading_partial", deployment=reading.deployment, target=reading.target,
                         model_name=reading.model_name, engine=reading.engine, left_out=list(reading.lacking),
                         estimated=[f"{quantity}: {reason}" for quantity, reason in reading.estimated],
                         notes=list(reading.notes))

    # --- scheduling -----------------------------------------------------------------------------

    def start(self) -> None:
        """Poll now, then every poll_interval, in a background scheduler thread."""
        from apscheduler.schedulers.background import BackgroundScheduler

        interval = self.config.poll_interval_seconds
        scheduler = BackgroundScheduler(timezone="UTC")
        # max_instances=1 + coalesce: a poll slower than the interval skips runs instead of piling up;
        # misfire grace of one interval: a late run still happens rather than being dropped.
        scheduler.add_job(self.poll_once, "interval", seconds=interval, id="poll", max_instances=1,
                          coalesce=True, misfire_grace_time=max(1, int(interval)),
                          next_run_time=datetime.now(UTC))
        scheduler.start()
        self._scheduler = scheduler

    def stop(self) -> None:
        self._stopping = True  # fetch workers finish the target in hand and take no other
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
            self._scheduler = None
        self._executor.shutdown(wait=False, cancel_futures=True)


def _reason(error: BaseException) -> str:
    reason = getattr(error, "reason", None)
    if isinstance(reason, str) and reason:
        detail = str(error)
        return detail if detail.startswith(reason) else reason
    return f"{type(error).__name__}: {error}"[:300]


def _what_to_change(disagreements: Iterable[tuple[str, str, str]]) -> str | None:
    """The config change that makes the configured model what the server runs (a 2 a.m. reader's next step)."""
    quantities = {quantity for quantity, _, _ in disagreements}
    if "weight_dtype" in quantities:
        return "set the deployment's weight_dtype (and kv_cache_dtype) to what the server runs (its --dtype)"
    if "kv_bytes_per_token" in quantities:
        return "set the deployment's kv_cache_dtype to the server's (--kv-cache-dtype), or check the model"
    return None
