"""The in-process alert loop: the alert rules of exporter/serve/rules/stepbudget.alerts.yaml (shipped in
the package), evaluated after every poll, posted to Alertmanager (API v2) when
`alerting.alertmanager_urls` is set.

Why in process as well as in Prometheus: a site without a rule pipeline still gets the page, and a
site with both gets ONE alert, because the labels here are exactly the labels the rules produce
(`alertname`, `severity`, and the series labels deployment, target, model_name, engine, plus
namespace and pod when discovered; the rules aggregate away job and instance), so Alertmanager
deduplicates them. Names, `for` durations, labels and annotations are read from the rules file
(exporter/serve/alert_rules.py), so they cannot drift from what Prometheus raises; only the conditions
and their thresholds are Python (CONDITIONS below), tested against promtool's verdicts.

Protocol (as Prometheus's notifier does): pending -> firing once the condition has held for `for`;
a firing alert is posted at once and then re-posted at most every RESEND_SECONDS with
endsAt = now + 4 x max(poll interval, RESEND_SECONDS), so Alertmanager resolves it by itself if the
daemon dies; a cleared alert is posted with endsAt = now and re-posted for RESOLVED_RETENTION_SECONDS.

The page holds on the last reading (docs/runbook.md#stepbudgetpredictedstepoverbudget): a target that
stops answering, or leaves discovery, while over budget has not come back under budget, so the page
stays firing, with the same labels and the last reading's value, until the target reads under budget
again. While the target is still polled and down that lasts as long as it is down; a series the
readings no longer carry (dropped by discovery, or an answering page without the figures) is held
PAGE_HOLD_SECONDS after its last reading and then forgotten, so a pod scaled down while over budget
does not page forever. A target whose engine is put to sleep (Reading.engine_sleeping) is not held at
all: it serves nothing, so the page resolves at its first sleeping reading. The rule expression does the
same with last_over_time, a recorded memory and `unless` the last stepbudget_engine_sleeping says asleep.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import requests
import structlog

from exporter.errors import InputError
from exporter.logs import say_tls_verification_is_off
from exporter.redaction import redact
from exporter.serve.alert_rules import (
    PACKAGED_RUNBOOK_BASE,
    TUNABLE_THRESHOLDS,
    AlertRule,
    AlertSettings,
    load_alert_rules,
)
from exporter.serve.config import DRIFT_ALERT, PAGE_ALERT, Alerting, Auth, Tls
from exporter.serve.discovery import NotReadyPod
from exporter.serve.reading import Reading

if TYPE_CHECKING:
    from exporter.serve.poller import PollResult

log = structlog.get_logger("stepbudget.alerting")

RESEND_SECONDS = 60.0
RESOLVED_RETENTION_SECONDS = 15 * 60.0
PREEMPTION_WINDOW_SECONDS = 5 * 60.0
# The packaged thresholds a site may set (alerting.rules.<alert>.threshold), one table for the rules and the loop.
DRIFT_THRESHOLD_RATIO = TUNABLE_THRESHOLDS[DRIFT_ALERT]
KV_CACHE_NEARLY_FULL_RATIO = TUNABLE_THRESHOLDS["StepBudgetKVCacheNearlyFull"]
# Prefill interference needs prefill: a window whose steps computed no prompt token (a decode-only pod of a
# P/D split, whose prompts arrive by KV transfer) cannot be slowed by prompt chunks, whatever else is slow.
PREFILL_INTERFERENCE_MIN_PREFILL_TOKENS_PER_STEP = 0.0
# A prefill server computing prompts above this share of its compute's rate queues them: TTFT grows.
PREFILL_OVER_CAPACITY_RATIO = TUNABLE_THRESHOLDS["StepBudgetPrefillOverCapacity"]
# How long the page holds for a series with no reading of its predicted step (gone from discovery):
# the `[30m]` of the page rule's last_over_time. Long enough to cover an overloaded pod that fails
# readiness until its load drains; short enough that a pod replaced or scaled down while over budget
# stops paging within the half hour.
PAGE_HOLD_SECONDS = 30 * 60.0
# A window in which nothing decoded has no measured step and no prediction error: the measured-step and
# drift alerts read the last within this long (the rules' last_over_time(...[2m])), so the lulls of a bursty
# load do not restart their `for`; this long with nothing decoded ends them.
IDLE_BRIDGE_SECONDS = 2 * 60.0

Condition = Callable[[Reading, "History"], "float | None"]
SeriesKey = tuple[tuple[str, str], ...]  # a series' labels, sorted: one alert per (alertname, series)


@dataclass(frozen=True)
class LastOverBudget:
    """The page's memory of one series: its last reading said over budget, with this predicted step."""

    predicted_step_seconds: float
    read_at_seconds: float

    def within_hold(self, now: float) -> bool:
        return now - self.read_at_seconds <= PAGE_HOLD_SECONDS


