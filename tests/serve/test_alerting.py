"""The in-process alert loop: names, `for`, severities, labels and annotations read from the
packaged rules file (a changed file changes the loop), rendered as Prometheus renders them; the same
conditions and thresholds as the rule expressions; pending -> firing -> resolved on an injected
clock; the Alertmanager API v2 protocol (resend cadence, endsAt); and a real Alertmanager on 127.0.0.1.
"""

from __future__ import annotations

import itertools
import re
from datetime import datetime
from pathlib import Path

import pytest
import requests
import structlog
import yaml
from structlog.testing import capture_logs

from exporter.errors import InputError
from exporter.serve.alert_rules import TemplateError, humanize_duration, render
from exporter.serve.alerting import (
    CONDITIONS,
    DEPLOYMENT_CONDITIONS,
    DRIFT_THRESHOLD_RATIO,
    IDLE_BRIDGE_SECONDS,
    KV_CACHE_NEARLY_FULL_RATIO,
    PAGE_ALERT,
    PAGE_HOLD_SECONDS,
    POD_CONDITIONS,
    PREEMPTION_WINDOW_SECONDS,
    PREFILL_INTERFERENCE_MIN_PREFILL_TOKENS_PER_STEP,
    PREFILL_OVER_CAPACITY_RATIO,
    PROMETHEUS_ONLY,
    AlertLoop,
    load_rules,
    packaged_rules,
    post_alerts,
)
from exporter.serve.config import Alerting
from exporter.serve.discovery import NotReadyPod
from exporter.serve.reading import Reading
from exporter.units import parse_duration_seconds
from tests.support.alertmanager import Alertmanager
from tests.support.alerts import Recorder, reading
from tests.support.clocks import ManualClock
from tests.support.monitoring import ALERTS_FILE as RULES_FILE
from tests.support.servers import wait_until

SERIES = {"deployment": "chat", "target": "10.0.0.5:8000", "model_name": "Qwen/Qwen3-8B", "engine": "0",
          "namespace": "llm", "pod": "vllm-0"}


def loop(clock: ManualClock, recorder: Recorder, **alerting: object) -> AlertLoop:
    config = Alerting(**{"alertmanager_urls": ("http://am.invalid:9093",), **alerting})  # type: ignore[arg-type]  # fields given as object: each test overrides a few
    return AlertLoop(config, poll_interval_seconds=15, generator_url="http://stepbudget:9421/", clock=clock,
                     post=recorder)


