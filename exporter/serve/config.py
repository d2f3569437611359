"""The daemon's YAML config: a declarative key table, validation with file lines, and `check-config`.

Why a table: every key has one place that says its type, default and meaning, so validation,
defaults, `docs/operations.md`, the chart's JSON schema and flag overrides cannot drift apart. The
optional sections (`shard`, `admission`, `pools`) are declared next to their features with the
public validators of `exporter/config_validators.py` and listed here, in `daemon_sections`, the
one place that says what a config may hold (`top_level_keys` joins them to the core keys): whether
a config is valid never depends on which modules happen to be imported. A bad key is reported as
`FILE:LINE: PATH: problem`, where PATH reads like `deployments[1].targets.static[0]`, and the CLI
exits 2.

`stepbudget check-config` runs `run` below; it imports the config's own modules only, never the
daemon's poller or server.
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import yaml

from exporter.admission.sections import ADMISSION_SECTION, POOLS_SECTION
from exporter.capacity import model
from exporter.capacity.deployment import ResolvedSetup, build_setup, load_architecture
from exporter.capacity.model import Architecture, ServingSetup
from exporter.capacity.presets import (
    CUSTOM_GPU,
    FIGURE_KEYS,
    DeviceFigures,
    Gpu,
    device,
    get_gpu,
    require_figures,
)
from exporter.config_validators import (
    REQUIRED,
    ConfigError,
    Invalid,
    Key,
    LineDict,
    LineList,
    Parser,
    Section,
    Table,
    Where,
    bandwidth,
    boolean,
    choice,
    duration,
    existing_file,
    flops,
    label_set,
    list_of,
    non_negative,
    non_negative_seconds,
    one_of_keys,
    port,
    positive,
    promql_selector,
    ratio,
    section,
    size,
    string,
    url,
    url_list,
    url_path,
    whole_positive,
)
from exporter.errors import InputError
from exporter.redaction import redact
from exporter.serve.alert_rules import packaged_for_seconds
from exporter.serve.online_calibration import Settings as OnlineSettings
from exporter.serve.online_calibration import SetupInUse
from exporter.serve.sharding import SHARD_SECTION

# The public names; ConfigError, Key, REQUIRED, Section, Table, Where, LineDict and `section` are
# re-exported from config_validators so `from exporter.serve.config import ConfigError` keeps working.
__all__ = [
    "ALERTING_KEYS",
    "AUTH_CHECK",
    "AUTH_KEYS",
    "BASIC_AUTH_KEYS",
    "CALIBRATION_NUMBERS",
    "CALIBRATION_REQUIRED_KEYS",
    "CORE_KEYS",
    "CUSTOM_DEVICE_KEYS",
    "DEFAULTS_KEYS",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DEFAULT_PROMETHEUS_RESPONSE_BYTES",
    "DEFAULT_QUERY_TIMEOUT_SHARE",
    "DEFAULT_STALE_AFTER_SECONDS",
    "DEPLOYMENT_KEYS",
    "DNS_KEYS",
    "GPU_KEYS",
    "KUBERNETES_KEYS",
    "LOG_FORMATS",
    "PROMETHEUS_KEYS",
    "REQUIRED",
    "SERVER_KINDS",
    "SERVER_ROLES",
    "TARGETS_KEYS",
    "TLS_KEYS",
    "TOP_LEVEL_KEYS",
    "Alerting",
    "Auth",
    "BasicAuth",
    "Config",
    "ConfigError",
    "CredentialError",
    "Deployment",
    "DnsTargets",
    "Key",
    "KubernetesTargets",
    "LineDict",
    "PrometheusTargets",
    "Section",
    "Table",
    "Tls",
    "Where",
    "auth_from",
    "basic_auth_check",
    "basic_authorization",
    "build_parser",
    "config_from_mapping",
    "daemon_sections",
    "empty_document",
    "gpu_check",
    "gpu_device",
    "gpu_preset",
    "listen_address",
    "load_config",
    "parse_listen",
    "read_document",
    "run",
    "section",
    "targets_check",
    "tls_check",
    "top_level_keys",
]

SERVER_KINDS = ("auto", "vllm", "sglang", "tgi")  # the page format: a server's `kind`
# What a server does in a prefill/decode (P/D) split; auto reads it off the page (reading.server_role).
SERVER_ROLES = ("auto", "prefill", "decode", "both")
LOG_FORMATS = ("auto", "json", "console")
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


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that keeps line numbers and rejects duplicate keys (PyYAML keeps the last)."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> LineDict:
    loader.flatten_mapping(node)
    result = LineDict(line=node.start_mark.line + 1)
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in result:
            raise ConfigError(f"line {key_node.start_mark.line + 1}: key {key!r} appears twice in one mapping")
        result[key] = loader.construct_object(value_node, deep=True)
        result.key_lines[key] = key_node.start_mark.line + 1
    return result


def _construct_sequence(loader: _LineLoader, node: yaml.SequenceNode) -> LineList:
    return LineList((loader.construct_object(child, deep=True) for child in node.value),
                    line=node.start_mark.line + 1, item_lines=[child.start_mark.line + 1 for child in node.value])


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)

# --- the key tables --------------------------------------------------------------------------

def targets_check(result: dict[str, Any], where: Where) -> None:
    """A deployment with no target source would poll nothing, silently; one that read Prometheus
    and also polled pages would read the same servers twice, as two sets of targets."""
    if not any(result[name] for name in ("static", "dns", "kubernetes", "prometheus")):
        raise Invalid("give at least one of static, dns, kubernetes, prometheus")
    if result["prometheus"] and any(result[name] for name in ("static", "dns", "kubernetes")):
        raise Invalid("prometheus reads every target from Prometheus: "
                      "give it alone, not with static, dns or kubernetes")
    shown: dict[str, str] = {}
    for static_url in result["static"]:
        # Two URLs that differ only in a credential's value would show (and be labelled) as one.
        other = shown.setdefault(redact(static_url), static_url)
        if other != static_url:
            raise Invalid(f"two static URLs differ only in a credential's value ({redact(static_url)}): "
                          "their `target` labels would be the same")


DNS_KEYS: Table = {
    "name": Key(string, REQUIRED,
                "DNS name resolving to every pod, e.g. a headless Service `vllm.ns.svc.cluster.local`"),
    "port": Key(port, 8000, "port of the model server's metrics endpoint"),
    "path": Key(url_path, "/metrics", "metrics path"),
    "scheme": Key(choice("http", "https"), "http", "http or https"),
}
KUBERNETES_KEYS: Table = {
    "namespace": Key(string, REQUIRED, "namespace of the model-server pods"),
    "label_selector": Key(string, REQUIRED, "label selector of the pods, e.g. `app=vllm`"),
    "port": Key(port, 8000, "port of the metrics endpoint on each pod"),
    "path": Key(url_path, "/metrics", "metrics path"),
    "scheme": Key(choice("http", "https"), "http", "http or https"),
    "kubeconfig": Key(existing_file, None,
                      "kubeconfig file; default: in-cluster config, else $KUBECONFIG / ~/.kube/config"),
    "startup_allowance": Key(duration, DEFAULT_STARTUP_ALLOWANCE_SECONDS,
                             "how long a pod may stay not Ready (loading its model) before "
                             "StepBudgetTargetNotReady warns; not-Ready pods are never polled"),
}
BASIC_AUTH_KEYS: Table = {
    "username": Key(string, REQUIRED, "the username"),
    "password_file": Key(existing_file, None,
                         "file holding the password, e.g. a mounted Secret (re-read at every use, so a rotated one "
                         "works)"),
    "password_env": Key(string, None, "name of an environment variable holding the password"),
}


def basic_auth_check(result: dict[str, Any], where: Where) -> None:
    """The password comes from exactly one place: none given is far more often a slip than an empty password."""
    given = [name for name in ("password_file", "password_env") if result[name] is not None]
    if len(given) != 1:
        raise Invalid("give the password in one of password_file, password_env" if not given
                      else "give one of password_file, password_env, not both")


def tls_check(result: dict[str, Any], where: Where) -> None:
    """A client key is nothing without its certificate (which may hold the key itself)."""
    if result["key_file"] is not None and result["cert_file"] is None:
        raise Invalid("key_file is the private key of a client certificate: give cert_file too")


AUTH_KEYS: Table = {
    "bearer_token_file": Key(existing_file, None,
                             "file holding a bearer token (re-read at every poll, so rotated tokens work)"),
    "bearer_token_env": Key(string, None, "name of an environment variable holding a bearer token"),
    "basic_auth": Key(section(BASIC_AUTH_KEYS, check=basic_auth_check), None,
                      "HTTP basic auth: a username and a password from a file or the environment"),
}
AUTH_CHECK = one_of_keys("bearer_token_file", "bearer_token_env", "basic_auth")
TLS_KEYS: Table = {
    "ca_file": Key(existing_file, None, "CA bundle to verify the servers' certificates"),
    "insecure_skip_verify": Key(boolean, False, "do not verify certificates (testing only)"),
    "cert_file": Key(existing_file, None,
                     "client certificate (PEM) presented to the servers (mutual TLS); its key in key_file or in "
                     "this file"),
    "key_file": Key(existing_file, None, "the client certificate's private key (PEM, not encrypted)"),
}
PROMETHEUS_KEYS: Table = {
    "url": Key(url, REQUIRED,
               "base URL of the Prometheus HTTP API (Prometheus, Thanos Querier, or Mimir's `/prometheus`)"),
    "selector": Key(promql_selector, REQUIRED,
                    'label matchers of the engines\' series and their `up`, e.g. `job="vllm"`'),
    "tenant": Key(string, None, "tenant sent as `X-Scope-OrgID` (Mimir, Cortex)"),
    "auth": Key(section(AUTH_KEYS, check=AUTH_CHECK), None,
                "bearer token or basic auth for the query API (default: the deployment's `auth`)"),
    "tls": Key(section(TLS_KEYS, check=tls_check), None,
               "TLS for an https query API (default: the deployment's `tls`)"),
    "max_response_bytes": Key(size, float(DEFAULT_PROMETHEUS_RESPONSE_BYTES),
                              "a query answer larger than this is refused"),
    "query_timeout": Key(duration, None,
                         "deadline of the poll's one query, connect to last byte (default: the larger of "
                         "`timeout` and 0.8 x `poll_interval`: 12s at 15s polls, ~2,400 engines' answer)"),
}
TARGETS_KEYS: Table = {
    "static": Key(url_list, [], "list of metrics URLs, e.g. `http://10.0.0.5:8000/metrics`"),
    "dns": Key(section(DNS_KEYS), None, "DNS discovery: every address the name resolves to is a target"),
    "kubernetes": Key(section(KUBERNETES_KEYS), None, "Kubernetes pod discovery (Ready pods with an IP)"),
    "prometheus": Key(section(PROMETHEUS_KEYS), None,
                      "read the engines' series from Prometheus's query API instead of fetching pages "
                      "(each `instance` is a target; docs/scaling.md)"),
}
# Every key defaults to None so a deployment's section overrides `defaults` key by key; the built-in
# defaults (in exporter.serve.online_calibration.Settings) apply where neither says.
ONLINE_CALIBRATION_KEYS: Table = {
    "enabled": Key(boolean, None, "fit the step's terms from the daemon's own windows (default true)"),
    "history": Key(duration, None, "windows this far back are fitted (default 6h)"),
    "holdout": Key(duration, None, "the most recent windows left out of the fit, so a sudden change shows as "
                                    "prediction error first (default 30m)"),
    "min_windows": Key(whole_positive, None, "the fit replaces the seed only with this many windows (default 30)"),
    "prometheus_url": Key(url, None, "Prometheus holding this daemon's own series: the fit is seeded from "
                                     "them at start-up (query_range over `history`)"),
}
DEFAULT_SPEED_OBJECTIVE = 0.99  # 1% of the decode tokens may stream under the target
DEFAULTS_KEYS: Table = {
    "target_tokens_per_second": Key(positive, 50.0, "per-user decode speed target (tokens/s)"),
    "speed_objective": Key(ratio, DEFAULT_SPEED_OBJECTIVE,
                           "the speed SLO: the share of decode tokens to stream at or above "
                           "target_tokens_per_second (its burn-rate alerts: docs/runbook.md)"),
    "headroom": Key(ratio, model.DEFAULT_HEADROOM,
                    "share of each step's budget kept for decode (the rest for prompt chunks)"),
    "bandwidth_efficiency": Key(ratio, model.DEFAULT_BANDWIDTH_EFFICIENCY,
                                "effective/peak memory bandwidth when not configured or calibrated"),
    "compute_efficiency": Key(ratio, model.DEFAULT_COMPUTE_EFFICIENCY, "effective/peak dense compute"),
    "online_calibration": Key(section(ONLINE_CALIBRATION_KEYS), None,
                              "online calibration for every deployment (docs/operations.md)"),
}


def gpu_preset(value: Any, where: Where) -> str:
    """The name of a GPU preset that exists (the error lists them, and the near miss)."""
    return get_gpu(string(value, where)).name


GPU_KEYS: Table = {
    "name": Key(string, None, "the device's name, the `gpu` label (required without `preset`; default the preset's)"),
    "preset": Key(gpu_preset, None, "a GPU preset whose figures the keys given here replace; absent: the device "
                                    "is wholly these figures"),
    "memory": Key(size, None, "memory per device, e.g. `24GB`, `64GiB`"),
    "peak_bandwidth": Key(bandwidth, None, "peak memory bandwidth per device, e.g. `600GB/s`, `2TB/s` or bytes/s"),
    "peak_flops": Key(flops, None, "peak dense FLOP/s per device, one figure for every precision, e.g. "
                                   "`125TFLOP/s` or `125e12`"),
}
# What a device without a preset must give: the whole device (its name is its `gpu` label).
CUSTOM_DEVICE_KEYS = ("name", *FIGURE_KEYS)


def gpu_check(result: dict[str, Any], where: Where) -> None:
    """Without `preset` nothing supplies a missing figure, so every one (and the name) must be given."""
    if result["preset"] is None:
        try:
            require_figures({key: result[key] for key in CUSTOM_DEVICE_KEYS}, "a device without `preset`")
        except InputError as error:
            raise Invalid(str(error)) from None


def gpu_device(value: Any, where: Where) -> Gpu:
    """`gpu`: a preset name, or a mapping of GPU_KEYS: a device by its numbers, or a preset with
    some of them replaced. Either way a Gpu, so the setup and the fit's bounds take it as a preset."""
    if isinstance(value, str):
        return get_gpu(gpu_preset(value, where))
    if not isinstance(value, dict):
        raise Invalid(f"expected a GPU preset's name or a mapping of {', '.join(CUSTOM_DEVICE_KEYS)} "
                      f"(and `preset`), got {type(value).__name__} {value!r}")
    given = section(GPU_KEYS, check=gpu_check)(value, where)
    figures = DeviceFigures(given["memory"], given["peak_bandwidth"], given["peak_flops"])
    return device(given["preset"] or CUSTOM_GPU, figures, name=given["name"])