@dataclass(frozen=True)
class Sample:
    value: float
    at_seconds: float


def _latest(last: Sample | None, value: float | None, now: float) -> Sample | None:
    return Sample(value, now) if value is not None else last


@dataclass
class History:
    """What a rule needs beyond one reading: the recent preemption counter values (for increase()),
    whether the last reading of the predicted step was over budget (the page's memory), and the last
    measured step and prediction error (bridging idle windows, IDLE_BRIDGE_SECONDS)."""

    preemptions: deque[tuple[float, float]] = field(default_factory=deque)
    over_budget: LastOverBudget | None = None
    measured: Sample | None = None
    error: Sample | None = None
    now: float = 0.0

    def measured_step_seconds(self) -> float | None:
        return self._bridged(self.measured)

    def prediction_error_ratio(self) -> float | None:
        return self._bridged(self.error)

    def _bridged(self, sample: Sample | None) -> float | None:
        return sample.value if sample is not None and self.now - sample.at_seconds <= IDLE_BRIDGE_SECONDS else None

    def remember(self, reading: Reading, now: float) -> None:
        """Update the page's memory as the page rule does: a sleeping engine releases it at once (it
        serves nothing, so it slows nobody); a reading with both figures decides; one without keeps the
        memory while the target is down, or within the hold; else it is released."""
        self.now = now
        self.measured = _latest(self.measured, reading.measured_step_seconds, now)
        self.error = _latest(self.error, reading.prediction_error_ratio, now)
        predicted, budget = reading.predicted_step_seconds, reading.step_budget_seconds
        if reading.engine_sleeping == 1.0:
            self.over_budget = None
        elif predicted is not None and budget is not None:
            self.over_budget = LastOverBudget(predicted, now) if predicted > budget else None
        elif reading.target_up:
            self.forget_after_hold(now)

    def forget_after_hold(self, now: float) -> None:
        if self.over_budget is not None and not self.over_budget.within_hold(now):
            self.over_budget = None

    def preemption_increase(self) -> float | None:
        """increase() over the window: the sum of rises, a drop counted as a reset (as PromQL does)."""
        if len(self.preemptions) < 2:
            return None
        values = [value for _, value in self.preemptions]
        return sum(b - a if b >= a else b for a, b in itertools.pairwise(values))


def _over(value: float | None, limit: float | None) -> float | None:
    return value if value is not None and limit is not None and value > limit else None


def _page_held(reading: Reading, history: History) -> float | None:
    """Predicted over budget by the last reading (History.remember), live or held."""
    return history.over_budget.predicted_step_seconds if history.over_budget is not None else None


def _measured_over(reading: Reading, history: History) -> float | None:
    """Measured over budget, an idle window bridged (IDLE_BRIDGE_SECONDS). A series without a step budget (a
    prefill-only server has no decode step) compares to nothing, as an absent series in PromQL: neither this
    nor the page can fire for it."""
    return _over(history.measured_step_seconds(), reading.step_budget_seconds)


def _drift(reading: Reading, history: History, threshold: float = DRIFT_THRESHOLD_RATIO) -> float | None:
    error = history.prediction_error_ratio()
    return _over(abs(error), threshold) if error is not None else None


def _prefill_interference(reading: Reading, history: History) -> float | None:
    measured = _over(reading.measured_step_seconds, reading.step_budget_seconds)
    memory, budget = reading.predicted_memory_step_seconds, reading.step_budget_seconds
    if measured is None or memory is None or budget is None or memory > budget:
        return None
    if _over(reading.prefill_tokens_per_step, PREFILL_INTERFERENCE_MIN_PREFILL_TOKENS_PER_STEP) is None:
        return None
    return measured


