"""The alert and recording rules, checked with the real promtool and against DESIGN §3.

promtool's own unit tests (tests/rules/*_test.yaml) prove each alert fires at the edge of its
`for` and stays silent on threshold values; the mutation tests below prove those unit tests would
notice if a threshold or a `for` drifted, so they cannot pass vacuously.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.support.monitoring import (
    ALERTS_FILE,
    RECORDING_FILE,
    REPO,
    known_metrics,
    metric_names,
    recorded_names,
)
from tests.support.tools import require_tool

RULE_TESTS = sorted((REPO / "tests" / "rules").glob("*_test.yaml"))
RUNBOOK = REPO / "docs" / "runbook.md"

# DESIGN §3 "Alerts": the names the daemon's alert loop shares.
DESIGN_ALERTS = {
    "StepBudgetPredictedStepOverBudget",
    "StepBudgetMeasuredStepOverBudget",
    "StepBudgetPredictionDrift",
    "StepBudgetPrefillInterference",
    "StepBudgetPrefillOverCapacity",  # a prefill-only server's budget (not in DESIGN §3's list yet)
    "StepBudgetKVCacheNearlyFull",
    "StepBudgetPreemptions",
    "StepBudgetTargetDown",
    "StepBudgetNoTargets",
    "StepBudgetTargetNotReady",  # a Kubernetes pod not Ready past its startup allowance
    "StepBudgetExporterAbsent",
    # The per-user speed objective's burn rates (not in DESIGN §3's list yet): the fast one pages.
    "StepBudgetSpeedBudgetBurn",
    "StepBudgetSpeedBudgetSlowBurn",
}
SPEED_BURN = "StepBudgetSpeedBudgetBurn"
SPEED_RATIOS = {f"deployment_model_name:stepbudget_decode_tokens_under_target:ratio_rate{window}"
                for window in ("5m", "30m", "1h", "2h", "6h", "1d", "3d")}
POOL_ALERTS = {"StepBudgetExporterAbsent", SPEED_BURN, "StepBudgetSpeedBudgetSlowBurn"}
# Request counts say nothing about step time; no alert may read them.
# Requests waiting for KV capacity are no such count: they are the harm of a full cache (KVCacheNearlyFull).
REQUEST_COUNT_PATTERN = re.compile(r"requests?_(running|waiting(?!_for_capacity)|total)|num_requests|request_success")


PAGE = "StepBudgetPredictedStepOverBudget"
# The page's memory (a target that stops answering while over budget stays paged): recorded in the
# alerts file itself, since the page reads it.
PAGE_MEMORY = "target:stepbudget_predicted_step_seconds:last_over_budget"


def _rules() -> list[dict]:
    groups = yaml.safe_load(ALERTS_FILE.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _alerts() -> list[dict]:
    return [rule for rule in _rules() if "alert" in rule]


def _alerts_file_records() -> set[str]:
    return {rule["record"] for rule in _rules() if "record" in rule}


def _alert(name: str) -> dict:
    return next(rule for rule in _alerts() if rule["alert"] == name)


def _duration_minutes_of(text: str) -> int:
    """Minutes of a Prometheus duration of one unit (5m, 1h, 3d)."""
    number, unit = int(text[:-1]), text[-1]
    return number * {"m": 1, "h": 60, "d": 1440}[unit]


def _duration_minutes(text: str) -> int:
    match = re.fullmatch(r"(\d+)m", text)
    assert match, f"expected a whole number of minutes, got {text!r}"
    return int(match.group(1))


def test_rule_files_pass_promtool_lint() -> None:
    promtool = require_tool("promtool")
    result = subprocess.run(
        [promtool, "check", "rules", "--lint=all", "--lint-fatal", str(ALERTS_FILE), str(RECORDING_FILE)],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass() -> None:
    promtool = require_tool("promtool")
    assert RULE_TESTS, "no tests/rules/*_test.yaml"
    result = subprocess.run([promtool, "test", "rules", *map(str, RULE_TESTS)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_dir_holds_an_exact_copy_of_the_packaged_alerts() -> None:
    """exporter/serve/rules/ is the one source (the daemon reads it); `make chart-sync` copies it to rules/."""
    copy = REPO / "rules" / ALERTS_FILE.name
    assert copy.read_bytes() == ALERTS_FILE.read_bytes(), f"{copy} drifted from {ALERTS_FILE}: run `make chart-sync`"


def test_every_design_alert_exists_and_nothing_else() -> None:
    assert {rule["alert"] for rule in _alerts()} == DESIGN_ALERTS


def test_the_page_is_predicted_step_over_budget_critical_for_five_minutes() -> None:
    page = _alert(PAGE)
    assert page["labels"]["severity"] == "critical"
    assert page["for"] == "5m"
    # Predicted over budget by the last reading; held by its own memory while the target is down.
    assert metric_names(page["expr"]) == {"stepbudget_predicted_step_seconds", "stepbudget_step_budget_seconds",
                                          "stepbudget_target_up", "stepbudget_engine_sleeping", PAGE_MEMORY}
    # The other page is on the symptom users feel over hours, the speed objective's fast burn.
    assert [r["alert"] for r in _alerts() if r["labels"]["severity"] == "critical"] == [page["alert"], SPEED_BURN]


def test_the_page_memory_records_the_page_condition_after_the_page() -> None:
    """Recorded after the page in the same group, the page reads the previous evaluation's memory
    (rules of a group run in order); with the same expression it carries exactly the page's verdict."""
    (group,) = [g for g in yaml.safe_load(ALERTS_FILE.read_text())["groups"]
                if any(r.get("alert") == PAGE for r in g["rules"])]
    names = [rule.get("alert") or rule.get("record") for rule in group["rules"]]
    assert names.index(PAGE_MEMORY) == names.index(PAGE) + 1
    (memory,) = [rule for rule in group["rules"] if rule.get("record") == PAGE_MEMORY]
    assert memory["expr"] == _alert(PAGE)["expr"]
    assert _alerts_file_records() == {PAGE_MEMORY} | SPEED_RATIOS


