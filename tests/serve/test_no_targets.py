"""A deployment that watches nothing raises StepBudgetNoTargets.

A selector typo, a DNS name with no address, pods that are not Running, a Prometheus selector that
matches no scrape target: discovery answers with nothing, so there is no target_up series for
StepBudgetTargetDown and no prediction for the page. Before, nothing was exported for such a
deployment and nothing alerted: its pages were silently blind. Now every poll counts each configured
deployment's targets (stepbudget_deployment_targets, 0 included) and the loop raises the alert the
rules file raises (tests/rules/stepbudget.alerts_test.yaml has promtool's verdicts).
"""

from __future__ import annotations

import argparse
import socket
from typing import Any

from exporter.serve import daemon
from exporter.serve.alerting import AlertLoop
from exporter.serve.config import Alerting, config_from_mapping
from exporter.serve.discovery import Discovery
from exporter.serve.poller import Poller
from tests.support.clocks import ManualClock, SteppingClock
from tests.support.pollers import scrape
from tests.support.prometheus_api import QueryApi, poller_for, success
from tests.support.prometheus_api import config as prometheus_config
from tests.support.tools import DATA

PAGE = (DATA / "genuine" / "vllm-0.33.0_GENUINE_dp1_t0.prom").read_text()
MODEL = {"model": "qwen3-8b", "gpu": "h100-sxm"}
NO_TARGETS = "StepBudgetNoTargets"


def _resolver(answers: dict[str, list[str]]) -> Any:
    """getaddrinfo as a cluster's DNS answers: NXDOMAIN for an unknown name, else its addresses."""
    def resolve(name: str, port: int, family: int = 0, kind: int = 0) -> list[tuple[Any, ...]]:
        if name not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers[name]]
    return resolve


def _alerts(clock: ManualClock, **kwargs: Any) -> AlertLoop:
    return AlertLoop(Alerting(alertmanager_urls=("http://am.invalid:9093",)), poll_interval_seconds=60,
                     generator_url="http://stepbudget/", clock=clock, post=lambda *_: None, **kwargs)


def _firing(alerts: AlertLoop) -> list[dict[str, str]]:
    return [alert for alert in alerts.firing() if alert["alertname"] == NO_TARGETS]


def test_a_deployment_that_finds_no_target_is_exported_as_0_and_alerts_after_10_minutes() -> None:
    """'chat' has a server; 'typo' names a Service that does not exist (NXDOMAIN); 'drained' is a
    headless Service whose pods are all unready (an empty answer). After 10 minutes of polls, one
    warning each for 'typo' and 'drained', labelled by the deployment alone; none for 'chat'. When
    'drained' gets a pod back, its alert resolves."""
    answers: dict[str, list[str]] = {"vllm-drained.llm.svc": []}
    config = config_from_mapping({"poll_interval": "60s", "deployments": [
        {"name": "chat", **MODEL, "targets": {"static": ["http://10.0.0.5:8000/metrics"]}},
        {"name": "typo", **MODEL, "targets": {"dns": {"name": "vllm-tpyo.llm.svc", "port": 8000}}},
        {"name": "drained", **MODEL, "targets": {"dns": {"name": "vllm-drained.llm.svc", "port": 8000}}},
    ]})
    clock = ManualClock()
    poller = Poller(config, Discovery(config.deployments, timeout_seconds=1.0, resolver=_resolver(answers)),
                    fetch=lambda url, **_: PAGE, clock=clock, monotonic=SteppingClock(0.01))
    alerts = _alerts(clock)
    poller.add_listener(alerts.on_poll)
    try:
        poller.poll_once()
        assert poller.deployment_targets() == (("chat", 1), ("typo", 0), ("drained", 0))
        exported = {labels["deployment"]: value for labels, value in scrape(config, poller)[
            "stepbudget_deployment_targets"]}
        assert exported == {"chat": 1.0, "typo": 0.0, "drained": 0.0}
        for _ in range(9):
            clock.advance(60)
            poller.poll_once()
        assert _firing(alerts) == []  # 9 minutes: pending
        assert {a["labels"]["deployment"] for a in alerts.active()
                if a["labels"]["alertname"] == NO_TARGETS} == {"typo", "drained"}  # type: ignore[index]  # labels: a dict
        clock.advance(60)
        poller.poll_once()
        assert sorted(_firing(alerts), key=str) == [
            {"alertname": "StepBudgetNoTargets", "deployment": "drained"},
            {"alertname": "StepBudgetNoTargets", "deployment": "typo"}]
        answers["vllm-drained.llm.svc"] = ["10.0.0.9"]
        clock.advance(60)
        poller.poll_once()
        assert _firing(alerts) == [{"alertname": "StepBudgetNoTargets", "deployment": "typo"}]
    finally:
        poller.stop()


def test_a_prometheus_selector_that_matches_nothing_counts_0() -> None:
    """Prometheus mode: a relabelled job leaves the selector matching no scrape target, and the query
    answers an empty vector: the deployment watches nothing, as a discovery that finds nothing."""
    api = QueryApi()
    clock = ManualClock()
    try:
        api.serve(success())
        poller, source = poller_for(prometheus_config(api.url), clock)
        try:
            result = poller.poll_once()
            assert result.readings == () and result.deployment_targets == (("chat", 0),)
        finally:
            poller.stop()
            source.close()
    finally:
        api.close()


def test_a_shard_leaves_the_alert_to_prometheus() -> None:
    """A shard polls a share of each deployment's targets: one shard holding none of them says nothing
    of the others, so its loop never raises StepBudgetNoTargets (Prometheus takes the largest count
    over the shards); an unsharded daemon's loop does."""
    parser = argparse.ArgumentParser()
    daemon.build_parser(parser)
    for shard, raises in ((["--shard", "0/3"], False), ([], True)):
        args = parser.parse_args(["--model", "qwen3-8b", "--gpu", "h100-sxm", "--listen", "127.0.0.1:0",
                                  "--target", "http://127.0.9.1:9/metrics", *shard])
        built = daemon.build_daemon(daemon.config_from_args(args))
        try:
            clock = ManualClock()
            loop = built.alert_loop
            for _ in range(11):
                loop.evaluate([], clock.now, (("default", 0),))
                clock.advance(60)
            assert bool(_firing(loop)) is raises
        finally:
            built.poller.stop()
            built.server.stop()
            built.fetcher.close()
