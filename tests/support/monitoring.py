"""Shared checks for the monitoring artefacts (rules, dashboards, the chart's copies of both).

Kept apart from the tests so that the rules, the dashboards and the rendered PrometheusRule are all
held to the same two questions: does promtool parse every expression, and does every expression
read only metrics that exist (DESIGN §3's exported list, Prometheus's own `up`, or a name recorded
by rules/stepbudget.rules.yaml)?
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

import yaml

from tests.support.tools import REPO

RULES_DIR = REPO / "rules"
# The one source of the alert rules is the packaged file the daemon reads; rules/ holds a copy.
ALERTS_FILE = REPO / "exporter" / "serve" / "rules" / "stepbudget.alerts.yaml"
RECORDING_FILE = RULES_DIR / "stepbudget.rules.yaml"

# DESIGN.md §3 "Exported metrics": the only stepbudget_ names the daemon exports.
DAEMON_METRICS: frozenset[str] = frozenset(
    {
        "stepbudget_target_up",
        "stepbudget_target_scrape_duration_seconds",
        "stepbudget_target_last_success_timestamp_seconds",
        "stepbudget_tokens_in_flight",
        "stepbudget_kv_cache_capacity_tokens",
        "stepbudget_kv_cache_usage_ratio",
        "stepbudget_kv_cache_used_tokens",
        "stepbudget_requests_running",
        "stepbudget_requests_waiting",
        "stepbudget_preemptions_total",
        "stepbudget_prefill_tokens_per_step",
        "stepbudget_prefill_mean_context_tokens",
        "stepbudget_step_read_bytes",
        "stepbudget_predicted_step_seconds",
        "stepbudget_predicted_memory_step_seconds",
        "stepbudget_predicted_compute_step_seconds",
        "stepbudget_measured_step_seconds",
        "stepbudget_measured_step_median_seconds",
        "stepbudget_measured_step_median_lower_seconds",
        "stepbudget_measured_step_median_upper_seconds",
        "stepbudget_prediction_error_ratio",
        "stepbudget_predicted_user_tokens_per_second",
        "stepbudget_step_budget_seconds",
        "stepbudget_token_budget_tokens",
        "stepbudget_token_budget_utilization_ratio",
        "stepbudget_effective_bandwidth_bytes_per_second",
        "stepbudget_kv_bytes_per_token",
        "stepbudget_weight_bytes",
        "stepbudget_model_info",
        "stepbudget_build_info",
        "stepbudget_admission_decisions_total",
        "stepbudget_admitted_tokens",
    }
)
# Exported by the daemon (exporter/serve/collector.py) but not (yet) in DESIGN.md §3's list: the page
# rule reads the sleep gauge to release its hold on a sleeping engine, StepBudgetNoTargets the targets
# each deployment has; the dashboards the KV shared by prefix caching and a prefill server's budget,
# which StepBudgetPrefillOverCapacity alerts on.
DAEMON_METRICS_BEYOND_DESIGN: frozenset[str] = frozenset({"stepbudget_engine_sleeping",
                                                          "stepbudget_deployment_targets",
                                                          "stepbudget_kv_cache_shared_ratio",
                                                          "stepbudget_prefill_tokens_per_second",
                                                          "stepbudget_prefill_capacity_tokens_per_second",
                                                          "stepbudget_prefill_utilization_ratio",
                                                          "stepbudget_measured_time_to_first_token_seconds",
                                                          "stepbudget_target_role_info",
                                                          # discovery's lifecycle, one process per target
                                                          "stepbudget_target_not_ready_since_timestamp_seconds",
                                                          "stepbudget_target_startup_allowance_seconds",
                                                          "stepbudget_target_mixed_processes",
                                                          # the per-user speed objective (its SLI, its objective)
                                                          "stepbudget_decode_tokens_total",
                                                          "stepbudget_decode_tokens_at_target_total",
                                                          "stepbudget_speed_objective_ratio",
                                                          "stepbudget_deployment_scales_to_zero",
                                                          # KVCacheNearlyFull's harm: requests waiting for it
                                                          "stepbudget_requests_waiting_for_capacity",
                                                          # speculative decoding counted: tokens per step / step
                                                          "stepbudget_measured_user_tokens_per_second"})
# Written by Prometheus itself for every scrape target.
PROMETHEUS_METRICS: frozenset[str] = frozenset({"up", "ALERTS"})  # ALERTS: the alerts it evaluates

_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
     "group_left", "group_right", "inf", "nan", "start", "end"}
)
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?")


def recorded_names() -> set[str]:
    """Names the recording rules produce, the recording file's and the alerts file's own (the page's memory,
    the speed objective's ratios, recorded beside the alerts that read them): legal for dashboards and
    later rules to read."""
    groups = [group for path in (RECORDING_FILE, ALERTS_FILE) for group in yaml.safe_load(path.read_text())["groups"]]
    return {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}


def known_metrics() -> set[str]:
    """Every metric name an expression in this project may read."""
    return set(DAEMON_METRICS | DAEMON_METRICS_BEYOND_DESIGN | PROMETHEUS_METRICS) | recorded_names()


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (good enough for our own expressions).

    Label matchers, grouping clauses, range/offset durations and string literals are removed first;
    what is left and not a function call, keyword or number is a metric name.
    """
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = _GROUPING.sub("", text)
    names = set()
    for match in _IDENT.finditer(text):
        word, call = match.group(1), match.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def grafana_to_promql(expr: str) -> str:
    """Replace Grafana's interval macros with a fixed duration so promtool can parse the query."""
    return re.sub(r"\$__(rate_)?interval|\$__range", "5m", expr)


def promtool_check_exprs(promtool: str, exprs: Iterable[str]) -> subprocess.CompletedProcess[str]:
    """Run `promtool check rules` over the expressions, each wrapped as an alerting rule."""
    rules = [{"alert": f"Expr{i}", "expr": grafana_to_promql(e)} for i, e in enumerate(exprs)]
    document = {"groups": [{"name": "expressions", "rules": rules}]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "exprs.yaml"
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        return subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False)
