"""Discovery: static URLs, DNS (bounded in time), and Kubernetes pods through lightkube.

The Kubernetes tests run lightkube against a fake API server: a stdlib HTTP server on 127.0.0.1
that answers `GET /api/v1/namespaces/NS/pods?labelSelector=...` with a PodList, reached through a
kubeconfig that points at it. It stands in for a Kubernetes API server, which cannot run here.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import structlog
from structlog.testing import capture_logs

from exporter.serve.alerting import AlertLoop
from exporter.serve.config import Alerting, config_from_mapping
from exporter.serve.discovery import Discovery, parse_label_selector, resolve_addresses, target_label
from tests.support.clocks import ManualClock
from tests.support.pages import VllmState, vllm_page
from tests.support.pollers import MakePoller, scrape
from tests.support.servers import PageServer, free_port, send_text


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


def pod(name: str, phase: str, ip: str | None, *, ready: bool | None = None, uid: str | None = None,
        app: str = "vllm", created: str = "2027-01-15T08:00:00Z", ready_changed: str | None = None,
        deleting: str | None = None) -> dict[str, object]:
    """A Pod as the API server lists it. `ready` None: Ready exactly when Running; a Pending pod has no
    Ready condition (not scheduled yet); `ready_changed` is the Ready condition's lastTransitionTime
    (default: `created`); `deleting` its deletionTimestamp (terminating)."""
    status: dict[str, object] = {"phase": phase}
    if ip:
        status["podIP"] = ip
    if ready is None:
        ready = phase == "Running"
    if phase != "Pending":
        status["conditions"] = [{"type": "Ready", "status": "True" if ready else "False",
                                 "lastTransitionTime": ready_changed or created}]
    metadata: dict[str, object] = {"name": name, "namespace": "llm", "uid": uid or f"uid-{name}",
                                   "labels": {"app": app}, "creationTimestamp": created}
    if deleting:
        metadata["deletionTimestamp"] = deleting
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "status": status}


@pytest.fixture
def fake_api(page_server: PageServer, tmp_path: Path):
    """The fake API server and a kubeconfig pointing at it."""
    state: dict[str, object] = {"pods": [], "status": 200}

    def answer(handler: BaseHTTPRequestHandler) -> None:
        if state["status"] != 200:
            send_text(handler, '{"kind":"Status","status":"Failure"}', int(state["status"]), "application/json")
            return
        # The `app=NAME` term of the selector picks the pods (enough for these tests' selectors).
        selector = parse_qs(urlsplit(handler.path).query).get("labelSelector", [""])[0]
        app = next((term.split("=", 1)[1] for term in selector.split(",") if term.startswith("app=")), None)
        items = [item for item in state["pods"] if app is None or item["metadata"]["labels"]["app"] == app]
        body = {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": items}
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


# --- Kubernetes: lifecycle and identity -------------------------------------------------------------
#
# Times: the pods' API timestamps are ISO strings; 2027-01-15T08:00:00Z is Unix 1,800,000,000 (the
# ManualClock's start), so 08:02:00Z is 1,800,000,120 and 08:05:00Z is 1,800,000,300.
T0 = 1_800_000_000.0


def kubernetes(fake_api, **spec: object) -> dict[str, object]:
    return {"namespace": "llm", "label_selector": "app=vllm", "kubeconfig": fake_api["kubeconfig"], **spec}


def test_only_ready_pods_are_polled_the_others_are_watched_and_terminating_ones_leave(fake_api) -> None:
    fake_api["pods"] = [
        pod("vllm-0", "Running", "10.1.0.5"),
        pod("vllm-1", "Running", "10.1.0.6", ready=False, ready_changed="2027-01-15T08:02:00Z"),  # loading
        pod("vllm-2", "Pending", None, created="2027-01-15T08:05:00Z"),  # not scheduled: since its creation
        pod("vllm-3", "Running", "10.1.0.7", deleting="2027-01-15T08:06:00Z"),  # Ready, but terminating
        pod("vllm-4", "Running", "10.1.0.8", ready=False, deleting="2027-01-15T08:06:00Z"),
        pod("vllm-5", "Failed", "10.1.0.9", ready=False),
    ]
    discovery = Discovery(deployments({"kubernetes": kubernetes(fake_api, startup_allowance="20m")}),
                          timeout_seconds=2)
    with capture_logs() as logs:
        found = discovery.discover()
    assert [(t.url, t.pod, t.uid) for t in found] == [("http://10.1.0.5:8000/metrics", "vllm-0", "uid-vllm-0")]
    assert [(p.pod, p.uid, p.since_seconds, p.startup_allowance_seconds, p.phase) for p in discovery.not_ready()] == [
        ("vllm-1", "uid-vllm-1", T0 + 120, 1200.0, "Running"), ("vllm-2", "uid-vllm-2", T0 + 300, 1200.0, "Pending")]
    [line] = [line for line in logs if line["event"] == "discovery_not_ready"]
    assert [entry.split(" ")[0] for entry in line["pods"]] == ["vllm-1", "vllm-2"]

    # The API fails: the last good lists stand, the not-Ready pods' too.
    fake_api["status"] = 403
    assert [t.pod for t in discovery.discover()] == ["vllm-0"]
    assert [p.pod for p in discovery.not_ready()] == ["vllm-1", "vllm-2"]

    # vllm-1 turns Ready (polled from now on); vllm-0 starts terminating (gone at once, Ready or not).
    fake_api["status"] = 200
    fake_api["pods"] = [pod("vllm-0", "Running", "10.1.0.5", deleting="2027-01-15T08:20:00Z"),
                        pod("vllm-1", "Running", "10.1.0.6", ready_changed="2027-01-15T08:19:00Z"),
                        pod("vllm-2", "Pending", None, created="2027-01-15T08:05:00Z")]
    assert [t.pod for t in discovery.discover()] == ["vllm-1"]
    assert [p.pod for p in discovery.not_ready()] == ["vllm-2"]


def test_the_startup_allowance_defaults_to_15_minutes(fake_api) -> None:
    (deployment,) = deployments({"kubernetes": kubernetes(fake_api)})
    assert deployment.kubernetes is not None and deployment.kubernetes.startup_allowance_seconds == 900.0


@pytest.mark.slow  # 1.6 s
def test_a_loading_pod_raises_no_target_down_and_past_its_allowance_the_startup_warning(
        fake_api, make_page_server: Callable[[], PageServer], clock: ManualClock, make_poller: MakePoller) -> None:
    """Deployment `big`: its one pod, vllm-big-0, has been Running but not Ready since T0 (its model
    loading). Polled, it would fail (nothing listens on its port) and raise StepBudgetTargetDown after 5m;
    it is not polled. With a 15m (900 s) allowance and the rule's `for: 1m`, polled every 60 s: at
    T0 + 900 it is exactly at the allowance (no alert), at T0 + 960 over it (pending), at T0 + 1020 firing
    with 1,020 s not Ready. Then it starts terminating: dropped at once, the warning resolves."""
    page_server = make_page_server()  # vllm-0's server (the fake API has its own)
    page_server.serve_text(vllm_page(VllmState()))
    port = int(page_server.url.split(":")[2].split("/")[0])
    big = [pod("vllm-big-0", "Running", "127.0.0.1", ready=False, app="vllm-big")]
    fake_api["pods"] = [pod("vllm-0", "Running", "127.0.0.1"), *big]
    config = config_from_mapping({"poll_interval": "60s", "deployments": [
        {"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
         "targets": {"kubernetes": kubernetes(fake_api, port=port)}},
        {"name": "big", "model": "qwen3-8b", "gpu": "h100-sxm",
         "targets": {"kubernetes": kubernetes(fake_api, label_selector="app=vllm-big", port=free_port(),
                                              startup_allowance="15m")}}]})
    poller = make_poller(config, clock)
    alerts = AlertLoop(Alerting(), poll_interval_seconds=60, clock=clock)
    poller.add_listener(alerts.on_poll)

    seen: dict[int, dict[str, tuple[str, str]]] = {}
    for minute in range(1, 18):
        clock.now = T0 + 60 * minute
        poller.poll_once()
        seen[minute] = {a["labels"]["alertname"]: (a["state"], a["value"]) for a in alerts.active()}
    assert all("StepBudgetTargetDown" not in active for active in seen.values())
    assert all("StepBudgetTargetNotReady" not in seen[minute] for minute in range(1, 16))
    assert seen[16]["StepBudgetTargetNotReady"] == ("pending", "960.0")
    assert seen[17]["StepBudgetTargetNotReady"] == ("firing", "1020.0")
    [firing] = [a for a in alerts.firing() if a["alertname"] == "StepBudgetTargetNotReady"]
    assert firing == {"alertname": "StepBudgetTargetNotReady", "deployment": "big", "namespace": "llm",
                      "pod": "vllm-big-0"}

    exported = scrape(config, poller)
    assert [(labels["pod"], labels.get("deployment")) for labels, _ in exported["stepbudget_target_up"]] == [
        ("vllm-0", "chat")]
    assert exported["stepbudget_target_not_ready_since_timestamp_seconds"] == [
        ({"deployment": "big", "namespace": "llm", "pod": "vllm-big-0"}, T0)]
    assert sorted((labels["deployment"], value)
                  for labels, value in exported["stepbudget_target_startup_allowance_seconds"]) == [
        ("big", 900.0), ("chat", 900.0)]

    fake_api["pods"] = [pod("vllm-0", "Running", "127.0.0.1"),
                        pod("vllm-big-0", "Running", "127.0.0.1", ready=False, app="vllm-big",
                            deleting="2027-01-15T08:17:30Z")]
    clock.now = T0 + 60 * 18
    with capture_logs() as logs:
        poller.poll_once()
    assert not any(a["labels"]["alertname"] == "StepBudgetTargetNotReady" for a in alerts.active())
    assert [line["alertname"] for line in logs if line["event"] == "alert_resolved"] == ["StepBudgetTargetNotReady"]
    assert "stepbudget_target_not_ready_since_timestamp_seconds" not in scrape(config, poller)
    assert [state.target.pod for state in poller.target_states()] == ["vllm-0"]


def busy(generation_tokens: float) -> str:
    """One engine that has sampled `generation_tokens` tokens, each observed at 20 ms (in the 25 ms bucket)."""
    return vllm_page(VllmState(running=4, generation_tokens=generation_tokens, itl_count=generation_tokens,
                               itl_sum=0.02 * generation_tokens,
                               itl_buckets={0.01: 0, 0.025: generation_tokens, 0.05: generation_tokens,
                                            0.1: generation_tokens}))


def test_a_new_pod_at_an_old_pods_ip_carries_its_own_name_on_every_series_and_alert(
        fake_api, make_page_server: Callable[[], PageServer], clock: ManualClock, make_poller: MakePoller) -> None:
    """vllm-0 (uid a) at 127.0.0.1 is polled; it is deleted, and vllm-7 (uid b) gets the same IP. The
    new pod is a new target: its first poll has no window (the old pod's 1,000 tokens are no start for
    it: from them, 2,000 - 1,000 tokens in 40 - 20 s would read 20 ms a step), its series and its
    StepBudgetTargetDown carry vllm-7, and nothing of vllm-0 is exported."""
    page_server = make_page_server()  # the pods' server (the fake API has its own)
    port = int(page_server.url.split(":")[2].split("/")[0])
    config = config_from_mapping({"poll_interval": "60s", "stale_after": "3m", "deployments": [
        {"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"kubernetes": kubernetes(
            fake_api, port=port)}}]})
    poller = make_poller(config, clock)
    alerts = AlertLoop(Alerting(), poll_interval_seconds=60, clock=clock)
    poller.add_listener(alerts.on_poll)

    fake_api["pods"] = [pod("vllm-0", "Running", "127.0.0.1", uid="a")]
    page_server.serve_text(busy(1000))
    clock.now = T0 + 60
    (first,) = poller.poll_once().readings
    assert first.pod == "vllm-0"

    fake_api["pods"] = [pod("vllm-7", "Running", "127.0.0.1", uid="b")]
    page_server.serve_text(busy(2000))
    clock.now = T0 + 120
    with capture_logs() as logs:
        (second,) = poller.poll_once().readings
    assert (second.pod, second.target_up, second.measured_step_seconds) == ("vllm-7", True, None)
    assert "first poll: no window yet" in second.notes
    [replaced] = [line for line in logs if line["event"] == "target_replaced"]
    assert (replaced["pod"], replaced["replaced_pod"], replaced["target"]) == ("vllm-7", "vllm-0", f"127.0.0.1:{port}")

    page_server.serve_text("oops", status=500)
    for minute in range(3, 9):  # down from 3m: TargetDown pending at 3m, firing at 8m
        clock.now = T0 + 60 * minute
        readings = poller.poll_once().readings
        assert [(r.pod, r.target_up) for r in readings] == [("vllm-7", False)]
    [down] = [a for a in alerts.firing() if a["alertname"] == "StepBudgetTargetDown"]
    assert down["pod"] == "vllm-7"
    exported = scrape(config, poller)
    assert {labels["pod"] for samples in exported.values() for labels, _ in samples if "pod" in labels} == {"vllm-7"}
