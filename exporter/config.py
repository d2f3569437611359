"""The daemon's YAML config: a declarative key table, validation with file lines, and `check-config`.

Why a table: every key has one place that says its type, default and meaning, so validation,
defaults, `docs/operations.md` and flag overrides cannot drift apart, and other parts of the
daemon add their own sections (`shard`, `admission`, `pools`) with `register_section` instead of
editing this file. A bad key is reported as `FILE:LINE: PATH: problem`, where PATH reads like
`deployments[1].targets.static[0]`, and the CLI exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import yaml

from exporter import model
from exporter.deployment import ResolvedSetup, build_setup, load_architecture
from exporter.errors import InputError
from exporter.model import Architecture
from exporter.presets import get_gpu
from exporter.suggest import close_names
from exporter.units import parse_duration_seconds, parse_overhead_seconds, parse_size_bytes

ENGINE_KINDS = ("auto", "vllm", "sglang", "tgi")
LOG_FORMATS = ("auto", "json", "console")
DEFAULT_MAX_RESPONSE_BYTES = 4 * 2**20


class ConfigError(InputError):
    """A config problem: the message carries file, line and key path."""


class _Bad(Exception):
    """Raised by a key's parser; the walker adds file, line and path to the message."""


# --- YAML with line numbers ---------------------------------------------------------------------


class _LineDict(dict):
    """A mapping that remembers the file line of itself and of each key."""

    line: int = 0
    key_lines: dict[Any, int]


