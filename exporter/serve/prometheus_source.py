"""`targets.prometheus`: read a deployment's engines from the user's Prometheus (or Thanos, or Mimir)
instead of fetching every server's page.

Why: in most clusters Prometheus already scrapes every model server; a second scraper doubles the
load on each server's API process and must be sharded by hand as the fleet grows, while the
query path of Prometheus/Thanos/Mimir already holds every series (docs/scaling.md).

What is asked, and why raw values: one instant query per poll for the whole deployment,
`{__name__=~"<every sample name the adapters read>|up", <selector>}`, returns the latest scraped
value of every counter, histogram bucket and gauge, exactly as the pages said them. They go through
the page reader's own selection (`engines.reading_from_scan`) and the poller's own window code, so
deltas, counter resets and the bucket-interpolated median are computed exactly as for fetched pages.
`increase()` was the other choice and is worse here: it extrapolates to the range's edges (counts
that are not whole numbers, steps that never happened), its range must match the poll interval,
and the median would come from extrapolated buckets; raw values need none of that.

The same query also asks `timestamp(up{<selector>})`, tagged with a label of its own: it says when
Prometheus last scraped each target. A poll that finds no newer scrape keeps the target's readings
as they are (a window of zero steps would blank its measured step). How old a scrape may be follows
the target's own scrape interval, inferred from the spacing of the scrape times the daemon has seen:
a scrape is naturally up to one interval plus its ingestion lag old, so a fixed `stale_after` at or
under the interval made a poll that lands between a scrape's start and its samples becoming
queryable see a too-old scrape at every poll, for ever. A target is down once its last scrape is
older than two of its intervals (one of grace for ingestion and remote-write lag) or `stale_after`,
whichever is longer; before two scrapes of it are seen, `stale_after` alone.

One query, not several, because Prometheus answers one query from one consistent view of its head
block: every sample of one scrape, or none. Remote-write backends (Mimir, Cortex, Thanos Receive)
do not promise that: one scrape's series arrive in several batches, and a query may see some from
the newer scrape and some from the older. So the query also asks, per target, the standard deviation
of its series' sample times; a target whose series that deviation says are more than
SAMPLE_TIME_TOLERANCE_SECONDS apart (judged as if one series were the odd one out, the least
deviation a tear can show: torn_gap_seconds) is not read that poll (its last window stands, and it
is said once), since a window over two scrapes'
counters is a wrong number; one torn since before its first reading, or for longer than it may be
stale, is down with the reason. `timestamp()` gives a sample's own time only for a bare selector and
drops the name (so two names' series would collide), hence one `timestamp(name{selector})` per
name, each tagged with its name: one more evaluation of the same series per poll, one more series
per target in the answer.

Each scrape target (`cluster`, `job`, `instance`) is one daemon target labelled by its `instance` (a global
Prometheus or Thanos querier carries each cluster's series with its `cluster` external label: the same
`job` and `instance` in two clusters are two targets, labelled `cluster/instance`); the labels
Prometheus added to it (those on its `up`: job, instance, namespace, pod, ...) are taken off its
series before reading, so they look as they did on the page. Failures are target failures: a query
error, a timeout, a Prometheus that is down or a partial answer (Thanos/Mimir `warnings`) make every
target of the deployment down with the reason; a target whose `up` is 0 is down with that reason.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import requests
import structlog

from exporter.logs import say_tls_verification_is_off
from exporter.redaction import redact
from exporter.serve.config import Deployment, PrometheusTargets
from exporter.serve.discovery import Target
from exporter.serve.engines import PageError, PageReading, PageScan, reading_from_scan, wanted_names
from exporter.serve.engines.exposition import parse_value

log = structlog.get_logger("stepbudget.prometheus_source")

SCRAPE_TIME_LABEL = "stepbudget_scrape_time"  # tags the timestamp(up) series in the one answer
SAMPLE_TIME_SPREAD_LABEL = "stepbudget_sample_time_stddev"  # tags each target's spread of sample times
SAMPLE_NAME_LABEL = "stepbudget_sample_name"  # keeps each name's timestamps apart once timestamp() drops it
# All samples of one scrape carry the scrape's start time (to the millisecond), so a whole scrape's
# deviation is 0; a gap between two scrapes' sample times above this, far below any real scrape
# interval, is series from two scrapes (torn_gap_seconds says how the gap is judged from the deviation).
SAMPLE_TIME_TOLERANCE_SECONDS = 0.1
# A scrape may be this many of its target's intervals old: one for its natural age, one of grace for
# ingestion (scrape duration, remote-write batching and backend lag) before it counts as missed.
SCRAPE_INTERVALS_ALLOWED = 2.0
INTERVALS_REMEMBERED = 8  # the interval is the shortest of the last few scrape spacings seen
CHUNK_BYTES = 1 << 20
ScrapeKey = tuple[str, str, str]  # (cluster, job, instance): one scrape target of the user's Prometheus


class QueryError(Exception):
    """The query API did not give a complete answer; `reason` is what every target logs."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class TargetOutcome:
    """What one poll learned about one target: new samples, a failure, or no newer scrape."""

    target: Target
    page: PageReading | None = None
    error: str | None = None
    unchanged: bool = False


