"""The in-process alert loop: the alert rules of rules/stepbudget.alerts.yaml, evaluated after every
poll, posted to Alertmanager (API v2) when `alerting.alertmanager_urls` is set.

Why in process as well as in Prometheus: a site without a rule pipeline still gets the page, and a
site with both gets ONE alert, because the labels here are exactly the labels the rules produce
(`alertname`, `severity`, and the series labels deployment, target, model_name, engine, plus
namespace and pod when discovered; the rules aggregate away job and instance), so Alertmanager
deduplicates them. RULES below is the one table of conditions, thresholds, `for` durations,
severities and annotations; tests/test_alerting.py checks it against the rules file.

Protocol (as Prometheus's notifier does): pending -> firing once the condition has held for `for`;
a firing alert is posted at once and then re-posted at most every RESEND_SECONDS with
endsAt = now + 4 x max(poll interval, RESEND_SECONDS), so Alertmanager resolves it by itself if the
daemon dies; a cleared alert is posted with endsAt = now and re-posted for RESOLVED_RETENTION_SECONDS.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterable, Sequence

import requests
import structlog

from exporter.config import Alerting
from exporter.reading import Reading

log = structlog.get_logger("stepbudget.alerting")

RESEND_SECONDS = 60.0
RESOLVED_RETENTION_SECONDS = 15 * 60.0
PREEMPTION_WINDOW_SECONDS = 5 * 60.0
DRIFT_THRESHOLD_RATIO = 0.15
KV_CACHE_NEARLY_FULL_RATIO = 0.95
PAGE_ALERT = "StepBudgetPredictedStepOverBudget"
RUNBOOK = "https://github.com/stepbudget/stepbudget/blob/main/docs/runbook.md#"

Condition = Callable[[Reading, "History"], "float | None"]


@dataclass
class History:
    """What a rule needs beyond one reading: the recent preemption counter values (for increase())."""

    preemptions: deque[tuple[float, float]] = field(default_factory=deque)

    def preemption_increase(self) -> float | None:
        """increase() over the window: the sum of rises, a drop counted as a reset (as PromQL does)."""
        if len(self.preemptions) < 2:
            return None
        values = [value for _, value in self.preemptions]
        return sum(b - a if b >= a else b for a, b in zip(values, values[1:]))


def _over(value: float | None, limit: float | None) -> float | None:
    return value if value is not None and limit is not None and value > limit else None


def _predicted_over(reading: Reading, history: History) -> float | None:
    return _over(reading.predicted_step_seconds, reading.step_budget_seconds)


def _measured_over(reading: Reading, history: History) -> float | None:
    return _over(reading.measured_step_seconds, reading.step_budget_seconds)


def _drift(reading: Reading, history: History) -> float | None:
    error = reading.prediction_error_ratio
    return _over(abs(error), DRIFT_THRESHOLD_RATIO) if error is not None else None


def _prefill_interference(reading: Reading, history: History) -> float | None:
    measured = _measured_over(reading, history)
    memory, budget = reading.predicted_memory_step_seconds, reading.step_budget_seconds
    if measured is None or memory is None or budget is None or memory > budget:
        return None
    return measured


def _kv_nearly_full(reading: Reading, history: History) -> float | None:
    return _over(reading.kv_cache_usage_ratio, KV_CACHE_NEARLY_FULL_RATIO)


def _preempting(reading: Reading, history: History) -> float | None:
    return _over(history.preemption_increase(), 0.0)


def _down(reading: Reading, history: History) -> float | None:
    return 0.0 if not reading.target_up else None


@dataclass(frozen=True)
class AlertRule:
    name: str
    severity: str
    for_seconds: float
    condition: Condition
    summary: str
    description: str  # a Prometheus template: {{ $labels.x }}, {{ $value | humanize... }}
    runbook_url: str


_WHERE = ("{{ $labels.target }} (deployment {{ $labels.deployment }}, "
          "model {{ $labels.model_name }}, {{ $labels.engine }})")

# The rules, as in rules/stepbudget.alerts.yaml (StepBudgetExporterAbsent is Prometheus-only: an
# absent daemon cannot report its own absence).
RULES: tuple[AlertRule, ...] = (
    AlertRule(PAGE_ALERT, "critical", 300.0, _predicted_over,
              "The predicted decode step is over the speed budget, so every stream on this server is slower than its target.",
              f"The predicted step time of {_WHERE} has been {{{{ $value | humanizeDuration }}}}, over its step budget, "
              "for 5 minutes: the tokens in flight exceed the token budget.",
              RUNBOOK + "stepbudgetpredictedstepoverbudget"),
    AlertRule("StepBudgetMeasuredStepOverBudget", "warning", 300.0, _measured_over,
              "The measured decode step (mean inter-token latency) is over the speed budget.",
              f"The measured mean step time of {_WHERE} has been {{{{ $value | humanizeDuration }}}}, over its step "
              "budget, for 5 minutes.",
              RUNBOOK + "stepbudgetmeasuredstepoverbudget"),
    AlertRule("StepBudgetPredictionDrift", "warning", 900.0, _drift,
              "The step-time model no longer fits this server; refit it with stepbudget calibrate.",
              f"The prediction for {_WHERE} has been off the measured step time by {{{{ $value | humanizePercentage }}}} "
              "(more than 15%) for 15 minutes.",
              RUNBOOK + "stepbudgetpredictiondrift"),
    AlertRule("StepBudgetPrefillInterference", "warning", 600.0, _prefill_interference,
              "Steps are over budget although the tokens in flight fit it; prompt (prefill) chunks are slowing every stream.",
              f"The measured step time of {_WHERE} has been {{{{ $value | humanizeDuration }}}}, over budget, for 10 "
              "minutes while the decode-only (memory) prediction fits the budget.",
              RUNBOOK + "stepbudgetprefillinterference"),
    AlertRule("StepBudgetKVCacheNearlyFull", "warning", 600.0, _kv_nearly_full,
              "The KV cache is nearly full; new requests will queue and running ones may be preempted.",
              f"The KV cache of {_WHERE} has been {{{{ $value | humanizePercentage }}}} full (over 95%) for 10 minutes.",
              RUNBOOK + "stepbudgetkvcachenearlyfull"),
    AlertRule("StepBudgetPreemptions", "warning", 300.0, _preempting,
              "The server keeps preempting running requests to free KV cache; their work is recomputed.",
              "{{ $labels.target }} (deployment {{ $labels.deployment }}, model {{ $labels.model_name }}, "
              "{{ $labels.engine }}) preempted {{ $value | humanize }} requests in the last 5 minutes, and has "
              "kept preempting for 5 minutes.",
              RUNBOOK + "stepbudgetpreemptions"),
    AlertRule("StepBudgetTargetDown", "warning", 300.0, _down,
              "stepbudget cannot read this model server's metrics; its predictions and alerts are blind.",
              "stepbudget has failed to fetch or parse the metrics of {{ $labels.target }} (deployment "
              "{{ $labels.deployment }}, model {{ $labels.model_name }}) for 5 minutes "
              "(stepbudget_target_up = {{ $value }}).",
              RUNBOOK + "stepbudgettargetdown"),
)


# --- annotation templates (the subset of Prometheus's template language the rules use) -----------


def humanize(value: float) -> str:
    """Prometheus's `humanize`: SI prefixes, 4 significant digits."""
    if value == 0 or not math.isfinite(value):
        return f"{value:.4g}"
    for factor, prefix in ((1e24, "Y"), (1e21, "Z"), (1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.4g}{prefix}"
    for factor, prefix in ((1e-3, "m"), (1e-6, "u"), (1e-9, "n"), (1e-12, "p"), (1e-15, "f"), (1e-18, "a")):
        if abs(value) >= factor:
            return f"{value / factor:.4g}{prefix}"
    return f"{value:.4g}"


def humanize_duration(seconds: float) -> str:
    """Prometheus's `humanizeDuration`: `1m 5s`, and SI-prefixed seconds under one second."""
    if not math.isfinite(seconds):
        return f"{seconds:.4g}"
    if abs(seconds) < 1:
        return humanize(seconds) + "s" if seconds else "0s"
    whole = int(abs(seconds))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{days}d"] if days else []
    parts += [f"{hours}h"] if hours else []
    parts += [f"{minutes}m"] if minutes else []
    parts.append(f"{secs}s" if parts else f"{abs(seconds):.4g}s")
    return ("-" if seconds < 0 else "") + " ".join(parts)


_TEMPLATE = re.compile(r"\{\{\s*(\$labels\.(\w+)|\$value)\s*(?:\|\s*(\w+)\s*)?\}\}")
_FILTERS: dict[str, Callable[[float], str]] = {
    "humanize": humanize,
    "humanizeDuration": humanize_duration,
    "humanizePercentage": lambda value: f"{value * 100:.4g}%",
}


def render(template: str, labels: dict[str, str], value: float) -> str:
    def substitute(match: re.Match[str]) -> str:
        if match.group(2):
            return labels.get(match.group(2), "")
        return _FILTERS.get(match.group(3) or "", lambda v: f"{v:g}")(value)

    return _TEMPLATE.sub(substitute, template)


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


def post_alerts(url: str, alerts: list[dict[str, object]], timeout_seconds: float) -> None:
    response = requests.post(f"{url.rstrip('/')}/api/v2/alerts", json=alerts, timeout=timeout_seconds)
    if response.status_code >= 300:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")


def _described(alert: _Alert) -> dict[str, object]:
    """An alert's labels and annotations, as both Alertmanager's API and `GET /api/v1/alerts` carry them."""
    return {
        "labels": {"alertname": alert.rule.name, "severity": alert.rule.severity, **alert.labels},
        "annotations": {
            "summary": alert.rule.summary,
            "description": render(alert.rule.description, alert.labels, alert.value),
            "runbook_url": alert.rule.runbook_url,
        },
    }


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class AlertLoop:
    """Evaluates RULES over each poll's readings; `evaluate` is driven by the poller (or a test)."""

    def __init__(self, config: Alerting, *, poll_interval_seconds: float, generator_url: str = "",
                 clock: Callable[[], float] = time.time, post: Post = post_alerts) -> None:
        self._urls = config.alertmanager_urls
        self._timeout = config.timeout_seconds
        self._generator_url = config.generator_url or generator_url
        self._clock = clock
        self._post = post
        self._valid_for_seconds = 4 * max(poll_interval_seconds, RESEND_SECONDS)
        self.rules = tuple(
            AlertRule(**{**rule.__dict__, "for_seconds": config.for_seconds}) if rule.name == PAGE_ALERT and config.for_seconds is not None
            else rule for rule in RULES
        )
        self._alerts: dict[tuple[str, tuple[tuple[str, str], ...]], _Alert] = {}
        self._history: dict[tuple[tuple[str, str], ...], History] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self._urls)

    def on_poll(self, result: object) -> None:
        """Poller listener."""
        self.evaluate(getattr(result, "readings"), self._clock())

    def evaluate(self, readings: Sequence[Reading], now: float) -> list[dict[str, object]]:
        """Advance every alert's state to `now`; post what is due; return what was posted."""
        # Each reading's labels and series key once per poll, for the history and for every rule.
        labelled = [(reading, labels := reading.labels, tuple(sorted(labels.items()))) for reading in readings]
        with self._lock:
            self._record(labelled, now)
            active: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
            for reading, labels, series in labelled:
                history = self._history[series]
                for rule in self.rules:
                    value = rule.condition(reading, history)
                    if value is None:
                        continue
                    key = (rule.name, series)
                    active.add(key)
                    alert = self._alerts.get(key)
                    if alert is None or alert.resolved_at is not None:
                        alert = self._alerts[key] = _Alert(rule, labels, active_since=now, value=value)
                    alert.value = value
                    if alert.fired_at is None and now - alert.active_since >= rule.for_seconds:
                        alert.fired_at = now
                        log.warning("alert_firing", alertname=rule.name, severity=rule.severity, value=value, **labels)
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

    def _record(self, labelled: Iterable[tuple[Reading, dict[str, str], tuple[tuple[str, str], ...]]],
                now: float) -> None:
        seen = set()
        for reading, _, series in labelled:
            seen.add(series)
            history = self._history.setdefault(series, History())
            if reading.preemptions_total is not None:
                history.preemptions.append((now, reading.preemptions_total))
            while history.preemptions and history.preemptions[0][0] < now - PREEMPTION_WINDOW_SECONDS:
                history.preemptions.popleft()
        for series in [s for s in self._history if s not in seen]:
            del self._history[series]

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
            **_described(alert),
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
            except Exception as error:  # noqa: BLE001 - Alertmanager down is logged, never fatal
                log.warning("alertmanager_post_failed", url=url, alerts=len(alerts),
                            reason=f"{type(error).__name__}: {str(error)[:200]}")

    def active(self) -> list[dict[str, object]]:
        """Every alert whose condition holds now, pending or firing, shaped like the `alerts` of
        Prometheus's `GET /api/v1/alerts` so the same tools and habits read it."""
        with self._lock:
            return [
                {
                    **_described(alert),
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