class _LineList(list):
    line: int = 0
    item_lines: list[int]


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that keeps line numbers and rejects duplicate keys (PyYAML keeps the last)."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> _LineDict:
    loader.flatten_mapping(node)
    result = _LineDict()
    result.line, result.key_lines = node.start_mark.line + 1, {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in result:
            raise ConfigError(f"line {key_node.start_mark.line + 1}: key {key!r} appears twice in one mapping")
        result[key] = loader.construct_object(value_node, deep=True)
        result.key_lines[key] = key_node.start_mark.line + 1
    return result


def _construct_sequence(loader: _LineLoader, node: yaml.SequenceNode) -> _LineList:
    result = _LineList(loader.construct_object(child, deep=True) for child in node.value)
    result.line, result.item_lines = node.start_mark.line + 1, [child.start_mark.line + 1 for child in node.value]
    return result


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


# --- the key table ----------------------------------------------------------------------------

REQUIRED = object()
Parser = Callable[[Any, "_Where"], Any]


@dataclass(frozen=True)
class Key:
    """One config key: how to read it, its default (REQUIRED: must be given), what it means."""

    parse: Parser
    default: Any = None
    doc: str = ""


@dataclass(frozen=True)
class _Where:
    """Where a value sits: its path like `deployments[1].targets` and its file line."""

    path: str
    line: int

    def child(self, name: str | int, line: int | None) -> "_Where":
        path = f"{self.path}[{name}]" if isinstance(name, int) else (f"{self.path}.{name}" if self.path else name)
        return _Where(path, line or self.line)


def _string(value: Any, where: _Where) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Bad(f"expected a non-empty string, got {value!r}")
    return value.strip()


def _with_unit(parse: Callable[[Any, str], float], value: Any) -> float:
    """A units.py parser's value; its message, less the placeholder name, becomes the key's problem."""
    try:
        return parse(value, "value")
    except InputError as error:
        raise _Bad(str(error).removeprefix("value: ")) from None


def _duration(value: Any, where: _Where) -> float:
    return _with_unit(parse_duration_seconds, value)


def _size(value: Any, where: _Where) -> float:
    return _with_unit(parse_size_bytes, value)


def _number(value: Any) -> float:
    if isinstance(value, str):
        # PyYAML (YAML 1.1) reads `8.0e9` and `2e12` as strings: accept plain numbers written so.
        try:
            value = float(value.strip())
        except ValueError:
            raise _Bad(f"expected a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Bad(f"expected a number, got {value!r}")
    return float(value)


def _positive(value: Any, where: _Where) -> float:
    number = _number(value)
    if not number > 0:
        raise _Bad(f"must be greater than zero, got {value!r}")
    return number


def _non_negative(value: Any, where: _Where) -> float:
    number = _number(value)
    if number < 0:
        raise _Bad(f"must not be negative, got {value!r}")
    return number


def _non_negative_seconds(value: Any, where: _Where) -> float:
    """Seconds or a duration such as `2ms`; zero is allowed (a per-step overhead of none)."""
    return _with_unit(parse_overhead_seconds, value)


def _ratio(value: Any, where: _Where) -> float:
    number = _number(value)
    if not 0 < number <= 1:
        raise _Bad(f"must be a ratio in (0, 1], got {value!r}")
    return number


def _whole_positive(value: Any, where: _Where) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _Bad(f"expected a whole number >= 1, got {value!r}")
    return value


def _port(value: Any, where: _Where) -> int:
    number = _whole_positive(value, where)
    if number > 65535:
        raise _Bad(f"a port is at most 65535, got {value!r}")
    return number


def _bool(value: Any, where: _Where) -> bool:
    if not isinstance(value, bool):
        raise _Bad(f"expected true or false, got {value!r}")
    return value


def _bandwidth(value: Any, where: _Where) -> float:
    """Bytes per second: a number, or a size such as `2TB` (read as per second)."""
    return _size(value, where)


def _choice(*choices: str) -> Parser:
    def parse(value: Any, where: _Where) -> str:
        text = _string(value, where).lower()
        if text not in choices:
            raise _Bad(f"expected one of {', '.join(choices)}, got {value!r}{close_names(str(value), choices)}")
        return text

    return parse


def _url(value: Any, where: _Where) -> str:
    text = _string(value, where)
    if not text.startswith(("http://", "https://")):
        raise _Bad(f"expected an http:// or https:// URL, got {value!r}")
    return text.rstrip("/") if text.count("/") > 2 and text.endswith("/") else text


def _existing_file(value: Any, where: _Where) -> str:
    path = _string(value, where)
    if not os.path.isfile(path):
        raise _Bad(f"file {path!r} does not exist")
    return path


def _url_path(value: Any, where: _Where) -> str:
    text = _string(value, where)
    if not text.startswith("/"):
        raise _Bad(f"a URL path starts with '/', got {value!r}")
    return text


def _list_of(item: Parser, *, non_empty: bool = True) -> Parser:
    def parse(value: Any, where: _Where) -> list[Any]:
        if not isinstance(value, list):
            raise _Bad(f"expected a list, got {type(value).__name__} {value!r}")
        if non_empty and not value:
            raise _Bad("the list is empty")
        lines = getattr(value, "item_lines", [where.line] * len(value))
        return [_parse_at(item, element, where.child(index, lines[index])) for index, element in enumerate(value)]

    return parse


def _url_list(value: Any, where: _Where) -> list[str]:
    return _list_of(_url)([value] if isinstance(value, str) else value, where)


Table = dict[str, Key]


def section(table: Table, *, check: Callable[[dict[str, Any], _Where], None] | None = None) -> Parser:
    """A mapping validated against `table`: unknown keys are errors, defaults fill the rest."""

    def parse(value: Any, where: _Where) -> dict[str, Any]:
        if value is None:
            value = _LineDict()
        if not isinstance(value, dict):
            raise _Bad(f"expected a mapping, got {type(value).__name__} {value!r}")
        lines = getattr(value, "key_lines", {})
        for name in value:
            if name not in table:
                raise ConfigError(_message(where.child(str(name), lines.get(name)),
                                           f"unknown key{close_names(str(name), table)}; known: {', '.join(table)}"))
        result = _LineDict()
        result.line, result.key_lines = where.line, dict(lines)
        for name, key in table.items():
            if name in value and value[name] is not None:
                result[name] = _parse_at(key.parse, value[name], where.child(name, lines.get(name)))
            elif key.default is REQUIRED:
                raise ConfigError(_message(where, f"missing required key {name!r}"))
            else:
                result[name] = key.default
        if check is not None:
            _run_check(check, result, where)
        return result

    return parse


def _run_check(check: Callable[[dict[str, Any], _Where], None], result: dict[str, Any], where: _Where) -> None:
    try:
        check(result, where)
    except _Bad as bad:
        raise ConfigError(_message(where, str(bad))) from None


_current_file: list[str] = [""]  # set while one file is validated, for messages


def _message(where: _Where, problem: str) -> str:
    place = f"{_current_file[0]}:{where.line}: " if _current_file[0] else (f"line {where.line}: " if where.line else "")
    return f"{place}{where.path or 'config'}: {problem}"


def _parse_at(parser: Parser, value: Any, where: _Where) -> Any:
    try:
        return parser(value, where)
    except _Bad as bad:
        raise ConfigError(_message(where, str(bad))) from None
    except ConfigError:
        raise
    except InputError as error:
        raise ConfigError(_message(where, str(error))) from None


def _one_of_keys(*names: str) -> Callable[[dict[str, Any], _Where], None]:
    def check(result: dict[str, Any], where: _Where) -> None:
        if sum(result[name] is not None for name in names) > 1:
            raise _Bad(f"give at most one of {', '.join(names)}")

    return check


def _targets_check(result: dict[str, Any], where: _Where) -> None:
    if not any(result[name] for name in ("static", "dns", "kubernetes")):
        raise _Bad("give at least one of static, dns, kubernetes")


DNS_KEYS: Table = {
    "name": Key(_string, REQUIRED, "DNS name resolving to every pod, e.g. a headless Service `vllm.ns.svc.cluster.local`"),
    "port": Key(_port, 8000, "port of the model server's metrics endpoint"),
    "path": Key(_url_path, "/metrics", "metrics path"),
    "scheme": Key(_choice("http", "https"), "http", "http or https"),
}
KUBERNETES_KEYS: Table = {
    "namespace": Key(_string, REQUIRED, "namespace of the model-server pods"),
    "label_selector": Key(_string, REQUIRED, "label selector of the pods, e.g. `app=vllm`"),
    "port": Key(_port, 8000, "port of the metrics endpoint on each pod"),
    "path": Key(_url_path, "/metrics", "metrics path"),
    "scheme": Key(_choice("http", "https"), "http", "http or https"),
    "kubeconfig": Key(_existing_file, None, "kubeconfig file; default: in-cluster config, else $KUBECONFIG / ~/.kube/config"),
}
TARGETS_KEYS: Table = {
    "static": Key(_url_list, [], "list of metrics URLs, e.g. `http://10.0.0.5:8000/metrics`"),
    "dns": Key(section(DNS_KEYS), None, "DNS discovery: every address the name resolves to is a target"),
    "kubernetes": Key(section(KUBERNETES_KEYS), None, "Kubernetes pod discovery (Running pods with an IP)"),
}
AUTH_KEYS: Table = {
    "bearer_token_file": Key(_existing_file, None, "file holding a bearer token (re-read at every poll, so rotated tokens work)"),
    "bearer_token_env": Key(_string, None, "name of an environment variable holding a bearer token"),
}
TLS_KEYS: Table = {
    "ca_file": Key(_existing_file, None, "CA bundle to verify the servers' certificates"),
    "insecure_skip_verify": Key(_bool, False, "do not verify certificates (testing only)"),
}
DEFAULTS_KEYS: Table = {
    "target_tokens_per_second": Key(_positive, 50.0, "per-user decode speed target (tokens/s)"),
    "headroom": Key(_ratio, model.DEFAULT_HEADROOM, "share of each step's budget kept for decode (the rest for prompt chunks)"),
    "bandwidth_efficiency": Key(_ratio, model.DEFAULT_BANDWIDTH_EFFICIENCY, "effective/peak memory bandwidth when not configured or calibrated"),
    "compute_efficiency": Key(_ratio, model.DEFAULT_COMPUTE_EFFICIENCY, "effective/peak dense compute"),
}
DEPLOYMENT_KEYS: Table = {
    "name": Key(_string, REQUIRED, "deployment name (the `deployment` label)"),
    "model": Key(_string, REQUIRED, "model preset name or path to a Hugging Face config.json"),
    "params": Key(_positive, None, "total parameter count, overriding the preset's"),
    "gpu": Key(_string, REQUIRED, "GPU preset name"),
    "gpu_memory": Key(_size, None, "GPU memory, overriding the preset's (e.g. `80GB`, a MIG slice)"),
    "tensor_parallel": Key(_whole_positive, 1, "GPUs per replica"),
    "weight_dtype": Key(_string, "bf16", "weight dtype: bf16, fp16, fp8, int8, int4, awq, gptq"),
    "kv_cache_dtype": Key(_string, "auto", "KV cache dtype: auto (16-bit), fp8, ..."),
    "gpu_memory_utilization": Key(_ratio, 0.9, "vLLM's --gpu-memory-utilization (capacity when the page lacks it)"),
    "effective_bandwidth": Key(_bandwidth, None, "effective memory bandwidth per GPU in bytes/s (source `configured`)"),
    "bandwidth_efficiency": Key(_ratio, None, "overrides defaults.bandwidth_efficiency for this deployment"),
    "compute_efficiency": Key(_ratio, None, "overrides defaults.compute_efficiency for this deployment"),
    "step_overhead": Key(_non_negative_seconds, None, "fixed per-step overhead (seconds or a duration like `2ms`)"),
    "calibration": Key(_existing_file, None, "`stepbudget calibrate --json` output: sets bandwidth and overhead (source `calibrated`)"),
    "target_tokens_per_second": Key(_positive, None, "overrides defaults.target_tokens_per_second"),
    "headroom": Key(_ratio, None, "overrides defaults.headroom"),
    "engine": Key(_choice(*ENGINE_KINDS), "auto", "page format: auto, vllm, sglang, tgi"),
    "targets": Key(section(TARGETS_KEYS, check=_targets_check), REQUIRED, "where the model servers are"),
    "auth": Key(section(AUTH_KEYS, check=_one_of_keys("bearer_token_file", "bearer_token_env")), None, "bearer token"),
    "tls": Key(section(TLS_KEYS), None, "TLS settings for https targets"),
}
ALERTING_KEYS: Table = {
    "alertmanager_urls": Key(_url_list, [], "Alertmanager base URLs; empty: the in-process alert loop is off"),
    "for": Key(_duration, None, "overrides the page's `for` (StepBudgetPredictedStepOverBudget, 5m in the rules)"),
    "timeout": Key(_duration, 5.0, "timeout of each POST to Alertmanager"),
    "generator_url": Key(_url, None, "link put in each alert (default: this daemon's `/`)"),
}


def _listen(value: Any, where: _Where) -> str:
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    try:
        parse_listen(text)
    except InputError as error:
        raise _Bad(str(error)) from None
    return text


def parse_listen(text: str) -> tuple[str, int]:
    """`:9421` -> ("", 9421) (all interfaces); `127.0.0.1:0` -> a free port."""
    host, _, port_text = text.rpartition(":")
    if not port_text.isdigit() or int(port_text) > 65535:
        raise InputError(f"listen: expected HOST:PORT or :PORT, got {text!r}")
    return host.strip("[]"), int(port_text)


TOP_LEVEL_KEYS: Table = {
    "listen": Key(_listen, ":9421", "address the daemon serves /metrics on"),
    "poll_interval": Key(_duration, 15.0, "how often every target is polled"),
    "timeout": Key(_duration, 5.0, "per-target fetch deadline (connect + whole body)"),
    "stale_after": Key(_duration, 60.0, "a failing target's last good values are dropped after this"),
    "max_response_bytes": Key(_size, float(DEFAULT_MAX_RESPONSE_BYTES), "a page larger than this is refused"),
    "log_format": Key(_choice(*LOG_FORMATS), "auto", "json, console, or auto (console on a TTY)"),
    "defaults": Key(section(DEFAULTS_KEYS), None, "defaults for every deployment"),
    "deployments": Key(_list_of(section(DEPLOYMENT_KEYS)), REQUIRED, "the model-server deployments to watch"),
    "alerting": Key(section(ALERTING_KEYS), None, "the in-process alert loop"),
}

# Extension point: other modules add top-level sections (`shard`, `admission`, `pools`) here. Their
# parsed, defaulted values land in `Config.sections[name]`.
_EXTRA_SECTIONS: dict[str, Key] = {}


def register_section(name: str, table: Table, doc: str = "", *,
                     check: Callable[[dict[str, Any], _Where], None] | None = None) -> None:
    """Add a top-level config section validated by `table` (call at import of the owning module)."""
    if name in TOP_LEVEL_KEYS and name not in _EXTRA_SECTIONS:
        raise ValueError(f"config section {name!r} is built in")
    key = Key(section(table, check=check), None, doc)
    _EXTRA_SECTIONS[name] = key
    TOP_LEVEL_KEYS[name] = key


# Checks across sections (e.g. `pools` naming deployments), run on the built Config; each raises
# ConfigError naming the key.
_CONFIG_CHECKS: list[Callable[["Config"], None]] = []


def register_config_check(check: Callable[["Config"], None]) -> None:
    _CONFIG_CHECKS.append(check)


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


@dataclass(frozen=True)
class Auth:
    bearer_token_file: str | None = None
    bearer_token_env: str | None = None

    def bearer_token(self) -> str | None:
        """Read at each use: Kubernetes rotates projected service-account tokens in place."""
        if self.bearer_token_file:
            with open(self.bearer_token_file, encoding="utf-8") as handle:
                return handle.read().strip() or None
        if self.bearer_token_env:
            return os.environ.get(self.bearer_token_env, "").strip() or None
        return None


@dataclass(frozen=True)
class Tls:
    ca_file: str | None = None
    insecure_skip_verify: bool = False


@dataclass(frozen=True)
class Deployment:
    name: str
    model: str
    gpu: str
    tensor_parallel: int
    kv_cache_dtype: str
    engine: str
    target_tokens_per_second: float
    headroom: float
    resolved: ResolvedSetup
    static_urls: tuple[str, ...] = ()
    dns: DnsTargets | None = None
    kubernetes: KubernetesTargets | None = None
    auth: Auth = field(default_factory=Auth)
    tls: Tls = field(default_factory=Tls)

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
    generator_url: str | None = None


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
                        (("static", d.static_urls), ("dns", d.dns), ("kubernetes", d.kubernetes)) if on})
        alerting = f"alerting to {len(self.alerting.alertmanager_urls)} Alertmanager(s)" if self.alerting.alertmanager_urls else "alerting off"
        return (f"{len(self.deployments)} deployment(s) ({', '.join(d.name for d in self.deployments)}), "
                f"discovery {'+'.join(modes)}, poll every {self.poll_interval_seconds:g}s, listen {self.listen}, {alerting}")