def test_the_speed_burns_read_their_groups_ratios_and_each_deployments_objective() -> None:
    """Recorded in the burns' own group, before them (a group runs its rules in order, so the alerts read the
    evaluation's ratios, not the last one's); the objective is the daemon's speed_objective per deployment."""
    (group,) = [g for g in yaml.safe_load(ALERTS_FILE.read_text())["groups"]
                if any(r.get("alert") == SPEED_BURN for r in g["rules"])]
    names = [rule.get("alert") or rule.get("record") for rule in group["rules"]]
    assert names == [*sorted(SPEED_RATIOS, key=lambda n: _duration_minutes_of(n.rsplit("_rate", 1)[1])),
                     SPEED_BURN, "StepBudgetSpeedBudgetSlowBurn"]
    for name in (SPEED_BURN, "StepBudgetSpeedBudgetSlowBurn"):
        expr = _alert(name)["expr"]
        assert metric_names(expr) - SPEED_RATIOS == {"stepbudget_speed_objective_ratio"}, name
        assert expr.count("(1 - max without (instance, job) (stepbudget_speed_objective_ratio))") == 4, name


@pytest.mark.parametrize("name", sorted(DESIGN_ALERTS))
def test_alert_annotations_and_runbook_section(name: str) -> None:
    rule = _alert(name)
    annotations = rule["annotations"]
    assert set(annotations) == {"summary", "description", "runbook_url"}
    assert annotations["summary"].endswith(".")
    assert "$value" in annotations["description"] and "$labels." in annotations["description"]
    assert annotations["runbook_url"].endswith(f"docs/runbook.md#{name.lower()}")
    headings = re.findall(r"^## (\S+)\s*$", RUNBOOK.read_text(), flags=re.MULTILINE)
    assert name in headings, f"docs/runbook.md has no '## {name}' section"
    assert rule["labels"]["severity"] in {"critical", "warning"}


@pytest.mark.parametrize("name", sorted(DESIGN_ALERTS - POOL_ALERTS))
def test_per_target_alerts_drop_scrape_labels(name: str) -> None:
    """Prometheus and the daemon must raise one alert, with one label set, not two."""
    expr = _alert(name)["expr"]
    for selector in metric_names(expr) - _alerts_file_records():  # recorded without instance/job already
        assert re.search(rf"max without \(instance, job\) \((\w+\()?{selector}\b", expr), (name, selector)


def test_no_alert_reads_request_counts() -> None:
    for rule in _alerts():
        assert not REQUEST_COUNT_PATTERN.search(rule["expr"]), rule["alert"]


def test_rules_read_only_exported_or_recorded_metrics() -> None:
    known = known_metrics() | _alerts_file_records()
    for path in (ALERTS_FILE, RECORDING_FILE):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                unknown = metric_names(rule["expr"]) - known
                assert not unknown, (rule.get("alert") or rule.get("record"), unknown)