def _prefill_over_capacity(reading: Reading, history: History,
                           threshold: float = PREFILL_OVER_CAPACITY_RATIO) -> float | None:
    return _over(reading.prefill_utilization_ratio, threshold)


def _kv_nearly_full(reading: Reading, history: History, threshold: float = KV_CACHE_NEARLY_FULL_RATIO) -> float | None:
    """Full while it harms: requests wait for its capacity, or running ones were preempted in the window.
    Full alone is how vLLM runs under load (it admits until the cache is full)."""
    usage = _over(reading.kv_cache_usage_ratio, threshold)
    if usage is None:
        return None
    harmed = _over(reading.requests_waiting_for_capacity, 0.0) is not None or _preempting(reading, history) is not None
    return usage if harmed else None


def _preempting(reading: Reading, history: History) -> float | None:
    return _over(history.preemption_increase(), 0.0)


def _down(reading: Reading, history: History) -> float | None:
    return 0.0 if not reading.target_up else None


# Which condition raises which alert of the rules file. StepBudgetExporterAbsent is Prometheus-only
# (an absent daemon cannot report its own absence); any other alert of the file without a condition
# here, or a condition without an alert there, fails loading.
CONDITIONS: dict[str, Condition] = {
    PAGE_ALERT: _page_held,
    "StepBudgetMeasuredStepOverBudget": _measured_over,
    "StepBudgetPredictionDrift": _drift,
    "StepBudgetPrefillInterference": _prefill_interference,
    "StepBudgetPrefillOverCapacity": _prefill_over_capacity,
    "StepBudgetKVCacheNearlyFull": _kv_nearly_full,
    "StepBudgetPreemptions": _preempting,
    "StepBudgetTargetDown": _down,
}
# Alerts only Prometheus raises: an absent daemon cannot report its own absence, and the speed objective's
# burn rates need hours to days of the daemon's counters, which only Prometheus keeps.
PROMETHEUS_ONLY = frozenset({"StepBudgetExporterAbsent", "StepBudgetSpeedBudgetBurn", "StepBudgetSpeedBudgetSlowBurn"})
# Per deployment, from the poll's target counts (PollResult.deployment_targets), labelled `deployment`
# only, as `sum without (instance, job)` leaves the rule's series. The value is the count.
DeploymentCondition = Callable[[int, bool], "float | None"]  # (targets found, scales to zero on purpose)


def _no_targets(count: int, scales_to_zero: bool) -> float | None:
    return 0.0 if count == 0 and not scales_to_zero else None


DEPLOYMENT_CONDITIONS: dict[str, DeploymentCondition] = {"StepBudgetNoTargets": _no_targets}
# Per Kubernetes pod not Ready (PollResult.not_ready: not polled, so it has no reading), labelled
# deployment, namespace and pod, as the rule's `time() - since > on (deployment) allowance` leaves them.
# The value is how long the pod has not been Ready (now - since).
PodCondition = Callable[[NotReadyPod, float], "float | None"]


def _not_ready_too_long(pod: NotReadyPod, now: float) -> float | None:
    waited = pod.not_ready_seconds(now)
    return waited if waited > pod.startup_allowance_seconds else None


POD_CONDITIONS: dict[str, PodCondition] = {"StepBudgetTargetNotReady": _not_ready_too_long}


def load_rules(path: Path | None = None, settings: Mapping[str, AlertSettings] | None = None
               ) -> tuple[AlertRule, ...]:
    """The alerts the loop raises, read from the rules file (the packaged one when `path` is None) as a
    site's `settings` (alerting.rules) set them: a changed `for`, severity or annotation in the file
    changes the loop with no Python edit."""
    rules = load_alert_rules(path, skip=PROMETHEUS_ONLY, settings=settings)
    disabled = {name for name, alert in (settings or {}).items() if not alert.enabled}
    names = {rule.name for rule in rules} | (disabled - PROMETHEUS_ONLY)
    known = set(CONDITIONS) | set(DEPLOYMENT_CONDITIONS) | set(POD_CONDITIONS)
    if names != known:
        raise InputError(f"{path or 'the packaged rules file'}: alerts without a condition in "
                         f"exporter/serve/alerting.py: {sorted(names - known) or 'none'}; "
                         f"conditions without an alert in the file: {sorted(known - names) or 'none'}")
    return rules