# What `stepbudget calibrate --json` always writes and the daemon reads, with how each is checked.
CALIBRATION_NUMBERS: dict[str, Parser] = {
    "effective_bandwidth_bytes_per_second": _positive,
    "step_overhead_seconds": _non_negative,
    "spread_ratio": _non_negative,
    "tolerance_ratio": _positive,
}
CALIBRATION_REQUIRED_KEYS = (*CALIBRATION_NUMBERS, "agrees")


def _calibration_values(path: str, deployment: str, where: _Where) -> tuple[float, float]:
    """Bandwidth and overhead from `stepbudget calibrate --json` output that calibrate itself accepted."""

    def refuse(problem: str) -> ConfigError:
        return ConfigError(_message(where, f"deployment {deployment!r}: calibration file {path!r} {problem}"))

    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, ValueError) as error:
        raise refuse(f"cannot be read: {error}") from None
    if not isinstance(document, dict):
        raise refuse(f"is not `stepbudget calibrate --json` output: expected a JSON object, got {type(document).__name__}")
    missing = [key for key in CALIBRATION_REQUIRED_KEYS if key not in document]
    if missing:
        raise refuse(f"is not `stepbudget calibrate --json` output: it lacks {', '.join(missing)}")
    numbers: dict[str, float] = {}
    for key, parse in CALIBRATION_NUMBERS.items():
        try:
            numbers[key] = parse(document[key], where)
        except _Bad as bad:
            raise refuse(f"has an unusable {key}: {bad}") from None
    agrees, spread, tolerance = document["agrees"], numbers["spread_ratio"], numbers["tolerance_ratio"]
    if not isinstance(agrees, bool):
        raise refuse(f"has an unusable agrees: expected true or false, got {agrees!r}")
    if agrees != (spread <= tolerance):
        raise refuse(f"says agrees: {str(agrees).lower()} but its spread_ratio {spread:g} and tolerance_ratio "
                     f"{tolerance:g} say otherwise (edited by hand?); re-run `stepbudget calibrate --json`")
    if not agrees:
        raise refuse(f"was rejected by `stepbudget calibrate` (agrees: false): its points' bandwidths spread "
                     f"{spread:.1%}, more than the {tolerance:.0%} tolerance, so no one bandwidth describes that "
                     "server; re-run `stepbudget calibrate` (its notes name likely causes) and use a file it accepts")
    return numbers["effective_bandwidth_bytes_per_second"], numbers["step_overhead_seconds"]


