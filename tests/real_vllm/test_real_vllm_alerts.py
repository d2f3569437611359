"""The page on a running vLLM 0.32.0 (CPU backend): long sessions push the predicted step over budget,
the page reaches a webhook through a real Alertmanager, from both the daemon's own alert loop and a real
Prometheus evaluating the shipped rules, and resolves once the sessions finish. And `promtool check
metrics` passes on the daemon's page while it watches the real server.

    real vLLM  <-  stepbudget serve  ->  prometheus (the rules, `for` cut to 9 s)  ->  alertmanager  ->  webhook
                                     ->  (its own alert loop, the same `for`)     ->  alertmanager

The daemon predicts with a fixed effective bandwidth (no online calibration: its 30-minute holdout is
longer than the test), so the page follows tokens in flight alone: 4 chats (~1,500 tokens, ~55 MB of KV
a step) stay under the 30 ms budget; two 6,000-token sessions (~400 MB more) push the step past it.
Each session streams 1,500 tokens, so the predicted step stays over budget for half a minute or more on
any host here: with 300, a host that stepped in about 20 ms ended the sessions within seconds of the 9 s
`for` (evaluated every 3 s), and a CI run there never paged.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from exporter.real_vllm.loadgen import LoadGenerator, Phase
from exporter.real_vllm.server import VllmServer
from tests.support.e2e.stack import (
    ManagedProcess,
    PrometheusApi,
    RecordingServer,
    alertmanager_binary,
    alertmanager_config,
    copy_rules_with_for,
    get_text,
    prometheus_config,
    start_alertmanager_and_prometheus,
    start_process,
    wait_for,
    webhook_alerts,
    write_yaml,
)
from tests.support.monitoring import ALERTS_FILE, RECORDING_FILE
from tests.support.real_vllm import MODEL_CONFIG, host_device, serving
from tests.support.servers import free_port
from tests.support.tools import require_tool

pytestmark = [pytest.mark.real_engine, pytest.mark.e2e]

PAGE = "StepBudgetPredictedStepOverBudget"
SHORT_FOR = "9s"
INTERVAL = "3s"  # the daemon's poll, Prometheus's scrape and rule evaluation
BANDWIDTH = "11GB/s"  # about what one model core reaches here (docs/operations.md: a CPU host)
TARGET_TOKENS_PER_SECOND = 30.0  # x headroom 0.9: a 30 ms step budget
SESSION_PROMPT_TOKENS, SESSION_OUTPUT_TOKENS = 6000, 1500  # 7,500 in all, under the 8,192 max_model_len
CHATS = Phase("chat", 4, 128, 300, spread_ratio=0.5)


@dataclass
class Stack:
    server: VllmServer
    prometheus: PrometheusApi
    alertmanager_url: str
    daemon_url: str
    webhook: RecordingServer
    load: LoadGenerator
    processes: list[ManagedProcess]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail(1500)}" for p in self.processes)

    def firing_at_webhook(self) -> list[dict[str, object]]:
        return webhook_alerts(self.webhook.recorded(), PAGE, "firing")

    def resolved_at_webhook(self) -> list[dict[str, object]]:
        return webhook_alerts(self.webhook.recorded(), PAGE, "resolved")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work: Path = tmp_path_factory.mktemp("real-vllm-alerts")
    prometheus_binary = require_tool("prometheus")
    am_address, prom_address, daemon_address = (f"127.0.0.1:{free_port()}" for _ in range(3))
    webhook = RecordingServer()
    rules_copy = copy_rules_with_for(ALERTS_FILE, work / "stepbudget.alerts.short-for.yaml", {PAGE: SHORT_FOR})
    am_config = write_yaml(work / "alertmanager.yml", alertmanager_config(
        webhook_url=f"{webhook.url}/hook", group_wait="1s", group_interval="1s", repeat_interval="1h",
        resolve_timeout="10s"))
    prom_config = write_yaml(work / "prometheus.yml", prometheus_config(
        scrape_address=daemon_address, alertmanager_address=am_address, rule_files=[rules_copy, RECORDING_FILE],
        interval=INTERVAL, external_labels={}, alert_relabel_configs=[]))
    with serving(work, max_model_len=8192) as server:
        daemon_config = write_yaml(work / "stepbudget.yaml", {
            "listen": daemon_address, "poll_interval": INTERVAL, "timeout": "10s",
            "deployments": [{
                "name": "tiny", "model": str(MODEL_CONFIG), "gpu": host_device(), "weight_dtype": "float32",
                "effective_bandwidth": BANDWIDTH, "target_tokens_per_second": TARGET_TOKENS_PER_SECOND,
                "targets": {"static": [server.metrics_url]}}],
            "alerting": {"alertmanager_urls": [f"http://{am_address}"], "for": SHORT_FOR},
        })
        processes: list[ManagedProcess] = []
        load = LoadGenerator(server.base_url, "tiny", vocab_size=server.vocab_size, seed=5)
        try:
            processes += start_alertmanager_and_prometheus(
                work, alertmanager=(alertmanager_binary(), am_config, am_address),
                prometheus=(prometheus_binary, prom_config, prom_address))
            processes.append(start_process("serve", [
                sys.executable, "-m", "exporter.cli", "serve", "--config", str(daemon_config)], work))
            stack = Stack(server, PrometheusApi(f"http://{prom_address}"), f"http://{am_address}",
                          f"http://{daemon_address}", webhook, load, processes)
            for url in (f"{stack.alertmanager_url}/-/ready", f"{stack.prometheus.url}/-/ready",
                        f"{stack.daemon_url}/-/ready"):
                def answers(url: str = url) -> bool:
                    return get_text(url) is not None

                wait_for(answers, timeout_seconds=60, what=url, state=stack.logs)
            yield stack
        finally:
            load.stop_all()
            load.join(120)
            for process in reversed(processes):
                process.stop()
            webhook.close()


def _daemon_page_alerts(stack: Stack) -> list[str]:
    text = get_text(f"{stack.daemon_url}/api/v1/alerts") or "{}"
    return [a["labels"]["alertname"] for a in json.loads(text).get("data", {}).get("alerts", [])
            if a.get("state") == "firing"]


def test_promtool_checks_the_daemons_page_while_it_watches_the_real_server(stack: Stack) -> None:
    promtool = require_tool("promtool")
    wait_for(lambda: "stepbudget_tokens_in_flight{" in (get_text(f"{stack.daemon_url}/metrics") or ""),
             timeout_seconds=30, what="the daemon's first reading of the real server", state=stack.logs)
    page = get_text(f"{stack.daemon_url}/metrics")
    assert page is not None
    done = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_long_sessions_page_through_alertmanager_and_the_page_resolves_after_them(stack: Stack) -> None:
    stack.load.start(CHATS)
    time.sleep(30.0)  # chats alone: ten polls, more than the page's `for`
    assert stack.firing_at_webhook() == [], "a page while only chats ran"
    assert PAGE not in _daemon_page_alerts(stack)
    sessions = Phase("sessions", 2, SESSION_PROMPT_TOKENS, SESSION_OUTPUT_TOKENS)
    stack.load.start(sessions)
    stack.load.stop("sessions")  # each of the two clients sends one session
    fired = wait_for(stack.firing_at_webhook, timeout_seconds=240, what=f"{PAGE} at the webhook",
                     state=lambda: (stack.prometheus.alerts(), stack.logs()))
    assert {alert["labels"]["deployment"] for alert in fired} == {"tiny"}  # type: ignore[index]  # webhook JSON
    def sessions_done() -> bool:
        ours = [s for s in stack.load.streams if s.prompt_tokens == SESSION_PROMPT_TOKENS]
        return len(ours) == 2 and all(s.finished_at_seconds is not None for s in ours)

    wait_for(sessions_done, timeout_seconds=600, what="the two sessions to finish", interval_seconds=1.0)
    # The chats go on: the page must resolve because the step came back under budget, not because
    # the server went quiet.
    resolved = wait_for(stack.resolved_at_webhook, timeout_seconds=180, what=f"{PAGE} resolved at the webhook",
                        state=lambda: (stack.prometheus.alerts(), stack.logs()))
    assert resolved
    stack.load.stop("chat")
    assert not stack.load.errors(), stack.load.errors()[:3]
