"""The Helm chart, rendered by the real helm binary and checked object by object.

Core objects are validated against the Kubernetes OpenAPI schemas (kubernetes-validate, strict);
the CRDs it cannot know (ServiceMonitor, PrometheusRule, ScaledObject) are checked for the fields
their operators read. The PrometheusRule's rules go through promtool, the ConfigMap's config
through `stepbudget check-config`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.support.chart import (
    CHART,
    CI_VALUES,
    DEPLOYMENT_VALUES,
    NAMESPACE,
    RELEASE,
    STATEFULSET_VALUES,
    helm,
    matches,
    of_kind,
    one,
    render,
    workload,
)
from tests.support.monitoring import REPO, known_metrics, metric_names, promtool_check_exprs
from tests.support.tools import require_tool

K8S_VERSION = "1.30"
# Chart.yaml's kubeVersion floor and the newest schemas kubernetes-validate ships.
K8S_VERSIONS = ["1.25", K8S_VERSION, "1.37"]
CONFIG_PATH = "/etc/stepbudget/config.yaml"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject"}
DEFAULT_RUNBOOK_BASE = "https://github.com/stepbudget/stepbudget/blob/main/docs/runbook.md"
VALUE_SETS = [None, *CI_VALUES]


def _id(values: Path | None) -> str:
    return values.name if values else "default"


def _merge(base: dict, overlay: dict) -> dict:
    """Helm's values coalescing: maps merge key by key, anything else (lists too) replaces."""
    merged = dict(base)
    for key, value in overlay.items():
        both_maps = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = _merge(base[key], value) if both_maps else value
    return merged


