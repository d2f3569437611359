"""The config's key tables: every key's type, default and meaning, and the checks across a section's keys.

Why a table: every key has one place that says its type, default and meaning, so validation,
defaults, `docs/operations.md`, the chart's JSON schema and flag overrides cannot drift apart. The
optional sections (`shard`, `admission`, `pools`) are declared next to their features with the
public validators of `exporter/config_validators.py` and listed here, in `daemon_sections`, the
one place that says what a config may hold (`top_level_keys` joins them to the core keys): whether
a config is valid never depends on which modules happen to be imported. Why a module of its own: the
tables are the config's schema, read by the parser (exporter.serve.config) and the chart's schema
(exporter.serve.config_schema) alike.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from exporter.admission.sections import ADMISSION_SECTION, POOLS_SECTION
from exporter.capacity import model
from exporter.capacity.presets import CUSTOM_GPU, FIGURE_KEYS, DeviceFigures, Gpu, device, get_gpu, require_figures
from exporter.config_validators import (
    REQUIRED,
    Invalid,
    Key,
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
    non_negative_seconds,
    one_of_keys,
    port,
    positive,
    prometheus_duration,
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
from exporter.serve.alert_rules import SEVERITIES, TUNABLE_THRESHOLDS, packaged_alert_names, percent_text
from exporter.serve.config_model import (
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_PROMETHEUS_RESPONSE_BYTES,
    DEFAULT_SPEED_OBJECTIVE,
    DEFAULT_STARTUP_ALLOWANCE_SECONDS,
)
from exporter.serve.sharding import SHARD_SECTION


def server_kind(value: Any, where: Where) -> str:
    """A server's `kind` (its page format): "auto" or a registered engine adapter's kind.

    Why a lookup at parse time: the adapter registry (exporter.serve.engines.ADAPTERS) is the one
    list of kinds, and importing it here at module level would load every adapter with the config.
    """
    from exporter.serve.engines import server_kinds  # the registry; see the docstring

    return str(choice(*server_kinds())(value, where))
# What a server does in a prefill/decode (P/D) split; auto reads it off the page (reading.server_role).
SERVER_ROLES = ("auto", "prefill", "decode", "both")
LOG_FORMATS = ("auto", "json", "console")
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
# defaults (in exporter.serve.online_settings.Settings) apply where neither says.
ONLINE_CALIBRATION_KEYS: Table = {
    "enabled": Key(boolean, None, "fit the step's terms from the daemon's own windows (default true)"),
    "history": Key(duration, None, "windows this far back are fitted (default 6h)"),
    "holdout": Key(duration, None, "the most recent windows left out of the fit, so a sudden change shows as "
                                    "prediction error first (default 30m)"),
    "min_windows": Key(whole_positive, None, "the fit replaces the seed only with this many windows (default 30)"),
    "prometheus_url": Key(url, None, "Prometheus holding this daemon's own series: the fit is seeded from "
                                     "them at start-up (query_range over `history`)"),
}
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
    "kind": Key(server_kind, "auto", "the servers' page format: auto (detected from the page) or an engine "
                                   "adapter's kind"),
    "role": Key(choice(*SERVER_ROLES), "auto",
                "what the servers do in a prefill/decode split: auto (from the page), prefill (no decode-step "
                "page; a prefill budget), decode (prompts arrive by KV transfer), both"),
    "targets": Key(section(TARGETS_KEYS, check=targets_check), REQUIRED, "where the model servers are"),
    "auth": Key(section(AUTH_KEYS, check=AUTH_CHECK), None,
                "credentials for the servers: a bearer token or basic auth, from files or the environment"),
    "tls": Key(section(TLS_KEYS, check=tls_check), None, "TLS settings for https targets"),
}
def alert_labels(value: Any, where: Where) -> dict[str, str]:
    """Labels an alert carries beyond its own; `severity` has a key of its own (routing reads it)."""
    labels = label_set(value, where)
    if "severity" in labels:
        raise Invalid("set the severity with the alert's own `severity` key, not as a label")
    return labels


def alert_threshold(value: Any, where: Where) -> float:
    """A threshold ratio between 0.0001 and 100 (the rule's expression and the loop compare with it)."""
    number = positive(value, where)
    if not 1e-4 <= number <= 100:
        raise Invalid(f"expected a ratio between 0.0001 and 100, got {value!r}")
    return number


def _alert_settings_keys(alert: str) -> Table:
    keys: dict[str, Key] = {
        "enabled": Key(boolean, True, "false: neither the daemon's loop nor the rules the chart renders raise it"),
        "for": Key(prometheus_duration, None, "how long its condition holds before it fires (default: the rules')"),
        "severity": Key(choice(*SEVERITIES), None, "critical, warning or info (default: the rules')"),
        "labels": Key(alert_labels, None, "labels added to it, e.g. `team: llm-serving` for routing"),
    }
    if alert in TUNABLE_THRESHOLDS:
        default = TUNABLE_THRESHOLDS[alert]
        keys["threshold"] = Key(alert_threshold, None, f"the ratio it fires above (default {default:g}: "
                                                       f"{percent_text(default)}%)")
    return keys


# Every alert of the packaged rules, tunable once for the daemon's loop and the rules the chart renders.
ALERT_RULES_KEYS: Table = {name: Key(section(_alert_settings_keys(name)), None, f"settings of {name}")
                           for name in packaged_alert_names()}
ALERTING_KEYS: Table = {
    "alertmanager_urls": Key(url_list, [], "Alertmanager base URLs; empty: the in-process alert loop is off"),
    "rules": Key(section(ALERT_RULES_KEYS), None,
                 "per alert: enabled, for, severity, labels and (drift, prefill capacity, KV cache) threshold; the "
                 "daemon's loop and the chart's PrometheusRule both follow them (`stepbudget rules` prints the "
                 "rules file for a Prometheus outside the chart)"),
    "for": Key(prometheus_duration, None, "the page's `for` (StepBudgetPredictedStepOverBudget, 5m in the rules): "
                                          "shorthand for rules.StepBudgetPredictedStepOverBudget.for"),
    "drift_for": Key(prometheus_duration, None, "StepBudgetPredictionDrift's `for` (15m in the rules): shorthand for "
                                                "rules.StepBudgetPredictionDrift.for; every "
                                                "online_calibration.holdout must outlast it"),
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