@dataclass(frozen=True)
class SourceResult:
    outcomes: tuple[TargetOutcome, ...]
    duration_seconds: float


@dataclass
class ScrapedTarget:
    """One scrape target's part of the answer."""

    target_labels: dict[str, str]
    up: float
    scrape_seconds: float | None = None
    sample_time_spread_seconds: float | None = None  # standard deviation of its series' sample times
    samples: list[tuple[str, dict[str, str], str]] = field(default_factory=list)


@dataclass
class ScrapeCadence:
    """One target's scrape times as the daemon saw them, and the interval they imply.

    The shortest recent spacing between distinct scrape times: a poll slower than the scrapes sees
    whole multiples of the interval, never less than one, so the estimate is never short (a short
    one would bring the blind phase back); a few spacings only, so a longer interval is learned.
    """

    last_seconds: float
    spacings_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=INTERVALS_REMEMBERED))

    def observe(self, scrape_seconds: float) -> None:
        if scrape_seconds > self.last_seconds:
            self.spacings_seconds.append(scrape_seconds - self.last_seconds)
            self.last_seconds = scrape_seconds

    @property
    def interval_seconds(self) -> float | None:
        return min(self.spacings_seconds) if self.spacings_seconds else None


def series_query(names: Iterable[str], selector: str) -> str:
    """The one instant query: every wanted sample and `up`, plus `up`'s sample timestamps and, per
    target, the standard deviation of its series' sample times (one series each: the answer barely grows).

    `or` keeps the tagged series because their extra label makes their label sets differ from the
    others'; sample names hold only [a-zA-Z0-9_:], nothing a regex or a label value would read specially.
    """
    every = sorted({"up", *names})
    matchers = f",{selector}" if selector else ""
    times = " or ".join(f'label_replace(timestamp({name}{{{selector}}}), "{SAMPLE_NAME_LABEL}", "{name}", "", "")'
                        for name in every)
    return (f'{{__name__=~"{"|".join(every)}"{matchers}}} or '
            f'label_replace(timestamp(up{{{selector}}}), "{SCRAPE_TIME_LABEL}", "1", "", "") or '
            f'label_replace(stddev by (cluster, job, instance) ({times}), "{SAMPLE_TIME_SPREAD_LABEL}", "1", "", "")')


def read_body(response: requests.Response, deadline: float, limit: int,
              monotonic: Callable[[], float] = time.monotonic) -> bytes:
    """The whole body, or QueryError past the deadline or the size limit: a read timeout is per
    recv, so a server trickling bytes would otherwise hold the poll forever."""
    chunks, size = [], 0
    for chunk in response.iter_content(CHUNK_BYTES):
        size += len(chunk)
        if size > limit:
            raise QueryError(f"answer over {limit} bytes "
                             "(raise targets.prometheus.max_response_bytes or narrow the selector)")
        if monotonic() > deadline:
            raise QueryError("answer not complete within the timeout")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_answer(status: int, body: bytes) -> list[dict[str, Any]]:
    """The result vector of a Prometheus API answer; QueryError for errors and partial answers."""
    try:
        payload = json.loads(body)
    except ValueError:
        raise QueryError(f"HTTP {status}: not a Prometheus API answer") from None
    if not isinstance(payload, dict):
        raise QueryError(f"HTTP {status}: not a Prometheus API answer")
    if payload.get("status") != "success":
        detail = f"{payload.get('errorType', 'error')}: {payload.get('error', '')}".strip(": ")
        raise QueryError(f"query failed (HTTP {status}): {detail}"[:300])
    warnings = payload.get("warnings") or []
    if warnings:
        # Thanos/Mimir say a store or querier did not answer: some targets' series may be missing.
        raise QueryError(f"partial response: {'; '.join(map(str, warnings))}"[:300])
    data = payload.get("data") or {}
    if data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise QueryError(f"unexpected answer: resultType {data.get('resultType')!r}")
    result: list[dict[str, Any]] = data["result"]
    return result