def _values(values: Path | None) -> dict:
    """The effective values: chart defaults overlaid with the file."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    return _merge(defaults, yaml.safe_load(values.read_text())) if values else defaults


def container(docs: list[dict]) -> dict:
    return workload(docs)["spec"]["template"]["spec"]["containers"][0]


# --- helm lint and the objects rendered ---------------------------------------------------------

@pytest.mark.parametrize("values", VALUE_SETS, ids=_id)
def test_helm_lint_strict(values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE] + (["-f", str(values)] if values else [])
    result = helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_default_values_render_only_the_core_objects() -> None:
    kinds = sorted(doc["kind"] for doc in render())
    assert kinds == ["ConfigMap", "Deployment", "Service", "ServiceAccount"]


def test_every_option_on_renders_every_object() -> None:
    sharded = sorted(doc["kind"] for doc in render(STATEFULSET_VALUES))
    dashboards = len(list((CHART / "files" / "dashboards").glob("*.json")))
    # Two namespaces (llm, agents) are discovered through the Kubernetes API: a Role each.
    assert sharded == sorted(
        ["ConfigMap"] * (1 + dashboards)
        + ["NetworkPolicy", "PodDisruptionBudget", "PrometheusRule", "Role", "Role", "RoleBinding", "RoleBinding",
           "ScaledObject", "Service", "Service", "ServiceAccount", "ServiceMonitor", "StatefulSet"]
    )
    unsharded = sorted(doc["kind"] for doc in render(DEPLOYMENT_VALUES))
    assert unsharded == sorted(
        ["ConfigMap"] * (1 + dashboards)
        + ["Deployment", "NetworkPolicy", "PodDisruptionBudget", "PrometheusRule", "ScaledObject", "Service",
           "ServiceAccount", "ServiceMonitor"]
    )


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("values", VALUE_SETS, ids=_id)
def test_core_objects_pass_strict_kubernetes_schemas(values: Path | None, version: str) -> None:
    unknown = set()
    for doc in render(values):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unknown.add(doc["kind"])
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {error}")
    assert unknown <= CRD_KINDS, f"only the CRDs may lack a schema: {unknown - CRD_KINDS}"


def test_strict_validation_catches_a_bad_field() -> None:
    """The schema check above can fail: a misspelt field in a rendered Deployment is refused."""
    deployment = workload(render())
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


# --- the pod ------------------------------------------------------------------------------------

@pytest.mark.parametrize("values", VALUE_SETS, ids=_id)
def test_pod_is_hardened(values: Path | None) -> None:
    docs = render(values)
    pod = workload(docs)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container(docs)["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert not security.get("privileged", False)


@pytest.mark.parametrize("values", VALUE_SETS, ids=_id)
def test_probes_args_config_mount_and_resources(values: Path | None) -> None:
    docs = render(values)
    main = container(docs)
    assert main["livenessProbe"]["httpGet"] == {"path": "/-/healthy", "port": "http"}
    assert main["readinessProbe"]["httpGet"] == {"path": "/-/ready", "port": "http"}
    assert main["args"][:3] == ["serve", "--config", CONFIG_PATH]
    mount = next(m for m in main["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] == str(Path(CONFIG_PATH).parent) and mount["readOnly"] is True
    volume = next(v for v in workload(docs)["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    config_map = next(c for c in of_kind(docs, "ConfigMap") if c["metadata"]["name"] == volume["configMap"]["name"])
    assert Path(CONFIG_PATH).name in config_map["data"]
    assert main["resources"] == _values(values)["resources"]


def test_resources_extra_args_and_image_digest_are_settable() -> None:
    digest = "sha256:" + "ab" * 32
    docs = render(None, "resources.limits.memory=300Mi", "extraArgs[0]=--example-flag", f"image.digest={digest}")
    main = container(docs)
    defaults = _values(None)["resources"]
    assert main["resources"] == {"requests": defaults["requests"], "limits": {"memory": "300Mi"}}
    assert main["args"][-1] == "--example-flag"
    assert main["image"] == f"stepbudget/stepbudget@{digest}"


def test_config_changes_roll_the_pods() -> None:
    """The pod template carries a checksum of the config, so a new config restarts the daemon."""
    def checksum(*sets: str) -> str:
        return workload(render(None, *sets))["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    assert checksum() != checksum("config.poll_interval=30s")


# --- StatefulSet mode (sharding) ----------------------------------------------------------------

@pytest.mark.parametrize("replicas", [3, 5])
def test_statefulset_replica_passes_its_ordinal_and_the_replica_count(replicas: int) -> None:
    docs = render(STATEFULSET_VALUES, f"replicas={replicas}")
    sts = one(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == replicas
    args = container(docs)["args"]
    shard = args[args.index("--shard") + 1]
    env = {e["name"]: e for e in container(docs)["env"]}
    index_var = re.fullmatch(r"\$\((\w+)\)/(\d+)", shard)
    assert index_var and int(index_var.group(2)) == replicas
    field = env[index_var.group(1)]["valueFrom"]["fieldRef"]["fieldPath"]
    assert field == "metadata.labels['apps.kubernetes.io/pod-index']"


def test_statefulset_has_a_headless_governing_service_not_scraped_twice() -> None:
    docs = render(STATEFULSET_VALUES)
    sts = one(docs, "StatefulSet")
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    monitor = one(docs, "ServiceMonitor")["spec"]["selector"]
    scraped = [name for name, s in services.items() if matches(monitor, s["metadata"]["labels"])]
    assert scraped == [name for name in services if name != sts["spec"]["serviceName"]]


def test_deployment_mode_has_no_shard_flag() -> None:
    assert "--shard" not in container(render(DEPLOYMENT_VALUES))["args"]


# --- ServiceAccount and pod discovery -----------------------------------------------------------

def test_pod_discovery_rbac_only_where_the_config_discovers() -> None:
    docs = render(STATEFULSET_VALUES)
    config = _values(STATEFULSET_VALUES)["config"]
    wanted = {d["targets"]["kubernetes"]["namespace"] for d in config["deployments"] if "kubernetes" in d["targets"]}
    roles = of_kind(docs, "Role")
    assert {r["metadata"]["namespace"] for r in roles} == wanted
    for role in roles:
        # exporter/serve/discovery.py only lists pods (client.list at every poll): no get, no watch.
        assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    account = one(docs, "ServiceAccount")["metadata"]["name"]
    for binding in of_kind(docs, "RoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
        assert binding["roleRef"]["name"] in {r["metadata"]["name"] for r in roles}
    assert workload(docs)["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert not of_kind(render(STATEFULSET_VALUES, "rbac.create=false"), "Role")


def test_no_api_token_without_kubernetes_discovery() -> None:
    for values in (None, DEPLOYMENT_VALUES):
        docs = render(values)
        assert not of_kind(docs, "Role") and not of_kind(docs, "RoleBinding")
        assert workload(docs)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


# --- the daemon's config ------------------------------------------------------------------------

def _rendered_config(values: Path | None) -> dict:
    config_map = next(c for c in of_kind(render(values), "ConfigMap") if "config.yaml" in c["data"])
    return yaml.safe_load(config_map["data"]["config.yaml"])


@pytest.mark.parametrize("values", VALUE_SETS, ids=_id)
def test_config_map_holds_values_config_listening_on_the_container_port(values: Path | None) -> None:
    effective = _values(values)
    config = _rendered_config(values)
    expected = {**effective["config"], "listen": f":{effective['port']}"}
    base = effective["prometheusRule"]["runbookBaseUrl"]
    if base != DEFAULT_RUNBOOK_BASE:  # the daemon's alerts link where the rules the chart renders do
        expected["alerting"] = {**(expected.get("alerting") or {}), "runbook_base_url": base}
    assert config == expected
    port = container(render(values))["ports"][0]
    assert port == {"name": "http", "containerPort": effective["port"], "protocol": "TCP"}


@pytest.mark.parametrize("values", VALUE_SETS, ids=_id)
def test_rendered_config_passes_stepbudget_check_config(values: Path | None, tmp_path: Path) -> None:
    """Depends on exporter/serve/config.py (`stepbudget check-config`), owned by another issue."""
    cli = Path(sys.executable).parent / "stepbudget"
    assert cli.exists(), f"{cli} missing: `pip install -e .` first"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_rendered_config(values)))
    # The pod gets VLLM_TOKEN from a Secret (ci/statefulset-values.yaml's bearer_token_env).
    env = {**os.environ, "VLLM_TOKEN": "token-for-the-test"}
    result = subprocess.run([str(cli), "check-config", str(path)], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", VALUE_SETS, ids=_id)
def test_daemon_accepts_the_rendered_args(values: Path | None, tmp_path: Path) -> None:
    """`stepbudget serve` parses the container's args (env references expanded as the kubelet does).

    The config path does not exist here, so the daemon stops at reading it instead of serving; an
    argparse error (usage line, unrecognized argument) would mean the chart and the CLI disagree.
    In StatefulSet mode this depends on `--shard INDEX/COUNT`, added to `serve` by another issue.
    """
    main = container(render(values))
    args = [re.sub(r"\$\((\w+)\)", "1", arg) for arg in main["args"]]
    args[args.index("--config") + 1] = str(tmp_path / "absent" / "config.yaml")
    cli = Path(sys.executable).parent / "stepbudget"
    result = subprocess.run([str(cli), *args], capture_output=True, text=True, timeout=60, check=False)
    assert "usage:" not in result.stderr and "unrecognized arguments" not in result.stderr, result.stderr
    assert result.returncode == 2 and "config" in result.stderr, result.stderr


# --- CRDs: shapes the operators read ------------------------------------------------------------

@pytest.mark.parametrize("values", CI_VALUES, ids=_id)
def test_service_monitor_scrapes_the_service_port_with_honor_labels(values: Path) -> None:
    docs = render(values)
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = next(s for s in of_kind(docs, "Service")
                   if matches(monitor["spec"]["selector"], s["metadata"]["labels"]))
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics" and endpoint["honorLabels"] is True
    for key in ("interval", "scrapeTimeout"):
        assert re.fullmatch(r"\d+(ms|s|m|h)", endpoint[key]), endpoint[key]
    drop = endpoint["relabelings"][0]
    assert drop["action"] == "labeldrop"
    assert {"namespace", "pod", "service", "endpoint", "container"} == set(drop["regex"].strip("()").split("|"))
    assert set(_values(values)["serviceMonitor"]["labels"].items()) <= set(monitor["metadata"]["labels"].items())


@pytest.mark.parametrize("values", CI_VALUES, ids=_id)
def test_prometheus_rule_is_rules_dir_and_passes_promtool(values: Path, tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    rule = one(render(values), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    base = _values(values)["prometheusRule"]["runbookBaseUrl"] or DEFAULT_RUNBOOK_BASE
    expected = []
    for path in sorted((REPO / "rules").glob("*.yaml")):
        expected += yaml.safe_load(path.read_text().replace(DEFAULT_RUNBOOK_BASE, base))["groups"]
    assert rule["spec"]["groups"] == expected
    rule_file = tmp_path / "rendered.rules.yaml"
    rule_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = subprocess.run([promtool, "check", "rules", "--lint=all", "--lint-fatal", str(rule_file)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", CI_VALUES, ids=_id)
def test_dashboard_config_maps_carry_the_sidecar_label_and_the_json(values: Path) -> None:
    settings = _values(values)["grafanaDashboards"]
    maps = [c for c in of_kind(render(values), "ConfigMap") if settings["label"] in c["metadata"]["labels"]]
    files = sorted((REPO / "dashboards").glob("*.json"))
    assert len(maps) == len(files)
    by_file = {name: c for c in maps for name in c["data"]}
    for path in files:
        config_map = by_file[path.name]
        assert config_map["metadata"]["labels"][settings["label"]] == "1"
        assert config_map["metadata"]["namespace"] == (settings["namespace"] or NAMESPACE)
        # The runbook link from the same base as the rules' runbook_url.
        base = _values(values)["prometheusRule"]["runbookBaseUrl"] or DEFAULT_RUNBOOK_BASE
        assert json.loads(config_map["data"][path.name]) == json.loads(
            path.read_text().replace(DEFAULT_RUNBOOK_BASE, base))
        (runbook,) = [link for link in json.loads(config_map["data"][path.name])["links"] if link["title"] == "Runbook"]
        assert runbook["url"] == base


@pytest.mark.parametrize("values", CI_VALUES, ids=_id)
def test_keda_scales_on_token_budget_utilization_not_requests(values: Path) -> None:
    promtool = require_tool("promtool")
    settings = _values(values)["keda"]
    scaled = one(render(values), "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == settings["scaleTargetRef"]["name"]
    assert scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    query = trigger["metadata"]["query"]
    assert metric_names(query) == {"deployment_model_name:stepbudget_token_budget_utilization:ratio"}
    assert metric_names(query) <= known_metrics()
    assert f'deployment="{settings["deployment"]}"' in query
    assert float(trigger["metadata"]["threshold"]) == float(settings["threshold"])
    result = promtool_check_exprs(promtool, [query])
    assert result.returncode == 0, result.stdout + result.stderr


# Model-server ports each ci file's config names, by hand: deployment-values has static URLs on
# 8000 and a DNS target on port 80; statefulset-values two kubernetes targets (8000 given, and the
# daemon's default 8000).
CONFIGURED_MODEL_PORTS = {DEPLOYMENT_VALUES: {80, 8000}, STATEFULSET_VALUES: {8000}}


@pytest.mark.parametrize("values", CI_VALUES, ids=_id)
def test_network_policy_admits_scrapes_and_derives_egress_from_the_config(values: Path) -> None:
    docs = render(values)
    policy = one(docs, "NetworkPolicy")["spec"]
    pod_labels = workload(docs)["spec"]["template"]["metadata"]["labels"]
    assert matches(policy["podSelector"], pod_labels)
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["ingress"][0]["ports"] == [{"port": "http", "protocol": "TCP"}]
    dns, model_servers, *others = policy["egress"]
    assert dns["ports"] == [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
    assert {p["port"] for p in model_servers["ports"]} == CONFIGURED_MODEL_PORTS[values]
    # Alertmanager (both files name http://alertmanager-operated.monitoring.svc:9093) and, only
    # where the config discovers pods, the API server: each its own rule.
    expected = ([[443, 6443]] if values == STATEFULSET_VALUES else []) + [[9093]]
    assert [[p["port"] for p in rule["ports"]] for rule in others] == expected


def test_network_policy_reads_ports_from_urls_and_kubernetes_defaults(tmp_path: Path) -> None:
    """A URL without a port means 80 (http) or 443 (https); kubernetes.port defaults to 8000."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "networkPolicy": {"enabled": True, "egress": {"modelServers": {"extraPorts": [30000]}}},
        "config": {"deployments": [{"name": "a", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {
            "static": ["https://a.example:8443/metrics", "https://b.example/metrics", "http://c.example/metrics"],
            "kubernetes": {"namespace": "llm", "label_selector": "app=sglang"}}}]},
    }))
    policy = one(render(values), "NetworkPolicy")["spec"]
    assert {p["port"] for p in policy["egress"][1]["ports"]} == {8443, 443, 80, 8000, 30000}
    # No alerting.alertmanager_urls: DNS, model servers and the API server only.
    assert len(policy["egress"]) == 3


