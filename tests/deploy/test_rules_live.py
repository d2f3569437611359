"""The rules and dashboard queries on a real Prometheus (127.0.0.1), scraping two exporter replicas
that serve the same page: the HA case the `max without (instance, job)` aggregation exists for.

promtool's unit tests prove the thresholds; this proves the server loads the rule files, evaluates
every rule without error, raises one alert per target with the daemon's label set, counts a target
scraped twice once, and that every dashboard query returns data.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
import yaml

from tests.support.monitoring import (
    ALERTS_FILE,
    DAEMON_METRICS,
    DAEMON_METRICS_BEYOND_DESIGN,
    RECORDING_FILE,
    REPO,
    grafana_to_promql,
)
from tests.support.servers import free_port, wait_until
from tests.support.tools import require_tool

pytestmark = pytest.mark.e2e

SERIES = {"deployment": "chat", "model_name": "qwen3-8b", "engine": "0"}
# Per target: over budget (a) and inside it (b). Exact binary fractions.
TARGETS = {
    "a": {"stepbudget_predicted_step_seconds": 0.03125, "stepbudget_tokens_in_flight": 65536},
    "b": {"stepbudget_predicted_step_seconds": 0.0078125, "stepbudget_tokens_in_flight": 32768},
}
COMMON = {"stepbudget_step_budget_seconds": 0.015625, "stepbudget_target_up": 1,
          "stepbudget_target_mixed_processes": 0, "stepbudget_kv_cache_usage_ratio": 0.25,
          "stepbudget_engine_sleeping": 0, "stepbudget_measured_step_seconds": 0.015625,
          "stepbudget_prediction_error_ratio": 0.0}
PER_DEPLOYMENT = {"stepbudget_kv_bytes_per_token", "stepbudget_weight_bytes", "stepbudget_model_info",
                  "stepbudget_deployment_targets"}
# Per deployment, what the speed objective's rules join the pools' ratios with.
DEPLOYMENT_VALUES = {"stepbudget_speed_objective_ratio": 0.99, "stepbudget_deployment_scales_to_zero": 0}
# Counters that grow, tokens per second: a's streams under the target, b's at it.
GROWING = {"a": {"stepbudget_decode_tokens_total": 64, "stepbudget_decode_tokens_at_target_total": 0},
           "b": {"stepbudget_decode_tokens_total": 64, "stepbudget_decode_tokens_at_target_total": 64}}
NOT_PER_TARGET = PER_DEPLOYMENT | set(DEPLOYMENT_VALUES) | {"stepbudget_build_info",
                                                            "stepbudget_admission_decisions_total",
                                   "stepbudget_admitted_tokens",
                                   # per Kubernetes pod not Ready / per deployment
                                   "stepbudget_target_not_ready_since_timestamp_seconds",
                                   "stepbudget_target_startup_allowance_seconds"}
# Labels a per-target family carries beyond the target's.
EXTRA_LABELS = {"stepbudget_effective_bandwidth_bytes_per_second": ',source="default"',
                "stepbudget_target_role_info": ',role="both"'}


def exposition(now_seconds: float = 0.0) -> str:
    """A page with every per-target metric the daemon exports for targets a and b (the GROWING counters at
    their rates times `now_seconds`), the deployment's objective and build_info."""
    lines = ['stepbudget_build_info{version="0.1.0"} 1']
    lines += [f'{metric}{{deployment="{SERIES["deployment"]}"}} {value}' for metric, value in DEPLOYMENT_VALUES.items()]
    for target, values in TARGETS.items():
        labels = ",".join(f'{k}="{v}"' for k, v in {**SERIES, "target": target}.items())
        growing = {metric: rate * int(now_seconds) for metric, rate in GROWING[target].items()}
        for metric in sorted((DAEMON_METRICS | DAEMON_METRICS_BEYOND_DESIGN) - NOT_PER_TARGET):
            value = {**COMMON, **values, **growing}.get(metric, 1.0)
            lines.append(f"{metric}{{{labels}{EXTRA_LABELS.get(metric, '')}}} {value}")
    return "\n".join(lines) + "\n"


@pytest.fixture
def exporters() -> Iterator[list[str]]:
    """Two HTTP servers on 127.0.0.1 serving the same page: two replicas of one exporter."""

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name
            body = exposition(time.time()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Page) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield [f"127.0.0.1:{server.server_address[1]}" for server in servers]
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def prometheus(exporters: list[str], tmp_path: Path) -> Iterator[str]:
    """A real Prometheus scraping both replicas every second with the project's rule files."""
    binary = require_tool("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS_FILE), str(RECORDING_FILE)],
        "scrape_configs": [{"job_name": "stepbudget", "static_configs": [{"targets": exporters}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address={address}"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"),
    )
    try:
        yield f"http://{address}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def _query(base: str, expr: str) -> list[dict]:
    response = requests.get(f"{base}/api/v1/query", params={"query": expr}, timeout=5)
    payload = response.json()
    assert payload["status"] == "success", (expr, payload)
    return payload["data"]["result"]


def _wait(condition: Callable[[], object]) -> object:
    """Wait on the live Prometheus (it answers nothing, or refuses, while it starts)."""
    return wait_until(condition, timeout_seconds=40.0, interval_seconds=0.25)


def _dashboard_queries() -> list[str]:
    """Every panel query, with the variables set to All."""
    queries = []
    for path in sorted((REPO / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                expr = grafana_to_promql(target["expr"])
                for variable in ("$cluster", "$deployment", "$model", "$namespace", "$target"):
                    expr = expr.replace(variable, ".*")
                queries.append(expr)
    return queries


def test_rules_and_dashboards_on_a_live_prometheus(prometheus: str) -> None:
    # Both replicas scraped, and the 5m rates have two samples each.
    _wait(lambda: len(_query(prometheus, "up == 1")) == 2
          and _query(prometheus, "target:stepbudget_preemptions:rate5m"))

    def all_rules_evaluated() -> list[dict]:
        groups = requests.get(f"{prometheus}/api/v1/rules", timeout=5).json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        return rules if all(rule["lastEvaluation"] > "2000" for rule in rules) else []

    rules = _wait(all_rules_evaluated)
    assert all(rule["health"] == "ok" for rule in rules), [(r["name"], r.get("lastError")) for r in rules]

    # One pending page for target a, although two replicas export it; no scrape labels.
    (alert,) = _query(prometheus, 'ALERTS{alertname="StepBudgetPredictedStepOverBudget"}')
    assert alert["metric"] == {"__name__": "ALERTS", "alertname": "StepBudgetPredictedStepOverBudget",
                               "alertstate": "pending", "severity": "critical", "target": "a", **SERIES}

    # The pool counts each target once: 65536 + 32768, not twice that.
    (pool,) = _query(prometheus, "deployment_model_name:stepbudget_tokens_in_flight:sum")
    expected = sum(values["stepbudget_tokens_in_flight"] for values in TARGETS.values())
    assert float(pool["value"][1]) == expected

    # Rule groups are evaluated independently: a pool rule fed by a 5m rate may lag the per-target
    # one by an evaluation, so poll until every panel has data or the deadline passes.
    deadline = time.monotonic() + 20.0
    while True:
        empty = [expr for expr in _dashboard_queries() if not _query(prometheus, expr)]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert not empty, f"dashboard queries with no data: {empty}"
