"""Discovery: static URLs, DNS (bounded in time), and Kubernetes pods through lightkube.

The Kubernetes tests run lightkube against a fake API server: a stdlib HTTP server on 127.0.0.1
that answers `GET /api/v1/namespaces/NS/pods?labelSelector=...` with a PodList, reached through a
kubeconfig that points at it. It stands in for a Kubernetes API server, which cannot run here.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import structlog
from structlog.testing import capture_logs

from exporter.serve.config import config_from_mapping
from exporter.serve.discovery import Discovery, parse_label_selector, resolve_addresses, target_label
from tests.support.servers import PageServer, send_text


@pytest.fixture(autouse=True)
def _reset_structlog():
    yield
    structlog.reset_defaults()


def deployments(targets: dict[str, object]):
    return config_from_mapping({"deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                                                 "targets": targets}]}).deployments


def test_static_targets_and_their_labels() -> None:
    found = Discovery(deployments({"static": ["http://10.0.0.5:8000/metrics", "https://vllm.example:443/v1/metrics"]}),
                      timeout_seconds=1).discover()
    assert [(t.url, t.target, t.discovery_labels) for t in found] == [
        ("http://10.0.0.5:8000/metrics", "10.0.0.5:8000", {}),
        ("https://vllm.example:443/v1/metrics", "vllm.example:443/v1/metrics", {}),
    ]
    assert target_label("http://[fd00::5]:8000/metrics") == "[fd00::5]:8000"
    # Two URLs never share a target label (they would export duplicate series).
    assert target_label("http://gw:80/metrics?pod=a") != target_label("http://gw:80/metrics?pod=b")


# --- DNS ------------------------------------------------------------------------------------------


def fake_resolver(answers: dict[str, list[str]]):
    def resolve(name: str, port: int, family: int = 0, kind: int = 0):
        if name not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
                for ip in answers[name]]
    return resolve


def test_dns_gives_one_target_per_address_and_drops_gone_ones() -> None:
    answers = {"vllm.llm.svc": ["10.0.0.6", "10.0.0.5", "10.0.0.6", "fd00::7"]}
    discovery = Discovery(deployments({"dns": {"name": "vllm.llm.svc", "port": 8000}}), timeout_seconds=1,
                          resolver=fake_resolver(answers))
    assert [t.url for t in discovery.discover()] == [
        "http://10.0.0.5:8000/metrics", "http://10.0.0.6:8000/metrics", "http://[fd00::7]:8000/metrics"]
    answers["vllm.llm.svc"] = ["10.0.0.6"]
    assert [t.target for t in discovery.discover()] == ["10.0.0.6:8000"]


def test_dns_resolution_is_bounded_in_time_and_a_failure_keeps_the_last_list() -> None:
    """getaddrinfo has no timeout; a lookup that hangs is abandoned after the timeout."""
    release = threading.Event()
    hang = {"on": False}
    good = fake_resolver({"vllm.llm.svc": ["10.0.0.5"]})

    def resolver(*args):
        if hang["on"]:
            release.wait(10)
        return good(*args)

    discovery = Discovery(deployments({"dns": {"name": "vllm.llm.svc", "port": 8000}}), timeout_seconds=0.2,
                          resolver=resolver)
    assert [t.target for t in discovery.discover()] == ["10.0.0.5:8000"]
    hang["on"] = True
    try:
        with capture_logs() as logs:
            assert [t.target for t in discovery.discover()] == ["10.0.0.5:8000"]
    finally:
        release.set()
    [line] = [line for line in logs if line["event"] == "discovery_failed"]
    assert line["source"] == "dns" and "longer than 0.2s" in line["reason"] and line["kept_targets"] == 1


def test_dns_name_that_does_not_resolve_is_logged_once_and_its_recovery_too() -> None:
    answers: dict[str, list[str]] = {}
    discovery = Discovery(deployments({"dns": {"name": "vllm.llm.svc", "port": 8000}}), timeout_seconds=1,
                          resolver=fake_resolver(answers))
    with capture_logs() as logs:
        assert discovery.discover() == [] and discovery.discover() == []
        answers["vllm.llm.svc"] = ["10.0.0.5"]
        assert [t.target for t in discovery.discover()] == ["10.0.0.5:8000"]
    events = [line["event"] for line in logs]
    assert events == ["discovery_failed", "discovery_recovered", "discovery_changed"]
    assert "Name or service not known" in logs[0]["reason"]


def test_real_resolver_on_localhost() -> None:
    assert "127.0.0.1" in resolve_addresses("localhost", 8000, timeout_seconds=5)


# --- Kubernetes -------------------------------------------------------------------------------------


def pod(name: str, phase: str, ip: str | None) -> dict[str, object]:
    status: dict[str, object] = {"phase": phase}
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "llm"}, "status": status}


@pytest.fixture
def fake_api(page_server: PageServer, tmp_path: Path):
    """The fake API server and a kubeconfig pointing at it."""
    state: dict[str, object] = {"pods": [], "status": 200}

    def answer(handler: BaseHTTPRequestHandler) -> None:
        if state["status"] != 200:
            send_text(handler, '{"kind":"Status","status":"Failure"}', int(state["status"]), "application/json")
            return
        body = {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": state["pods"]}
        send_text(handler, json.dumps(body), 200, "application/json")

    page_server.respond = answer
    base = page_server.url.removesuffix("/metrics")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": base}}],
        "users": [{"name": "reader", "user": {"token": "fake-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "reader", "namespace": "default"}}],
    }))
    state["kubeconfig"] = str(kubeconfig)
    state["server"] = page_server
    return state


def test_kubernetes_pods_become_targets_with_namespace_and_pod_labels(fake_api) -> None:
    fake_api["pods"] = [pod("vllm-1", "Running", "10.1.0.6"), pod("vllm-0", "Running", "10.1.0.5"),
                        pod("vllm-2", "Pending", None), pod("vllm-3", "Running", None),
                        pod("vllm-4", "Succeeded", "10.1.0.9")]
    spec = {"namespace": "llm", "label_selector": "app=vllm,tier!=batch", "port": 8000,
            "kubeconfig": fake_api["kubeconfig"]}
    discovery = Discovery(deployments({"kubernetes": spec}), timeout_seconds=2)
    found = discovery.discover()
    assert [(t.url, t.pod, t.namespace) for t in found] == [
        ("http://10.1.0.5:8000/metrics", "vllm-0", "llm"), ("http://10.1.0.6:8000/metrics", "vllm-1", "llm")]
    request = fake_api["server"].requests[-1]
    path = urlsplit(request["path"])
    assert path.path == "/api/v1/namespaces/llm/pods"
    assert parse_qs(path.query)["labelSelector"] == ["app=vllm,tier!=batch"]
    assert request["authorization"] == "Bearer fake-token"

    fake_api["pods"] = [pod("vllm-1", "Running", "10.1.0.6")]  # vllm-0 deleted
    assert [t.pod for t in discovery.discover()] == ["vllm-1"]


def test_kubernetes_api_failure_keeps_the_last_list(fake_api) -> None:
    fake_api["pods"] = [pod("vllm-0", "Running", "10.1.0.5")]
    spec = {"namespace": "llm", "label_selector": "app=vllm", "kubeconfig": fake_api["kubeconfig"]}
    discovery = Discovery(deployments({"kubernetes": spec}), timeout_seconds=2)
    assert [t.pod for t in discovery.discover()] == ["vllm-0"]
    fake_api["status"] = 403
    with capture_logs() as logs:
        assert [t.pod for t in discovery.discover()] == ["vllm-0"]
    [line] = [line for line in logs if line["event"] == "discovery_failed"]
    assert line["source"] == "kubernetes" and line["kept_targets"] == 1


def test_label_selector_parsing() -> None:
    from lightkube.core.selector import build_selector

    selector = "app=vllm, tier!=batch, env in (prod, canary), gpu, !draining, zone notin (a)"
    assert build_selector(parse_label_selector(selector)) == \
        "app=vllm,tier!=batch,env in (canary,prod),gpu,!draining,zone notin (a)"  # lightkube sorts set values
    with pytest.raises(ValueError):
        parse_label_selector("app=vllm,=oops")