def test_recording_rule_names_follow_level_metric_operation() -> None:
    for name in recorded_names() | _alerts_file_records():
        level, metric, operation = name.split(":")
        assert level in {"target", "deployment_model_name"}, name
        assert metric.startswith("stepbudget_") and operation, name


def test_every_recording_rule_is_unit_tested() -> None:
    tested = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            tested |= {check["expr"] for check in case.get("promql_expr_test", [])}
    assert recorded_names() | _alerts_file_records() <= tested


# --- mutation: the promtool unit tests must catch a drifted `for` or threshold -----------------

def _run_unit_tests_against(promtool: str, alerts_text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Copy the rule tests next to a mutated alerts file, in the repository's layout, and run them."""
    alerts, recording = tmp_path / ALERTS_FILE.relative_to(REPO), tmp_path / RECORDING_FILE.relative_to(REPO)
    for directory in (alerts.parent, recording.parent, tmp_path / "tests" / "rules"):
        directory.mkdir(parents=True, exist_ok=True)
    alerts.write_text(alerts_text)
    shutil.copy(RECORDING_FILE, recording)
    copies = []
    for path in RULE_TESTS:
        copy = tmp_path / "tests" / "rules" / path.name
        shutil.copy(path, copy)
        copies.append(str(copy))
    return subprocess.run([promtool, "test", "rules", *copies], capture_output=True, text=True, check=False)


@pytest.mark.parametrize("name", sorted(DESIGN_ALERTS))
def test_unit_tests_catch_a_for_one_minute_shorter(name: str, tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    document = yaml.safe_load(ALERTS_FILE.read_text())
    rule = next(r for g in document["groups"] for r in g["rules"] if r.get("alert") == name)
    rule["for"] = f"{_duration_minutes(rule['for']) - 1}m"
    result = _run_unit_tests_against(promtool, yaml.safe_dump(document, sort_keys=False), tmp_path)
    assert result.returncode != 0, f"shortening {name}'s `for` went unnoticed"
    assert name in result.stdout + result.stderr  # promtool names the failing alert


# (alert, comparison as written, comparison one step looser or tighter at the threshold).
# StepBudgetTargetDown has no threshold to move: target_up is 0 or 1; its `for` is mutated above.
THRESHOLD_MUTATIONS = [
    (PAGE, "(stepbudget_predicted_step_seconds[30m]))\n  >", "(stepbudget_predicted_step_seconds[30m]))\n  >="),
    ("StepBudgetMeasuredStepOverBudget",
     "(stepbudget_measured_step_seconds[2m]))\n  >", "(stepbudget_measured_step_seconds[2m]))\n  >="),
    ("StepBudgetPredictionDrift", "> 0.15", ">= 0.15"),
    # An idle window is bridged for 2m, no longer; and bridged at all.
    ("StepBudgetMeasuredStepOverBudget", "(stepbudget_measured_step_seconds[2m])",
     "(stepbudget_measured_step_seconds[4m])"),
    ("StepBudgetMeasuredStepOverBudget", "last_over_time(stepbudget_measured_step_seconds[2m])",
     "stepbudget_measured_step_seconds"),
    ("StepBudgetPredictionDrift", "last_over_time(stepbudget_prediction_error_ratio[2m])",
     "stepbudget_prediction_error_ratio"),
    ("StepBudgetPrefillInterference", "<=", "<"),
    # Interference needs prefill: a window that computed no prompt token (a P/D decode pod) cannot have it.
    ("StepBudgetPrefillInterference", "(stepbudget_prefill_tokens_per_step) > 0",
     "(stepbudget_prefill_tokens_per_step) >= 0"),
    ("StepBudgetPrefillOverCapacity", "> 0.9", ">= 0.9"),
    ("StepBudgetKVCacheNearlyFull", "> 0.95", ">= 0.95"),
    # Full with nobody waiting and nothing preempted is not harm.
    ("StepBudgetKVCacheNearlyFull", "(stepbudget_requests_waiting_for_capacity) > 0",
     "(stepbudget_requests_waiting_for_capacity) >= 0"),
    ("StepBudgetKVCacheNearlyFull", "(increase(stepbudget_preemptions_total[5m])) > 0",
     "(increase(stepbudget_preemptions_total[5m])) >= 0"),
    ("StepBudgetPreemptions", "> 0", ">= 0"),
    ("StepBudgetExporterAbsent", "up == 0", "up <= 1"),
    ("StepBudgetNoTargets", "== 0", "<= 1"),
    ("StepBudgetNoTargets", "max without", "min without"),
    # A pool that scales to zero on purpose is silent; one that does not say so is not.
    ("StepBudgetNoTargets", "scales_to_zero) == 1", "scales_to_zero) == 2"),
    # A pod exactly at its allowance is not over it.
    ("StepBudgetTargetNotReady", "> on (cluster, deployment)", ">= on (cluster, deployment)"),
    # A cluster gone from a global ruler is remembered for a day, not a minute.
    ("StepBudgetExporterAbsent", "[1d]", "[1m]"),
]


@pytest.mark.parametrize(("name", "old", "new"), THRESHOLD_MUTATIONS, ids=[m[0] for m in THRESHOLD_MUTATIONS])
def test_unit_tests_catch_a_moved_threshold(name: str, old: str, new: str, tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    document = yaml.safe_load(ALERTS_FILE.read_text())
    rule = next(r for g in document["groups"] for r in g["rules"] if r.get("alert") == name)
    flat = re.sub(r"\n\s+", "\n  ", rule["expr"])
    assert old in flat, f"mutation anchor {old!r} not in {name}"
    rule["expr"] = flat.replace(old, new, 1)
    result = _run_unit_tests_against(promtool, yaml.safe_dump(document, sort_keys=False), tmp_path)
    assert result.returncode != 0, f"{name}: {old!r} -> {new!r} went unnoticed"


# --- mutation: the unit tests must catch a page that resolves when its evidence goes missing ----------

_LIVE_ONLY = """max without (instance, job) (stepbudget_predicted_step_seconds)
  > max without (instance, job) (stepbudget_step_budget_seconds)
"""


def _without_memory(expr: str) -> str:
    return expr.split("\nor\n")[0] + "\n"


_SLEEPING = "max without (instance, job) (last_over_time(stepbudget_engine_sleeping[30m])) == 1"


def _awake_always(expr: str) -> str:
    """The hold as it was before a sleeping engine released it: no `unless` on the sleep gauge."""
    return re.sub(r"\n\s*unless\n\s*" + re.escape(_SLEEPING), "", expr)


# (id, rule (alert or record name), change of its expression). Each is a way the page could lose its
# hold, or keep it where it must not; tests/rules/stepbudget.alerts_test.yaml must notice every one.
HOLD_MUTATIONS = [
    ("the live reading only, with no memory of the last reading", PAGE, lambda expr: _LIVE_ONLY),
    ("no memory of a down target", PAGE, _without_memory),
    ("a shorter hold after the last reading", PAGE, lambda expr: expr.replace("[30m]", "[20m]")),
    ("a longer hold after the last reading", PAGE, lambda expr: expr.replace("[30m]", "[1h]")),
    ("held while the target answers", PAGE, lambda expr: expr.replace("== 0", ">= 0")),
    ("a memory that carries nothing", PAGE_MEMORY, _without_memory),
    ("a memory carried while the target answers", PAGE_MEMORY, lambda expr: expr.replace("== 0", ">= 0")),
    ("held while the engine sleeps", PAGE, _awake_always),
    ("a memory carried while the engine sleeps", PAGE_MEMORY, _awake_always),
    ("asleep only while the sleep gauge is fresh", PAGE,
     lambda expr: expr.replace(_SLEEPING, "max without (instance, job) (stepbudget_engine_sleeping) == 1")),
]


@pytest.mark.parametrize(("rule_name", "mutate"), [m[1:] for m in HOLD_MUTATIONS], ids=[m[0] for m in HOLD_MUTATIONS])
def test_unit_tests_catch_a_page_that_loses_or_overstays_its_hold(rule_name: str, mutate: Callable[[str], str],
                                                                   tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    document = yaml.safe_load(ALERTS_FILE.read_text())
    rule = next(r for g in document["groups"] for r in g["rules"] if rule_name in (r.get("alert"), r.get("record")))
    mutated = mutate(rule["expr"])
    assert mutated != rule["expr"], f"mutation of {rule_name} changed nothing"
    rule["expr"] = mutated
    result = _run_unit_tests_against(promtool, yaml.safe_dump(document, sort_keys=False), tmp_path)
    assert result.returncode != 0, f"{rule_name}: {mutated!r} went unnoticed"