def tuned_conditions(settings: Mapping[str, AlertSettings]) -> dict[str, Condition]:
    """CONDITIONS with each tunable alert's threshold as `settings` set it (alert_rules.TUNABLE_THRESHOLDS)."""
    tuned = dict(CONDITIONS)
    for name, alert in settings.items():
        if alert.threshold is not None and name in CONDITIONS:
            tuned[name] = functools.partial(CONDITIONS[name], threshold=alert.threshold)  # type: ignore[call-arg]  # the tunable conditions take threshold=; Condition's type has two arguments
    return tuned


@functools.cache
def packaged_rules() -> tuple[AlertRule, ...]:
    """The shipped rules, read once per process (every AlertLoop of a test run shares them)."""
    return load_rules()


# --- the loop ------------------------------------------------------------------------------------


@dataclass
class _Alert:
    rule: AlertRule
    labels: dict[str, str]
    active_since: float
    value: float
    fired_at: float | None = None
    resolved_at: float | None = None
    last_sent: float | None = None


Post = Callable[[str, list[dict[str, object]], float], None]


class AlertmanagerPoster:
    """POSTs alerts to Alertmanager's API v2 (`/api/v2/alerts`) with `alerting.auth` (a bearer token or
    basic auth, read at each post so a rotated Secret works) and `alerting.tls` (CA, client certificate)."""

    def __init__(self, auth: Auth, tls: Tls) -> None:
        self._auth, self._tls = auth, tls
        if tls.insecure_skip_verify:
            say_tls_verification_is_off(log, "alertmanager")

    def __call__(self, url: str, alerts: list[dict[str, object]], timeout_seconds: float) -> None:
        headers = {}
        authorization = self._auth.authorization()
        if authorization:
            headers["Authorization"] = authorization
        response = requests.post(f"{url.rstrip('/')}/api/v2/alerts", json=alerts, timeout=timeout_seconds,
                                 headers=headers, verify=self._tls.verify, cert=self._tls.client_cert)
        if response.status_code >= 300:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")


def post_alerts(url: str, alerts: list[dict[str, object]], timeout_seconds: float) -> None:
    """One POST with no credentials and the system's CAs."""
    AlertmanagerPoster(Auth(), Tls())(url, alerts, timeout_seconds)


def _described(alert: _Alert, external_labels: Mapping[str, str] = MappingProxyType({}),
               runbook_base_url: str | None = None) -> dict[str, object]:
    """An alert's labels and annotations, as both Alertmanager's API and `GET /api/v1/alerts` carry them;
    no credential in any of them (the readings' labels are redacted already: this is the backstop).

    `external_labels` go under the alert's own, as Prometheus adds its external labels to the alerts it
    sends (only where the alert has no label of that name): the daemon's alert and Prometheus's must
    carry the same set for Alertmanager to show one. `runbook_base_url` replaces the packaged rules'
    runbook base in every annotation, as the chart does to the rules Prometheus loads."""
    annotations = {key: template.render(alert.labels, alert.value) for key, template in alert.rule.annotations.items()}
    if runbook_base_url:
        annotations = {key: text.replace(PACKAGED_RUNBOOK_BASE, runbook_base_url) for key, text in annotations.items()}
    return {
        "labels": {key: redact(value) for key, value in
                   {**external_labels, "alertname": alert.rule.name, **alert.rule.labels, **alert.labels}.items()},
        "annotations": {key: redact(text) for key, text in annotations.items()},
    }