DEPLOYMENT_KEYS: Table = {
    "name": Key(string, REQUIRED, "deployment name (the `deployment` label)"),
    "model": Key(string, REQUIRED, "model preset name or path to a Hugging Face config.json"),
    "params": Key(positive, None, "total parameter count, overriding the preset's"),
    "gpu": Key(gpu_device, REQUIRED, "GPU preset name, or the device by its numbers: a mapping of `name`, `memory`, "
                                     "`peak_bandwidth`, `peak_flops` (with `preset`: those given replace the "
                                     "preset's)"),
    "gpu_memory": Key(size, None, "GPU memory, overriding the device's (e.g. `80GB`, a MIG slice)"),
    "tensor_parallel": Key(whole_positive, 1, "GPUs per replica"),
    "weight_dtype": Key(string, None, "weight dtype: bf16, fp16, fp8, int8, int4, awq, gptq (default: the checkpoint's "
                                      "quantization_config, else bf16)"),
    "kv_cache_dtype": Key(string, "auto", "KV cache dtype: auto (16-bit), fp8, ..."),
    "gpu_memory_utilization": Key(ratio, 0.9, "vLLM's --gpu-memory-utilization (capacity when the page lacks it)"),
    "effective_bandwidth": Key(bandwidth, None, "effective memory bandwidth per GPU in bytes/s (source `configured`)"),
    "bandwidth_efficiency": Key(ratio, None, "overrides defaults.bandwidth_efficiency for this deployment"),
    "compute_efficiency": Key(ratio, None, "overrides defaults.compute_efficiency for this deployment"),
    "step_overhead": Key(non_negative_seconds, None, "fixed per-step overhead (seconds or a duration like `2ms`)"),
    "calibration": Key(existing_file, None,
                       "`stepbudget calibrate --json` output: sets bandwidth, overhead, per-request cost and compute "
                       "where fitted (source `calibrated`)"),
    "target_tokens_per_second": Key(positive, None, "overrides defaults.target_tokens_per_second"),
    "speed_objective": Key(ratio, None, "overrides defaults.speed_objective"),
    "scales_to_zero": Key(boolean, False, "the pool runs no server at times on purpose (a KEDA ScaledObject with "
                                          "minReplicaCount 0): StepBudgetNoTargets stays silent for it"),
    "headroom": Key(ratio, None, "overrides defaults.headroom"),
    "online_calibration": Key(section(ONLINE_CALIBRATION_KEYS), None,
                              "overrides defaults.online_calibration key by key"),
    "kind": Key(choice(*SERVER_KINDS), "auto", "the servers' page format: auto, vllm, sglang, tgi"),
    "role": Key(choice(*SERVER_ROLES), "auto",
                "what the servers do in a prefill/decode split: auto (from the page), prefill (no decode-step "
                "page; a prefill budget), decode (prompts arrive by KV transfer), both"),
    "targets": Key(section(TARGETS_KEYS, check=targets_check), REQUIRED, "where the model servers are"),
    "auth": Key(section(AUTH_KEYS, check=AUTH_CHECK), None,
                "credentials for the servers: a bearer token or basic auth, from files or the environment"),
    "tls": Key(section(TLS_KEYS, check=tls_check), None, "TLS settings for https targets"),
}
ALERTING_KEYS: Table = {
    "alertmanager_urls": Key(url_list, [], "Alertmanager base URLs; empty: the in-process alert loop is off"),
    "for": Key(duration, None, "overrides the page's `for` (StepBudgetPredictedStepOverBudget, 5m in the rules)"),
    "drift_for": Key(duration, None, "overrides StepBudgetPredictionDrift's `for` (15m in the rules) in the daemon's "
                                     "loop; every online_calibration.holdout must outlast it"),
    "timeout": Key(duration, 5.0, "timeout of each POST to Alertmanager"),
    "generator_url": Key(url, None, "link put in each alert (default: this daemon's `/`)"),
    "external_labels": Key(label_set, None, "labels added to every alert the daemon sends where the alert has "
                                            "none of that name, as Prometheus adds its external labels: give "
                                            "the same as the Prometheus evaluating the rules (e.g. `cluster`), "
                                            "so Alertmanager sees one alert"),
    "runbook_base_url": Key(url, None, "base of each alert's runbook_url (default: the project's "
                                       "docs/runbook.md); the chart sets it from prometheusRule.runbookBaseUrl"),
    "auth": Key(section(AUTH_KEYS, check=AUTH_CHECK), None,
                "credentials for Alertmanager: a bearer token or basic auth, from files or the environment"),
    "tls": Key(section(TLS_KEYS, check=tls_check), None, "TLS for https Alertmanagers"),
}