def seconds(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


@pytest.fixture(autouse=True)
def _reset_structlog():
    yield
    structlog.reset_defaults()


# --- the rules file is the one source ---------------------------------------------------------------


def _rule_file_alerts(path: Path = RULES_FILE) -> dict[str, dict[str, object]]:
    document = yaml.safe_load(path.read_text())
    return {rule["alert"]: rule for group in document["groups"] for rule in group["rules"] if "alert" in rule}


def _edited_copy(tmp_path: Path, name: str, **changes: object) -> Path:
    """A copy of the packaged rules file with `changes` merged into one alert (None deletes a key)."""
    document = yaml.safe_load(RULES_FILE.read_text())
    rule = next(r for group in document["groups"] for r in group["rules"] if r.get("alert") == name)
    for key, value in changes.items():
        if value is None:
            rule.pop(key)
        elif isinstance(value, dict):
            rule[key] = {**rule.get(key, {}), **value}
        else:
            rule[key] = value
    copy = tmp_path / "stepbudget.alerts.yaml"
    copy.write_text(yaml.safe_dump(document, sort_keys=False))
    return copy


def test_the_loop_raises_every_alert_of_the_rules_file_as_written_there() -> None:
    file_rules = _rule_file_alerts()
    # Prometheus-only: a daemon cannot report its own absence, nor keep days of its counters for the burns.
    assert PROMETHEUS_ONLY == {"StepBudgetExporterAbsent", "StepBudgetSpeedBudgetBurn", "StepBudgetSpeedBudgetSlowBurn"}
    assert [rule.name for rule in packaged_rules()] == [name for name in file_rules if name not in PROMETHEUS_ONLY]
    assert {rule.name for rule in packaged_rules()} == \
        set(CONDITIONS) | set(DEPLOYMENT_CONDITIONS) | set(POD_CONDITIONS)
    for rule in packaged_rules():
        source = file_rules[rule.name]
        assert dict(rule.labels) == source["labels"] and rule.severity == source["labels"]["severity"], rule.name
        assert rule.for_seconds == parse_duration_seconds(source["for"]), rule.name
        assert {key: t.source for key, t in rule.annotations.items()} == source["annotations"], rule.name


# What the loop rendered when the rules were a Python table: the same text, construct by construct.
RENDERED = {
    (PAGE_ALERT, 0.025): "The predicted step time of 10.0.0.5:8000 "
                         "(deployment chat, model Qwen/Qwen3-8B, engine 0) has been 25ms, over its step budget, "
                         "for 5m: the tokens in flight exceed the token "
                         "budget. If the target has stopped answering, that is its last reading: the page holds "
                         "until the target reads under budget again.",
    ("StepBudgetKVCacheNearlyFull", 0.963): "The KV cache of 10.0.0.5:8000 "
                                            "(deployment chat, model Qwen/Qwen3-8B, engine 0) has been 96.3% full "
                                            "(over 95%) for 10m while requests waited for its capacity or "
                                            "were preempted.",
    ("StepBudgetPreemptions", 1234.0): "10.0.0.5:8000 (deployment chat, model Qwen/Qwen3-8B, engine 0) "
                                       "preempted 1.234k requests in the last 5 minutes, "
                                       "and has kept preempting for 5m.",
    ("StepBudgetTargetDown", 0.0): "stepbudget has failed to fetch or parse the metrics of 10.0.0.5:8000 (deployment "
                                   "chat, model Qwen/Qwen3-8B) for 5m (stepbudget_target_up = 0).",
}


@pytest.mark.parametrize(("name", "value"), list(RENDERED), ids=[name for name, _ in RENDERED])
def test_descriptions_render_as_the_python_table_did(name: str, value: float) -> None:
    rule = next(rule for rule in packaged_rules() if rule.name == name)
    assert rule.annotations["description"].render(SERIES, value) == RENDERED[(name, value)]
    runbook_url = _rule_file_alerts()[name]["annotations"]["runbook_url"]
    assert rule.annotations["runbook_url"].render(SERIES, value) == runbook_url


def test_changing_for_severity_labels_or_text_in_the_rules_file_changes_the_loop(clock: ManualClock,
                                                                                 tmp_path: Path) -> None:
    """No Python edit: the loop built from an edited copy of the rules file follows the copy."""
    copy = _edited_copy(tmp_path, PAGE_ALERT, **{
        "for": "1m", "labels": {"severity": "page", "team": "inference"},
        "annotations": {"summary": "Slow streams on {{ $labels.target }}."}})
    recorder = Recorder()
    alerts = AlertLoop(Alerting(alertmanager_urls=("http://am.invalid",)), poll_interval_seconds=15, clock=clock,
                       post=recorder, rules=load_rules(copy))
    over = reading(predicted_step_seconds=0.025, predicted_memory_step_seconds=0.025)
    assert alerts.evaluate([over], clock.now) == []
    clock.advance(60)  # the copy's `for`, not the packaged 5m
    [posted] = alerts.evaluate([over], clock.now)
    assert posted["labels"] == {"alertname": PAGE_ALERT, "severity": "page", "team": "inference", **SERIES}
    assert posted["annotations"]["summary"] == "Slow streams on 10.0.0.5:8000."
    # alerting.for still overrides the page's `for`, whatever the file says.
    overridden = AlertLoop(Alerting(for_seconds=30.0), poll_interval_seconds=15, rules=load_rules(copy))
    assert {rule.name: rule.for_seconds for rule in overridden.rules}[PAGE_ALERT] == 30.0


@pytest.mark.parametrize("construct", ['{{ $value | printf "%.2f" }}', "{{ if $labels.pod }}x{{ end }}",
                                       "{{ $externalLabels.cluster }}", "{{- $value }}", "{{ $value"])
def test_a_template_construct_the_loop_cannot_render_fails_loading_naming_it(construct: str, tmp_path: Path) -> None:
    copy = _edited_copy(tmp_path, "StepBudgetKVCacheNearlyFull", annotations={"description": f"at {construct}"})
    with pytest.raises(TemplateError) as error:
        load_rules(copy)
    message = str(error.value)
    assert "StepBudgetKVCacheNearlyFull" in message and "description" in message
    assert construct.split("{{")[1].split("}}")[0] in message


@pytest.mark.parametrize(("name", "changes", "named"), [
    ("StepBudgetKVCacheNearlyFull", {"keep_firing_for": "5m"}, "keep_firing_for"),
    ("StepBudgetKVCacheNearlyFull", {"labels": {"severity": "{{ $value }}"}}, "label severity"),
    ("StepBudgetKVCacheNearlyFull", {"alert": "StepBudgetSomethingNew"}, "StepBudgetSomethingNew"),
])
def test_a_rules_file_the_loop_cannot_honour_fails_loading(name: str, changes: dict[str, object], named: str,
                                                           tmp_path: Path) -> None:
    with pytest.raises(InputError, match=named):
        load_rules(_edited_copy(tmp_path, name, **changes))


def test_a_rule_without_for_fires_at_once(tmp_path: Path) -> None:
    rules = load_rules(_edited_copy(tmp_path, "StepBudgetTargetDown", **{"for": None}))
    assert {rule.name: rule.for_seconds for rule in rules}["StepBudgetTargetDown"] == 0.0


def test_a_compound_for_is_read_as_prometheus_reads_it(tmp_path: Path) -> None:
    """`for: 1m30s` is valid Prometheus: the loop must start with it, not refuse the rules file."""
    rules = load_rules(_edited_copy(tmp_path, "StepBudgetTargetDown", **{"for": "1m30s"}))
    assert {rule.name: rule.for_seconds for rule in rules}["StepBudgetTargetDown"] == 90.0


def test_thresholds_match_the_rule_expressions() -> None:
    file_rules = _rule_file_alerts()
    assert f"> {DRIFT_THRESHOLD_RATIO}" in file_rules["StepBudgetPredictionDrift"]["expr"]
    assert f"> {KV_CACHE_NEARLY_FULL_RATIO}" in file_rules["StepBudgetKVCacheNearlyFull"]["expr"]
    assert f"> {PREFILL_OVER_CAPACITY_RATIO}" in file_rules["StepBudgetPrefillOverCapacity"]["expr"]
    assert (f"(stepbudget_prefill_tokens_per_step) > {PREFILL_INTERFERENCE_MIN_PREFILL_TOKENS_PER_STEP:g}"
            in file_rules["StepBudgetPrefillInterference"]["expr"])
    window = re.search(r"\[(\w+)\]", file_rules["StepBudgetPreemptions"]["expr"]).group(1)
    assert parse_duration_seconds(window) == PREEMPTION_WINDOW_SECONDS
    # The page holds a series with no reading as long as the rule's last_over_time looks back.
    holds = set(re.findall(r"last_over_time\(\w+\[(\w+)\]\)", file_rules[PAGE_ALERT]["expr"]))
    assert {parse_duration_seconds(hold) for hold in holds} == {PAGE_HOLD_SECONDS}
    for rule in file_rules.values():
        if rule["alert"] != "StepBudgetExporterAbsent":
            assert "max without (instance, job)" in rule["expr"], \
                "rules aggregate job/instance away, as the daemon's labels"


# --- for semantics and the protocol ------------------------------------------------------------------


def test_pending_then_firing_after_for_with_exactly_the_rule_labels(clock: ManualClock) -> None:
    recorder = Recorder()
    alerts = loop(clock, recorder)
    over = reading(predicted_step_seconds=0.025, predicted_memory_step_seconds=0.025)
    start = clock.now
    assert alerts.evaluate([over], clock.now) == []
    clock.advance(299)
    assert alerts.evaluate([over], clock.now) == []
    clock.advance(1)
    [posted] = alerts.evaluate([over], clock.now)
    assert posted["labels"] == {"alertname": PAGE_ALERT, "severity": "critical", **SERIES}
    assert seconds(posted["startsAt"]) == pytest.approx(start + 300)
    assert seconds(posted["endsAt"]) == pytest.approx(clock.now + 4 * max(15, 60))
    assert posted["generatorURL"] == "http://stepbudget:9421/"
    assert posted["annotations"]["description"].startswith(
        "The predicted step time of 10.0.0.5:8000 (deployment chat, model Qwen/Qwen3-8B, engine 0) has been 25ms,")
    assert recorder.posts[0][0] == "http://am.invalid:9093" and recorder.posts[0][2] == 5.0



def test_external_labels_go_under_the_alerts_own_and_the_runbook_moves_to_the_configured_base(
        clock: ManualClock) -> None:
    """As Prometheus adds its external labels (only where the alert has no label of that name), so that
    the daemon's page and Prometheus's carry the same set; the runbook link from the site's own base, as
    the chart renders the rules Prometheus loads."""
    recorder = Recorder()
    alerts = loop(clock, recorder, for_seconds=0.0, runbook_base_url="https://wiki.example.com/llm/runbook",
                  external_labels={"cluster": "prod-eu", "namespace": "from-the-config"})
    [posted] = alerts.evaluate([reading(predicted_step_seconds=0.025, predicted_memory_step_seconds=0.025)],
                               clock.now)
    assert posted["labels"] == {"alertname": PAGE_ALERT, "severity": "critical", **SERIES, "cluster": "prod-eu"}
    assert posted["annotations"]["runbook_url"] == (
        "https://wiki.example.com/llm/runbook#stepbudgetpredictedstepoverbudget")
    # GET /api/v1/alerts shows what Prometheus's does: the rule's labels, no external ones.
    [active] = alerts.active()
    assert active["labels"] == {"alertname": PAGE_ALERT, "severity": "critical", **SERIES}
    assert active["annotations"] == posted["annotations"]

def test_firing_alert_is_reposted_at_most_every_60s_and_resolved_with_ends_at_now(clock: ManualClock) -> None:
    recorder = Recorder()
    alerts = loop(clock, recorder, for_seconds=0.0)
    over = reading(predicted_step_seconds=0.025, predicted_memory_step_seconds=0.025)
    assert len(alerts.evaluate([over], clock.now)) == 1
    sent = [clock.now]
    for _ in range(12):  # every 15 s for 3 minutes
        clock.advance(15)
        if alerts.evaluate([over], clock.now):
            sent.append(clock.now)
    assert [b - a for a, b in itertools.pairwise(sent)] == [60.0, 60.0, 60.0]
    clock.advance(15)
    [resolved] = alerts.evaluate([reading()], clock.now)
    assert resolved["labels"]["alertname"] == PAGE_ALERT
    assert seconds(resolved["endsAt"]) == pytest.approx(clock.now)
    assert alerts.firing() == []
    # Resolved notifications are repeated (as Prometheus does) for 15 minutes, then forgotten.
    resent = 0
    for _ in range(80):
        clock.advance(15)
        resent += len(alerts.evaluate([reading()], clock.now))
    assert resent == 15


def test_endsat_follows_a_long_poll_interval(clock: ManualClock) -> None:
    recorder = Recorder()
    alerts = AlertLoop(Alerting(alertmanager_urls=("http://am.invalid",), for_seconds=0.0),
                       poll_interval_seconds=120, clock=clock, post=recorder)
    [posted] = alerts.evaluate([reading(predicted_step_seconds=1.0, predicted_memory_step_seconds=1.0)], clock.now)
    assert seconds(posted["endsAt"]) == pytest.approx(clock.now + 4 * 120)


def test_pending_that_clears_is_never_sent(clock: ManualClock) -> None:
    recorder = Recorder()
    alerts = loop(clock, recorder)
    alerts.evaluate([reading(predicted_step_seconds=0.025)], clock.now)
    clock.advance(200)
    alerts.evaluate([reading()], clock.now)
    clock.advance(200)
    assert alerts.evaluate([reading(predicted_step_seconds=0.025)], clock.now) == []
    assert recorder.posts == []


def test_for_override_applies_to_the_page(clock: ManualClock) -> None:
    alerts = loop(clock, Recorder(), for_seconds=30.0)
    rules = {rule.name: rule.for_seconds for rule in alerts.rules}
    assert rules[PAGE_ALERT] == 30.0
    assert rules["StepBudgetPredictionDrift"] == 900.0


def test_alertmanager_down_is_logged_never_fatal(clock: ManualClock) -> None:
    recorder = Recorder(fail=True)
    alerts = loop(clock, recorder, for_seconds=0.0)
    with capture_logs() as logs:
        alerts.evaluate([reading(predicted_step_seconds=0.025)], clock.now)
    [line] = [line for line in logs if line["event"] == "alertmanager_post_failed"]
    assert line["url"] == "http://am.invalid:9093" and "Connection refused" in line["reason"]


def test_real_post_to_an_unreachable_alertmanager_times_out_cleanly() -> None:
    from tests.support.servers import free_port

    with pytest.raises(requests.ConnectionError):
        post_alerts(f"http://127.0.0.1:{free_port()}", [], 1.0)


# --- each condition ---------------------------------------------------------------------------------


def firing_names(readings_sequence: list[list[Reading]], clock: ManualClock, step: float = 60.0) -> set[str]:
    """Feed readings one poll at a time, `step` seconds apart, long enough for every `for`."""
    alerts = loop(clock, Recorder())
    for readings in readings_sequence:
        alerts.evaluate(readings, clock.now)
        clock.advance(step)
    return {alert["alertname"] for alert in alerts.firing()}


def held(r: Reading, minutes: int = 16) -> list[list[Reading]]:
    return [[r]] * (minutes + 1)


@pytest.mark.parametrize("values, expected", [
    ({}, set()),
    ({"predicted_step_seconds": 0.02, "predicted_memory_step_seconds": 0.02}, {PAGE_ALERT}),
    ({"measured_step_seconds": 0.02, "prediction_error_ratio": -0.1, "predicted_memory_step_seconds": 0.019},
     {"StepBudgetMeasuredStepOverBudget"}),
    # Measured over, memory prediction fits, prompt chunks in the steps: they are the cause.
    ({"measured_step_seconds": 0.02, "prediction_error_ratio": -0.1, "prefill_tokens_per_step": 256.0},
     {"StepBudgetMeasuredStepOverBudget", "StepBudgetPrefillInterference"}),
    # The same without prefill (a decode pod of a P/D split, or a page that cannot tell): not interference.
    ({"measured_step_seconds": 0.02, "prediction_error_ratio": -0.1, "prefill_tokens_per_step": 0.0},
     {"StepBudgetMeasuredStepOverBudget"}),
    ({"measured_step_seconds": 0.02, "prediction_error_ratio": -0.1, "prefill_tokens_per_step": None},
     {"StepBudgetMeasuredStepOverBudget"}),
    ({"prefill_utilization_ratio": 0.95}, {"StepBudgetPrefillOverCapacity"}),
    ({"prefill_utilization_ratio": 0.9}, set()),
    ({"prediction_error_ratio": -0.16}, {"StepBudgetPredictionDrift"}),
    ({"prediction_error_ratio": 0.16}, {"StepBudgetPredictionDrift"}),
    ({"prediction_error_ratio": 0.15}, set()),
    # Full while requests wait for its capacity; full with nobody waiting (vLLM under load, by design) is nothing.
    ({"kv_cache_usage_ratio": 0.96, "requests_waiting_for_capacity": 2.0}, {"StepBudgetKVCacheNearlyFull"}),
    ({"kv_cache_usage_ratio": 0.96, "requests_waiting_for_capacity": 0.0}, set()),
    ({"kv_cache_usage_ratio": 0.96}, set()),
    ({"kv_cache_usage_ratio": 0.95, "requests_waiting_for_capacity": 2.0}, set()),
])
def test_each_condition(values: dict[str, object], expected: set[str], clock: ManualClock) -> None:
    assert firing_names(held(reading(**values)), clock) == expected


def test_missing_values_raise_no_alert(clock: ManualClock) -> None:
    """A value left out of the export (None) compares to nothing, as an absent series in PromQL."""
    blank = reading(predicted_step_seconds=None, measured_step_seconds=None, prediction_error_ratio=None,
                    kv_cache_usage_ratio=None, preemptions_total=None, predicted_memory_step_seconds=None)
    assert firing_names(held(blank), clock) == set()


def prefill_server(**values: object) -> Reading:
    """A prefill-only server (P/D disaggregation) as the reading gives it: no decode step, so no predicted,
    memory or compute step and no step budget; a prefill budget and TTFT instead. A measured ITL may be
    there (a prefill server that samples its first token), and prompt tokens in every step."""
    base = dict(deployment="prefill", target="10.0.1.5:8000", model_name="Qwen/Qwen3-8B", engine="0",
                target_up=True, role="prefill", prefill_tokens_per_step=8192.0, prefill_tokens_per_second=16384.0,
                prefill_capacity_tokens_per_second=32768.0, prefill_utilization_ratio=0.5,
                measured_time_to_first_token_seconds=0.25, measured_step_seconds=1.0, kv_cache_usage_ratio=0.5)
    return Reading(**{**base, **values})  # type: ignore[arg-type]  # fields given as object: each test overrides a few


def test_no_step_alert_fires_for_a_prefill_server(clock: ManualClock) -> None:
    """No predicted step and no budget: the page, the measured-step warning and prefill interference have
    nothing to compare, however slow its one ITL is, as the rules (tests/rules: the prefill servers)."""
    assert firing_names(held(prefill_server(), minutes=40), clock) == set()


def test_prefill_over_capacity_as_promtool_sees_it(clock: ManualClock) -> None:
    """The promtool case minute by minute (tests/rules/stepbudget.alerts_test.yaml, StepBudgetPrefillOverCapacity):
    .5 at half its capacity at 0m and at 15/16 from 1m is pending at 10m and firing at 11m; .6 exactly at
    0.9 never fires. Neither gets a step alert."""
    alerts = loop(clock, Recorder())
    over = [prefill_server(prefill_utilization_ratio=0.5)] + [prefill_server(prefill_utilization_ratio=0.9375)] * 11
    at_limit = prefill_server(target="10.0.1.6:8000", prefill_utilization_ratio=0.9)
    verdicts = {}
    for minute, reading_now in enumerate(over):
        alerts.evaluate([reading_now, at_limit], clock.now)
        verdicts[minute] = [(a["alertname"], a["target"]) for a in alerts.firing()]
        clock.advance(60)
    assert verdicts[10] == []
    assert verdicts[11] == [("StepBudgetPrefillOverCapacity", "10.0.1.5:8000")]
    [active] = alerts.active()
    assert active["annotations"]["description"] == (  # type: ignore[index]  # annotations: a dict
        "The prefill load of 10.0.1.5:8000 (deployment prefill, model Qwen/Qwen3-8B, engine 0) has been 93.75% of "
        "its prefill capacity (over 90%) for 10m: prompts queue and the time to first token grows.")


def test_prefill_interference_as_promtool_sees_it(clock: ManualClock) -> None:
    """The promtool case (StepBudgetPrefillInterference): measured 31.25 ms over a 15.625 ms budget from 1m
    with the memory step inside it. With 256 prompt tokens a step it fires at 11m (memory step under the
    budget, and exactly at it); with none (0, or unknown) it never does; with a memory step over the budget,
    the tokens in flight are the cause, not prefill."""
    budget, over, inside = 0.015625, 0.03125, 0.0078125
    cases = {
        "10.0.0.5:8000": {"predicted_memory_step_seconds": inside, "prefill_tokens_per_step": 256.0},
        "10.0.0.6:8000": {"predicted_memory_step_seconds": budget, "prefill_tokens_per_step": 256.0},
        "10.0.0.7:8000": {"predicted_memory_step_seconds": over, "prefill_tokens_per_step": 256.0},
        "10.0.0.8:8000": {"predicted_memory_step_seconds": inside, "prefill_tokens_per_step": 0.0},
        "10.0.0.9:8000": {"predicted_memory_step_seconds": inside, "prefill_tokens_per_step": None},
    }
    alerts = loop(clock, Recorder())
    interfering = {}
    for minute in range(12):
        readings = [reading(target=target, namespace=None, pod=None, step_budget_seconds=budget,
                            measured_step_seconds=budget if minute == 0 and target != "10.0.0.7:8000" else over,
                            predicted_step_seconds=budget, **values)
                    for target, values in cases.items()]
        alerts.evaluate(readings, clock.now)
        interfering[minute] = sorted(a["target"] for a in alerts.firing()
                                     if a["alertname"] == "StepBudgetPrefillInterference")
        clock.advance(60)
    assert interfering[10] == []
    assert interfering[11] == ["10.0.0.5:8000", "10.0.0.6:8000"]


def test_preemptions_fire_while_increasing_and_clear_after_the_window(clock: ManualClock) -> None:
    alerts = loop(clock, Recorder())
    for count in range(7):  # one more preemption every minute for 6 minutes
        alerts.evaluate([reading(preemptions_total=float(count))], clock.now)
        clock.advance(60)
    assert {a["alertname"] for a in alerts.firing()} == {"StepBudgetPreemptions"}
    for _ in range(6):  # flat for 6 minutes: increase over 5m drops to 0
        alerts.evaluate([reading(preemptions_total=6.0)], clock.now)
        clock.advance(60)
    assert alerts.firing() == []


def test_an_idle_window_does_not_restart_the_measured_and_drift_for_as_promtool_sees_it(clock: ManualClock) -> None:
    """The promtool case (tests/rules/stepbudget.alerts_test.yaml, "An idle window bridged") minute by minute:
    .5 over budget and 50% off from 1m with nothing decoded at 3m (no measured step, no error) fires the
    measured alert at 6m and the drift alert at 16m; .6, with nothing decoded from 3m to 6m (past
    IDLE_BRIDGE_SECONDS by 5m), restarts at 7m and fires at 12m."""
    assert IDLE_BRIDGE_SECONDS == 120.0
    budget, over = 0.015625, 0.0625
    alerts = loop(clock, Recorder())
    start, fired = clock.now, {}
    for minute in range(20):
        idle_5, idle_6 = minute == 3, 3 <= minute <= 6
        measured_5 = None if idle_5 else (budget if minute == 0 else over)
        measured_6 = None if idle_6 else (budget if minute == 0 else over)
        readings = [
            reading(target="10.0.0.5:8000", step_budget_seconds=budget, measured_step_seconds=measured_5,
                    prediction_error_ratio=None if idle_5 else (0.0 if minute == 0 else 0.5)),
            reading(target="10.0.0.6:8000", step_budget_seconds=budget, measured_step_seconds=measured_6),
        ]
        alerts.evaluate(readings, clock.now)
        for alert in alerts.firing():
            fired.setdefault(f"{alert['alertname']}@{alert['target']}", (clock.now - start) / 60)
        clock.advance(60)
    assert fired == {"StepBudgetMeasuredStepOverBudget@10.0.0.5:8000": 6,
                     "StepBudgetMeasuredStepOverBudget@10.0.0.6:8000": 12,
                     "StepBudgetPredictionDrift@10.0.0.5:8000": 16}, fired


def test_target_down_has_only_the_labels_the_series_has(clock: ManualClock) -> None:
    """A target never read has no model_name/engine: the alert carries none (as Prometheus drops empty labels)."""
    down = Reading(deployment="chat", target="10.0.0.9:8000", target_up=False)
    alerts = loop(clock, Recorder())
    posted = []
    for _ in range(6):
        posted += alerts.evaluate([down], clock.now)
        clock.advance(60)
    assert [p["labels"] for p in posted] == [{"alertname": "StepBudgetTargetDown", "severity": "warning",
                                              "deployment": "chat", "target": "10.0.0.9:8000"}]


def test_templates_render_like_prometheus() -> None:
    assert humanize_duration(0.025) == "25ms"
    assert humanize_duration(75) == "1m 15s"
    assert humanize_duration(3.5) == "3.5s"
    assert render("{{ $labels.target }}: {{ $value | humanizePercentage }}", {"target": "t"}, 0.2) == "t: 20%"
    assert render("{{ $value | humanize }}", {}, 1234.0) == "1.234k"


# --- a real Alertmanager ---------------------------------------------------------------------------------


@pytest.mark.e2e
def test_over_budget_alert_reaches_a_real_alertmanager_and_resolves(alertmanager: Alertmanager) -> None:
    """Short `for` from config, injected clock for the loop, real Alertmanager API v2.

    The injected clock starts 10 s in the past so that the resolution's endsAt is already over
    when Alertmanager reads it (it treats an alert as active until endsAt).
    """
    import time

    clock = ManualClock(start=time.time() - 10)
    alerts = AlertLoop(Alerting(alertmanager_urls=(alertmanager.url,), for_seconds=2.0, timeout_seconds=5.0),
                       poll_interval_seconds=1, clock=clock)
    over = reading(predicted_step_seconds=0.025, predicted_memory_step_seconds=0.025)
    alerts.evaluate([over], clock.now)
    clock.advance(1)
    alerts.evaluate([over], clock.now)
    assert alertmanager.alerts() == [], "still pending: nothing sent before `for`"
    clock.advance(1)
    alerts.evaluate([over], clock.now)

    def page_firing() -> list[dict[str, object]]:
        return [a for a in alertmanager.alerts() if a["labels"].get("alertname") == PAGE_ALERT]

    [received] = wait_until(page_firing)
    assert received["labels"] == {"alertname": PAGE_ALERT, "severity": "critical", **SERIES}
    assert received["status"]["state"] == "active"
    assert received["annotations"]["runbook_url"].endswith("#stepbudgetpredictedstepoverbudget")

    clock.advance(1)
    alerts.evaluate([reading()], clock.now)
    wait_until(lambda: page_firing() == [])


def test_active_view_shows_pending_then_firing_without_any_alertmanager(clock: ManualClock) -> None:
    """With no Alertmanager configured the loop still evaluates: `active()` (served by the daemon as
    GET /api/v1/alerts) shows the page pending, then firing once it has held for `for`, then gone."""
    recorder = Recorder()
    alerts = AlertLoop(Alerting(), poll_interval_seconds=15, clock=clock, post=recorder)
    over = reading(predicted_step_seconds=0.030)  # budget 0.018
    alerts.evaluate([over], clock())
    (pending,) = alerts.active()
    assert pending["state"] == "pending"
    assert pending["labels"] == {"alertname": PAGE_ALERT, "severity": "critical", **SERIES}
    assert seconds(pending["activeAt"]) == clock() and float(pending["value"]) == 0.030
    page_for_seconds = next(rule.for_seconds for rule in packaged_rules() if rule.name == PAGE_ALERT)
    clock.advance(page_for_seconds)
    alerts.evaluate([over], clock())
    (firing,) = alerts.active()
    assert firing["state"] == "firing" and seconds(firing["activeAt"]) == clock() - page_for_seconds
    assert "has been 30ms, over its step budget" in firing["annotations"]["description"]  # humanizeDuration(0.030)
    clock.advance(15)
    alerts.evaluate([reading()], clock())
    assert alerts.active() == [] and recorder.posts == []


def test_a_pod_not_ready_past_its_allowance_as_promtool_sees_it(clock: ManualClock) -> None:
    """tests/rules/stepbudget.alerts_test.yaml's case, minute by minute from the epoch: vllm-2 not Ready
    since 60 s with a 900 s allowance (pending at 17m with 960 s, firing at 18m with 1,020 s, the
    description's 17m 0s); vllm-9 of `long` (1,800 s) never within 30m; exactly at the allowance, nothing."""
    clock.now = 0.0
    recorder = Recorder()
    alerts = loop(clock, recorder)
    pods = [NotReadyPod("chat", "llm", "vllm-2", "u2", 60.0, 900.0, "Running"),
            NotReadyPod("long", "llm", "vllm-9", "u9", 60.0, 1800.0, "Running")]
    states = {}
    for minute in range(1, 31):
        clock.now = 60.0 * minute
        alerts.evaluate([], clock.now, not_ready=pods)
        states[minute] = {(a["labels"]["pod"], a["state"], a["value"]) for a in alerts.active()}
    assert states[16] == set()  # 960 - 60 = 900: at the allowance, not over it
    assert states[17] == {("vllm-2", "pending", "960.0")}
    assert states[18] == {("vllm-2", "firing", "1020.0")}
    assert states[30] == {("vllm-2", "firing", "1740.0")}
    _, [posted], _ = recorder.posts[0]  # the first post, at 18m (then re-posted every 60 s)
    assert posted["labels"] == {"alertname": "StepBudgetTargetNotReady", "severity": "warning",
                                "deployment": "chat", "namespace": "llm", "pod": "vllm-2"}
    assert posted["annotations"]["description"].startswith(
        "Pod llm/vllm-2 (deployment chat) has not been Ready for 17m 0s, longer than")


def test_a_full_cache_that_preempts_warns_where_the_page_cannot_say_who_waits(clock: ManualClock) -> None:
    """A page without waiting-by-reason (vLLM before 0.32): full and preempting is the harm. Full with a flat
    preemption counter is not."""
    preempting = [[reading(kv_cache_usage_ratio=0.96, requests_waiting_for_capacity=None,
                           preemptions_total=float(minute))] for minute in range(17)]
    assert firing_names(preempting, clock) == {"StepBudgetKVCacheNearlyFull", "StepBudgetPreemptions"}
    flat = [[reading(kv_cache_usage_ratio=0.96, requests_waiting_for_capacity=None, preemptions_total=3.0)]] * 17
    assert firing_names(flat, clock) == set()


def test_no_targets_is_silent_for_a_pool_that_scales_to_zero_on_purpose(clock: ManualClock) -> None:
    alerts = AlertLoop(Alerting(), poll_interval_seconds=60, clock=clock, scales_to_zero=["keda"])
    for _ in range(12):
        alerts.evaluate([], clock.now, deployment_targets=[("keda", 0), ("typo", 0)])
        clock.advance(60)
    assert alerts.firing() == [{"alertname": "StepBudgetNoTargets", "deployment": "typo"}]
