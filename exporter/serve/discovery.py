"""Which model servers to poll: static URLs, every address of a DNS name, or Kubernetes pods.

Discovery runs before each poll. A source that fails (DNS timeout, API server down) keeps its last
good list and logs why, so one flaky lookup does not blank a deployment's targets; a target that
truly disappears (pod deleted, address gone from DNS) is dropped, and the poller then drops its
readings from the export.

Kubernetes pods know their lifecycle: a pod is polled only once it is Ready (vLLM opens its port long
before its model is loaded, and a page from a loading server is no reading); a pod that is not Ready
yet is listed in `not_ready()` with the time it has been so since, which the daemon exports and alerts
on past the deployment's startup allowance (StepBudgetTargetNotReady, not TargetDown); a terminating
pod (deletionTimestamp set) leaves at once. A pod's identity is its UID, not its IP: a new pod that
gets an old pod's IP is a new target (Target.uid), with its own name on every series.
"""

from __future__ import annotations

import functools
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import structlog

from exporter.serve.config_model import Deployment, DnsTargets, KubernetesTargets

log = structlog.get_logger("stepbudget.discovery")

Resolver = Callable[..., list[tuple[Any, ...]]]


@dataclass(frozen=True)
class Target:
    """One model server's metrics endpoint, as polled and as labelled."""

    deployment: str
    url: str
    # The `target` label: host:port (plus the path when it is not /metrics), like Prometheus's instance.
    target: str
    namespace: str | None = None
    pod: str | None = None
    # The pod's UID (Kubernetes discovery): what tells a new pod from an old one at the same IP. Not a
    # label; a target whose UID changes under the same URL is a new target (the poller starts afresh).
    uid: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.deployment, self.url)

    @property
    def discovery_labels(self) -> dict[str, str]:
        labels = {}
        if self.namespace is not None:
            labels["namespace"] = self.namespace
        if self.pod is not None:
            labels["pod"] = self.pod
        return labels


def target_label(url: str) -> str:
    """Unique per URL: two targets must never export the same series."""
    parts = urlsplit(url)
    label = parts.netloc + ("" if parts.path in ("", "/metrics") else parts.path)
    return label + (f"?{parts.query}" if parts.query else "")


def _host_port_url(scheme: str, host: str, port: int, path: str) -> str:
    host_text = f"[{host}]" if ":" in host else host  # IPv6 literals need brackets in URLs
    return f"{scheme}://{host_text}:{port}{path}"


# --- DNS ---------------------------------------------------------------------------------------

# getaddrinfo has no timeout and blocks in C: each lookup runs on its own daemon thread (so a stuck
# one never delays exit) and the caller stops waiting at the deadline. At most DNS_WORKERS lookups
# may be stuck at once; past that, lookups fail at once instead of piling up threads.
DNS_WORKERS = 4
_DNS_SLOTS = threading.BoundedSemaphore(DNS_WORKERS)


def resolve_addresses(name: str, port: int, timeout_seconds: float,
                      resolver: Resolver = socket.getaddrinfo) -> list[str]:
    """Every distinct IP `name` resolves to (a headless Service gives one per ready pod), sorted."""
    if not _DNS_SLOTS.acquire(timeout=timeout_seconds):
        raise TimeoutError(f"DNS lookup of {name!r}: all {DNS_WORKERS} resolver workers are stuck")
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def lookup() -> None:
        try:
            outcome["infos"] = resolver(name, port, 0, socket.SOCK_STREAM)
        except BaseException as error:  # handed to the caller
            outcome["error"] = error
        finally:
            _DNS_SLOTS.release()
            done.set()

    threading.Thread(target=lookup, name="stepbudget-dns", daemon=True).start()
    if not done.wait(timeout_seconds):
        raise TimeoutError(f"DNS lookup of {name!r} took longer than {timeout_seconds:g}s")
    if "error" in outcome:
        raise outcome["error"]
    return sorted({str(info[4][0]) for info in outcome["infos"]})


# --- Kubernetes --------------------------------------------------------------------------------

_SET_SELECTOR = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQUALITY_SELECTOR = re.compile(r"^\s*(!?)\s*([\w./-]+)\s*(?:(==|=|!=)\s*([\w.-]*))?\s*$")