def listen_address(value: Any, where: Where) -> str:
    """`HOST:PORT` or `:PORT` (a bare port number too), kept as text for `parse_listen` at bind time."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    try:
        parse_listen(text)
    except InputError as error:
        raise Invalid(str(error)) from None
    return text


def parse_listen(text: str) -> tuple[str, int]:
    """`:9421` -> ("", 9421) (all interfaces); `127.0.0.1:0` -> a free port."""
    host, _, port_text = text.rpartition(":")
    if not port_text.isdigit() or int(port_text) > 65535:
        raise InputError(f"listen: expected HOST:PORT or :PORT, got {text!r}")
    return host.strip("[]"), int(port_text)


CORE_KEYS: Table = MappingProxyType({
    "listen": Key(listen_address, ":9421", "address the daemon serves /metrics on"),
    "poll_interval": Key(duration, 15.0, "how often every target is polled"),
    "timeout": Key(duration, 5.0, "per-target fetch deadline (connect + whole body)"),
    "stale_after": Key(duration, None, "a failing target's last good values are dropped after this; longer than "
                                       "poll_interval + timeout (default: 60s, or 2 x poll_interval + timeout "
                                       "when longer)"),
    "max_response_bytes": Key(size, float(DEFAULT_MAX_RESPONSE_BYTES), "a page larger than this is refused"),
    "log_format": Key(choice(*LOG_FORMATS), "auto", "json, console, or auto (console on a TTY)"),
    "defaults": Key(section(DEFAULTS_KEYS), None, "defaults for every deployment"),
    "deployments": Key(list_of(section(DEPLOYMENT_KEYS)), REQUIRED, "the model-server deployments to watch"),
    "alerting": Key(section(ALERTING_KEYS), None, "the in-process alert loop"),
})


def daemon_sections() -> tuple[Section, ...]:
    """Every optional top-level section, each declared by its feature and listed here only.

    Their parsed, defaulted values land in `Config.sections[name]`; a section not listed here is an
    unknown key. One explicit list (not registration at import) keeps validity independent of
    which modules were imported first.
    """
    return (SHARD_SECTION, ADMISSION_SECTION, POOLS_SECTION)


def top_level_keys(sections: tuple[Section, ...] | None = None) -> Table:
    """The whole schema of a config file: the core keys plus `sections` (default: `daemon_sections()`)."""
    keys = dict(CORE_KEYS)
    for extra in daemon_sections() if sections is None else sections:
        if extra.name in keys:
            raise ValueError(f"config section {extra.name!r} is already a key of the config")
        keys[extra.name] = extra.key()
    return MappingProxyType(keys)


TOP_LEVEL_KEYS: Table = top_level_keys()  # read-only: what `check-config` and the chart's schema accept


# --- the parsed config --------------------------------------------------------------------------


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
    kind: str  # the servers' page format: auto | vllm | sglang | tgi
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
    # The setup predictions use now: the seed until the online fit replaces it (exporter.serve.online_calibration).
    setup_in_use: SetupInUse = field(default_factory=SetupInUse, compare=False, repr=False)

    def predicting_setup(self) -> tuple[ServingSetup, str]:
        """The setup to predict with and the source of its bandwidth (`online` once the fit replaced the
        seed's, the seed's own where the fit holds it: InUse.source_of)."""
        in_use = self.setup_in_use.get()
        if in_use is None:
            return self.resolved.setup, self.resolved.bandwidth_source
        return in_use.setup, in_use.source_of("bandwidth_bytes_per_second")

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


# What `stepbudget calibrate --json` always writes and the daemon reads, with how each is checked.
CALIBRATION_NUMBERS: dict[str, Parser] = {
    "effective_bandwidth_bytes_per_second": positive,
    "step_overhead_seconds": non_negative,
    "spread_ratio": non_negative,
    "tolerance_ratio": positive,
}
CALIBRATION_REQUIRED_KEYS = (*CALIBRATION_NUMBERS, "agrees")
# Written by calibrations that fit them; absent or null: not fitted (0 per-request cost, compute from efficiency).
CALIBRATION_OPTIONAL_NUMBERS: dict[str, Parser] = {
    "per_request_seconds": non_negative,
    "effective_compute_flops_per_second": positive,
}

# What a refused file's spread_ratio measured, by its agreement_basis (files from before the key: bandwidths).
_REJECTION_MEASURES = {
    model.AGREEMENT_ON_BANDWIDTHS: "its points' bandwidths spread",
    model.AGREEMENT_ON_FIT_RESIDUALS: "its fitted terms miss a point by",
    model.AGREEMENT_ON_WINDOW_RESIDUALS: "its fit misses 10% of its windows by more than",
}


@dataclass(frozen=True)
class CalibrationValues:
    bandwidth_bytes_per_second: float
    step_overhead_seconds: float
    per_request_seconds: float = 0.0
    compute_flops_per_second: float | None = None


def _calibration_values(path: str, deployment: str, where: Where) -> CalibrationValues:
    """The fitted terms from `stepbudget calibrate --json` output that calibrate itself accepted."""

    def refuse(problem: str) -> ConfigError:
        return where.error(f"deployment {deployment!r}: calibration file {path!r} {problem}")

    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, ValueError) as error:
        raise refuse(f"cannot be read: {error}") from None
    if not isinstance(document, dict):
        raise refuse("is not `stepbudget calibrate --json` output: "
                     f"expected a JSON object, got {type(document).__name__}")
    missing = [key for key in CALIBRATION_REQUIRED_KEYS if key not in document]
    if missing:
        raise refuse(f"is not `stepbudget calibrate --json` output: it lacks {', '.join(missing)}")
    numbers: dict[str, float] = {}
    for key, parse in CALIBRATION_NUMBERS.items():
        try:
            numbers[key] = parse(document[key], where)
        except Invalid as bad:
            raise refuse(f"has an unusable {key}: {bad}") from None
    optional: dict[str, float | None] = {}
    for key, parse in CALIBRATION_OPTIONAL_NUMBERS.items():
        try:
            optional[key] = None if document.get(key) is None else parse(document[key], where)
        except Invalid as bad:
            raise refuse(f"has an unusable {key}: {bad} (null when not fitted)") from None
    agrees, spread, tolerance = document["agrees"], numbers["spread_ratio"], numbers["tolerance_ratio"]
    if not isinstance(agrees, bool):
        raise refuse(f"has an unusable agrees: expected true or false, got {agrees!r}")
    if agrees != (spread <= tolerance):
        raise refuse(f"says agrees: {str(agrees).lower()} but its spread_ratio {spread:g} and tolerance_ratio "
                     f"{tolerance:g} say otherwise (edited by hand?); re-run `stepbudget calibrate --json`")
    if not agrees:
        measure = _REJECTION_MEASURES.get(str(document.get("agreement_basis")),
                                          _REJECTION_MEASURES[model.AGREEMENT_ON_BANDWIDTHS])
        raise refuse(f"was rejected by `stepbudget calibrate` (agrees: false): {measure} {spread:.1%}, more than "
                     f"the {tolerance:.0%} tolerance, so the model does not describe that server; re-run "
                     "`stepbudget calibrate` (its notes name likely causes) and use a file it accepts")
    return CalibrationValues(numbers["effective_bandwidth_bytes_per_second"], numbers["step_overhead_seconds"],
                             optional["per_request_seconds"] or 0.0, optional["effective_compute_flops_per_second"])


def _build_deployment(raw: dict[str, Any], defaults: dict[str, Any], where: Where,
                      query_timeout_seconds: float) -> Deployment:
    lines = getattr(raw, "key_lines", {})
    bandwidth, overhead, calibrated = raw["effective_bandwidth"], raw["step_overhead"], False
    per_request, compute = 0.0, None
    if raw["calibration"] is not None:
        if bandwidth is not None:
            raise where.error("give effective_bandwidth or calibration, not both")
        values = _calibration_values(raw["calibration"], raw["name"],
                                     where.child("calibration", lines.get("calibration")))
        bandwidth = values.bandwidth_bytes_per_second
        overhead = values.step_overhead_seconds if overhead is None else overhead
        per_request, compute = values.per_request_seconds, values.compute_flops_per_second
        calibrated = True

    def at_key(key: str, check: Callable[[], Any]) -> Any:
        """Run `check`; its InputError becomes a ConfigError at `key`'s line."""
        try:
            return check()
        except InputError as error:
            raise where.child(key, lines.get(key)).error(str(error)) from None

    architecture: Architecture = at_key("model", lambda: load_architecture(raw["model"], raw["params"]))
    at_key("tensor_parallel", lambda: model.check_tensor_parallel(architecture, raw["tensor_parallel"]))
    try:
        resolved = build_setup(
            architecture, raw["gpu"],
            gpu_memory_bytes=raw["gpu_memory"],
            tensor_parallel=raw["tensor_parallel"],
            weight_dtype=raw["weight_dtype"],
            kv_cache_dtype=raw["kv_cache_dtype"],
            gpu_memory_utilization=raw["gpu_memory_utilization"],
            bandwidth_bytes_per_second=bandwidth,
            bandwidth_is_calibrated=calibrated,
            bandwidth_efficiency=raw["bandwidth_efficiency"] or defaults["bandwidth_efficiency"],
            compute_efficiency=raw["compute_efficiency"] or defaults["compute_efficiency"],
            step_overhead_seconds=overhead or 0.0,
            per_request_seconds=per_request,
            compute_flops_per_second=compute,
        )
    except InputError as error:
        raise where.error(str(error)) from None
    targets = raw["targets"]
    auth, tls = raw["auth"], raw["tls"]
    deployment_auth, deployment_tls = auth_from(auth) or Auth(), Tls(**tls) if tls else Tls()
    return Deployment(
        name=raw["name"], model=raw["model"], gpu=raw["gpu"].name, tensor_parallel=raw["tensor_parallel"],
        kv_cache_dtype=raw["kv_cache_dtype"], kind=raw["kind"], role=raw["role"],
        target_tokens_per_second=raw["target_tokens_per_second"] or defaults["target_tokens_per_second"],
        headroom=raw["headroom"] or defaults["headroom"],
        speed_objective=raw["speed_objective"] or defaults["speed_objective"],
        scales_to_zero=raw["scales_to_zero"],
        resolved=resolved,
        static_urls=tuple(targets["static"]),
        dns=DnsTargets(**targets["dns"]) if targets["dns"] else None,
        kubernetes=_kubernetes_targets(targets["kubernetes"]),
        auth=deployment_auth, tls=deployment_tls,
        prometheus=_prometheus_targets(targets["prometheus"], deployment_auth, deployment_tls, query_timeout_seconds),
        online_calibration=online_settings(raw["online_calibration"], defaults["online_calibration"]),
    )


