"""Alert settings set once (config `alerting.rules`): the daemon's loop, the rules `stepbudget check-config
--alert-rules` prints and the PrometheusRule the chart renders all follow them, and promtool tests the tuned
rules (tests/rules/tuned/config.yaml touches every alert; tests/rules/tuned/stepbudget.alerts_tuned_test.yaml).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.config_validators import ConfigError
from exporter.errors import InputError
from exporter.serve.alert_rules import (
    PACKAGED_RUNBOOK_BASE,
    TUNABLE_THRESHOLDS,
    AlertSettings,
    packaged_rules_text,
    percent_text,
    tune_rules_document,
)
from exporter.serve.alerting import AlertLoop
from exporter.serve.config import config_from_mapping, load_config
from exporter.units import parse_duration_seconds
from tests.support.alerts import Recorder, reading
from tests.support.chart import of_kind, one, render
from tests.support.clocks import ManualClock
from tests.support.monitoring import RECORDING_FILE
from tests.support.tools import REPO, require_tool

RULES_DIR = REPO / "tests" / "rules" / "tuned"  # apart: test_rules runs every tests/rules/*_test.yaml
TUNED_CONFIG = RULES_DIR / "config.yaml"
TUNED_TEST = RULES_DIR / "stepbudget.alerts_tuned_test.yaml"
TUNED_RULES_NAME = "stepbudget.alerts.tuned.yaml"  # what the tuned test's rule_files names
# Alerts whose description says how long differently: the pod's own time not Ready, the windows of the burn.
SAYS_NO_FOR = {"StepBudgetTargetNotReady", "StepBudgetSpeedBudgetBurn", "StepBudgetSpeedBudgetSlowBurn"}


def _alerts(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for group in document["groups"] for rule in group["rules"] if "alert" in rule}


def _packaged() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(packaged_rules_text())
    return document


def _tuned_rules_text(config: Path = TUNED_CONFIG) -> str:
    done = subprocess.run([sys.executable, "-m", "exporter.cli", "check-config", str(config), "--alert-rules"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


# --- the packaged rules say each tunable part once --------------------------------------------------------


def test_each_description_says_its_for_and_each_tunable_expression_its_threshold_once() -> None:
    """What the tuning rewrites is there to rewrite: `for 5m` in each description (but the three that say how
    long otherwise), `> 0.15` once in each tunable expression and `(over 15%)` once in its description."""
    alerts = _alerts(_packaged())
    for name, rule in alerts.items():
        if name not in SAYS_NO_FOR:
            assert f"for {rule['for']}" in rule["annotations"]["description"], name
    for name, default in TUNABLE_THRESHOLDS.items():
        assert alerts[name]["expr"].count(f"> {default:g}") == 1, name
        assert alerts[name]["annotations"]["description"].count(f"(over {default * 100:g}%)") == 1, name


def test_tuning_rewrites_what_the_settings_name_and_nothing_else() -> None:
    packaged = _packaged()
    tuned = tune_rules_document(packaged, {
        "StepBudgetPredictionDrift": AlertSettings(for_text="1h", threshold=0.3, severity="critical",
                                                   labels={"team": "llm"}),
        "StepBudgetPreemptions": AlertSettings(enabled=False)})
    before, after = _alerts(packaged), _alerts(tuned)
    assert set(before) - set(after) == {"StepBudgetPreemptions"}
    drift = after["StepBudgetPredictionDrift"]
    assert drift["for"] == "1h" and drift["labels"] == {"severity": "critical", "team": "llm"}
    assert drift["expr"] == before["StepBudgetPredictionDrift"]["expr"].replace("> 0.15", "> 0.3")
    assert drift["annotations"]["description"] == (before["StepBudgetPredictionDrift"]["annotations"]["description"]
                                                   .replace("(over 15%) for 15m", "(over 30%) for 1h"))
    assert {name: rule for name, rule in after.items() if name != "StepBudgetPredictionDrift"} == \
        {name: rule for name, rule in before.items() if name not in ("StepBudgetPredictionDrift",
                                                                      "StepBudgetPreemptions")}
    assert packaged == _packaged()  # the document given is left as it was


def test_percentages_are_written_as_the_charts_printf_writes_them() -> None:
    # Go's printf "%.4g" of ratio x 100: 4 significant digits, no trailing zeros.
    assert [percent_text(r) for r in (0.15, 0.875, 0.9, 1.0, 0.12345)] == ["15", "87.5", "90", "100", "12.35"]


# --- promtool on the tuned rules ---------------------------------------------------------------------------


def _promtool_tuned(tmp_path: Path, rules_text: str) -> subprocess.CompletedProcess[str]:
    shutil.copy(TUNED_TEST, tmp_path / TUNED_TEST.name)
    (tmp_path / TUNED_RULES_NAME).write_text(rules_text)
    return subprocess.run([require_tool("promtool"), "test", "rules", str(tmp_path / TUNED_TEST.name)],
                          capture_output=True, text=True, timeout=120, check=False)


def test_promtool_passes_every_alert_of_the_tuned_rules(tmp_path: Path) -> None:
    text = _tuned_rules_text()
    check = subprocess.run([require_tool("promtool"), "check", "rules", "/dev/stdin"], input=text,
                           capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    result = _promtool_tuned(tmp_path, text)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_tuned_promtool_tests_fail_on_the_packaged_rules(tmp_path: Path) -> None:
    """Every alert's tuned case fails where the rules are the packaged ones: the tests see the tuning."""
    result = _promtool_tuned(tmp_path, packaged_rules_text())
    assert result.returncode != 0
    failed = result.stdout + result.stderr
    assert all(name in failed for name in _alerts(_packaged())), failed


