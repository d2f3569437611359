"""The parsed config: the frozen dataclasses a config file becomes (Config, Deployment, its targets,
auth and TLS) and the defaults they share with the key tables.

Why a module of its own: every reader of a config (discovery, the poller, the collector, the optional
sections' checks) needs these types and none of the parsing; a section's module can name `Config`
without importing the module that lists the sections, so no import knot forms around the config.
The config is data read once at load: what changes while the daemon runs (the setup the online fit
publishes) lives with its owner (exporter.serve.setups_in_use), not here.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from exporter.capacity import model
from exporter.capacity.architecture import Architecture
from exporter.capacity.deployment import ResolvedSetup
from exporter.serve.alert_rules import AlertSettings
from exporter.serve.online_settings import Settings as OnlineSettings

DEFAULT_MAX_RESPONSE_BYTES = 4 * 2**20
# One answer holds a whole deployment's series (~20 KB of JSON per vLLM engine): 10,000 engines fit.
DEFAULT_PROMETHEUS_RESPONSE_BYTES = 512 * 2**20
# The query may take this share of a poll: docs/scaling.md measures ~10 s per 2,000 engines, and a poll
# still ending before the next is due is not skipped by the scheduler.
DEFAULT_QUERY_TIMEOUT_SHARE = 0.8
DEFAULT_STALE_AFTER_SECONDS = 60.0
# How long a Kubernetes pod may stay not Ready before StepBudgetTargetNotReady: a 70B-class model's load
# (weights from a volume or a registry, CUDA graphs, warm-up) takes 5-10 minutes on one node.
DEFAULT_STARTUP_ALLOWANCE_SECONDS = 15 * 60.0
DEFAULT_SPEED_OBJECTIVE = 0.99  # 1% of the decode tokens may stream under the target


@dataclass(frozen=True)
class DnsTargets:
    name: str
    port: int
    path: str
    scheme: str


@dataclass(frozen=True)
class KubernetesTargets:
    namespace: str
    label_selector: str
    port: int
    path: str
    scheme: str
    kubeconfig: str | None
    # How long a pod may stay not Ready before StepBudgetTargetNotReady (config `startup_allowance`).
    startup_allowance_seconds: float = DEFAULT_STARTUP_ALLOWANCE_SECONDS


class CredentialError(Exception):
    """A credential the config names cannot be read now; `reason` says which and why (never its value)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class BasicAuth:
    username: str
    password_file: str | None = None
    password_env: str | None = None

    def password(self) -> str:
        """Read at each use (a rotated Secret works); CredentialError when it cannot be."""
        if self.password_file:
            try:
                with open(self.password_file, encoding="utf-8") as handle:
                    return handle.read().strip()
            except OSError as error:
                raise CredentialError(f"basic_auth.password_file {self.password_file}: cannot be read: "
                                      f"{error.strerror or type(error).__name__}") from None
        if self.password_env:
            value = os.environ.get(self.password_env)
            if value is None:
                raise CredentialError(f"basic_auth.password_env: environment variable {self.password_env} is not set")
            return value.strip()
        return ""


@dataclass(frozen=True)
class Auth:
    bearer_token_file: str | None = None
    bearer_token_env: str | None = None
    basic_auth: BasicAuth | None = None

    def bearer_token(self) -> str | None:
        """Read at each use: Kubernetes rotates projected service-account tokens in place."""
        if self.bearer_token_file:
            with open(self.bearer_token_file, encoding="utf-8") as handle:
                return handle.read().strip() or None
        if self.bearer_token_env:
            return os.environ.get(self.bearer_token_env, "").strip() or None
        return None

    def authorization(self) -> str | None:
        """The `Authorization` header's value, read now: `Basic ...` (RFC 7617, UTF-8), `Bearer ...`, or None."""
        if self.basic_auth is not None:
            return basic_authorization(self.basic_auth.username, self.basic_auth.password())
        token = self.bearer_token()
        return f"Bearer {token}" if token else None