def _build_deployment(raw: dict[str, Any], defaults: dict[str, Any], where: _Where) -> Deployment:
    lines = getattr(raw, "key_lines", {})
    bandwidth, overhead, calibrated = raw["effective_bandwidth"], raw["step_overhead"], False
    if raw["calibration"] is not None:
        if bandwidth is not None:
            raise ConfigError(_message(where, "give effective_bandwidth or calibration, not both"))
        bandwidth, calibrated_overhead = _calibration_values(raw["calibration"], raw["name"],
                                                             where.child("calibration", lines.get("calibration")))
        overhead = calibrated_overhead if overhead is None else overhead
        calibrated = True

    def at_key(key: str, check: Callable[[], Any]) -> Any:
        """Run `check`; its InputError becomes a ConfigError at `key`'s line."""
        try:
            return check()
        except InputError as error:
            raise ConfigError(_message(where.child(key, lines.get(key)), str(error))) from None

    architecture: Architecture = at_key("model", lambda: load_architecture(raw["model"], raw["params"]))
    at_key("gpu", lambda: get_gpu(raw["gpu"]))
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
        )
    except InputError as error:
        raise ConfigError(_message(where, str(error))) from None
    targets = raw["targets"]
    auth, tls = raw["auth"], raw["tls"]
    return Deployment(
        name=raw["name"], model=raw["model"], gpu=raw["gpu"], tensor_parallel=raw["tensor_parallel"],
        kv_cache_dtype=raw["kv_cache_dtype"], engine=raw["engine"],
        target_tokens_per_second=raw["target_tokens_per_second"] or defaults["target_tokens_per_second"],
        headroom=raw["headroom"] or defaults["headroom"],
        resolved=resolved,
        static_urls=tuple(targets["static"]),
        dns=DnsTargets(**targets["dns"]) if targets["dns"] else None,
        kubernetes=KubernetesTargets(**targets["kubernetes"]) if targets["kubernetes"] else None,
        auth=Auth(**auth) if auth else Auth(),
        tls=Tls(**tls) if tls else Tls(),
    )


