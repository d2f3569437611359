"""The chart in a real cluster's layout, and its values checked before anything reaches the API server.

Rendered by the real helm binary for docs/quickstart-kubernetes.md's layout (stepbudget in
`monitoring`, vLLM in `llm`; tests/data/chart/quickstart-values.yaml): where each object lands,
what the NetworkPolicy lets through, the PodDisruptionBudget, NOTES.txt; every custom resource
validated against the upstream CRDs vendored in tests/data/crds/ (README there: source, tag,
sha256), and `helm template` refusing typos with a message naming the key.
"""

from __future__ import annotations

import copy
import ipaddress
import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from jsonschema import Draft7Validator

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
from tests.support.tools import DATA

LAYOUT_VALUES = DATA / "chart" / "quickstart-values.yaml"
CRDS = DATA / "crds"
MODEL_NAMESPACE = "llm"
SHARDED = ("mode=statefulset", "replicas=3")


# --- a NetworkPolicy evaluator (egress), after the Kubernetes NetworkPolicy semantics ------------

def _namespace_labels(name: str) -> dict:
    return {"kubernetes.io/metadata.name": name}


def _peer_admits(peer: dict, destination: dict, policy_namespace: str) -> bool:
    """One NetworkPolicyPeer against a destination: a pod {namespace, labels} or an address {ip}."""
    if "ipBlock" in peer:
        if "ip" not in destination:
            return False
        address = ipaddress.ip_address(destination["ip"])
        block = peer["ipBlock"]
        return (address in ipaddress.ip_network(block["cidr"])
                and not any(address in ipaddress.ip_network(e) for e in block.get("except", [])))
    if "namespace" not in destination:  # a host-network address is no pod a selector can pick
        return False
    if "namespaceSelector" in peer:
        namespace_ok = matches(peer["namespaceSelector"], _namespace_labels(destination["namespace"]))
    else:
        namespace_ok = destination["namespace"] == policy_namespace
    return namespace_ok and matches(peer.get("podSelector", {}), destination["labels"])


def egress_allows(policy: dict, destination: dict, port: int, protocol: str = "TCP") -> bool:
    """Whether some egress rule lets the selected pods connect to `destination` on port/protocol."""
    for rule in policy["spec"]["egress"]:
        ports = rule.get("ports")
        if ports and not any(p["port"] == port and p.get("protocol", "TCP") == protocol for p in ports):
            continue
        peers = rule.get("to")
        if not peers or any(_peer_admits(p, destination, policy["metadata"]["namespace"]) for p in peers):
            return True
    return False


def _pod(namespace: str, **labels: str) -> dict:
    return {"namespace": namespace, "labels": labels}


VLLM = _pod(MODEL_NAMESPACE, app="vllm")
ALERTMANAGER = _pod("monitoring", **{"app.kubernetes.io/name": "alertmanager"})
KUBE_DNS = _pod("kube-system", **{"k8s-app": "kube-dns"})
API_SERVER = {"ip": "172.18.0.2"}  # a control-plane node address


def test_evaluator_denies_what_no_rule_allows() -> None:
    """The evaluator can say no: a pod-selector peer excludes other namespaces and other ports."""
    policy = {"metadata": {"namespace": "monitoring"},
              "spec": {"egress": [{"ports": [{"port": 8000, "protocol": "TCP"}],
                                   "to": [{"namespaceSelector": {"matchLabels": _namespace_labels("llm")}}]}]}}
    assert egress_allows(policy, VLLM, 8000)
    assert not egress_allows(policy, VLLM, 8001)
    assert not egress_allows(policy, _pod("default", app="vllm"), 8000)
    assert not egress_allows(policy, API_SERVER, 8000)


# --- the documented layout ----------------------------------------------------------------------

def test_layout_renders_the_scaled_object_in_the_scale_targets_namespace() -> None:
    """KEDA resolves scaleTargetRef in the ScaledObject's own namespace (templates/keda-scaledobject.yaml
    cites the controller code), so with vLLM in `llm` the ScaledObject must be in `llm` too."""
    docs = render(LAYOUT_VALUES)
    scaled = one(docs, "ScaledObject")
    assert scaled["metadata"]["namespace"] == MODEL_NAMESPACE
    assert scaled["spec"]["scaleTargetRef"]["name"] == "vllm"
    # Everything else of the release stays in the release namespace.
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] not in {"ScaledObject", "Role", "RoleBinding"}} \
        == {NAMESPACE}
    # keda.threshold given as the number 0.75 reaches KEDA as the string it wants.
    assert scaled["spec"]["triggers"][0]["metadata"]["threshold"] == "0.75"