def _kubernetes_targets(raw: Mapping[str, Any] | None) -> KubernetesTargets | None:
    if not raw:
        return None
    keys = dict(raw)
    allowance = keys.pop("startup_allowance")
    return KubernetesTargets(**keys, startup_allowance_seconds=allowance)


def auth_from(raw: Mapping[str, Any] | None) -> Auth | None:
    """An `auth` section as Auth (None when not given)."""
    if not raw:
        return None
    basic = raw["basic_auth"]
    return Auth(bearer_token_file=raw["bearer_token_file"], bearer_token_env=raw["bearer_token_env"],
                basic_auth=BasicAuth(**basic) if basic else None)


def online_settings(own: Mapping[str, Any] | None, defaults: Mapping[str, Any] | None) -> OnlineSettings:
    """A deployment's `online_calibration`, key by key over `defaults.online_calibration`."""
    built_in = OnlineSettings()
    values: dict[str, Any] = {}
    for key, field_name in (("enabled", "enabled"), ("history", "history_seconds"), ("holdout", "holdout_seconds"),
                            ("min_windows", "min_windows"), ("prometheus_url", "prometheus_url")):
        chosen = next((section_[key] for section_ in (own, defaults) if section_ and section_[key] is not None),
                      getattr(built_in, field_name))
        values[field_name] = chosen
    return OnlineSettings(**values)