def _with_page_for(rules: Iterable[AlertRule], for_seconds: float | None,
                   drift_for_seconds: float | None = None) -> tuple[AlertRule, ...]:
    """Config `alerting.for` overrides the page's `for` (docs/operations.md): a site can page sooner or
    later without forking the rules file; `alerting.drift_for` the drift alert's, which every online
    calibration's holdout outlasts (config._check_holdouts)."""
    wanted = {name: seconds for name, seconds in ((PAGE_ALERT, for_seconds), (DRIFT_ALERT, drift_for_seconds))
              if seconds is not None}
    return tuple(replace(rule, for_seconds=wanted[rule.name]) if rule.name in wanted else rule for rule in rules)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class AlertLoop:
    """Evaluates the rules over each poll's readings; `evaluate` is driven by the poller (or a test).

    `rules` defaults to the packaged rules file; tests pass rules loaded from a modified copy."""

    def __init__(self, config: Alerting, *, poll_interval_seconds: float, generator_url: str = "",
                 clock: Callable[[], float] = time.time, post: Post | None = None,
                 rules: Sequence[AlertRule] | None = None, deployment_alerts: bool = True,
                 scales_to_zero: Collection[str] = ()) -> None:
        self._urls = config.alertmanager_urls
        self._timeout = config.timeout_seconds
        self._generator_url = redact(config.generator_url or generator_url)
        self._external_labels, self._runbook_base_url = config.external_labels, config.runbook_base_url
        self._clock = clock
        self._post = post or AlertmanagerPoster(config.auth, config.tls)
        self._valid_for_seconds = 4 * max(poll_interval_seconds, RESEND_SECONDS)
        if rules is None:
            rules = load_rules(settings=config.rules) if config.rules else packaged_rules()
        self.rules = _with_page_for(rules, config.for_seconds, config.drift_for_seconds)
        self._conditions = tuned_conditions(config.rules)
        self._page = next((rule for rule in self.rules if rule.name == PAGE_ALERT), None)  # None: disabled
        self._reading_rules = tuple(rule for rule in self.rules if rule.name in CONDITIONS)
        # A sharded daemon's counts are its share's (build_daemon): only Prometheus sums them.
        self._deployment_rules = tuple(rule for rule in self.rules
                                       if rule.name in DEPLOYMENT_CONDITIONS and deployment_alerts)
        self._pod_rules = tuple(rule for rule in self.rules if rule.name in POD_CONDITIONS)
        self._scales_to_zero = frozenset(scales_to_zero)  # deployments that run no server on purpose at times
        self._alerts: dict[tuple[str, SeriesKey], _Alert] = {}
        self._history: dict[SeriesKey, History] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self._urls)

    def on_poll(self, result: PollResult) -> None:
        """Poller listener."""
        self.evaluate(result.readings, self._clock(), result.deployment_targets, result.not_ready)

    def evaluate(self, readings: Sequence[Reading], now: float,
                 deployment_targets: Sequence[tuple[str, int]] = (),
                 not_ready: Sequence[NotReadyPod] = ()) -> list[dict[str, object]]:
        """Advance every alert's state to `now`; post what is due; return what was posted."""
        # Each reading's labels and series key once per poll, for the history and for every rule.
        labelled = [(reading, labels := reading.labels, tuple(sorted(labels.items()))) for reading in readings]
        with self._lock:
            held = self._record(labelled, now)
            active: set[tuple[str, SeriesKey]] = set()
            for reading, labels, series in labelled:
                history = self._history[series]
                for rule in self._reading_rules:
                    value = self._conditions[rule.name](reading, history)
                    if value is not None:
                        active.add(self._hold(rule, labels, series, value, now))
            for name, count in deployment_targets:
                for rule in self._deployment_rules:
                    value = DEPLOYMENT_CONDITIONS[rule.name](count, name in self._scales_to_zero)
                    if value is not None:
                        labels = {"deployment": name}
                        active.add(self._hold(rule, labels, tuple(labels.items()), value, now))
            for pod in not_ready:
                for rule in self._pod_rules:
                    value = POD_CONDITIONS[rule.name](pod, now)
                    if value is not None:
                        labels = pod.labels
                        active.add(self._hold(rule, labels, tuple(sorted(labels.items())), value, now))
            for series, value in held:  # gone from the readings, over budget at their last one
                if self._page is not None:
                    active.add(self._hold(self._page, dict(series), series, value, now))
            for key, alert in list(self._alerts.items()):
                if key in active or alert.resolved_at is not None:
                    continue
                if alert.fired_at is None:
                    del self._alerts[key]  # pending that cleared: nothing was ever sent
                else:
                    alert.resolved_at = now
                    log.info("alert_resolved", alertname=alert.rule.name, **alert.labels)
            due = self._due(now)
        if due and self._urls:
            self._send(due)
        return due

    def _hold(self, rule: AlertRule, labels: dict[str, str], series: SeriesKey, value: float,
              now: float) -> tuple[str, SeriesKey]:
        """Keep (or start) the rule's alert for the series as active now; fire it once it has held for `for`."""
        key = (rule.name, series)
        alert = self._alerts.get(key)
        if alert is None or alert.resolved_at is not None:
            alert = self._alerts[key] = _Alert(rule, labels, active_since=now, value=value)
        alert.value = value
        if alert.fired_at is None and now - alert.active_since >= rule.for_seconds:
            alert.fired_at = now
            log.warning("alert_firing", alertname=rule.name, severity=rule.severity, value=value, **labels)
        return key

    def _record(self, labelled: Iterable[tuple[Reading, dict[str, str], SeriesKey]],
                now: float) -> list[tuple[SeriesKey, float]]:
        """Update every series' history; return the series missing from the readings whose page is still
        held (with the last reading's value). The others' histories are dropped."""
        seen = set()
        for reading, _, series in labelled:
            seen.add(series)
            history = self._history.setdefault(series, History())
            history.remember(reading, now)
            if reading.preemptions_total is not None:
                history.preemptions.append((now, reading.preemptions_total))
            while history.preemptions and history.preemptions[0][0] < now - PREEMPTION_WINDOW_SECONDS:
                history.preemptions.popleft()
        held = []
        for series in [s for s in self._history if s not in seen]:
            history = self._history[series]
            history.forget_after_hold(now)
            if history.over_budget is None:
                del self._history[series]
            else:
                held.append((series, history.over_budget.predicted_step_seconds))
        return held

    def _due(self, now: float) -> list[dict[str, object]]:
        due = []
        for key, alert in list(self._alerts.items()):
            if alert.fired_at is None:
                continue
            if alert.resolved_at is not None and now - alert.resolved_at > RESOLVED_RETENTION_SECONDS:
                del self._alerts[key]
                continue
            newly = alert.last_sent is None or (alert.resolved_at == now)
            if not newly and now - (alert.last_sent or 0.0) < RESEND_SECONDS:
                continue
            alert.last_sent = now
            due.append(self._payload(alert, now))
        return due

    def _payload(self, alert: _Alert, now: float) -> dict[str, object]:
        ends_at = alert.resolved_at if alert.resolved_at is not None else now + self._valid_for_seconds
        payload: dict[str, object] = {
            **_described(alert, self._external_labels, self._runbook_base_url),
            "startsAt": _iso(alert.fired_at or now),
            "endsAt": _iso(ends_at),
        }
        if self._generator_url:
            payload["generatorURL"] = self._generator_url
        return payload

    def _send(self, alerts: list[dict[str, object]]) -> None:
        for url in self._urls:
            try:
                self._post(url, alerts, self._timeout)
            except Exception as error:  # Alertmanager down is logged, never fatal
                log.warning("alertmanager_post_failed", url=redact(url), alerts=len(alerts),
                            reason=redact(f"{type(error).__name__}: {str(error)[:200]}"))

    def sizes(self) -> tuple[int, int]:
        """(series remembered, alerts tracked). Series: those of the last poll's readings, plus those gone
        from the readings while over budget, each for PAGE_HOLD_SECONDS at most; each keeps the preemption
        counter's values of the last PREEMPTION_WINDOW_SECONDS. Alerts: one per rule and series whose
        condition holds (pending or firing), plus the resolved ones, each for RESOLVED_RETENTION_SECONDS."""
        with self._lock:
            return len(self._history), len(self._alerts)

    def active(self) -> list[dict[str, object]]:
        """Every alert whose condition holds now, pending or firing, shaped like the `alerts` of
        Prometheus's `GET /api/v1/alerts` so the same tools and habits read it."""
        with self._lock:
            return [
                {
                    **_described(alert, runbook_base_url=self._runbook_base_url),
                    "state": "pending" if alert.fired_at is None else "firing",
                    "activeAt": _iso(alert.active_since),
                    "value": repr(alert.value),
                }
                for alert in self._alerts.values() if alert.resolved_at is None
            ]

    def firing(self) -> list[dict[str, str]]:
        """Labels of the alerts firing now (for the landing page and tests)."""
        with self._lock:
            return [{"alertname": a.rule.name, **a.labels} for a in self._alerts.values()
                    if a.fired_at is not None and a.resolved_at is None]
