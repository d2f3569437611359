"""The Helm chart rendered by the real helm binary, and the objects picked out of what it renders:
tests/deploy/test_helm_chart.py and tests/deploy/test_helm_layout.py check the same renders, so both
read them from here."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import yaml

from tests.support.tools import REPO, require_tool

CHART = REPO / "helm" / "stepbudget"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
STATEFULSET_VALUES = CHART / "ci" / "statefulset-values.yaml"
DEPLOYMENT_VALUES = CHART / "ci" / "deployment-values.yaml"
NAMESPACE = "monitoring"
RELEASE = "sb"


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_tool("helm"), *args], capture_output=True, text=True, check=False)


@functools.cache
def _render_text(values: Path | None, sets: tuple[str, ...] = ()) -> str:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if values:
        args += ["-f", str(values)]
    for item in sets:
        args += ["--set", item]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def render(values: Path | None = None, *sets: str) -> list[dict]:
    """Every object `helm template` produces for these values."""
    return [doc for doc in yaml.safe_load_all(_render_text(values, tuple(sets))) if doc]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def workload(docs: list[dict]) -> dict:
    found = of_kind(docs, "Deployment") + of_kind(docs, "StatefulSet")
    assert len(found) == 1, [d["kind"] for d in found]
    return found[0]


def matches(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics: matchLabels and In/NotIn/Exists/DoesNotExist expressions."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        verdict = {"Exists": key in labels, "DoesNotExist": key not in labels,
                   "In": labels.get(key) in expression.get("values", []),
                   "NotIn": labels.get(key) not in expression.get("values", [])}[operator]
        if not verdict:
            return False
    return True
