"""Read the files docs/quickstart-kubernetes.md tells users to write, so the tests use exactly them.

The quickstart writes its values files with shell here-documents (`cat > NAME <<'EOF' ... EOF`);
these helpers return their contents, and the Helm flags its commands add.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "docs" / "quickstart-kubernetes.md"
KUBE_PROMETHEUS_STACK_VALUES = "kube-prometheus-stack-values.yaml"
STEPBUDGET_VALUES = "stepbudget-values.yaml"

# What prometheus-operator (kube-prometheus-stack's) does to every alert its Prometheus sends:
# external labels `prometheus: <namespace>/<name>` and `prometheus_replica: <pod>`, and an alert
# relabeling that drops only the replica (so HA pairs deduplicate). Names as for the release
# `kube-prometheus-stack` in namespace `monitoring`.
OPERATOR_EXTERNAL_LABELS = {"prometheus": "monitoring/kube-prometheus-stack-prometheus",
                            "prometheus_replica": "prometheus-kube-prometheus-stack-prometheus-0"}
OPERATOR_ALERT_RELABEL_CONFIGS = [{"action": "labeldrop", "regex": "prometheus_replica"}]


def heredoc(name: str) -> str:
    """The body of `cat > NAME <<'EOF' ... EOF` in the quickstart."""
    match = re.search(rf"^cat > {re.escape(name)} <<'EOF'\n(.*?)\nEOF$", QUICKSTART.read_text(), re.S | re.M)
    if match is None:
        raise AssertionError(f"{QUICKSTART.name}: no here-document writing {name}")
    return match.group(1) + "\n"


def values(name: str) -> dict[str, Any]:
    return yaml.safe_load(heredoc(name))


def quickstart_alert_relabel_configs() -> list[dict[str, Any]]:
    """The alert relabeling the quickstart adds to kube-prometheus-stack's Prometheus."""
    return values(KUBE_PROMETHEUS_STACK_VALUES)["prometheus"]["prometheusSpec"]["additionalAlertRelabelConfigs"]


def helm_set_flags(release: str) -> list[list[str]]:
    """Every `--set` list given to `helm upgrade RELEASE ...` in the quickstart (one list per command)."""
    commands = re.findall(rf"^helm upgrade (?:--install )?{re.escape(release)} .*$",
                          QUICKSTART.read_text().replace("\\\n", " "), re.M)
    return [re.findall(r"--set (\S+)", command) for command in commands]