def group_by_target(result: list[dict[str, Any]]) -> dict[ScrapeKey, ScrapedTarget]:
    """The answer sorted by scrape target; series with no `up` of their own (not from a scrape
    this selector covers) are left out, since their target labels cannot be told apart."""
    ups: dict[ScrapeKey, ScrapedTarget] = {}
    times: dict[ScrapeKey, float] = {}
    spreads: dict[ScrapeKey, float] = {}
    series: dict[ScrapeKey, list[tuple[str, dict[str, str], str]]] = {}
    for item in result:
        labels = dict(item["metric"])
        value = item["value"][1]
        name = labels.pop("__name__", "")
        key = (labels.get("cluster", ""), labels.get("job", ""), labels.get("instance", ""))
        if SCRAPE_TIME_LABEL in labels:
            times[key] = float(value)
        elif SAMPLE_TIME_SPREAD_LABEL in labels:
            spreads[key] = float(value)
        elif name == "up":
            ups[key] = ScrapedTarget(labels, float(value))
        else:
            series.setdefault(key, []).append((name, labels, value))
    for key, scraped in ups.items():
        scraped.scrape_seconds = times.get(key)
        scraped.sample_time_spread_seconds = spreads.get(key)
        scraped.samples = series.get(key, [])
    return ups


def page_scan(scraped: ScrapedTarget) -> PageScan:
    """One target's series as the page reader's PageScan, less the labels Prometheus added."""
    scan = PageScan()
    added = scraped.target_labels.items()
    seen: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
    for name, labels, text in scraped.samples:
        own = {k: v for k, v in labels.items() if (k, v) not in added}
        value = parse_value(text)
        if value is None:
            scan.problems.append(f"{name}{own}: value {text!r} is not a number: skipped")
            continue
        key = (name, tuple(sorted(own.items())))
        entries = scan.samples.setdefault(name, [])
        if key in seen:
            # Two series equal but for a label Prometheus added (e.g. a replica label): keep one.
            scan.problems.append(f"duplicate series {name}{own} once Prometheus's labels are off: kept the last value")
            entries[seen[key]] = (own, value)
            continue
        seen[key] = len(entries)
        entries.append((own, value))
        scan.sample_lines += 1
    return scan