def _prometheus_targets(raw: Mapping[str, Any] | None, auth: Auth, tls: Tls,
                        default_query_timeout_seconds: float) -> PrometheusTargets | None:
    """`targets.prometheus`; its own auth and tls, else the deployment's (in this mode the daemon
    talks to no model server, so the deployment's credentials can only be meant for Prometheus)."""
    if not raw:
        return None
    return PrometheusTargets(
        url=raw["url"], selector=raw["selector"], tenant=raw["tenant"],
        auth=auth_from(raw["auth"]) or auth, tls=Tls(**raw["tls"]) if raw["tls"] else tls,
        max_response_bytes=int(raw["max_response_bytes"]),
        query_timeout_seconds=raw["query_timeout"] or default_query_timeout_seconds,
    )


def config_from_mapping(document: Any, source: str = "", *, sections: tuple[Section, ...] | None = None) -> Config:
    """Validate a parsed YAML document (from `load_config` or built from flags).

    `source` (the file name) rides along in every `Where`, so messages name the file without any
    global state; `sections` defaults to `daemon_sections()` (tests pass their own).
    """
    extras = daemon_sections() if sections is None else sections
    root = Where("", getattr(document, "line", 0), source)
    try:
        top = section(top_level_keys(extras))(document, root)
    except Invalid as bad:
        raise Where("", 1, source).error(str(bad)) from None
    deployments = _build_deployments(document, top, Where("deployments", 0, source))
    stale_after = _stale_after_seconds(top, deployments, root.child("stale_after", _key_line(document, "stale_after")))
    alerting_raw = top["alerting"]
    alerting = Alerting(
        alertmanager_urls=tuple(alerting_raw["alertmanager_urls"]), for_seconds=alerting_raw["for"],
        timeout_seconds=alerting_raw["timeout"], generator_url=alerting_raw["generator_url"],
        drift_for_seconds=alerting_raw["drift_for"], external_labels=alerting_raw["external_labels"] or {},
        runbook_base_url=alerting_raw["runbook_base_url"],
        auth=auth_from(alerting_raw["auth"]) or Auth(),
        tls=Tls(**alerting_raw["tls"]) if alerting_raw["tls"] else Tls(),
    ) if alerting_raw else Alerting()
    deployments = _check_holdouts(document, top, deployments, alerting, root)
    config = Config(
        listen=top["listen"], poll_interval_seconds=top["poll_interval"], timeout_seconds=top["timeout"],
        stale_after_seconds=stale_after, max_response_bytes=int(top["max_response_bytes"]),
        log_format=top["log_format"], deployments=deployments, alerting=alerting,
        sections={extra.name: top[extra.name] for extra in extras}, source=source,
    )
    for extra in extras:
        if extra.config_check is not None:
            extra.config_check(config)
    return config