def parse_label_selector(selector: str) -> dict[str, Any]:
    """A Kubernetes label selector string as lightkube's `labels=` mapping.

    Supports `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k` (exists), `!k` (absent).
    """
    from lightkube import operators

    labels: dict[str, Any] = {}
    for term in _split_selector(selector):
        set_match = _SET_SELECTOR.match(term)
        if set_match:
            key, op, values = set_match.groups()
            items = [value.strip() for value in values.split(",") if value.strip()]
            labels[key] = operators.in_(items) if op == "in" else operators.not_in(items)
            continue
        match = _EQUALITY_SELECTOR.match(term)
        if not match:
            raise ValueError(f"cannot read label selector term {term!r}")
        negated, key, op, value = match.groups()
        if negated:
            labels[key] = operators.not_exists()
        elif op is None:
            labels[key] = None  # exists
        elif op == "!=":
            labels[key] = operators.not_equal(value)
        else:
            labels[key] = value
    return labels


def _split_selector(selector: str) -> list[str]:
    """Split on commas outside parentheses."""
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    return [term for term in [*terms, current] if term.strip()]


@dataclass(frozen=True)
class PodAddress:
    name: str
    ip: str
    uid: str | None = None


@dataclass(frozen=True)
class NotReadyPod:
    """A pod the selector matches that is not Ready yet (or no longer): not polled, watched.

    `since_seconds` is when it last became not Ready (its Ready condition's lastTransitionTime), or
    its creation when it has no Ready condition yet (still being scheduled): Unix seconds, the
    API server's clock. Exported as stepbudget_target_not_ready_since_timestamp_seconds; past
    `startup_allowance_seconds` it raises StepBudgetTargetNotReady.
    """

    deployment: str
    namespace: str
    pod: str
    uid: str | None
    since_seconds: float
    startup_allowance_seconds: float
    phase: str

    @property
    def labels(self) -> dict[str, str]:
        return {"deployment": self.deployment, "namespace": self.namespace, "pod": self.pod}

    def not_ready_seconds(self, now_seconds: float) -> float:
        return now_seconds - self.since_seconds


@dataclass(frozen=True)
class WaitingPod:
    """A pod of the listing that is not Ready: its name, UID, phase, and since when (None: the API
    gave no time; discovery then counts from when it first saw it)."""

    name: str
    uid: str | None
    since_seconds: float | None
    phase: str


def kubernetes_client(kubeconfig: str | None, timeout_seconds: float) -> Any:
    """In-cluster config when running in a pod, else the kubeconfig file ($KUBECONFIG, ~/.kube/config)."""
    import httpx2
    from lightkube import Client
    from lightkube.config.kubeconfig import KubeConfig

    config = KubeConfig.from_file(kubeconfig) if kubeconfig else KubeConfig.from_env()
    return Client(config, timeout=httpx2.Timeout(timeout_seconds), trust_env=False)


