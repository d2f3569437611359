"""The Grafana dashboards: committed JSON equals what dashboards/build.py builds, and every query is
valid PromQL (checked by the real promtool) that reads only metrics the daemon or the recording
rules export."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from dashboards import build
from tests.support.monitoring import REPO, known_metrics, metric_names, promtool_check_exprs
from tests.support.tools import require_tool

DASHBOARD_FILES = sorted((REPO / "dashboards").glob("*.json"))
RUNBOOK = REPO / "docs" / "runbook.md"

# What the overview must show, by panel title.
OVERVIEW_PANELS = {
    "Predicted vs measured step time",
    "Tokens in flight vs token budget and KV capacity",
    "Per-user tokens/s vs target",
    "Prediction error",
    "Prefill tokens per step",
    "Preemptions",
    "KV cache usage",
    "Target up",
}


def _load(name: str) -> dict:
    return json.loads((REPO / "dashboards" / f"{name}.json").read_text())


def _dashboards() -> list[dict]:
    return [json.loads(path.read_text()) for path in DASHBOARD_FILES]


def _panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            yield panel
        yield from panel.get("panels", [])


def _exprs(dashboard: dict) -> list[str]:
    exprs = [target["expr"] for panel in _panels(dashboard) for target in panel.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def _label_values_metric(query: str) -> str:
    """`label_values(metric{...}, label)` -> the PromQL part promtool can parse."""
    match = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
    assert match, f"variable query is not label_values(): {query}"
    return match.group(1)


def _promql(expr: str) -> str:
    return _label_values_metric(expr) if expr.startswith("label_values(") else expr


def test_committed_json_is_what_the_code_builds() -> None:
    built = build.rendered()
    assert sorted(built) == DASHBOARD_FILES, "a dashboard JSON is missing or not built by the code"
    stale = [path.name for path, text in built.items() if path.read_text() != text]
    assert not stale, f"run `make dashboards`: {stale} differ from dashboards/build.py"


def test_check_mode_reports_drift(tmp_path, monkeypatch) -> None:
    """`python -m dashboards.build --check` fails on a stale file and passes on a fresh one."""
    monkeypatch.setattr(build, "OUTPUT_DIR", tmp_path)
    assert build.main(["--check"]) == 1
    assert build.main([]) == 0 and build.main(["--check"]) == 0
    (tmp_path / "stepbudget-overview.json").write_text("{}")
    assert build.main(["--check"]) == 1


def test_uids_are_stable_and_unique() -> None:
    uids = [d["uid"] for d in _dashboards()]
    assert uids == ["stepbudget-overview", "stepbudget-pools"]


def test_grafana_11_6_schema() -> None:
    for dashboard in _dashboards():
        assert dashboard["schemaVersion"] == 41


def test_overview_has_the_required_panels_and_variables() -> None:
    overview = _load("stepbudget-overview")
    titles = {panel["title"] for panel in _panels(overview)}
    assert OVERVIEW_PANELS <= titles, OVERVIEW_PANELS - titles
    names = [v["name"] for v in overview["templating"]["list"]]
    assert names == ["datasource", "cluster", "deployment", "model", "namespace", "target"]


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_every_panel_has_a_unit_an_id_and_the_datasource_variable(path) -> None:
    dashboard = json.loads(path.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in _panels(dashboard):
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{panel['title']}: no unit"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert target["expr"] and target["refId"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == "${datasource}"


# The first row of each dashboard, what on-call reads first: what is wrong anywhere, not only in the selection.
STATUS_PANELS = ["Firing stepbudget alerts", "Pools over their token budget", "Highest pool token budget utilization",
                 "Fastest speed budget burn (1h)"]


def test_overview_queries_follow_the_variables() -> None:
    """Changing deployment, model or target must filter every overview panel but the status row's."""
    for panel in _panels(_load("stepbudget-overview")):
        if panel["title"] in STATUS_PANELS:
            continue
        for target in panel["targets"]:
            for matcher in ('cluster=~"$cluster"', 'deployment=~"$deployment"', 'model_name=~"$model"',
                            'target=~"$target"'):
                assert matcher in target["expr"], (panel["title"], target["expr"])


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_queries_read_only_exported_or_recorded_metrics(path) -> None:
    known = known_metrics()
    for expr in _exprs(json.loads(path.read_text())):
        unknown = metric_names(_promql(expr)) - known
        assert not unknown, (expr, unknown)


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_promtool_parses_every_query(path) -> None:
    promtool = require_tool("promtool")
    exprs = [_promql(e) for e in _exprs(json.loads(path.read_text()))]
    result = promtool_check_exprs(promtool, exprs)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