def _build_deployments(document: Any, top: Mapping[str, Any], where: Where) -> tuple[Deployment, ...]:
    """Every deployment resolved (model, GPU, calibration), each name used once."""
    defaults = top["defaults"] or section(DEFAULTS_KEYS)(None, where.child("defaults", 0))
    raw_deployments = document["deployments"]
    item_lines = getattr(raw_deployments, "item_lines", [0] * len(raw_deployments))
    query_timeout = max(top["timeout"], DEFAULT_QUERY_TIMEOUT_SHARE * top["poll_interval"])
    deployments = [_build_deployment(raw, defaults, where.child(index, item_lines[index]), query_timeout)
                   for index, raw in enumerate(top["deployments"])]
    names = [d.name for d in deployments]
    for index, name in enumerate(names):
        if names.index(name) != index:
            raise where.child(index, item_lines[index]).child("name", None).error(
                f"deployment name {name!r} is used twice")
    return tuple(deployments)


def _key_line(document: Any, key: str) -> int | None:
    lines: Mapping[str, int] = getattr(document, "key_lines", {})
    return lines.get(key)


def _stale_after_seconds(top: Mapping[str, Any], deployments: tuple[Deployment, ...], where: Where) -> float:
    """`stale_after`, given or derived, longer than any one poll that fails: a target's values are kept
    while `now - last success < stale_after`, and a poll that fails by its deadline ends up to
    `poll_interval + deadline` after the last success. Anything shorter turns one timed-out fetch or
    query into dropped values and restarted `for` timers, so it is refused (a deliberate value is not
    silently changed); not given, it grows with the poll interval."""
    poll: float = top["poll_interval"]
    waits: list[tuple[str, float]] = [("timeout", top["timeout"])] + [
        (f"deployments[{index}].targets.prometheus.query_timeout", d.prometheus.query_timeout_seconds)
        for index, d in enumerate(deployments) if d.prometheus is not None]
    name, wait = max(waits, key=lambda pair: pair[1])
    floor = 2 * poll + wait
    given: float | None = top["stale_after"]
    if given is None:
        return max(DEFAULT_STALE_AFTER_SECONDS, floor)
    if given <= poll + wait:
        short = name.rsplit(".", 1)[-1]
        raise where.error(
            f"{given:g}s is not longer than poll_interval + {name} ({poll:g}s + {wait:g}s = {poll + wait:g}s): "
            f"one poll failing by its {short} would drop every target's last values and restart the alerts' "
            f"`for` timers; set stale_after to at least {floor:g}s (2 x poll_interval + {short}), "
            f"or leave it out to get that")
    return float(given)