def test_network_policy_reaches_the_prometheus_the_config_reads(tmp_path: Path) -> None:
    """Prometheus mode (targets.prometheus.url) and online calibration's seeding (prometheus_url under
    defaults or a deployment) query Prometheus: its ports get their own rule, with their own peers."""
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "networkPolicy": {"enabled": True, "egress": {"prometheus": {"to": monitoring}}},
        "config": {
            "defaults": {"online_calibration": {"prometheus_url": "http://prometheus.monitoring.svc:9092"}},
            "deployments": [
                {"name": "a", "model": "qwen3-8b", "gpu": "h100-sxm",
                 "targets": {"prometheus": {"url": "http://prometheus.monitoring.svc:9090", "selector": 'job="v"'}}},
                {"name": "b", "model": "qwen3-8b", "gpu": "h100-sxm",
                 "online_calibration": {"prometheus_url": "https://thanos.monitoring.svc"},
                 "targets": {"static": ["http://b.llm.svc:8000/metrics"]}}]},
    }))
    policy = one(render(values), "NetworkPolicy")["spec"]
    dns, model_servers, prometheus = policy["egress"]
    assert {p["port"] for p in dns["ports"]} == {53}
    assert {p["port"] for p in model_servers["ports"]} == {8000}
    assert sorted(p["port"] for p in prometheus["ports"]) == [443, 9090, 9092]
    assert prometheus["to"] == monitoring
    assert "to" not in model_servers  # the Prometheus peers restrict that rule only


