"""The daemon's YAML config: read with file lines, validated against the key tables, built, and `check-config`.

The config is three modules, one job each: the key tables (exporter.serve.config_keys: each key's
type, default and meaning), the dataclasses a config becomes (exporter.serve.config_model), and this
one, which reads the YAML, validates it against the tables and builds the dataclasses (a deployment's
calibration file is read by exporter.serve.config_calibration). The names of all three are
re-exported here, so `from exporter.serve.config import Config` keeps working. A bad key is reported as
`FILE:LINE: PATH: problem`, where PATH reads like `deployments[1].targets.static[0]`, and the CLI
exits 2.

`stepbudget check-config` runs `run` below; it imports the config's own modules only, never the
daemon's poller or server.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import yaml

from exporter.capacity.architecture import Architecture, check_tensor_parallel
from exporter.capacity.deployment import build_setup, is_path_like, load_architecture
from exporter.capacity.presets import get_model_preset
from exporter.config_validators import (
    REQUIRED,
    ConfigError,
    Invalid,
    Key,
    LineDict,
    LineList,
    OfflineReads,
    Section,
    Table,
    Where,
    section,
)
from exporter.errors import InputError
from exporter.serve.alert_rules import AlertSettings, packaged_for_seconds, tuned_rules_text
from exporter.serve.config_calibration import CALIBRATION_NUMBERS, CALIBRATION_REQUIRED_KEYS, calibration_values
from exporter.serve.config_keys import (
    ALERTING_KEYS,
    AUTH_CHECK,
    AUTH_KEYS,
    BASIC_AUTH_KEYS,
    CORE_KEYS,
    CUSTOM_DEVICE_KEYS,
    DEFAULTS_KEYS,
    DEPLOYMENT_KEYS,
    DNS_KEYS,
    GPU_KEYS,
    KUBERNETES_KEYS,
    LOG_FORMATS,
    PROMETHEUS_KEYS,
    SERVER_ROLES,
    TARGETS_KEYS,
    TLS_KEYS,
    TOP_LEVEL_KEYS,
    basic_auth_check,
    daemon_sections,
    gpu_check,
    gpu_device,
    gpu_preset,
    listen_address,
    parse_listen,
    server_kind,
    targets_check,
    tls_check,
    top_level_keys,
)
from exporter.serve.config_model import (
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_PROMETHEUS_RESPONSE_BYTES,
    DEFAULT_QUERY_TIMEOUT_SHARE,
    DEFAULT_STALE_AFTER_SECONDS,
    Alerting,
    Auth,
    BasicAuth,
    Config,
    CredentialError,
    Deployment,
    DnsTargets,
    KubernetesTargets,
    PrometheusTargets,
    Tls,
    basic_authorization,
)
from exporter.serve.online_settings import Settings as OnlineSettings
from exporter.units import parse_overhead_seconds

# The public names; ConfigError, Key, REQUIRED, Section, Table, Where, LineDict and `section` are
# re-exported from config_validators, the key tables from config_keys and the dataclasses from config_model,
# so `from exporter.serve.config import ConfigError` (or Config, or DEPLOYMENT_KEYS) keeps working.
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
    "server_kind",
    "targets_check",
    "tls_check",
    "top_level_keys",
]



# What `check-config --offline` resolves a deployment with when its model is a config.json it does not read:
# any model would do (nothing model-dependent is checked then); the name says it is not the deployment's.
OFFLINE_STAND_IN_MODEL = replace(get_model_preset("qwen3-8b"), name="model not read (offline)")


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

def _build_deployment(raw: dict[str, Any], defaults: dict[str, Any], where: Where,
                      query_timeout_seconds: float) -> Deployment:
    lines = getattr(raw, "key_lines", {})
    bandwidth, overhead, calibrated = raw["effective_bandwidth"], raw["step_overhead"], False
    per_request, compute = 0.0, None
    if raw["calibration"] is not None:
        if bandwidth is not None:
            raise where.error("give effective_bandwidth or calibration, not both")
    where_calibration = where.child("calibration", lines.get("calibration"))
    if raw["calibration"] is not None and not where_calibration.skips_read(raw["calibration"]):
        values = calibration_values(raw["calibration"], raw["name"], where_calibration)
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

    # Offline, a model given as a config.json is not read: a stand-in carries the other keys through
    # build_setup's checks, and what only the model's heads can tell (tensor_parallel) is left unchecked.
    model_unread = is_path_like(raw["model"]) and where.child("model", lines.get("model")).skips_read(
        raw["model"], "tensor_parallel not checked against its attention heads")
    architecture: Architecture = (OFFLINE_STAND_IN_MODEL if model_unread
                                  else at_key("model", lambda: load_architecture(raw["model"], raw["params"])))
    tensor_parallel = 1 if model_unread else raw["tensor_parallel"]
    at_key("tensor_parallel", lambda: check_tensor_parallel(architecture, tensor_parallel))
    try:
        resolved = build_setup(
            architecture, raw["gpu"],
            gpu_memory_bytes=raw["gpu_memory"],
            tensor_parallel=tensor_parallel,
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
    if model_unread:
        resolved = replace(resolved, setup=replace(resolved.setup, tensor_parallel=raw["tensor_parallel"]))
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


def config_from_mapping(document: Any, source: str = "", *, sections: tuple[Section, ...] | None = None,
                        offline: OfflineReads | None = None) -> Config:
    """Validate a parsed YAML document (from `load_config` or built from flags).

    `source` (the file name) rides along in every `Where`, so messages name the file without any
    global state; `sections` defaults to `daemon_sections()` (tests pass their own). With `offline`
    (`check-config --offline`) no file the config names is read (each is noted there instead): the
    Config is for checking only, never for `serve`.
    """
    extras = daemon_sections() if sections is None else sections
    root = Where("", getattr(document, "line", 0), source, offline)
    try:
        top = section(top_level_keys(extras))(document, root)
    except Invalid as bad:
        raise Where("", 1, source).error(str(bad)) from None
    deployments = _build_deployments(document, top, Where("deployments", 0, source, offline))
    stale_after = _stale_after_seconds(top, deployments, root.child("stale_after", _key_line(document, "stale_after")))
    alerting_raw = top["alerting"]
    where_alerting = root.child("alerting", _key_line(document, "alerting"))
    rules = _alert_settings(alerting_raw, where_alerting) if alerting_raw else {}
    alerting = Alerting(
        alertmanager_urls=tuple(alerting_raw["alertmanager_urls"]),
        for_seconds=_for_seconds(rules.get(PAGE_ALERT)),
        timeout_seconds=alerting_raw["timeout"], generator_url=alerting_raw["generator_url"],
        drift_for_seconds=_for_seconds(rules.get(DRIFT_ALERT)), rules=rules,
        external_labels=alerting_raw["external_labels"] or {},
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
PAGE_ALERT = "StepBudgetPredictedStepOverBudget"
# The shorthands of alerting.rules.<alert>.for, from before there was one key per alert.
_FOR_SHORTHANDS = {"for": PAGE_ALERT, "drift_for": DRIFT_ALERT}


def _alert_settings(alerting: Mapping[str, Any], where: Where) -> dict[str, AlertSettings]:
    """alerting.rules, with the shorthands `for` and `drift_for` in (one of the two ways per alert)."""
    raw = {name: dict(keys) for name, keys in (alerting.get("rules") or {}).items() if keys}
    for shorthand, alert in _FOR_SHORTHANDS.items():
        if alerting.get(shorthand) is None:
            continue
        if raw.get(alert, {}).get("for") is not None:
            raise where.child(shorthand, None).error(f"set either alerting.{shorthand} or alerting.rules.{alert}.for, "
                                               "not both")
        raw.setdefault(alert, {"enabled": True, "for": None, "severity": None, "labels": None})["for"] = \
            alerting[shorthand]
    return {name: AlertSettings(enabled=keys.get("enabled", True) is not False, for_text=keys.get("for"),
                                severity=keys.get("severity"), labels=keys.get("labels") or {},
                                threshold=keys.get("threshold")) for name, keys in raw.items()}


def _for_seconds(settings: AlertSettings | None) -> float | None:
    if settings is None or settings.for_text is None:
        return None
    return parse_overhead_seconds(settings.for_text, "for")


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


def load_config(path: str, overrides: Mapping[str, Any] | None = None, *,
                offline: OfflineReads | None = None) -> Config:
    """Read, apply flag overrides (top-level keys, same validation), validate and resolve (offline:
    reading none of the files the config names, see `config_from_mapping`)."""
    document = read_document(path)
    for key, value in (overrides or {}).items():
        document[key] = value
    return config_from_mapping(document, path, offline=offline)


# --- `stepbudget check-config` ------------------------------------------------------------------


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the YAML config to validate")
    parser.add_argument("--alert-rules", action="store_true",
                        help="print the alert rules file as the config's alerting.rules (and runbook_base_url) set "
                             "them: what a Prometheus outside the chart must evaluate to raise the daemon's alerts")
    parser.add_argument("--offline", action="store_true",
                        help="check structure and values only, reading none of the files the config names "
                             "(token, password and TLS files, kubeconfig, calibration files, a model's config.json, "
                             "admission.token_file): for CI or a laptop without the pod's mounts; each file not "
                             "read is listed as `not read (offline): KEY FILE`")


def run(args: argparse.Namespace) -> int:
    """Validate one file with the same schema `serve` uses; exit 2 (ConfigError) on the first problem."""
    offline = OfflineReads() if args.offline else None
    config = load_config(args.file, offline=offline)
    unread = offline.lines() if offline is not None else []
    if args.alert_rules:
        print(tuned_rules_text(config.alerting.rules, config.alerting.runbook_base_url), end="")
        for line in unread:  # stdout is the rules file
            print(line, file=sys.stderr)
        return 0
    mode = f" (offline: {len(unread)} file(s) not read)" if offline is not None else ""
    print(f"{args.file}: ok{mode}: {config.summary()}")
    for line in unread:
        print(f"  {line}")
    return 0