DRIFT_ALERT = "StepBudgetPredictionDrift"


@functools.cache
def packaged_drift_for_seconds() -> float:
    """StepBudgetPredictionDrift's `for` in the packaged rules file (15m)."""
    return packaged_for_seconds(DRIFT_ALERT)


def _check_holdouts(document: Any, top: Mapping[str, Any], deployments: tuple[Deployment, ...], alerting: Alerting,
                    root: Where) -> tuple[Deployment, ...]:
    """Every enabled online calibration's `holdout` outlasts StepBudgetPredictionDrift's `for`, plus two
    polls (the first that sees the change, the one that evaluates the alert). The holdout is how long
    a change of the server's speed shows as prediction error before the fit takes it in; shorter than
    the alert's `for`, a slower GPU or engine release can be absorbed with no alert, so a holdout given
    that short is refused (a deliberate value is not silently changed); not given, the built-in 30m
    grows to that floor (hour-long polls)."""
    drift_for = alerting.drift_for_seconds
    drift_for = packaged_drift_for_seconds() if drift_for is None else drift_for
    floor = drift_for + 2 * top["poll_interval"]
    defaults = top["defaults"] or {}
    default_section = defaults.get("online_calibration") or {}
    checked = list(deployments)
    for index, deployment in enumerate(deployments):
        settings = deployment.online_calibration
        if settings is None or not settings.enabled or settings.holdout_seconds >= floor:
            continue
        own = top["deployments"][index]["online_calibration"] or {}
        if own.get("holdout") is not None:
            path: tuple[str | int, ...] = ("deployments", index, "online_calibration", "holdout")
        elif default_section.get("holdout") is not None:
            path = ("defaults", "online_calibration", "holdout")
        else:
            checked[index] = replace(deployment, online_calibration=replace(settings, holdout_seconds=floor))
            continue
        where, node = root, document
        for key in path:
            lines = getattr(node, "item_lines", None) if isinstance(key, int) else getattr(node, "key_lines", None)
            line = (lines[key] if isinstance(key, int) and lines and key < len(lines)
                    else lines.get(key) if isinstance(lines, Mapping) else None)
            where = where.child(key, line)
            try:
                node = node[key]
            except (KeyError, IndexError, TypeError):
                node = None
        named = "alerting.drift_for" if alerting.drift_for_seconds is not None else f"the rules' {DRIFT_ALERT}"
        raise where.error(
            f"deployment {deployment.name!r}: holdout {settings.holdout_seconds:g}s is shorter than {named} `for` "
            f"({drift_for:g}s) + 2 x poll_interval ({top['poll_interval']:g}s) = {floor:g}s: a step change would be "
            f"fitted before {DRIFT_ALERT} fires, and never alert; set holdout to at least {floor:g}s (default 30m), "
            f"or shorten the alert's `for` with alerting.drift_for (and in the rules Prometheus evaluates)")
    return tuple(checked)