# --- values.schema.json -------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ("mode=daemonset", "mode"),
        ("replicas=0", "replicas"),
        ("config.listen=:1234", "config"),
        ("securityContext.allowPrivilegeEscalation=yes", "allowPrivilegeEscalation"),
        ("serviceMonitor.interval=30 seconds", "interval"),
        ("keda.threshold=high", "threshold"),
        ("unknownKey=1", "unknownKey"),
    ],
)
def test_schema_rejects_bad_values(setting: str, key: str) -> None:
    result = helm("template", RELEASE, str(CHART), "--set", setting)
    assert result.returncode != 0, f"{setting} was accepted"
    assert key in result.stderr


def test_keda_requires_a_scale_target() -> None:
    result = helm("template", RELEASE, str(CHART), "--set", "keda.enabled=true", "--set", "keda.deployment=chat")
    assert result.returncode != 0 and "keda.scaleTargetRef.name is required" in result.stderr


# --- make chart-sync drift ----------------------------------------------------------------------

def test_chart_files_are_exact_copies_of_rules_and_dashboards() -> None:
    """`make chart-sync` copies rules/ and dashboards/ into the chart; run it after changing either."""
    pairs = [(REPO / "rules", "*.yaml", CHART / "files" / "rules"),
             (REPO / "dashboards", "*.json", CHART / "files" / "dashboards")]
    for source, pattern, copy in pairs:
        originals = {p.name: p.read_bytes() for p in source.glob(pattern)}
        copies = {p.name: p.read_bytes() for p in copy.iterdir()}
        assert copies == originals, f"{copy} drifted from {source}: run `make chart-sync`"