def _timestamp(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def _ready_condition(status: Any) -> Any:
    return next((c for c in (status.conditions or []) if c.type == "Ready"), None) if status is not None else None


def list_pods(client: Any, spec: KubernetesTargets) -> tuple[list[PodAddress], list[WaitingPod]]:
    """Pods matching the selector, sorted by name: those Running, Ready and with an IP are polled; those
    Pending or Running but not Ready are reported as not ready; terminating pods (deletionTimestamp set)
    and finished ones (Succeeded, Failed) are neither."""
    from lightkube.resources.core_v1 import Pod

    pods = client.list(Pod, namespace=spec.namespace, labels=parse_label_selector(spec.label_selector))
    ready: list[PodAddress] = []
    waiting: list[WaitingPod] = []
    for pod in sorted(pods, key=lambda pod: pod.metadata.name):
        metadata, status = pod.metadata, pod.status
        if metadata.deletionTimestamp is not None:
            continue  # terminating: its server is shutting down, its page soon gone
        phase = status.phase if status is not None and status.phase else "Pending"
        if phase not in ("Pending", "Running"):
            continue
        condition = _ready_condition(status)
        if phase == "Running" and condition is not None and condition.status == "True" and status.podIP:
            ready.append(PodAddress(name=metadata.name, ip=status.podIP, uid=metadata.uid))
            continue
        since = (_timestamp(condition.lastTransitionTime) if condition is not None else None) \
            or _timestamp(metadata.creationTimestamp)
        waiting.append(WaitingPod(metadata.name, metadata.uid, since, phase))
    return ready, waiting


# --- all sources -------------------------------------------------------------------------------


class Discovery:
    """Turns each deployment's `targets` into the current list of Targets."""

    def __init__(self, deployments: Sequence[Deployment], *, timeout_seconds: float,
                 resolver: Resolver = socket.getaddrinfo,
                 kubernetes_client_factory: Callable[[str | None, float], Any] = kubernetes_client,
                 clock: Callable[[], float] = time.time) -> None:
        self._deployments = tuple(deployments)
        # Static targets never change: built once, not at every poll.
        self._static = tuple([Target(d.name, url, target_label(url)) for url in d.static_urls]
                             for d in self._deployments)
        self._timeout_seconds = timeout_seconds
        self._resolver = resolver
        self._client_factory = kubernetes_client_factory
        self._clients: dict[str | None, Any] = {}
        # Last good answer per (deployment, source), kept when a lookup fails.
        self._last: dict[tuple[str, str], list[Target]] = {}
        self._last_error: dict[tuple[str, str], str] = {}
        # Per deployment, the pods of its last good Kubernetes listing that are not Ready (kept, like the
        # targets, when a listing fails); and when discovery first saw a pod the API gave no time for.
        self._not_ready: dict[str, list[NotReadyPod]] = {}
        self._first_seen: dict[tuple[str, str], float] = {}
        self._clock = clock

    def not_ready(self) -> list[NotReadyPod]:
        """The pods the last good listings found not Ready, every Kubernetes deployment's (not polled)."""
        return [pod for pods in self._not_ready.values() for pod in pods]

    def discover(self) -> list[Target]:
        targets: list[Target] = []
        for deployment, static in zip(self._deployments, self._static, strict=True):
            targets += static
            if deployment.dns is not None:
                targets += self._guarded(deployment, "dns",
                                         functools.partial(self._dns, deployment.name, deployment.dns))
            if deployment.kubernetes is not None:
                targets += self._guarded(deployment, "kubernetes",
                                         functools.partial(self._kubernetes, deployment.name, deployment.kubernetes))
        unique: dict[tuple[str, str], Target] = {}
        for target in targets:
            unique.setdefault(target.key, target)
        return list(unique.values())

    def _guarded(self, deployment: Deployment, source: str, lookup: Callable[[], list[Target]]) -> list[Target]:
        key = (deployment.name, source)
        try:
            found = lookup()
        except Exception as error:  # any discovery failure keeps the last good list
            kept = self._last.get(key, [])
            reason = f"{type(error).__name__}: {error}"[:300]
            if self._last_error.get(key) != reason:  # once per change, not once per poll
                log.warning("discovery_failed", deployment=deployment.name, source=source, reason=reason,
                            kept_targets=len(kept))
            self._last_error[key] = reason
            return kept
        if key in self._last_error:
            log.info("discovery_recovered", deployment=deployment.name, source=source)
            del self._last_error[key]
        if [(t.url, t.pod, t.uid) for t in found] != [(t.url, t.pod, t.uid) for t in self._last.get(key, [])]:
            log.info("discovery_changed", deployment=deployment.name, source=source,
                     targets=[t.target for t in found])
        self._last[key] = found
        return found

    def _dns(self, deployment: str, spec: DnsTargets) -> list[Target]:
        addresses = resolve_addresses(spec.name, spec.port, self._timeout_seconds, self._resolver)
        urls = [_host_port_url(spec.scheme, address, spec.port, spec.path) for address in addresses]
        return [Target(deployment, url, target_label(url)) for url in urls]

    def _kubernetes(self, deployment: str, spec: KubernetesTargets) -> list[Target]:
        if spec.kubeconfig not in self._clients:
            self._clients[spec.kubeconfig] = self._client_factory(spec.kubeconfig, self._timeout_seconds)
        pods, waiting = list_pods(self._clients[spec.kubeconfig], spec)
        targets = []
        for pod in pods:
            url = _host_port_url(spec.scheme, pod.ip, spec.port, spec.path)
            targets.append(Target(deployment, url, target_label(url), namespace=spec.namespace, pod=pod.name,
                                  uid=pod.uid))
        self._keep_not_ready(deployment, spec, waiting)
        return targets

    def _keep_not_ready(self, deployment: str, spec: KubernetesTargets, waiting: list[WaitingPod]) -> None:
        now = self._clock()
        seen = {(deployment, pod.uid or pod.name) for pod in waiting}
        for key in [key for key in self._first_seen if key[0] == deployment and key not in seen]:
            del self._first_seen[key]  # Ready or gone: forgotten, so the map stays as small as the listing
        found = []
        for pod in waiting:
            since = pod.since_seconds
            if since is None:
                since = self._first_seen.setdefault((deployment, pod.uid or pod.name), now)
            found.append(NotReadyPod(deployment, spec.namespace, pod.name, pod.uid, since,
                                     spec.startup_allowance_seconds, pod.phase))
        before = self._not_ready.get(deployment, [])
        if [(p.pod, p.uid) for p in found] != [(p.pod, p.uid) for p in before]:
            # Once per change, not once per poll: which pods are coming up (or stuck), and since when.
            log.info("discovery_not_ready", deployment=deployment, source="kubernetes",
                     pods=[f"{p.pod} ({p.phase}, not Ready for {max(0.0, now - p.since_seconds):.0f}s)"
                           for p in found])
        self._not_ready[deployment] = found