# --- the chart renders the rules the daemon reads ----------------------------------------------------------


def test_the_chart_renders_the_rules_its_config_sets(tmp_path: Path) -> None:
    """The chart's values carry tests/rules/tuned/config.yaml under `config:`; the PrometheusRule it renders is
    exactly the rules the daemon reading the ConfigMap it renders would print (and the recording rules)."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"prometheusRule": {"enabled": True},
                                      "config": yaml.safe_load(TUNED_CONFIG.read_text())}))
    objects = render(values)
    (config_map,) = [c for c in of_kind(objects, "ConfigMap") if "config.yaml" in c["data"]]
    daemon_config = tmp_path / "config.yaml"
    daemon_config.write_text(config_map["data"]["config.yaml"])
    expected = yaml.safe_load(_tuned_rules_text(daemon_config))["groups"] + \
        yaml.safe_load(RECORDING_FILE.read_text())["groups"]
    assert one(objects, "PrometheusRule")["spec"]["groups"] == expected


def test_the_chart_refuses_an_alert_the_rules_do_not_have(tmp_path: Path) -> None:
    from tests.support.chart import CHART, helm

    result = helm("template", "sb", str(CHART), "--set", "prometheusRule.enabled=true",
                  "--set", "config.alerting.rules.StepBudgetPageTypo.for=5m")
    assert result.returncode != 0 and "StepBudgetPageTypo" in result.stderr, result.stderr


# --- the daemon's loop follows them -------------------------------------------------------------------------


def test_the_loops_rules_are_the_printed_rules() -> None:
    """Every alert the loop raises has the printed file's `for`, labels and annotations (the loop moves each
    runbook link to the configured base as it sends the alert)."""
    config = load_config(str(TUNED_CONFIG))
    base = config.alerting.runbook_base_url
    assert base is not None
    printed = _alerts(yaml.safe_load(_tuned_rules_text()))
    loop = AlertLoop(config.alerting, poll_interval_seconds=15, post=Recorder())
    assert {rule.name for rule in loop.rules} == set(printed) - {
        "StepBudgetExporterAbsent", "StepBudgetSpeedBudgetBurn"}  # Prometheus's only; the slow burn is off
    for rule in loop.rules:
        source = printed[rule.name]
        assert rule.for_seconds == parse_duration_seconds(source["for"]), rule.name
        assert dict(rule.labels) == source["labels"], rule.name
        assert {key: t.source.replace(PACKAGED_RUNBOOK_BASE, base) for key, t in rule.annotations.items()} \
            == source["annotations"], rule.name


def test_the_loop_fires_on_the_tuned_threshold_after_the_tuned_for() -> None:
    """Drift 0.25 for 20m: 18.75% off (over the packaged 15%) never fires; 50% off fires at 20m, not at 19m,
    with the team label and the site's runbook. KV cache 0.875 for 5m: 93.75% full with requests waiting
    (under the packaged 95%) fires at 5m. MeasuredStepOverBudget is off: 4x the budget for an hour, nothing."""
    config = load_config(str(TUNED_CONFIG))
    clock, recorder = ManualClock(), Recorder()
    loop = AlertLoop(config.alerting, poll_interval_seconds=60, post=recorder, clock=clock)
    start = clock()
    fired: dict[str, float] = {}
    for minute in range(61):
        now = start + 60.0 * minute
        clock.now = now
        readings = [
            reading(target="10.0.0.5:8000", prediction_error_ratio=0.5, measured_step_seconds=0.072),
            reading(target="10.0.0.6:8000", prediction_error_ratio=-0.1875,
                    kv_cache_usage_ratio=0.9375, requests_waiting_for_capacity=3.0),
        ]
        for alert in loop.evaluate(readings, now):
            labels = alert["labels"]
            assert isinstance(labels, dict)
            fired.setdefault(f"{labels['alertname']}@{labels['target']}", now - start)  # none resolves
            if labels["alertname"] == "StepBudgetPredictionDrift":
                assert labels["team"] == "llm-serving"
                annotations = alert["annotations"]
                assert isinstance(annotations, dict)
                assert annotations["runbook_url"].startswith("https://runbooks.llm.internal/stepbudget.md#")
                assert "(over 25%) for 20m" in annotations["description"]
    assert fired == {"StepBudgetPredictionDrift@10.0.0.5:8000": 20 * 60.0,
                     "StepBudgetKVCacheNearlyFull@10.0.0.6:8000": 5 * 60.0}, fired


# --- the config says what is wrong --------------------------------------------------------------------------


def _config(alerting: dict[str, Any]) -> None:
    config_from_mapping({"deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                                          "targets": {"static": ["http://127.0.0.1:8000"]}}], "alerting": alerting})


@pytest.mark.parametrize(("alerting", "named"), [
    ({"rules": {"StepBudgetPageTypo": {"for": "5m"}}}, "StepBudgetPageTypo"),
    ({"rules": {"StepBudgetTargetDown": {"threshold": 0.5}}}, "threshold"),
    ({"rules": {"StepBudgetTargetDown": {"labels": {"severity": "page"}}}}, "severity"),
    ({"rules": {"StepBudgetTargetDown": {"severity": "page"}}}, "severity"),
    ({"rules": {"StepBudgetTargetDown": {"for": "1.5m"}}}, "Prometheus duration"),
    ({"rules": {"StepBudgetKVCacheNearlyFull": {"threshold": 0}}}, "threshold"),
    ({"for": "5m", "rules": {"StepBudgetPredictedStepOverBudget": {"for": "10m"}}}, "not both"),
])
def test_a_setting_the_rules_cannot_take_is_refused_naming_it(alerting: dict[str, Any], named: str) -> None:
    with pytest.raises((ConfigError, InputError)) as raised:
        _config(alerting)
    assert named in str(raised.value)


def test_the_default_settings_change_nothing() -> None:
    config = load_config(str(TUNED_CONFIG))
    assert config.alerting.rules  # the file sets some
    untouched = tune_rules_document(_packaged(), {name: AlertSettings() for name in _alerts(_packaged())})
    assert untouched == _packaged()
    assert PACKAGED_RUNBOOK_BASE in packaged_rules_text()
