"""One page per incident, with the quickstart's own routing, on real servers on 127.0.0.1:

    4 x stepbudget simulate (agents-join) + 1 dead target  ->  stepbudget serve  ->  prometheus  ->  alertmanager
                                                                `-- its own alert loop ------------^      |
                                                                               oncall webhook, tickets webhook

Everything a user installs comes from docs/quickstart-kubernetes.md: Alertmanager runs its
`alertmanager.config` (routes, grouping, inhibition), Prometheus its `externalLabels` and alert
relabeling, and the daemon and the rules are rendered by the chart from its stepbudget values, with
`prometheusRule.runbookBaseUrl` set to a site's own base. What changes, and only to fit a test into a
minute: the receivers' URLs (recording servers here), the stepbudget route's group timings, the rules'
`for` and the daemon's poll. The targets are static URLs instead of Kubernetes discovery, which needs an
API server (mocked elsewhere: tests/serve/test_discovery.py).

A pool of 4 replicas goes over budget together (the agents join every replica at once): on-call gets ONE
notification listing the 4 pods, with the cluster label and a runbook link from the configured base; the
measured-step warning the page makes redundant is held back; the dead fifth target's TargetDown reaches
the tickets receiver.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.simulator import AGENTS_JOIN_SECONDS, AGENTS_LEAVE_SECONDS
from tests.support.chart import of_kind, one, render
from tests.support.e2e.quickstart import (
    KUBE_PROMETHEUS_STACK_VALUES,
    OPERATOR_ALERT_RELABEL_CONFIGS,
    OPERATOR_EXTERNAL_LABELS,
    STEPBUDGET_VALUES,
    heredoc,
    quickstart_alert_relabel_configs,
    values,
)
from tests.support.e2e.stack import (
    Deadline,
    ManagedProcess,
    Post,
    RecordingServer,
    alertmanager_alerts,
    alertmanager_binary,
    get_text,
    prometheus_config,
    start_alertmanager_and_prometheus,
    start_process,
    wait_for,
    webhook_alerts,
    write_yaml,
)
from tests.support.servers import free_port
from tests.support.tools import require_tool

pytestmark = pytest.mark.e2e

PAGE, MEASURED, TARGET_DOWN = ("StepBudgetPredictedStepOverBudget", "StepBudgetMeasuredStepOverBudget",
                               "StepBudgetTargetDown")
REPLICAS = 4
SPEED = 10.0  # simulated seconds per wall second: the agents join 12 s after start and leave at 42 s
INTERVAL = "1s"  # scrape, rule evaluation and the daemon's poll
# The alerts' `for`, cut once in the chart's values (config.alerting.rules), so the rules Prometheus loads and the
# daemon's own loop hold the same: the page first, the warning it holds back later (so it would otherwise be sent).
FOR = {PAGE: "5s", MEASURED: "10s", TARGET_DOWN: "5s"}
# The stepbudget route's timings, cut as the `for` is: 30s / 5m / 4h in the quickstart.
GROUP_WAIT, GROUP_INTERVAL, REPEAT_INTERVAL = "6s", "2s", "1h"
RUNBOOK_BASE = "https://runbooks.example.internal/llm/stepbudget.md"
STACK_SECONDS = 120.0


@dataclass
class Routed:
    oncall: RecordingServer
    tickets: RecordingServer
    alertmanager_url: str
    replica_targets: list[str]
    dead_target: str
    cluster: str
    agents_leave_monotonic: float
    deadline: Deadline
    processes: list[ManagedProcess]

    def check_running(self) -> None:
        for process in self.processes:
            process.check_running()

    def logs(self) -> str:
        return "; ".join(f"{p.name}: {p.log_path}" for p in self.processes)


def _alertmanager_config(oncall_url: str, tickets_url: str) -> dict[str, Any]:
    """The quickstart's Alertmanager config with the receivers' URLs and the stepbudget route's timings
    replaced; nothing else (checked by test_only_urls_and_timings_differ_from_the_quickstart)."""
    config: dict[str, Any] = values(KUBE_PROMETHEUS_STACK_VALUES)["alertmanager"]["config"]
    urls = {"llm-oncall": oncall_url, "llm-tickets": tickets_url}
    for receiver in config["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = urls[receiver["name"]]
    (route,) = [r for r in config["route"]["routes"] if r["receiver"] == "llm-tickets"]
    route.update(group_wait=GROUP_WAIT, group_interval=GROUP_INTERVAL, repeat_interval=REPEAT_INTERVAL)
    return config


def _daemon_config(rendered: dict[str, Any], listen: str, targets: list[str], alertmanager_url: str) -> dict[str, Any]:
    """The chart's rendered config with this test's targets, listen address, Alertmanager and timings."""
    config = yaml.safe_load(yaml.safe_dump(rendered))
    config.update(listen=listen, poll_interval=INTERVAL, timeout=INTERVAL, stale_after="60s", log_format="json")
    (deployment,) = config["deployments"]
    deployment["targets"] = {"static": targets}
    config["alerting"].update(alertmanager_urls=[alertmanager_url])
    return config


def _rendered_chart(work: Path) -> tuple[dict[str, Any], Path]:
    """The quickstart's stepbudget values rendered by the chart with a site's own runbook base and the cut
    `for`s (config.alerting.rules): the daemon's config and the rules Prometheus loads, from one value each."""
    values_file = work / STEPBUDGET_VALUES
    values_file.write_text(heredoc(STEPBUDGET_VALUES))
    objects = render(values_file, f"prometheusRule.runbookBaseUrl={RUNBOOK_BASE}",
                     *(f"config.alerting.rules.{alert}.for={duration}" for alert, duration in FOR.items()))
    (config_map,) = [c for c in of_kind(objects, "ConfigMap") if "config.yaml" in c["data"]]
    rules = write_yaml(work / "rendered.rules.yaml", {"groups": one(objects, "PrometheusRule")["spec"]["groups"]})
    return yaml.safe_load(config_map["data"]["config.yaml"]), rules


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routed]:
    prometheus_binary = require_tool("prometheus")
    deadline = Deadline(STACK_SECONDS)
    work = tmp_path_factory.mktemp("e2e-routing")
    am_address, prom_address, daemon_address = (f"127.0.0.1:{free_port()}" for _ in range(3))
    replica_ports = [free_port() for _ in range(REPLICAS)]
    dead_port = free_port()  # nothing listens here
    oncall, tickets = RecordingServer(), RecordingServer()
    rendered_config, rendered_rules = _rendered_chart(work)
    rules = rendered_rules
    am_config = write_yaml(work / "alertmanager.yml", _alertmanager_config(f"{oncall.url}/hook",
                                                                          f"{tickets.url}/hook"))
    prometheus_labels = values(KUBE_PROMETHEUS_STACK_VALUES)["prometheus"]["prometheusSpec"]["externalLabels"]
    prom_config = write_yaml(work / "prometheus.yml", prometheus_config(
        scrape_address=daemon_address, alertmanager_address=am_address, rule_files=[rules], interval=INTERVAL,
        external_labels={**OPERATOR_EXTERNAL_LABELS, **prometheus_labels},
        alert_relabel_configs=OPERATOR_ALERT_RELABEL_CONFIGS + quickstart_alert_relabel_configs()))
    targets = [f"http://127.0.0.1:{port}/metrics" for port in [*replica_ports, dead_port]]
    daemon_config = write_yaml(work / "stepbudget.yaml", _daemon_config(
        rendered_config, daemon_address, targets, f"http://{am_address}"))
    (deployment,) = rendered_config["deployments"]
    processes: list[ManagedProcess] = []
    try:
        processes += start_alertmanager_and_prometheus(
            work, alertmanager=(alertmanager_binary(), am_config, am_address),
            prometheus=(prometheus_binary, prom_config, prom_address))
        launched = time.monotonic()
        for seed, port in enumerate(replica_ports):
            processes.append(start_process(f"simulate-{seed}", [
                sys.executable, "-m", "exporter.cli", "simulate", "--scenario", "agents-join", "--speed", f"{SPEED:g}",
                "--port", str(port), "--seed", str(seed), "--model", deployment["model"], "--gpu", deployment["gpu"]],
                work))
        processes.append(start_process("serve", [
            sys.executable, "-m", "exporter.cli", "serve", "--config", str(daemon_config)], work))
        stack = Routed(oncall, tickets, f"http://{am_address}", [f"127.0.0.1:{port}" for port in replica_ports],
                       f"127.0.0.1:{dead_port}", rendered_config["alerting"]["external_labels"]["cluster"],
                       launched + AGENTS_LEAVE_SECONDS / SPEED, deadline, processes)
        for name, url in [("alertmanager", f"http://{am_address}/-/ready"),
                          ("prometheus", f"http://{prom_address}/-/ready"),
                          ("stepbudget serve", f"http://{daemon_address}/-/ready")]:
            def up(url: str = url) -> bool:
                stack.check_running()
                return get_text(url) is not None

            wait_for(up, timeout_seconds=30, what=f"{name} to answer {url}", state=stack.logs, deadline=deadline)
        assert time.monotonic() < launched + AGENTS_JOIN_SECONDS / SPEED, "started after the agents joined"
        yield stack
    finally:
        for process in reversed(processes):
            process.stop()
        for server in (oncall, tickets):
            server.close()