def read_document(path: str) -> Any:
    """The YAML document with line numbers; a missing file or a YAML syntax error is a ConfigError."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the config: {error.strerror or error}") from None
    try:
        document = yaml.load(text, Loader=_LineLoader)
    except ConfigError as error:
        raise ConfigError(f"{path}:{str(error).removeprefix('line ')}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f"{mark.line + 1}:" if mark is not None else ""
        raise ConfigError(f"{path}:{line} not valid YAML: {getattr(error, 'problem', None) or error}") from None
    if document is None:
        document = empty_document()
    if not isinstance(document, dict):
        raise ConfigError(f"{path}:1: config: the file must hold a mapping of keys, got {type(document).__name__}")
    return document


def empty_document() -> LineDict:
    """A config document with no keys yet (flags fill it in when `serve` runs without a file)."""
    return LineDict()


def load_config(path: str, overrides: Mapping[str, Any] | None = None) -> Config:
    """Read, apply flag overrides (top-level keys, same validation), validate and resolve."""
    document = read_document(path)
    for key, value in (overrides or {}).items():
        document[key] = value
    return config_from_mapping(document, path)


# --- `stepbudget check-config` ------------------------------------------------------------------


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the YAML config to validate")


def run(args: argparse.Namespace) -> int:
    """Validate one file with the same schema `serve` uses; exit 2 (ConfigError) on the first problem."""
    config = load_config(args.file)
    print(f"{args.file}: ok: {config.summary()}")
    return 0