def test_layout_scaled_object_defaults_to_the_release_namespace() -> None:
    scaled = one(render(LAYOUT_VALUES, "keda.namespace="), "ScaledObject")
    assert scaled["metadata"]["namespace"] == NAMESPACE


@pytest.mark.parametrize("sets", [(), SHARDED], ids=["deployment", "statefulset"])
def test_layout_egress_reaches_model_servers_and_keeps_api_alertmanager_and_dns(sets: tuple[str, ...]) -> None:
    policy = one(render(LAYOUT_VALUES, *sets), "NetworkPolicy")
    # The model servers: vLLM pods in llm on the configured port 8000, and nothing else there.
    assert egress_allows(policy, VLLM, 8000)
    assert not egress_allows(policy, _pod("default", app="vllm"), 8000)
    assert not egress_allows(policy, _pod(MODEL_NAMESPACE, app="other"), 8000)
    assert not egress_allows(policy, VLLM, 8080)
    # The restricted model-server peer leaves the other purposes reachable: the API server (discovery)...
    assert egress_allows(policy, API_SERVER, 443) and egress_allows(policy, API_SERVER, 6443)
    # ... Alertmanager on its configured port 9093, and DNS over UDP and TCP.
    assert egress_allows(policy, ALERTMANAGER, 9093)
    assert egress_allows(policy, KUBE_DNS, 53, "UDP") and egress_allows(policy, KUBE_DNS, 53, "TCP")


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_ci_egress_allows_every_configured_target_port(values: Path) -> None:
    """deployment-values: static URLs on 8000 and a DNS target on port 80 (which a fixed port list
    blocked); statefulset-values: kubernetes targets in llm and agents on 8000, peers restricted."""
    docs = render(values)
    policy = one(docs, "NetworkPolicy")
    config = yaml.safe_load(one([d for d in of_kind(docs, "ConfigMap") if "config.yaml" in d["data"]],
                                "ConfigMap")["data"]["config.yaml"])
    namespaces = {d["targets"].get("kubernetes", {}).get("namespace", MODEL_NAMESPACE) for d in config["deployments"]}
    ports = {DEPLOYMENT_VALUES: [8000, 80], STATEFULSET_VALUES: [8000]}[values]
    for namespace in namespaces:
        for port in ports:
            assert egress_allows(policy, _pod(namespace, app="vllm-chat"), port), (namespace, port)
    assert egress_allows(policy, ALERTMANAGER, 9093)
    assert egress_allows(policy, KUBE_DNS, 53, "UDP")
    if values == STATEFULSET_VALUES:
        assert egress_allows(policy, API_SERVER, 6443)
        assert not egress_allows(policy, _pod("default", app="x"), 8000)
        assert not egress_allows(policy, _pod("monitoring", app="not-alertmanager"), 9093)