def _notifications(posts: list[Post], alertname: str) -> list[list[dict[str, Any]]]:
    """Each webhook notification of this alert: its alerts."""
    return [[a for a in post.body["alerts"] if a["labels"]["alertname"] == alertname]
            for post in posts if isinstance(post.body, dict)
            and any(a["labels"]["alertname"] == alertname for a in post.body.get("alerts", []))]


def test_only_urls_and_timings_differ_from_the_quickstart() -> None:
    original = values(KUBE_PROMETHEUS_STACK_VALUES)["alertmanager"]["config"]
    changed = _alertmanager_config("http://127.0.0.1:1/hook", "http://127.0.0.1:2/hook")
    for config in (original, changed):
        for receiver in config["receivers"]:
            for webhook in receiver.get("webhook_configs", []):
                webhook.pop("url")
        for route in config["route"]["routes"]:
            for key in ("group_wait", "group_interval", "repeat_interval"):
                route.pop(key, None)
    assert changed == original


def test_a_pool_over_budget_pages_once_listing_its_pods(routed: Routed) -> None:
    """All 4 replicas' pages at once in one notification to on-call, each with the cluster label and a
    runbook link from the configured base; then nothing more while they stay firing (three group
    intervals), although both senders post each alert (the daemon and Prometheus) and keep reposting."""
    def all_paged() -> list[list[dict[str, Any]]] | None:
        routed.check_running()
        notes = _notifications(routed.oncall.recorded(), PAGE)
        return notes if notes and {a["labels"]["target"] for a in notes[0]} == set(routed.replica_targets) else None

    wait_for(all_paged, timeout_seconds=routed.agents_leave_monotonic - time.monotonic(), deadline=routed.deadline,
             what=f"one {PAGE} notification listing the {REPLICAS} replicas",
             state=lambda: (_notifications(routed.oncall.recorded(), PAGE), routed.logs()))
    time.sleep(3 * 2.0)  # three of the test's group intervals
    assert time.monotonic() < routed.agents_leave_monotonic, "the agents left: the pages may have resolved"
    notes = _notifications(routed.oncall.recorded(), PAGE)
    assert len(notes) == 1, [[a["labels"]["target"] for a in note] for note in notes]
    (alerts,) = notes
    assert sorted(a["labels"]["target"] for a in alerts) == sorted(routed.replica_targets)
    for alert in alerts:
        assert alert["status"] == "firing"
        assert alert["labels"]["cluster"] == routed.cluster and "prometheus" not in alert["labels"]
        assert alert["annotations"]["runbook_url"] == f"{RUNBOOK_BASE}#stepbudgetpredictedstepoverbudget"
    # Nothing but the page reached on-call, and no page reached the tickets queue.
    assert {a["labels"]["alertname"] for post in routed.oncall.recorded() for a in post.body["alerts"]} == {PAGE}
    assert not webhook_alerts(routed.tickets.recorded(), PAGE, "firing")