def basic_authorization(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode("ascii")


@dataclass(frozen=True)
class Tls:
    ca_file: str | None = None
    insecure_skip_verify: bool = False
    cert_file: str | None = None  # a client certificate (mutual TLS), its key here or in key_file
    key_file: str | None = None

    @property
    def verify(self) -> bool | str:
        """What an HTTP client's `verify` takes: False (not checked), the CA file, or True (the system's CAs)."""
        return False if self.insecure_skip_verify else (self.ca_file or True)

    @property
    def client_cert(self) -> str | tuple[str, str] | None:
        """What `requests`' `cert` takes: the certificate file, (certificate, key), or None."""
        if self.cert_file is None:
            return None
        return (self.cert_file, self.key_file) if self.key_file else self.cert_file


@dataclass(frozen=True)
class PrometheusTargets:
    """`targets.prometheus`: the engines' series read from a Prometheus-compatible query API."""

    url: str
    selector: str  # label matchers without braces, e.g. `job="vllm"`
    auth: Auth
    tls: Tls
    tenant: str | None = None
    max_response_bytes: int = DEFAULT_PROMETHEUS_RESPONSE_BYTES
    query_timeout_seconds: float = DEFAULT_QUERY_TIMEOUT_SHARE * 15.0  # from poll_interval and timeout


@dataclass(frozen=True)
class Deployment:
    name: str
    model: str
    gpu: str  # the device's name (a preset's, or the one given with its numbers); the device is resolved.gpu
    tensor_parallel: int
    kv_cache_dtype: str
    kind: str  # the servers' page format: "auto" or an engine adapter's kind (server_kind)
    target_tokens_per_second: float
    headroom: float
    resolved: ResolvedSetup
    static_urls: tuple[str, ...] = ()
    dns: DnsTargets | None = None
    kubernetes: KubernetesTargets | None = None
    auth: Auth = field(default_factory=Auth)
    tls: Tls = field(default_factory=Tls)
    prometheus: PrometheusTargets | None = None
    online_calibration: OnlineSettings | None = None
    role: str = "auto"  # auto | prefill | decode | both (SERVER_ROLES)
    speed_objective: float = DEFAULT_SPEED_OBJECTIVE  # share of decode tokens to stream at the target or faster
    scales_to_zero: bool = False  # no server at times on purpose: no StepBudgetNoTargets

    @property
    def mode(self) -> str:
        """How this deployment's servers are read: `prometheus` (query API) or `pages` (fetched)."""
        return "prometheus" if self.prometheus is not None else "pages"

    @property
    def architecture(self) -> Architecture:
        return self.resolved.setup.architecture

    @property
    def step_budget_seconds(self) -> float:
        return model.step_budget_seconds(self.target_tokens_per_second, self.headroom)


@dataclass(frozen=True)
class Alerting:
    alertmanager_urls: tuple[str, ...] = ()
    for_seconds: float | None = None
    timeout_seconds: float = 5.0
    drift_for_seconds: float | None = None  # StepBudgetPredictionDrift's `for` in the loop (None: the rules file's)
    rules: Mapping[str, AlertSettings] = field(default_factory=dict)  # alerting.rules, the shorthands in
    generator_url: str | None = None
    external_labels: Mapping[str, str] = field(default_factory=dict)
    runbook_base_url: str | None = None
    auth: Auth = field(default_factory=Auth)
    tls: Tls = field(default_factory=Tls)


@dataclass(frozen=True)
class Config:
    listen: str
    poll_interval_seconds: float
    timeout_seconds: float
    stale_after_seconds: float
    max_response_bytes: int
    log_format: str
    deployments: tuple[Deployment, ...]
    alerting: Alerting = field(default_factory=Alerting)
    sections: Mapping[str, Any] = field(default_factory=dict)  # registered extension sections
    source: str = ""

    def summary(self) -> str:
        modes = sorted({mode for d in self.deployments for mode, on in
                        (("static", d.static_urls), ("dns", d.dns), ("kubernetes", d.kubernetes),
                         ("prometheus", d.prometheus)) if on})
        urls = self.alerting.alertmanager_urls
        alerting = f"alerting to {len(urls)} Alertmanager(s)" if urls else "alerting off"
        return (f"{len(self.deployments)} deployment(s) ({', '.join(d.name for d in self.deployments)}), "
                f"discovery {'+'.join(modes)}, poll every {self.poll_interval_seconds:g}s, "
                f"listen {self.listen}, {alerting}")
