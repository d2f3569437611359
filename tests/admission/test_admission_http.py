"""The admission API on a running daemon, over real HTTP on 127.0.0.1, through the Python client.

The daemon polls a simulated vLLM server (also on 127.0.0.1) once, so its admission book holds a
real Reading's token budget; the client then admits, is refused, releases, and gets 400/401.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
import yaml

from exporter.admission import wiring as admission
from exporter.admission.client import (
    AdmissionClient,
    AdmissionError,
    AdmissionRefused,
    AdmissionUnavailable,
)
from exporter.capacity import model
from exporter.capacity.deployment import build_setup
from exporter.capacity.presets import get_model_preset
from exporter.serve import daemon as daemon_module
from exporter.serve.config import config_from_mapping
from exporter.simulator import ServerSpec, start_server
from tests.support.admission import RunningDaemon, daemon_with_admission
from tests.support.servers import free_port, wait_until

TOKEN = "gateway-token-123"
TIMEOUT_SECONDS = 5.0


def chat_budget_tokens() -> float:
    """Qwen3-8B on an H100 SXM at the default 50 tok/s and 0.9 headroom, by the capacity model."""
    setup = build_setup(get_model_preset("qwen3-8b"), "h100-sxm").setup
    return model.token_budget_tokens(setup, model.step_budget_seconds(50.0, 0.9))


@pytest.fixture()
def running(tmp_path: Path) -> Iterator[RunningDaemon]:
    with daemon_with_admission(tmp_path, TOKEN) as daemon:
        yield daemon


def test_admit_refuse_release_over_http_with_the_client(running: RunningDaemon) -> None:
    with AdmissionClient(running.url, TOKEN, timeout_seconds=TIMEOUT_SECONDS) as client:
        first = client.admit(100_000, 10_000, deployment="chat")
        assert first.admitted and first.id and first.target and first.target.startswith("127.0.0.1:")
        assert first.tokens == 110_000
        # The simulated server is idle: nothing measured, so the budget minus this admission is left.
        assert first.tokens_left == pytest.approx(chat_budget_tokens() - 110_000, abs=1.0)
        prompt_over = int(first.tokens_left)  # with a one-token output: one token more than is left
        refused = client.admit(prompt_over, 1, deployment="chat")
        assert not refused.admitted and refused.decision == "refused"
        # The next poll, at most the default 15-s interval after the one the fixture took.
        assert refused.retry_after_seconds is not None and 1 <= refused.retry_after_seconds <= 15
        with pytest.raises(AdmissionRefused) as raised:
            with client.admitted(prompt_over, 1, deployment="chat"):
                pytest.fail("a refused request must not run the block")
        assert raised.value.result.decision == "refused"
        assert client.release(first.id) is True
        assert client.release(first.id) is False
        with client.admitted(prompt_over, 1, deployment="chat") as ticket:
            assert ticket.admitted  # the release made room
            assert running.daemon.server.registry.get_sample_value(
                "stepbudget_admitted_tokens", {"deployment": "chat", "target": ticket.target}) == ticket.tokens
        assert running.daemon.server.registry.get_sample_value(
            "stepbudget_admitted_tokens", {"deployment": "chat", "target": ticket.target}) == 0


def test_the_context_manager_releases_when_the_block_raises(running: RunningDaemon) -> None:
    client = AdmissionClient(running.url, TOKEN, timeout_seconds=TIMEOUT_SECONDS)
    with pytest.raises(RuntimeError, match="upstream failed"):
        with client.admitted(1000, 100, deployment="chat") as ticket:
            raise RuntimeError("upstream failed")
    assert client.release(ticket.id or "") is False  # already released by the context manager
    client.close()


def test_decisions_appear_on_the_daemons_metrics_page(running: RunningDaemon) -> None:
    client = AdmissionClient(running.url, TOKEN, timeout_seconds=TIMEOUT_SECONDS)
    client.admit(10, 10, deployment="chat")
    client.admit(10_000_000, 10, deployment="chat")
    page = requests.get(f"{running.url}/metrics", timeout=TIMEOUT_SECONDS).text
    assert 'stepbudget_admission_decisions_total{decision="admitted",deployment="chat"} 1.0' in page
    assert 'stepbudget_admission_decisions_total{decision="refused",deployment="chat"} 1.0' in page
    assert 'stepbudget_admission_decisions_total{decision="redirected",deployment="chat"} 0.0' in page
    client.close()


def test_a_wrong_token_is_401_and_a_bad_body_is_400_with_the_message(running: RunningDaemon) -> None:
    with pytest.raises(AdmissionError) as wrong:
        AdmissionClient(running.url, "not-the-token", timeout_seconds=TIMEOUT_SECONDS).admit(10, 10, deployment="chat")
    assert wrong.value.status == 401 and "bearer token" in wrong.value.message
    client = AdmissionClient(running.url, TOKEN, timeout_seconds=TIMEOUT_SECONDS)
    with pytest.raises(AdmissionError) as unknown:
        client.admit(10, 10, deployment="chta")
    assert unknown.value.status == 400 and "unknown deployment 'chta'" in unknown.value.message
    with pytest.raises(AdmissionError) as negative:
        client.admit(-1, 10, deployment="chat")
    assert negative.value.status == 400 and "'prompt_tokens' must be at least 1" in negative.value.message
    raw = requests.post(f"{running.url}/v1/admission", data=b"{oops", timeout=TIMEOUT_SECONDS,
                        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]
    assert raw.headers["Content-Type"] == "application/json"
    client.close()


def test_an_unreachable_daemon_raises_unavailable_within_the_timeout() -> None:
    port = free_port()  # free a moment ago: nothing listens there
    client = AdmissionClient(f"http://127.0.0.1:{port}", TOKEN, timeout_seconds=0.5)
    with pytest.raises(AdmissionUnavailable):
        client.admit(10, 10, deployment="chat")
    client.close()


def test_admission_is_off_by_default_and_its_routes_are_absent(tmp_path: Path) -> None:
    config = config_from_mapping({
        "listen": "127.0.0.1:0",
        "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                         "targets": {"static": ["http://127.0.0.1:9/metrics"]}}],
    })
    daemon = daemon_module.build_daemon(config)
    try:
        admission.install(daemon)
        daemon.server.start()
        answer = requests.post(f"http://127.0.0.1:{daemon.server.port}/v1/admission", timeout=TIMEOUT_SECONDS,
                               data=json.dumps({"deployment": "chat", "prompt_tokens": 1, "max_output_tokens": 1}))
        assert answer.status_code == 404
        assert daemon.server.registry.get_sample_value(
            "stepbudget_admission_decisions_total", {"deployment": "chat", "decision": "admitted"}) is None
    finally:
        daemon.server.stop()
        daemon.poller.stop()
        daemon.fetcher.close()


def test_a_keep_alive_connection_the_daemon_closed_is_reopened_without_asking_twice() -> None:
    """A server that closes every connection after answering, without saying so: the client's
    second call finds its kept-alive socket dead and sends once more on a fresh one."""
    received: list[bytes] = []

    class ClosingHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # http.server's naming
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            body = json.dumps({"decision": "admitted", "deployment": "chat", "pool": None, "tokens": 2,
                               "tokens_left": 0, "reason": "test", "id": f"id-{len(received)}"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True  # closed without a `Connection: close` header

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), ClosingHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with AdmissionClient(url, TOKEN, timeout_seconds=TIMEOUT_SECONDS) as client:
            assert client.admit(1, 1, deployment="chat").id == "id-1"
            assert client.admit(1, 1, deployment="chat").id == "id-2"
        assert len(received) == 2
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_stepbudget_serve_with_an_admission_config_serves_the_api(tmp_path: Path) -> None:
    """The real `stepbudget serve` process: the optional module's config sections exist before the
    file is read, and its hook adds the routes."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    simulated = start_server("127.0.0.1", 0, None, 1.0, ServerSpec())
    listen_port = free_port()
    config_file = tmp_path / "stepbudget.yaml"
    config_file.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{listen_port}", "poll_interval": "1s", "log_format": "json",
        "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                         "targets": {"static": [f"{simulated.url}/metrics"]}}],
        "admission": {"enabled": True, "token_file": str(token_file)},
    }))
    process = subprocess.Popen([sys.executable, "-m", "exporter.cli", "serve", "--config", str(config_file)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{listen_port}"
    try:
        wait_until(lambda: requests.get(f"{base}/-/ready", timeout=1).status_code == 200, timeout_seconds=20)
        with AdmissionClient(base, TOKEN, timeout_seconds=TIMEOUT_SECONDS) as client:
            result = client.admit(1000, 100, deployment="chat")
            assert result.admitted and result.target == f"127.0.0.1:{simulated.port}"
            assert client.release(result.id or "")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
        simulated.stop()
