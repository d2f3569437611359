"""End to end: the real `stepbudget serve` process against a local vLLM-format server whose
counters advance, its /metrics scraped over HTTP, then SIGTERM/SIGINT -> exit 0 within seconds.

Waiting here is on real processes (startup, polls at a 0.2 s interval), never a speed assertion.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support.pages import VllmState, vllm_page
from tests.support.servers import PageServer, free_port, send_text, wait_until

STEPBUDGET = Path(sys.executable).with_name("stepbudget")
SHUTDOWN_SECONDS = 5


class AdvancingServer:
    """Each GET of /metrics is one more window of steady decoding: +100 tokens of 20 ms each
    (all in the 0.01-0.025 bucket), +400 prompt tokens over +20 engine steps; usage fixed at 25%."""

    def __init__(self, server: PageServer) -> None:
        self.state = VllmState(running=8, waiting=1, kv_usage_ratio=0.25, preemptions=2,
                               itl_buckets={0.01: 0, 0.025: 0, 0.05: 0, 0.1: 0})
        self.first_request_may_finish = threading.Event()
        self._lock = threading.Lock()
        server.respond = self.respond

    def respond(self, handler: BaseHTTPRequestHandler) -> None:
        self.first_request_may_finish.wait(10)
        with self._lock:
            s = self.state
            s.itl_count += 100
            s.itl_sum += 100 * 0.02
            s.itl_buckets = {0.01: 0, 0.025: s.itl_count, 0.05: s.itl_count, 0.1: s.itl_count}
            s.prompt_tokens += 400
            s.engine_steps += 20
            s.generation_tokens += 100
            page = vllm_page(s)
        send_text(handler, page)


def start_daemon(*args: str) -> tuple[subprocess.Popen[str], str]:
    listen_port = free_port()
    process = subprocess.Popen(
        [str(STEPBUDGET), "serve", "--listen", f"127.0.0.1:{listen_port}", "--poll-interval", "200ms",
         "--timeout", "2s", "--log-format", "json", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    return process, f"http://127.0.0.1:{listen_port}"


def stop_daemon(process: subprocess.Popen[str], sig: signal.Signals) -> tuple[int, list[dict[str, object]]]:
    process.send_signal(sig)
    try:
        code = process.wait(timeout=SHUTDOWN_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"daemon did not stop within {SHUTDOWN_SECONDS}s of {sig.name}")
    _, stderr = process.communicate()
    # Every line, stepbudget's own and the bridged stdlib ones (apscheduler, urllib3), is one JSON object.
    return code, [json.loads(line) for line in stderr.splitlines() if line.strip()]


@pytest.fixture
def daemons() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def samples(base: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = requests.get(f"{base}/metrics", timeout=5).text
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


@pytest.mark.e2e
def test_serve_polls_exports_and_stops_on_sigterm(page_server: PageServer, daemons) -> None:
    upstream = AdvancingServer(page_server)
    process, base = start_daemon("--target", page_server.url, "--model", "qwen3-8b", "--gpu", "h100-sxm",
                                 "--deployment", "chat")
    daemons.append(process)
    # The first poll is held at the model server: healthy, but not ready yet.
    wait_until(lambda: requests.get(f"{base}/-/healthy", timeout=1).status_code == 200)
    assert requests.get(f"{base}/-/ready", timeout=1).status_code == 503
    upstream.first_request_may_finish.set()
    wait_until(lambda: requests.get(f"{base}/-/ready", timeout=1).status_code == 200)

    found = wait_until(lambda: (lambda s: s if "stepbudget_measured_step_seconds" in s else None)(samples(base)))
    labels = {"deployment": "chat", "target": page_server.url[len("http://"):-len("/metrics")],
              "model_name": "Qwen/Qwen3-8B", "engine": "0"}

    def value(name: str) -> float:
        [(sample_labels, sample_value)] = found[name]
        assert sample_labels == labels, name
        return sample_value

    assert value("stepbudget_target_up") == 1
    # 4,095 usable blocks of 16 (the null block is never handed out), less 8 half-empty last blocks.
    assert value("stepbudget_tokens_in_flight") == pytest.approx(0.25 * 4095 * 16 - 8 * (16 - 1) / 2)
    assert value("stepbudget_requests_running") == 8 and value("stepbudget_requests_waiting") == 1
    assert value("stepbudget_measured_step_seconds") == pytest.approx(100 * 0.02 / 100)
    # All 100 observations in (0.01, 0.025]: PromQL would put the median halfway through that bucket,
    # 17.5 ms, whatever the steps were; the bucket is exported instead of that point.
    assert "stepbudget_measured_step_median_seconds" not in found
    assert value("stepbudget_measured_step_median_lower_seconds") == 0.01
    assert value("stepbudget_measured_step_median_upper_seconds") == 0.025
    assert value("stepbudget_prefill_tokens_per_step") == pytest.approx(400 / 20)
    assert value("stepbudget_preemptions_total") == 2
    predicted = value("stepbudget_predicted_step_seconds")
    assert value("stepbudget_prediction_error_ratio") == pytest.approx((predicted - 0.02) / 0.02)
    assert found["stepbudget_build_info"][0][1] == 1

    landing = requests.get(f"{base}/", timeout=5).text
    assert labels["target"] in landing and "vllm" in landing and "/metrics" in landing

    code, logs = stop_daemon(process, signal.SIGTERM)
    assert code == 0
    started = next(line for line in logs if line["event"] == "started")
    assert started["listen"] == base[len("http://"):] and started["deployments"][0]["static"] == [page_server.url]
    assert any(line["event"] == "kind_detected" and line["kind"] == "vllm" for line in logs)
    assert logs[-1]["event"] == "stopped"


@pytest.mark.e2e
def test_serve_keeps_serving_with_a_dead_target_and_stops_on_sigint(daemons, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    config = tmp_path / "stepbudget.yaml"
    config.write_text(f"deployments:\n  - name: chat\n    model: llama-3.1-8b\n    gpu: a100-80gb\n"
                      f"    targets: {{static: [{dead}]}}\n")
    process, base = start_daemon("--config", str(config))
    daemons.append(process)
    wait_until(lambda: requests.get(f"{base}/-/ready", timeout=1).status_code == 200)
    found = samples(base)
    assert found["stepbudget_target_up"] == [({"deployment": "chat", "target": dead[7:-8]}, 0.0)]
    assert "stepbudget_tokens_in_flight" not in found
    assert found["stepbudget_model_info"][0][0]["gpu"] == "a100-80gb"
    code, logs = stop_daemon(process, signal.SIGINT)
    assert code == 0
    [down] = [line for line in logs if line["event"] == "target_down"]
    assert down["target"] == dead[7:-8] and "Connection refused" in down["reason"]


def test_serve_with_a_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("deployments:\n  - name: chat\n    model: qwen3-8b\n    gpu: h100-sxm\n"
                      "    targets: {static: [http://127.0.0.1:1/metrics]}\n    headrom: 0.5\n")
    result = subprocess.run([str(STEPBUDGET), "serve", "--config", str(config)], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2
    assert "bad.yaml:6: deployments[0].headrom: unknown key (did you mean: headroom?)" in result.stderr


@pytest.mark.e2e
def test_serve_posts_the_page_to_a_real_alertmanager(page_server: PageServer, daemons, alertmanager) -> None:
    """The daemon's own alert loop, wired by flags: at 500 tok/s the step budget (0.9/500 = 1.8 ms)
    is below the weight read alone (16.4 GB at 2 TB/s = 8 ms), so the page fires after `for`."""
    upstream = AdvancingServer(page_server)
    upstream.first_request_may_finish.set()
    process, base = start_daemon("--target", page_server.url, "--model", "qwen3-8b", "--gpu", "h100-sxm",
                                 "--deployment", "chat", "--target-tps", "500",
                                 "--alertmanager-url", alertmanager.url, "--alert-for", "1s")
    daemons.append(process)

    def page() -> list[dict[str, object]]:
        return [a for a in alertmanager.alerts() if a["labels"]["alertname"] == "StepBudgetPredictedStepOverBudget"]

    [alert] = wait_until(page, timeout_seconds=20)
    assert alert["labels"] == {"alertname": "StepBudgetPredictedStepOverBudget", "severity": "critical",
                               "deployment": "chat", "target": page_server.url[7:-8],
                               "model_name": "Qwen/Qwen3-8B", "engine": "0"}
    assert alert["generatorURL"] == f"{base}/"
    # The same alert, as the daemon itself reports it (Prometheus's /api/v1/alerts shape).
    served = requests.get(f"{base}/api/v1/alerts", timeout=5).json()
    [own] = [a for a in served["data"]["alerts"] if a["labels"]["alertname"] == "StepBudgetPredictedStepOverBudget"]
    assert served["status"] == "success" and own["state"] == "firing" and own["labels"] == alert["labels"]
    code, logs = stop_daemon(process, signal.SIGTERM)
    assert code == 0
    assert any(line["event"] == "alert_firing" for line in logs)
