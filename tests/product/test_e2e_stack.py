"""The whole path, with real servers on 127.0.0.1:

    stepbudget simulate (agents-join, steady-chat)  ->  stepbudget serve  ->  prometheus  ->  alertmanager  ->  webhook
                                                         `-- its own alert loop -------------^

Each part has its own tests; this proves that they fit: the page reaches a receiver with its labels
and annotations and resolves when the agents leave; the daemon and Prometheus raise ONE alert in
Alertmanager, not two; Prometheus stores exactly what the daemon exports; the recording rules
compute what they say; every dashboard panel has data.

Time: the simulators run at SPEED x real time, so the agents join 12 s and leave 42 s after start.
The page's `for:` is shortened to SHORT_FOR in a copy of the alert rules (the only change, checked
below); promtool's unit tests pin the five-minute semantics. The stack is started once per module.

Prometheus runs as prometheus-operator (kube-prometheus-stack) runs it: with the external labels
`prometheus` and `prometheus_replica` on every alert it sends, the replica dropped, plus the alert
relabeling that docs/quickstart-kubernetes.md tells users to add (read from that file). Without
that relabeling, Prometheus's page carries `prometheus=...` and the daemon's does not: two alerts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.simulator import AGENTS_JOIN_SECONDS, AGENTS_LEAVE_SECONDS
from exporter.units import parse_duration_seconds
from tests.support.e2e.quickstart import (
    KUBE_PROMETHEUS_STACK_VALUES,
    OPERATOR_ALERT_RELABEL_CONFIGS,
    OPERATOR_EXTERNAL_LABELS,
    QUICKSTART,
    STEPBUDGET_VALUES,
    helm_set_flags,
    heredoc,
    quickstart_alert_relabel_configs,
    values,
)
from tests.support.e2e.stack import (
    DaemonHistory,
    Deadline,
    ManagedProcess,
    PrometheusApi,
    RecordingServer,
    SeriesKey,
    alertmanager_alerts,
    alertmanager_binary,
    alertmanager_config,
    compare_pages,
    copy_rules_with_for,
    describe,
    differences_besides_for,
    get_text,
    panels,
    parse_exposition,
    poll_times,
    posted_alerts,
    prometheus_config,
    rate_interval,
    resolve_variables,
    start_alertmanager_and_prometheus,
    start_process,
    substitute,
    wait_for,
    webhook_alerts,
    write_yaml,
)
from tests.support.monitoring import ALERTS_FILE, DAEMON_METRICS, RECORDING_FILE, REPO
from tests.support.servers import free_port
from tests.support.tools import require_tool

pytestmark = pytest.mark.e2e

PAGE = "StepBudgetPredictedStepOverBudget"
SPEED = 10.0  # simulated seconds per wall second
SHORT_FOR = "5s"
INTERVAL = "1s"  # scrape, rule evaluation and the daemon's poll
DEPLOYMENT, MODEL, GPU = "chat", "qwen3-8b", "h100-sxm"
STACK_SECONDS = 150.0  # the whole module's budget: every wait below is capped by it
START_SECONDS = 30.0


@dataclass
class Stack:
    prometheus: PrometheusApi
    alertmanager_url: str
    daemon_url: str
    agents_target: str  # the `target` label of the simulator running agents-join
    steady_target: str
    webhook: RecordingServer
    daemon_tap: RecordingServer  # the daemon -> Alertmanager line
    prometheus_tap: RecordingServer  # Prometheus -> Alertmanager
    rules_copy: Path
    simulators_launched: float  # time.monotonic() just before the simulators started
    deadline: Deadline
    processes: list[ManagedProcess]

    @property
    def agents_join_monotonic(self) -> float:
        """The earliest the agents can join: a paced simulator lags the wall clock, never leads it."""
        return self.simulators_launched + AGENTS_JOIN_SECONDS / SPEED

    @property
    def agents_leave_monotonic(self) -> float:
        return self.simulators_launched + AGENTS_LEAVE_SECONDS / SPEED

    def logs(self) -> str:
        return "; ".join(f"{p.name}: {p.log_path}" for p in self.processes)

    def check_running(self) -> None:
        for process in self.processes:
            process.check_running()


def _page_rule() -> dict[str, Any]:
    document = yaml.safe_load(ALERTS_FILE.read_text())
    (rule,) = [r for group in document["groups"] for r in group["rules"] if r.get("alert") == PAGE]
    return rule


def _daemon_config(listen: str, simulator_urls: list[str], alertmanager_url: str) -> dict[str, Any]:
    return {
        "listen": listen, "poll_interval": INTERVAL, "timeout": INTERVAL, "stale_after": "60s", "log_format": "json",
        "deployments": [{"name": DEPLOYMENT, "model": MODEL, "gpu": GPU, "kind": "vllm",
                         "targets": {"static": [f"{url}/metrics" for url in simulator_urls]}}],
        "alerting": {"alertmanager_urls": [alertmanager_url], "for": SHORT_FOR},
    }


def _ready(url: str) -> bool:
    return get_text(url) is not None


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prometheus_binary = require_tool("prometheus")
    alertmanager_binary_path = alertmanager_binary()
    deadline = Deadline(STACK_SECONDS)
    work = tmp_path_factory.mktemp("e2e-stack")
    am_address, prom_address, daemon_address = (f"127.0.0.1:{free_port()}" for _ in range(3))
    sim_ports = {"agents-join": free_port(), "steady-chat": free_port()}
    sim_urls = {scenario: f"http://127.0.0.1:{port}" for scenario, port in sim_ports.items()}

    webhook = RecordingServer()
    daemon_tap = RecordingServer(upstream=f"http://{am_address}")
    prometheus_tap = RecordingServer(upstream=f"http://{am_address}")
    rules_copy = copy_rules_with_for(ALERTS_FILE, work / "stepbudget.alerts.short-for.yaml", {PAGE: SHORT_FOR})
    am_config = write_yaml(work / "alertmanager.yml", alertmanager_config(
        webhook_url=f"{webhook.url}/hook", group_wait="1s", group_interval="1s", repeat_interval="5s",
        resolve_timeout="5s"))
    prom_config = write_yaml(work / "prometheus.yml", prometheus_config(
        scrape_address=daemon_address, alertmanager_address=prometheus_tap.url.removeprefix("http://"),
        rule_files=[rules_copy, RECORDING_FILE], interval=INTERVAL, external_labels=OPERATOR_EXTERNAL_LABELS,
        alert_relabel_configs=OPERATOR_ALERT_RELABEL_CONFIGS + quickstart_alert_relabel_configs()))
    daemon_config = write_yaml(work / "stepbudget.yaml", _daemon_config(
        daemon_address, list(sim_urls.values()), daemon_tap.url))

    processes: list[ManagedProcess] = []
    try:
        processes += start_alertmanager_and_prometheus(
            work, alertmanager=(alertmanager_binary_path, am_config, am_address),
            prometheus=(prometheus_binary, prom_config, prom_address))
        simulators_launched = time.monotonic()
        for seed, (scenario, port) in enumerate(sim_ports.items()):
            processes.append(start_process(f"simulate-{scenario}", [
                sys.executable, "-m", "exporter.cli", "simulate", "--scenario", scenario, "--speed", f"{SPEED:g}",
                "--port", str(port), "--seed", str(seed), "--model", MODEL, "--gpu", GPU], work))
        processes.append(start_process("serve", [
            sys.executable, "-m", "exporter.cli", "serve", "--config", str(daemon_config)], work))
        stack = Stack(PrometheusApi(f"http://{prom_address}"), f"http://{am_address}", f"http://{daemon_address}",
                      f"127.0.0.1:{sim_ports['agents-join']}",
                      f"127.0.0.1:{sim_ports['steady-chat']}", webhook, daemon_tap, prometheus_tap, rules_copy,
                      simulators_launched, deadline, processes)
        for name, url in [("alertmanager", f"{stack.alertmanager_url}/-/ready"),
                          ("prometheus", f"{stack.prometheus.url}/-/ready"),
                          *((f"simulator {s}", f"{u}/metrics") for s, u in sim_urls.items()),
                          ("stepbudget serve", f"{stack.daemon_url}/-/ready")]:
            def up(url: str = url) -> bool:
                stack.check_running()
                return _ready(url)

            wait_for(up, timeout_seconds=START_SECONDS, what=f"{name} to answer {url}", state=stack.logs,
                     deadline=deadline)
        yield stack
    finally:
        for process in reversed(processes):
            process.stop()
        for server in (webhook, daemon_tap, prometheus_tap):
            server.close()


# --- the rule copy ------------------------------------------------------------------------------------


def test_the_short_for_copy_differs_from_the_rules_only_in_for(tmp_path: Path) -> None:
    """The page's `for`, and its description saying it (as the daemon's loop, given alerting.for, says it)."""
    original = yaml.safe_load(ALERTS_FILE.read_text())
    path = copy_rules_with_for(ALERTS_FILE, tmp_path / "copy.yaml", {PAGE: SHORT_FOR})
    copy = yaml.safe_load(path.read_text())
    description = original["groups"][0]["rules"][0]["annotations"]["description"]
    said = description.replace(f"for {_page_rule()['for']}:", f"for {SHORT_FOR}:")
    assert said != description
    assert differences_besides_for(original, copy) == [
        f".groups[0].rules[0].annotations.description: {description!r} vs {said!r}"]
    fors = {(r["alert"], r["for"], c["for"]) for g, h in zip(original["groups"], copy["groups"], strict=True)
            for r, c in zip(g["rules"], h["rules"], strict=True) if r.get("for") != c.get("for")}
    assert fors == {(PAGE, _page_rule()["for"], SHORT_FOR)}
    # The comparison itself can fail: any other change is reported.
    copy["groups"][0]["rules"][0]["labels"]["severity"] = "page"
    assert ".groups[0].rules[0].labels.severity: 'critical' vs 'page'" in differences_besides_for(original, copy)


# --- the page -----------------------------------------------------------------------------------------


def _daemon_series(stack: Stack, name: str, target: str) -> tuple[dict[str, str], float]:
    """Labels and value of one of the daemon's per-target series, from its /metrics."""
    page = parse_exposition(get_text(f"{stack.daemon_url}/metrics"))
    ((labels, value),) = [(dict(key[1]), value) for key, value in page.items()
                          if key[0] == name and dict(key[1]).get("target") == target]
    return labels, value