def config_from_mapping(document: Any, source: str = "") -> Config:
    """Validate a parsed YAML document (from `load_config` or built from flags)."""
    _current_file[0] = source
    try:
        top = section(TOP_LEVEL_KEYS)(document, _Where("", getattr(document, "line", 0)))
    except _Bad as bad:
        raise ConfigError(_message(_Where("", 1), str(bad))) from None
    try:
        defaults = top["defaults"] or section(DEFAULTS_KEYS)(None, _Where("defaults", 0))
        raw_deployments = document["deployments"]
        item_lines = getattr(raw_deployments, "item_lines", [0] * len(raw_deployments))
        deployments = []
        for index, raw in enumerate(top["deployments"]):
            deployments.append(_build_deployment(raw, defaults, _Where("deployments", 0).child(index, item_lines[index])))
        names = [d.name for d in deployments]
        for index, name in enumerate(names):
            if names.index(name) != index:
                raise ConfigError(_message(_Where("deployments", 0).child(index, item_lines[index]).child("name", None),
                                           f"deployment name {name!r} is used twice"))
        alerting_raw = top["alerting"]
        alerting = Alerting(
            alertmanager_urls=tuple(alerting_raw["alertmanager_urls"]), for_seconds=alerting_raw["for"],
            timeout_seconds=alerting_raw["timeout"], generator_url=alerting_raw["generator_url"],
        ) if alerting_raw else Alerting()
        config = Config(
            listen=top["listen"], poll_interval_seconds=top["poll_interval"], timeout_seconds=top["timeout"],
            stale_after_seconds=top["stale_after"], max_response_bytes=int(top["max_response_bytes"]),
            log_format=top["log_format"], deployments=tuple(deployments), alerting=alerting,
            sections={name: top[name] for name in _EXTRA_SECTIONS}, source=source,
        )
        for check in _CONFIG_CHECKS:
            check(config)
        return config
    finally:
        _current_file[0] = ""


def read_document(path: str) -> Any:
    """The YAML document with line numbers; a missing file or a YAML syntax error is a ConfigError."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the config: {error.strerror or error}") from None
    try:
        document = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except ConfigError as error:
        raise ConfigError(f"{path}:{str(error).removeprefix('line ')}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f"{mark.line + 1}:" if mark is not None else ""
        raise ConfigError(f"{path}:{line} not valid YAML: {getattr(error, 'problem', None) or error}") from None
    if document is None:
        document = _LineDict()
    if not isinstance(document, dict):
        raise ConfigError(f"{path}:1: config: the file must hold a mapping of keys, got {type(document).__name__}")
    return document


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
    from exporter.daemon import _load_optional_modules

    _load_optional_modules()  # they register their sections (admission, pools) before the file is read
    config = load_config(args.file)
    print(f"{args.file}: ok: {config.summary()}")
    return 0