def test_sharded_statefulset_gets_a_pdb_that_lets_one_shard_go_at_a_time() -> None:
    docs = render(LAYOUT_VALUES, *SHARDED)
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    sts = one(docs, "StatefulSet")
    assert matches(pdb["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    assert pdb["metadata"]["namespace"] == sts["metadata"]["namespace"] == NAMESPACE
    kubernetes_validate.validate(pdb, "1.25", strict=True)


@pytest.mark.parametrize(("sets", "expected"), [
    ((), None),                                              # one replica: a PDB would block every drain
    (("replicas=2",), {"maxUnavailable": 1}),                 # duplicate Deployment pods
    (("podDisruptionBudget.enabled=false", *SHARDED), None),
    (("podDisruptionBudget.enabled=true",), {"maxUnavailable": 1}),
    ((*SHARDED, "podDisruptionBudget.minAvailable=2"), {"minAvailable": 2}),
])
def test_pdb_is_on_by_default_only_with_more_than_one_replica(sets: tuple[str, ...], expected: dict | None) -> None:
    found = of_kind(render(LAYOUT_VALUES, *sets), "PodDisruptionBudget")
    if expected is None:
        assert not found
    else:
        assert {k: v for k, v in found[0]["spec"].items() if k != "selector"} == expected


# --- custom resources against the upstream CRDs -------------------------------------------------

def _strict(schema: dict) -> dict:
    """The CRD's structural schema with unknown fields refused (as kubectl's --validate=strict does):
    additionalProperties false on every object that lists properties and does not keep unknown fields."""
    schema = copy.deepcopy(schema)

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def _crd_validators() -> dict[tuple[str, str], Draft7Validator]:
    validators = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            api_version = f"{crd['spec']['group']}/{version['name']}"
            schema = _strict(version["schema"]["openAPIV3Schema"])
            validators[(api_version, crd["spec"]["names"]["kind"])] = Draft7Validator(schema)
    return validators


VALIDATORS = _crd_validators()


def _crd_errors(doc: dict) -> list[str]:
    validator = VALIDATORS[(doc["apiVersion"], doc["kind"])]
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize("values", [*CI_VALUES, LAYOUT_VALUES], ids=lambda p: p.name)
def test_every_custom_resource_passes_the_upstream_crd_schema(values: Path) -> None:
    docs = render(values)
    custom = [d for d in docs if "." in d["apiVersion"].split("/")[0] and not d["apiVersion"].startswith(
        ("apps/", "policy/", "networking.k8s.io/", "rbac.authorization.k8s.io/"))]
    assert sorted(d["kind"] for d in custom) == ["PrometheusRule", "ScaledObject", "ServiceMonitor"]
    for doc in custom:
        assert _crd_errors(doc) == [], doc["kind"]


def test_crd_validation_refuses_what_the_api_server_would() -> None:
    """The CRD check can fail: a misspelt field, a Prometheus-invalid duration, a rule without expr."""
    docs = render(LAYOUT_VALUES)
    monitor = copy.deepcopy(one(docs, "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    assert any("intervall" in e for e in _crd_errors(monitor))
    monitor = copy.deepcopy(one(docs, "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["interval"] = "30 seconds"
    assert any("does not match" in e for e in _crd_errors(monitor))
    rule = copy.deepcopy(one(docs, "PrometheusRule"))
    del rule["spec"]["groups"][0]["rules"][0]["expr"]
    assert any("'expr' is a required property" in e for e in _crd_errors(rule))
    scaled = copy.deepcopy(one(docs, "ScaledObject"))
    scaled["spec"]["scaleTargetRef"]["namespace"] = MODEL_NAMESPACE  # KEDA has no such field
    assert any("namespace" in e for e in _crd_errors(scaled))


def test_values_duration_is_the_service_monitor_crds_pattern() -> None:
    crd = yaml.safe_load((CRDS / "monitoring.coreos.com_servicemonitors.yaml").read_text())
    endpoint = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "endpoints"]["items"]["properties"]
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["definitions"]["duration"]["pattern"] == endpoint["interval"]["pattern"]
    assert schema["definitions"]["duration"]["pattern"] == endpoint["scrapeTimeout"]["pattern"]


# --- values.schema.json: typos refused at `helm template`, naming the key ----------------------

def _refusal(values: dict, tmp_path: Path) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(path))
    assert result.returncode != 0, f"{values} was accepted"
    return result.stderr


def _deployment(**overrides: object) -> dict:
    return {"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
            "targets": {"static": ["http://10.0.0.5:8000/metrics"]}, **overrides}


@pytest.mark.parametrize(("values", "named"), [
    ({"config": {"poll_intervall": "15s", "deployments": [_deployment()]}}, "'poll_intervall'"),
    ({"config": {"deployments": [_deployment(targets={"kubernetes": {"label_selector": "app=vllm"}})]}},
     "'namespace'"),
    ({"config": {"deployments": [_deployment(gpu_memory_utilisation=0.9)]}}, "'gpu_memory_utilisation'"),
    ({"config": {"deployments": [_deployment(kind="vllmm")]}}, "/config/deployments/0/kind"),
    ({"config": {"listen": ":1234", "deployments": [_deployment()]}}, "'listen'"),
    ({"securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                          "capabilities": {"drop": ["ALL"]}, "runAsNonRot": True}}, "'runAsNonRot'"),
    ({"securityContext": {"capabilities": {"dorp": ["ALL"]}}}, "'dorp'"),
    ({"podSecurityContext": {"fsGroupp": 65532}}, "'fsGroupp'"),
    ({"podSecurityContext": {"seccompProfile": {"typ": "RuntimeDefault"}}}, "'typ'"),
    ({"livenessProbe": {"periodSecond": 10}}, "'periodSecond'"),
    ({"readinessProbe": {"httpGet": {"paht": "/-/ready"}}}, "'paht'"),
    ({"resources": {"request": {"cpu": "50m"}}}, "'request'"),
    ({"resources": {"limits": {"memroy": "256Mi"}}}, "memroy"),
    ({"securityContext": None}, "'securityContext'"),
    ({"podSecurityContext": None}, "'podSecurityContext'"),
    ({"networkPolicy": {"egressTo": []}}, "'egressTo'"),
    ({"podDisruptionBudget": {"enabled": "yes"}}, "/podDisruptionBudget/enabled"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_helm_template_refuses_typos_naming_the_key(values: dict, named: str, tmp_path: Path) -> None:
    assert named in _refusal(values, tmp_path)


def test_schema_accepts_prometheus_durations_and_numeric_thresholds() -> None:
    """`1m30s` as the ServiceMonitor interval and as the daemon's poll_interval; keda.threshold 0.8."""
    docs = render(LAYOUT_VALUES, "config.poll_interval=1m30s", "keda.threshold=0.8")
    assert one(docs, "ServiceMonitor")["spec"]["endpoints"][0]["interval"] == "1m30s"
    assert one(docs, "ScaledObject")["spec"]["triggers"][0]["metadata"]["threshold"] == "0.8"


def test_strict_blocks_list_the_fields_kubernetes_has(tmp_path: Path) -> None:
    """The strict schemas know every field of Kubernetes 1.25 and none that 1.37 lacks."""
    schema = json.loads((CHART / "values.schema.json").read_text())["definitions"]
    pairs = {"podSecurityContext": "podsecuritycontext-v1", "securityContext": "securitycontext-v1",
             "probe": "probe-v1", "resources": "resourcerequirements-v1"}
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    for ours, theirs in pairs.items():
        old = set(json.loads((root / "v1.25.0-local-strict" / f"{theirs}.json").read_text())["properties"])
        new = set(json.loads((root / "v1.37.0-local-strict" / f"{theirs}.json").read_text())["properties"])
        assert schema[ours]["additionalProperties"] is False
        assert old <= set(schema[ours]["properties"]) <= new, ours
    assert set(schema["probe"]["properties"]["httpGet"]["properties"]) == set(json.loads(
        (root / "v1.37.0-local-strict" / "httpgetaction-v1.json").read_text())["properties"])


# --- NOTES.txt, Chart.yaml, RBAC ----------------------------------------------------------------

def _notes(values: Path | None, *sets: str) -> str:
    args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client"]
    args += ["-f", str(values)] if values else []
    for item in sets:
        args += ["--set", item]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:\n", 1)[1]


def test_notes_give_runnable_commands_and_a_runbook_url() -> None:
    notes = _notes(None)
    assert "&& curl" not in notes  # port-forward never exits, so a chained curl never runs
    assert f"kubectl -n {NAMESPACE} port-forward svc/{RELEASE}-stepbudget 9421\n" in notes
    assert "curl -s localhost:9421/metrics" in notes
    runbook = yaml.safe_load((CHART / "values.yaml").read_text())["prometheusRule"]["runbookBaseUrl"]
    assert f"Runbook (one section per alert): {runbook}" in notes and runbook.startswith("https://")
    custom = _notes(None, "prometheusRule.runbookBaseUrl=https://runbooks.example.com/sb.md")
    assert "https://runbooks.example.com/sb.md" in custom


def test_notes_warn_about_the_release_label_and_shards() -> None:
    unlabelled = _notes(None, "serviceMonitor.enabled=true")
    assert "ServiceMonitor has no `release` label" in unlabelled
    assert "`release` label" not in _notes(LAYOUT_VALUES)
    sharded = _notes(LAYOUT_VALUES, *SHARDED)
    assert "reaches ONE pod, i.e. one shard" in sharded
    assert f"port-forward pod/{RELEASE}-stepbudget-0 9421" in sharded
    assert "N = 0..2" in sharded
    assert "one shard" not in _notes(LAYOUT_VALUES)


def test_chart_metadata_has_home_sources_and_maintainer_url() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["home"].startswith("https://")
    assert chart["sources"] and all(s.startswith("https://") for s in chart["sources"])
    assert all(m.get("url", "").startswith("https://") for m in chart["maintainers"])


def test_default_resources_are_burstable_not_best_effort() -> None:
    resources = workload(render())["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"} and "memory" in resources["limits"]


@pytest.mark.parametrize("version", ["1.28", "1.37"])  # statefulset mode needs 1.28 (the pod-index label)
@pytest.mark.parametrize("sets", [(), SHARDED], ids=["deployment", "statefulset"])
def test_layout_core_objects_pass_strict_kubernetes_schemas(sets: tuple[str, ...], version: str) -> None:
    for doc in render(LAYOUT_VALUES, *sets):
        if doc["kind"] in {"ServiceMonitor", "PrometheusRule", "ScaledObject"}:
            continue  # checked against their CRDs above
        kubernetes_validate.validate(doc, version, strict=True)