def test_promtool_check_rejects_a_broken_query() -> None:
    """The syntax check above can fail: an unclosed parenthesis is refused."""
    promtool = require_tool("promtool")
    result = promtool_check_exprs(promtool, ["max without (instance, job) (stepbudget_target_up"])
    assert result.returncode != 0


def test_runbook_names_only_existing_panels() -> None:
    """docs/runbook.md tells on-call which panel to open; each named panel must exist."""
    titles = {panel["title"] for dashboard in _dashboards() for panel in _panels(dashboard)}
    found = re.findall(r"(?<![*\w])\*([A-Z][^*]+?)\*(?![*\w])", RUNBOOK.read_text())
    named = {" ".join(name.split()) for name in found}  # a name may wrap across lines
    labels = {"Meaning.", "Confirm.", "What to do.", "The page.", "Two sources, one alert."}
    assert named - labels, "the runbook names no panel"
    assert named - labels <= titles, (named - labels) - titles


def test_the_step_time_panel_shows_the_median_as_its_bucket_and_the_runbook_confirms_with_the_mean() -> None:
    """With vLLM's default ITL buckets every step from 10 to 25 ms interpolates to a 17.5 ms median:
    the panel draws the bucket's bounds beside the exact mean, and the runbook's
    confirmation reads the mean and the bounds, never the interpolated median."""
    (panel,) = [p for p in _panels(_load("stepbudget-overview")) if p["title"] == "Predicted vs measured step time"]
    read = {name for target in panel["targets"] for name in metric_names(target["expr"])}
    assert {"stepbudget_measured_step_seconds", "stepbudget_measured_step_median_lower_seconds",
            "stepbudget_measured_step_median_upper_seconds"} <= read
    assert "stepbudget_measured_step_median_seconds" not in read
    section = RUNBOOK.read_text().split("## StepBudgetMeasuredStepOverBudget", 1)[1].split("\n## ", 1)[0]
    confirm = section.split("**Confirm.**", 1)[1].split("**What to do.**", 1)[0]
    assert "stepbudget_measured_step_seconds" in confirm
    assert "stepbudget_measured_step_median_lower_seconds" in confirm
    assert "stepbudget_measured_step_median_upper_seconds" in confirm
    assert "median) lines are above the budget" not in confirm  # the old confirmation, by the interpolation


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_each_dashboard_opens_on_its_status_and_links_to_the_others_and_the_runbook(path) -> None:
    """The first row: anything firing, pools over budget, the busiest pool, the fastest speed budget burn; each
    a number even when all is well (0, not "No data"). Then the links: every stepbudget dashboard, keeping
    the variables and time range, and the runbook."""
    dashboard = json.loads(path.read_text())
    first_row = dashboard["panels"][0]
    assert first_row["type"] == "row" and first_row["title"] == "Now"
    status = [panel["title"] for panel in dashboard["panels"][1:1 + len(STATUS_PANELS)]]
    assert status == STATUS_PANELS
    counts = [panel["targets"][0]["expr"] for panel in dashboard["panels"][1:3]]
    assert all(expr.endswith(" or vector(0)") for expr in counts), counts
    links = {link["title"]: link for link in dashboard["links"]}
    assert links["stepbudget"]["type"] == "dashboards" and links["stepbudget"]["tags"] == ["stepbudget"]
    assert links["stepbudget"]["includeVars"] and links["stepbudget"]["keepTime"]
    assert links["Runbook"]["url"].endswith("docs/runbook.md")


def test_overview_legends_name_the_pod_before_the_address() -> None:
    """On-call knows pods by name, not by IP: where discovery gives a pod, the legend shows it."""
    legends = [target["legendFormat"] for panel in _panels(_load("stepbudget-overview"))
               for target in panel.get("targets", []) if "{{target}}" in target.get("legendFormat", "")]
    assert legends and all(legend.startswith("{{pod}} {{target}}") for legend in legends), legends