class PrometheusSource:
    """One deployment's targets and samples, read from the query API once per poll."""

    def __init__(self, deployment: Deployment, *, timeout_seconds: float, stale_after_seconds: float,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 session: requests.Session | None = None,
                 keep: Callable[[list[Target]], list[Target]] | None = None) -> None:
        if deployment.prometheus is None:
            raise ValueError(f"deployment {deployment.name!r} has no targets.prometheus")
        self.deployment = deployment
        self.spec: PrometheusTargets = deployment.prometheus
        # The daemon's `timeout` bounds the connect only: the query itself takes the deployment's
        # `query_timeout` (an answer for thousands of engines takes seconds to compute and send).
        self._connect_timeout_seconds = min(timeout_seconds, self.spec.query_timeout_seconds)
        self._timeout_seconds = self.spec.query_timeout_seconds
        self._stale_after_seconds = stale_after_seconds
        self._clock = clock
        self._monotonic = monotonic
        self._session = session or _session()
        self._keep = keep  # this shard's share of the targets (sharding), or all
        # The query API's URL as logs and labels show it (exporter/redaction.py: a `?token=` stays out).
        self._shown_url = redact(self.spec.url)
        if self.spec.tls.insecure_skip_verify:
            say_tls_verification_is_off(log, self._shown_url)
        self._query = series_query(wanted_names(deployment.kind), self.spec.selector)
        self._targets: dict[ScrapeKey, Target] = {}  # last answer's targets: what a failed query marks down
        self._read_at: dict[ScrapeKey, float] = {}  # scrape time of the last samples read, per target
        self._cadences: dict[ScrapeKey, ScrapeCadence] = {}  # every scrape time seen, read or not
        self._torn_since: dict[ScrapeKey, float] = {}  # when a target's series were first seen torn
        self._intervals_said: set[float] = set()  # scrape intervals already logged as outgrowing stale_after

    @property
    def query(self) -> str:
        return self._query

    def describe(self) -> dict[str, str]:
        """What the start-up log says about this deployment's mode."""
        return {"mode": "prometheus", "url": self._shown_url, "selector": self.spec.selector}

    def read(self) -> SourceResult:
        """Every target's outcome; never raises: a failed query is every target's failure."""
        started = self._monotonic()
        try:
            scraped = group_by_target(self._ask())
        except Exception as error:  # QueryError, connection errors, anything: targets go down
            reason = getattr(error, "reason", None)
            reason = reason if isinstance(reason, str) else _connection_reason(error)
            return SourceResult(self._all_down(redact(f"prometheus {reason}")), self._monotonic() - started)
        outcomes = self._outcomes(scraped)
        return SourceResult(tuple(outcomes), self._monotonic() - started)

    def close(self) -> None:
        self._session.close()

    # --- the query ---------------------------------------------------------------------------

    def _ask(self) -> list[dict[str, Any]]:
        headers = {"Accept": "application/json"}
        authorization = self.spec.auth.authorization()  # bearer or basic, read now (rotated files work)
        if authorization:
            headers["Authorization"] = authorization
        if self.spec.tenant:
            headers["X-Scope-OrgID"] = self.spec.tenant
        deadline = self._monotonic() + self._timeout_seconds
        # POST: a long selector stays out of URL length limits; partial_response=false asks Thanos
        # for an error rather than a silently partial answer (Prometheus and Mimir ignore it).
        with self._session.post(f"{self.spec.url}/api/v1/query",
                                data={"query": self._query, "partial_response": "false"},
                                headers=headers, timeout=(self._connect_timeout_seconds, self._timeout_seconds),
                                verify=self.spec.tls.verify, cert=self.spec.tls.client_cert,
                                stream=True) as response:
            body = read_body(response, deadline, self.spec.max_response_bytes, self._monotonic)
            return decode_answer(response.status_code, body)

    # --- from the answer to outcomes ---------------------------------------------------------

    def _outcomes(self, scraped: Mapping[ScrapeKey, ScrapedTarget]) -> list[TargetOutcome]:
        targets = self._name_targets(scraped)
        mine = {target.key for target in (self._keep(list(targets.values())) if self._keep else targets.values())}
        self._targets = {key: target for key, target in targets.items() if target.key in mine}
        for memory in (self._read_at, self._cadences, self._torn_since):
            for key in [key for key in memory if key not in self._targets]:
                del memory[key]
        return [self._outcome(key, target, scraped[key]) for key, target in self._targets.items()]

    def _name_targets(self, scraped: Mapping[ScrapeKey, ScrapedTarget]) -> dict[ScrapeKey, Target]:
        """`instance` is the `target` label; where two jobs scrape one instance, the job is added; where two
        clusters hold one instance (a global querier), the cluster is put first."""
        # Counts per poll, not a scan per target.
        jobs_per_instance = Counter((cluster, instance) for cluster, _, instance in scraped)
        clusters_per_instance = Counter(instance for _, instance in {(c, i) for c, _, i in scraped})
        targets = {}
        for (cluster, job, instance), entry in sorted(scraped.items()):
            label = instance if jobs_per_instance[(cluster, instance)] == 1 else f"{instance}/{job}"
            label = label if clusters_per_instance[instance] == 1 else f"{cluster}/{label}"
            where = f"cluster={cluster}," if cluster else ""
            url = f"{self._shown_url}/api/v1/query#{where}job={job},instance={instance}"
            targets[(cluster, job, instance)] = Target(self.deployment.name, url, redact(label),
                                              namespace=entry.target_labels.get("namespace"),
                                              pod=entry.target_labels.get("pod"))
        return targets

    def _outcome(self, key: ScrapeKey, target: Target, scraped: ScrapedTarget) -> TargetOutcome:
        at = scraped.scrape_seconds
        interval = self._observe(key, target, at)
        if scraped.up != 1:
            self._read_at.pop(key, None)
            return TargetOutcome(target, error=f"Prometheus cannot scrape it (up {scraped.up:g})")
        allowed = self._max_scrape_age_seconds(interval)
        if at is not None and self._clock() - at > allowed:
            self._read_at.pop(key, None)
            cadence = f"it scrapes it every {interval:g}s; " if interval is not None else ""
            return TargetOutcome(target, error=f"Prometheus's last scrape of it is {self._clock() - at:.0f}s old "
                                               f"({cadence}{allowed:g}s allowed)")
        torn = self._torn(key, target, scraped.sample_time_spread_seconds, len(scraped.samples) + 1, allowed)
        if torn is not None:
            return torn
        if at is not None and self._read_at.get(key) == at:
            return TargetOutcome(target, unchanged=True)
        try:
            page = reading_from_scan(page_scan(scraped), self.deployment.kind)
        except PageError as error:
            self._read_at.pop(key, None)
            return TargetOutcome(target, error=str(error))
        except Exception as error:  # a reader bug fails this target, never the poll
            self._read_at.pop(key, None)
            return TargetOutcome(target, error=f"unreadable series: {type(error).__name__}: {error}"[:300])
        if at is not None:
            self._read_at[key] = at
        return TargetOutcome(target, page=page)

    def _observe(self, key: ScrapeKey, target: Target, scrape_seconds: float | None) -> float | None:
        """Record the scrape time; the target's scrape interval as seen so far (None: not yet known)."""
        if scrape_seconds is None:
            return None
        cadence = self._cadences.setdefault(key, ScrapeCadence(scrape_seconds))
        before = cadence.interval_seconds
        cadence.observe(scrape_seconds)
        interval = cadence.interval_seconds
        if (interval is not None and interval != before and interval not in self._intervals_said
                and self._max_scrape_age_seconds(interval) > self._stale_after_seconds):
            # Once per deployment and interval, not per target: 2,000 engines share one scrape config.
            self._intervals_said.add(interval)
            log.info("staleness_follows_scrape_interval", deployment=self.deployment.name, target=target.target,
                     scrape_interval_seconds=interval, max_scrape_age_seconds=self._max_scrape_age_seconds(interval),
                     stale_after_seconds=self._stale_after_seconds)
        return interval

    def _max_scrape_age_seconds(self, interval_seconds: float | None) -> float:
        if interval_seconds is None:
            return self._stale_after_seconds
        return max(self._stale_after_seconds, SCRAPE_INTERVALS_ALLOWED * interval_seconds)

    def _torn(self, key: ScrapeKey, target: Target, spread_seconds: float | None, series: int,
              allowed_seconds: float) -> TargetOutcome | None:
        """None when the target's series (`series` of them, `up` included: what the deviation is over)
        are from one scrape; else the outcome that skips them: the last window kept while there is one
        and the tear is younger than `allowed_seconds`."""
        if spread_seconds is None or torn_gap_seconds(spread_seconds, series) <= SAMPLE_TIME_TOLERANCE_SECONDS:
            if self._torn_since.pop(key, None) is not None:
                log.info("scrape_consistent", deployment=self.deployment.name, target=target.target)
            return None
        now = self._clock()
        since = self._torn_since.setdefault(key, now)
        reason = (f"its series carry different sample times (standard deviation {spread_seconds:.3g}s): "
                  "parts of two scrapes (a remote-write backend still ingesting one?)")
        if since == now:
            log.warning("scrape_torn", deployment=self.deployment.name, target=target.target, reason=reason,
                        action="kept the last window" if key in self._read_at else "not read")
        if key not in self._read_at:
            return TargetOutcome(target, error=reason)
        if now - since > allowed_seconds:
            self._read_at.pop(key, None)
            return TargetOutcome(target, error=f"{reason}, for {now - since:.0f}s")
        return TargetOutcome(target, unchanged=True)

    def _all_down(self, reason: str) -> tuple[TargetOutcome, ...]:
        """Every known target down; before any answer, one target named after Prometheus itself,
        so that a deployment whose Prometheus never answered still shows `target_up 0`."""
        self._read_at.clear()
        if self._targets:
            return tuple(TargetOutcome(target, error=reason) for target in self._targets.values())
        label = urlsplit(self._shown_url).netloc or self._shown_url
        return (TargetOutcome(Target(self.deployment.name, self._shown_url, label), error=reason),)


def torn_gap_seconds(stddev_seconds: float, series: int) -> float:
    """How far apart two scrapes' sample times are, at least, for `series` sample times to show this
    (population) standard deviation: m of them Δ seconds from the rest give Δ·sqrt(m(N - m))/N, least
    at m = 1, so Δ is at least stddev·N/sqrt(N - 1). The deviation itself shrinks as 1/sqrt(N) for one
    straggler: 0.086 s for one series of 545 two seconds behind, under a tolerance a 15 s tear of half
    of them passes by far. Remote write sends a scrape's series over parallel shards, one batch each,
    so one series arriving before or after the rest is the common tear, not the rare one."""
    if series < 2:
        return stddev_seconds
    return stddev_seconds * series / math.sqrt(series - 1)


def _session() -> requests.Session:
    session = requests.Session()
    session.trust_env = False  # no proxy or netrc from the environment: the config says where Prometheus is
    return session


def _connection_reason(error: BaseException) -> str:
    text = str(error)
    for marker in ("Connection refused", "Read timed out", "Connect timeout", "Name or service not known",
                   "certificate verify failed", "Connection reset"):
        if marker in text:
            return f"unreachable: {marker}"
    return f"unreachable: {type(error).__name__}: {text}"[:300]