def test_the_measured_warning_waits_while_the_pool_pages(routed: Routed) -> None:
    """The measured step is over budget too (its `for` cut to 10 s, after the page's 5 s): Alertmanager
    holds it, inhibited by the page of the same pool, and the tickets queue never gets it."""
    def inhibited() -> list[dict[str, Any]] | None:
        routed.check_running()
        found = [a for a in alertmanager_alerts(routed.alertmanager_url) if a["labels"]["alertname"] == MEASURED
                 and a["labels"]["target"] in routed.replica_targets]
        return found if found and all(a["status"]["inhibitedBy"] for a in found) else None

    held = wait_for(inhibited, timeout_seconds=routed.agents_leave_monotonic - time.monotonic(),
                    deadline=routed.deadline, what=f"{MEASURED} inhibited",
                    state=lambda: [(a["labels"]["alertname"], a["status"]) for a in
                                   alertmanager_alerts(routed.alertmanager_url)])
    assert all(a["status"]["state"] == "suppressed" for a in held)
    assert not webhook_alerts(routed.tickets.recorded(), MEASURED, "firing")


def test_a_dead_target_reaches_the_tickets_queue(routed: Routed) -> None:
    """The fifth target answers nothing: its TargetDown (stepbudget is blind to it) is a warning, and the
    quickstart's routing sends it to a queue someone reads, not to "null"."""
    def down() -> list[dict[str, Any]] | None:
        routed.check_running()
        return [a for a in webhook_alerts(routed.tickets.recorded(), TARGET_DOWN, "firing")
                if a["labels"]["target"] == routed.dead_target] or None

    (alert, *_) = wait_for(down, timeout_seconds=60, deadline=routed.deadline,
                           what=f"{TARGET_DOWN} at the tickets queue",
                           state=lambda: [(a["labels"]["alertname"], a["status"])
                                          for a in alertmanager_alerts(routed.alertmanager_url)])
    assert alert["labels"]["cluster"] == routed.cluster
    assert alert["annotations"]["runbook_url"] == f"{RUNBOOK_BASE}#stepbudgettargetdown"
    assert not webhook_alerts(routed.oncall.recorded(), TARGET_DOWN, "firing")