def _expected_page_labels(stack: Stack) -> dict[str, str]:
    """The alert's labels worked out from the inputs: the rule's labels plus the daemon's series labels."""
    labels, _ = _daemon_series(stack, "stepbudget_predicted_step_seconds", stack.agents_target)
    return {"alertname": PAGE, **_page_rule()["labels"], **labels}


_SI_PREFIX = {"": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def _description_value_seconds(template: str, labels: dict[str, str], text: str) -> float:
    """Match a rendered description against its template; return the `humanizeDuration` value."""
    pattern = re.escape(" ".join(template.split()))
    for name, value in labels.items():
        pattern = pattern.replace(re.escape("{{ $labels." + name + " }}"), re.escape(value))
    pattern = pattern.replace(re.escape("{{ $value | humanizeDuration }}"), r"(?P<number>[0-9.]+)(?P<prefix>[mun]?)s")
    match = re.fullmatch(pattern, " ".join(text.split()))
    assert match, f"description {text!r} does not render template {template!r} with {labels}"
    return float(match["number"]) * _SI_PREFIX[match["prefix"]]


def _firing_page(stack: Stack) -> list[dict[str, Any]]:
    stack.check_running()
    return webhook_alerts(stack.webhook.recorded(), PAGE, "firing")


def test_the_page_reaches_the_webhook_with_its_labels_and_annotations(stack: Stack) -> None:
    wait_for(lambda: _firing_page(stack), timeout_seconds=90, deadline=stack.deadline,
             what=f"{PAGE} at the webhook", state=lambda: (stack.prometheus.alerts(), stack.logs()))
    first = min(p.received_monotonic for p in stack.webhook.recorded() if webhook_alerts([p], PAGE, "firing"))
    assert first >= stack.agents_join_monotonic, "the page arrived before the agents could have joined"

    # Prometheus runs the copy, which differs from the rules file only in the page's `for` (and the description
    # saying it, test_the_short_for_copy_differs_from_the_rules_only_in_for), as the daemon's loop does.
    copy = yaml.safe_load(stack.rules_copy.read_text())
    assert len(differences_besides_for(yaml.safe_load(ALERTS_FILE.read_text()), copy)) == 1
    (loaded,) = [r for r in stack.prometheus.rules() if r.get("name") == PAGE]
    assert loaded["duration"] == parse_duration_seconds(SHORT_FOR)

    expected = _expected_page_labels(stack)
    (rule,) = [r for g in copy["groups"] for r in g["rules"] if r.get("alert") == PAGE]
    for alert in _firing_page(stack):  # only the agents' target pages; the steady chat stays inside its budget
        assert alert["labels"] == expected
        annotations = alert["annotations"]
        assert set(annotations) == set(rule["annotations"])
        assert annotations["summary"] == rule["annotations"]["summary"]
        assert annotations["runbook_url"] == rule["annotations"]["runbook_url"]
        step_seconds = _description_value_seconds(rule["annotations"]["description"], expected,
                                                  annotations["description"])
        _, budget_seconds = _daemon_series(stack, "stepbudget_step_budget_seconds", stack.agents_target)
        assert step_seconds > budget_seconds, (annotations["description"], budget_seconds)


def _firing_posts(stack: Stack) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return (posted_alerts(stack.daemon_tap.recorded(), PAGE), posted_alerts(stack.prometheus_tap.recorded(), PAGE))


def test_daemon_and_prometheus_raise_one_alert_in_alertmanager(stack: Stack) -> None:
    daemon_posts, prometheus_posts = wait_for(
        lambda: all(_firing_posts(stack)) and _firing_posts(stack), timeout_seconds=90, deadline=stack.deadline,
        what=f"{PAGE} posted by both the daemon and Prometheus", state=lambda: [len(p) for p in _firing_posts(stack)])
    expected = _expected_page_labels(stack)
    rule_output = [a["labels"] for a in stack.prometheus.alerts()
                   if a["labels"]["alertname"] == PAGE and a["state"] == "firing"]
    assert rule_output == [expected], "the alerting rule's aggregation gives another label set than the daemon's"
    assert daemon_posts[0]["labels"] == expected, "the daemon's alert loop sent another label set than its series"
    assert prometheus_posts[0]["labels"] == expected, "Prometheus's external labels reached the alert"
    for tap in (stack.daemon_tap, stack.prometheus_tap):
        assert {post.status for post in tap.recorded()} == {200}, "Alertmanager refused a post"

    in_alertmanager = [a for a in alertmanager_alerts(stack.alertmanager_url) if a["labels"]["alertname"] == PAGE]
    assert [a["labels"] for a in in_alertmanager] == [expected]
    assert in_alertmanager[0]["status"]["state"] == "active"
    def notified() -> set[str]:
        return {json.dumps(alert["labels"], sort_keys=True)
                for alert in webhook_alerts(stack.webhook.recorded(), PAGE, "firing")}

    # The receiver got the page, and only ever with this one label set (not one per sender).
    wait_for(notified, timeout_seconds=30, deadline=stack.deadline, what=f"{PAGE} at the webhook", state=notified)
    assert notified() == {json.dumps(expected, sort_keys=True)}


# --- the numbers --------------------------------------------------------------------------------------

RAW_SERIES = '{__name__=~"stepbudget_.+", job="stepbudget"}'
ADMISSION_METRICS = {"stepbudget_admission_decisions_total", "stepbudget_admitted_tokens"}  # admission is off here


def test_prometheus_stores_what_the_daemon_exports(stack: Stack) -> None:
    """Every raw series, label set and value, at the same poll of each target."""
    with DaemonHistory(f"{stack.daemon_url}/metrics") as history:
        last: dict[str, Any] = {}

        def same_poll_pages() -> tuple[dict[SeriesKey, float], dict[SeriesKey, float]] | None:
            stored = stack.prometheus.samples(RAW_SERIES)
            polls = last["polls"] = poll_times(stored)
            exported = history.page_at(polls) if set(polls) == {stack.agents_target, stack.steady_target} else None
            return (exported, stored) if exported is not None else None

        exported, stored = wait_for(same_poll_pages, timeout_seconds=30, deadline=stack.deadline,
                                    what="Prometheus's latest samples and a daemon page of the same poll",
                                    state=lambda: (last, sorted(history.by_poll)[-4:]))
    assert compare_pages(exported, stored) == []
    # The point median is left out where its ITL bucket is coarse, as vLLM's default buckets are for
    # every step: its bounds are exported instead.
    conditional = {"stepbudget_measured_step_median_seconds"}
    missing = DAEMON_METRICS - ADMISSION_METRICS - conditional - {name for name, _ in stored}
    assert not missing, f"DESIGN §3 metrics neither exported nor stored: {sorted(missing)}"


def _recorded_rules() -> dict[str, list[str]]:
    """Recording rule names per group, in order."""
    groups = yaml.safe_load(RECORDING_FILE.read_text())["groups"]
    return {group["name"]: [rule["record"] for rule in group["rules"]] for group in groups}


Labels = frozenset[tuple[str, str]]


def _by_target(raw: dict[SeriesKey, float], name: str) -> dict[Labels, float]:
    return {labels: value for (series, labels), value in raw.items() if series == name}


def _pool(labels: Labels) -> Labels:
    return frozenset((k, v) for k, v in labels if k in ("deployment", "model_name"))


def _expected_target_rules(raw: dict[SeriesKey, float],
                           preemption_rises: dict[Labels, bool]) -> dict[SeriesKey, float | bool]:
    """What the target-level recording rules must give, from the raw samples they read.

    The 5m preemption rate is checked as zero or not: its value depends on PromQL's extrapolation.
    """
    predicted = _by_target(raw, "stepbudget_predicted_step_seconds")
    measured = _by_target(raw, "stepbudget_measured_step_seconds")
    budget = _by_target(raw, "stepbudget_step_budget_seconds")
    expected: dict[SeriesKey, float | bool] = {}
    for labels, rises in preemption_rises.items():
        expected[("target:stepbudget_preemptions:rate5m", labels)] = rises
    for labels in predicted.keys() & budget.keys():
        expected[("target:stepbudget_predicted_step_per_budget:ratio", labels)] = predicted[labels] / budget[labels]
    for labels in measured.keys() & budget.keys():
        expected[("target:stepbudget_measured_step_per_budget:ratio", labels)] = measured[labels] / budget[labels]
    for labels, value in _by_target(raw, "stepbudget_measured_user_tokens_per_second").items():
        expected[("target:stepbudget_measured_user_tokens_per_second:mean", labels)] = value
    return expected


POOL = "deployment_model_name:stepbudget_"
# Pool-level recorded series (name after POOL) -> how its rule aggregates a pool's targets, and
# the raw series it reads. Two targets per pool here: Python's sum and PromQL's add in one step.
POOL_AGGREGATES: dict[str, tuple[Callable[[list[float]], float], str]] = {
    "tokens_in_flight:sum": (sum, "stepbudget_tokens_in_flight"),
    "token_budget_tokens:sum": (sum, "stepbudget_token_budget_tokens"),
    "kv_cache_capacity_tokens:sum": (sum, "stepbudget_kv_cache_capacity_tokens"),
    "kv_cache_used_tokens:sum": (sum, "stepbudget_kv_cache_used_tokens"),
    "targets_up:sum": (sum, "stepbudget_target_up"),
    "targets:count": (lambda values: float(len(values)), "stepbudget_target_up"),
    "predicted_step_seconds:max": (max, "stepbudget_predicted_step_seconds"),
    "measured_step_seconds:max": (max, "stepbudget_measured_step_seconds"),
    "step_budget_seconds:min": (min, "stepbudget_step_budget_seconds"),
}
# Pool ratios: (numerator sum, denominator sum): the numerator over the denominator, when above 0. The
# token budget is about what the steps read (tokens in flight), the KV capacity about what the caches
# hold (KV used).
POOL_RATIOS = {"token_budget_utilization:ratio": ("tokens_in_flight:sum", "token_budget_tokens:sum"),
               "kv_cache_usage:ratio": ("kv_cache_used_tokens:sum", "kv_cache_capacity_tokens:sum")}


def _per_pool(series: dict[Labels, float]) -> dict[Labels, list[float]]:
    pools: dict[Labels, list[float]] = {}
    for labels, value in series.items():
        pools.setdefault(_pool(labels), []).append(value)
    return pools


def _expected_pool_rules(raw: dict[SeriesKey, float], target_rates: dict[SeriesKey, float]) -> dict[SeriesKey, float]:
    """What the pool-level recording rules must give: sums, counts, extremes and ratios per pool."""
    expected: dict[SeriesKey, float] = {}
    for suffix, (aggregate, source) in POOL_AGGREGATES.items():
        for pool, pool_values in _per_pool(_by_target(raw, source)).items():
            expected[(POOL + suffix, pool)] = aggregate(pool_values)
    predicted = _by_target(raw, "stepbudget_predicted_step_seconds")
    budget = _by_target(raw, "stepbudget_step_budget_seconds")
    over = {labels: float(predicted[labels] > budget[labels]) for labels in predicted.keys() & budget.keys()}
    for pool, pool_values in _per_pool(over).items():
        expected[(POOL + "targets_over_budget:sum", pool)] = sum(pool_values)
    for pool, pool_values in _per_pool({labels: value for (_, labels), value in target_rates.items()}).items():
        expected[(POOL + "preemptions:rate5m", pool)] = sum(pool_values)
    for ratio, (numerator, denominator) in POOL_RATIOS.items():
        for (name, pool), tokens in list(expected.items()):
            total = expected.get((POOL + denominator, pool), 0.0)
            if name == POOL + numerator and total > 0:
                expected[(POOL + ratio, pool)] = tokens / total
    return expected


def _evaluated_at(stack: Stack, record: str) -> float | None:
    """When the rule group last wrote `record`: its samples carry the evaluation's timestamp."""
    stamps = [float(item["value"][1]) for item in stack.prometheus.query(f"timestamp({record})")]
    return max(stamps) if stamps else None


def _preemption_rises(stack: Stack, at_seconds: float) -> dict[Labels, bool]:
    """Per target: did the preemption counter rise in the 5m window the rate rule reads?"""
    rises = {}
    for item in stack.prometheus.query('stepbudget_preemptions_total[5m]', at_seconds):
        values = [float(v) for _, v in item["values"]]
        key = frozenset((k, v) for k, v in item["metric"].items() if k not in ("__name__", "instance", "job"))
        rises[key] = len(values) >= 2 and values[-1] != values[0]
    return rises


def _check_group(stack: Stack, records: list[str]) -> list[str] | None:
    """None when the group's latest evaluation agrees with its inputs; else the differences."""
    at_seconds = _evaluated_at(stack, records[0])
    if at_seconds is None:
        return [f"{records[0]}: not recorded yet"]
    raw = stack.prometheus.samples(RAW_SERIES, at_seconds)
    recorded = stack.prometheus.samples("{__name__=~\"" + "|".join(map(re.escape, records)) + "\"}", at_seconds)
    if all(record.startswith("target:") for record in records):
        expected: dict[SeriesKey, Any] = _expected_target_rules(raw, _preemption_rises(stack, at_seconds))
    else:
        target_rates = stack.prometheus.samples("target:stepbudget_preemptions:rate5m", at_seconds)
        expected = _expected_pool_rules(raw, target_rates)
    problems = [f"missing {describe(k)}" for k in expected.keys() - recorded.keys()]
    problems += [f"recorded, but this test does not recompute it: {describe(k)}"
                 for k in recorded.keys() - expected.keys()]
    for key in expected.keys() & recorded.keys():
        want, got = expected[key], recorded[key]
        if (isinstance(want, bool) and (got > 0) != want) or (not isinstance(want, bool) and got != want):
            problems.append(f"{describe(key)}: expected {want!r}, recorded {got!r} (evaluated at {at_seconds})")
    return problems or None


def test_recording_rules_compute_what_they_say_from_the_daemons_series(stack: Stack) -> None:
    """Every recorded series of each group's latest evaluation, recomputed here from the raw samples it read.

    The raw samples are the daemon's own values (test above); a retry covers a scrape that landed
    between the evaluation and the read.
    """
    for group, records in _recorded_rules().items():
        last: list[list[str] | None] = [None]

        def agrees(records: list[str] = records, last: list[list[str] | None] = last) -> bool:
            last[0] = _check_group(stack, records)
            return last[0] is None

        wait_for(agrees, timeout_seconds=20, deadline=stack.deadline, what=f"the {group} recording rules to agree",
                 state=lambda last=last: last[0])
        recorded_names = {name for name, _ in stack.prometheus.samples(
            "{__name__=~\"" + "|".join(map(re.escape, records)) + "\"}")}
        assert recorded_names == set(records), f"recorded series with no data: {set(records) - recorded_names}"


# Panels only a prefill-only server (P/D disaggregation) gives data to: the stack's servers prefill and decode.
PREFILL_SERVER_PANELS = {"Prefill tokens/s vs prefill capacity", "Prefill utilization", "Time to first token"}


def test_every_dashboard_panel_has_data(stack: Stack) -> None:
    scrape_seconds = parse_duration_seconds(INTERVAL)
    intervals = {"$__rate_interval": f"{rate_interval(scrape_seconds, scrape_seconds):g}s",
                 "${__rate_interval}": f"{rate_interval(scrape_seconds, scrape_seconds):g}s",
                 "$__interval": INTERVAL, "${__interval}": INTERVAL}
    queries: list[tuple[str, str, str]] = []
    titles: set[str] = set()
    for path in sorted((REPO / "dashboards").glob("*.json")):
        dashboard = json.loads(path.read_text())
        titles |= {panel.get("title", "") for panel in panels(dashboard)}
        variables = resolve_variables(dashboard, stack.prometheus)
        assert variables.get("deployment") == [DEPLOYMENT] and variables.get("model") == [MODEL], variables
        if "target" in variables:
            assert set(variables["target"]) == {stack.agents_target, stack.steady_target}, variables
        for panel in panels(dashboard):
            if panel.get("title") in PREFILL_SERVER_PANELS:
                continue
            for target in panel.get("targets", []):
                if target.get("expr"):
                    expr = substitute(target["expr"], variables, intervals)
                    queries.append((path.name, panel.get("title", ""), expr))
    assert queries
    assert PREFILL_SERVER_PANELS <= titles, "a panel left out here is no longer on the dashboards"
    last: list[list[tuple[str, str, str]]] = [[]]

    def every_panel_has_data() -> bool:
        last[0] = [query for query in queries if not stack.prometheus.query(query[2])]
        return not last[0]

    wait_for(every_panel_has_data, timeout_seconds=20, deadline=stack.deadline, what="data in every dashboard panel",
             state=lambda: last[0])


# --- the page resolves ---------------------------------------------------------------------------------


def _iso_seconds(text: str) -> float:
    return datetime.fromisoformat(re.sub(r"\.(\d{6})\d*", r".\1", text.replace("Z", "+00:00"))).timestamp()


def _last_page_post_ended(tap: RecordingServer) -> bool:
    """The sender's last post of the page ends it: endsAt no later than when it was sent."""
    posts = [post for post in tap.recorded() if posted_alerts([post], PAGE)]
    return bool(posts) and all(_iso_seconds(alert["endsAt"]) <= posts[-1].received_unix + 1.0
                               for alert in posted_alerts(posts[-1:], PAGE))


def test_the_page_resolves_when_the_agents_leave(stack: Stack) -> None:
    expected = _expected_page_labels(stack)

    def resolved_everywhere() -> dict[str, bool]:
        stack.check_running()
        return {
            "webhook": any(a["labels"] == expected for a in webhook_alerts(stack.webhook.recorded(), PAGE, "resolved")),
            "alertmanager": not [a for a in alertmanager_alerts(stack.alertmanager_url)
                                 if a["labels"]["alertname"] == PAGE],
            "daemon": _last_page_post_ended(stack.daemon_tap),
            "prometheus": _last_page_post_ended(stack.prometheus_tap),
        }

    wait_for(lambda: all(resolved_everywhere().values()), timeout_seconds=120, deadline=stack.deadline,
             what=f"{PAGE} resolved by both senders, at the webhook, and gone from Alertmanager",
             state=lambda: (resolved_everywhere(), alertmanager_alerts(stack.alertmanager_url)))
    hook = stack.webhook.recorded()
    first_resolved = min(p.received_monotonic for p in hook if webhook_alerts([p], PAGE, "resolved"))
    assert first_resolved >= stack.agents_leave_monotonic, "resolved before the agents could have left"
    assert all(a["labels"] == expected for a in webhook_alerts(hook, PAGE, "resolved"))
    for tap in (stack.daemon_tap, stack.prometheus_tap):
        assert all(alert["labels"] == expected for alert in posted_alerts(tap.recorded(), PAGE))


def test_every_dashboard_draws_from_the_run(stack: Stack, tmp_path: Path) -> None:
    """Each dashboard's panels as this run's Prometheus answers their own queries, drawn to <uid>.png
    (dashboards/render.py): into STEPBUDGET_RENDER_DASHBOARDS where set (`make dashboard-images` writes
    docs/dashboards/), else a temporary folder. A panel whose query Prometheus refuses fails the drawing."""
    folder = Path(os.environ.get("STEPBUDGET_RENDER_DASHBOARDS") or tmp_path)
    from dashboards.render import render_dashboard

    scrape_seconds = parse_duration_seconds(INTERVAL)
    window = f"{rate_interval(scrape_seconds, scrape_seconds):g}s"
    intervals = {"$__rate_interval": window, "${__rate_interval}": window, "$__interval": INTERVAL,
                 "${__interval}": INTERVAL}
    end = time.time()
    start = end - (time.monotonic() - stack.simulators_launched)
    for path in sorted((REPO / "dashboards").glob("*.json")):
        dashboard = json.loads(path.read_text())
        variables = resolve_variables(dashboard, stack.prometheus)
        drawn = render_dashboard(dashboard, stack.prometheus.url,
                                 lambda e, chosen=variables: substitute(e, chosen, intervals),
                                 start, end, folder / f"{dashboard['uid']}.png", step=2.0)
        assert drawn.failed == [] and drawn.path.stat().st_size > 10_000, drawn


# --- the Kubernetes quickstart -----------------------------------------------------------------------


def test_the_kubernetes_quickstart_values_install_what_it_says(tmp_path: Path) -> None:
    """The chart renders the quickstart's values (and its low-budget `--set`) into the objects its
    commands then use; the daemon config inside passes check-config."""
    helm = require_tool("helm")
    values_file = tmp_path / STEPBUDGET_VALUES
    values_file.write_text(heredoc(STEPBUDGET_VALUES))
    lint = subprocess.run([helm, "lint", str(REPO / "helm" / "stepbudget"), "-f", str(values_file)],
                          capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    release, namespace = "stepbudget", "monitoring"
    set_flags = [flag for flags in helm_set_flags(release) for flag in flags]
    assert set_flags == ["config.defaults.target_tokens_per_second=5000"]
    for flags in ([], set_flags):
        rendered = subprocess.run(
            [helm, "template", release, str(REPO / "helm" / "stepbudget"), "--namespace", namespace,
             "-f", str(values_file), *(part for flag in flags for part in ("--set", flag))],
            capture_output=True, text=True, timeout=60)
        assert rendered.returncode == 0, rendered.stderr
        objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(rendered.stdout) if o}
        # The names the quickstart's kubectl commands use.
        assert objects[("Deployment", "stepbudget")]["metadata"]["namespace"] == namespace
        (port,) = objects[("Service", "stepbudget")]["spec"]["ports"]
        assert port["port"] == 9421 and "svc/stepbudget 9421:9421" in QUICKSTART.read_text()
        assert objects[("Role", "stepbudget-pod-discovery")]["metadata"]["namespace"] == "llm"
        # kube-prometheus-stack selects these by its release label; Grafana's sidecar by grafana_dashboard.
        for kind in ("ServiceMonitor", "PrometheusRule"):
            assert objects[(kind, "stepbudget")]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        dashboards = [o for (kind, _), o in objects.items()
                      if kind == "ConfigMap" and o["metadata"]["labels"].get("grafana_dashboard") == "1"]
        assert {uid for o in dashboards for text in o["data"].values() for uid in [json.loads(text)["uid"]]} == {
            "stepbudget-overview", "stepbudget-pools"}
        config = yaml.safe_load(objects[("ConfigMap", "stepbudget")]["data"]["config.yaml"])
        config_file = tmp_path / "config.yaml"
        config_file.write_text(yaml.safe_dump(config))
        check = subprocess.run([sys.executable, "-m", "exporter.cli", "check-config", str(config_file)],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        target_tps = config["defaults"]["target_tokens_per_second"]
        assert target_tps == (5000 if flags else 50)
        assert all("target_tokens_per_second" not in d for d in config["deployments"]), "would hide the --set"
    assert config["alerting"]["alertmanager_urls"] == ["http://kube-prometheus-stack-alertmanager.monitoring.svc:9093"]


def test_the_kubernetes_quickstart_alertmanager_config_is_valid(tmp_path: Path) -> None:
    amtool = require_tool("amtool")
    config = tmp_path / "alertmanager.yml"
    config.write_text(yaml.safe_dump(values(KUBE_PROMETHEUS_STACK_VALUES)["alertmanager"]["config"]))
    check = subprocess.run([amtool, "check-config", str(config)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
