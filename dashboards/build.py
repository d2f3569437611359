"""Build stepbudget's Grafana dashboards from code and write them as JSON next to this file.

`python -m dashboards.build` rewrites the committed JSON; `--check` only reports drift. The JSON is
committed so that Grafana (and the Helm chart's dashboard ConfigMaps) need no Python, and a test
fails when the committed JSON and this code disagree.

Every per-target query takes `max without (instance, job)`, as the alert rules do, so a target
polled by two exporter replicas draws one line, with the labels the alerts carry.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders.prometheus import Dataquery as PromQuery
from grafana_foundation_sdk.builders.stat import Panel as Stat
from grafana_foundation_sdk.builders.statetimeline import Panel as StateTimeline
from grafana_foundation_sdk.builders.table import Panel as Table
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    DataTransformerConfig,
    DynamicConfigValue,
    Threshold,
    ThresholdsMode,
    ValueMap,
    ValueMappingResult,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

# The runbook the rules link to; the chart rewrites it with prometheusRule.runbookBaseUrl, in the rules and
# these dashboards alike.
from exporter.serve.alert_rules import PACKAGED_RUNBOOK_BASE

OUTPUT_DIR = Path(__file__).resolve().parent
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
TAGS = ["stepbudget"]
# Label matchers driven by the dashboard variables.
# `cluster` keeps apart pools of one name in several clusters on a global Prometheus (Thanos, Mimir); where
# series carry no `cluster` label, All (.*) matches them.
POOL_SELECTOR = 'cluster=~"$cluster", deployment=~"$deployment", model_name=~"$model"'
# `namespace`: the model servers' Kubernetes namespace (a series of a static or DNS target has none; All, .*,
# matches it).
TARGET_SELECTOR = POOL_SELECTOR + ', namespace=~"$namespace", target=~"$target"'
TOKENS_PER_SECOND = "suffix: tok/s"  # Grafana custom unit: no built-in tokens/s
PANEL_HEIGHT = 8
HALF, THIRD, QUARTER = 12, 8, 6
Panel = Timeseries | Stat | StateTimeline | Table


@dataclass(frozen=True)
class Query:
    """One PromQL query of a panel and the legend Grafana draws for it."""

    expr: str
    legend: str


FIRING = 'ALERTS{alertname=~"StepBudget.+", alertstate="firing", cluster=~"$cluster"}'
# How a legend names a model server: its pod where discovery knows one (Kubernetes), then its address; a label
# a series lacks renders empty in Grafana's legend.
WHO = "{{pod}} {{target}}"
# The speed objective's recorded SLI (the alerts file's speed-objective group) and the share of decode tokens
# its objective allows under the target, per deployment.
SPEED_ERRORS = "deployment_model_name:stepbudget_decode_tokens_under_target:ratio_rate"
ALLOWED_ERRORS = ('(1 - max without (instance, job) '
                  '(stepbudget_speed_objective_ratio{cluster=~"$cluster", deployment=~"$deployment"}))')


def per_target(metric: str, selector: str = TARGET_SELECTOR) -> str:
    """A daemon metric per target, scrape labels dropped (one line per target, as alerts see it)."""
    return f"max without (instance, job) ({metric}{{{selector}}})"


def _targets(queries: Sequence[Query]) -> list[PromQuery]:
    return [
        PromQuery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i)).datasource(DATASOURCE)
        for i, q in enumerate(queries)
    ]


def _limit_line() -> common_builders.GraphThresholdsStyleConfig:
    """Thresholds drawn as a dashed line: used where a ratio crosses 1 (the budget)."""
    return common_builders.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.DASHED)


def _thresholds(limit: float | None) -> dash.ThresholdsConfig:
    steps = [Threshold(value=None, color="green")]
    if limit is not None:
        steps.append(Threshold(value=limit, color="red"))
    return dash.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(steps)


def _dashed_red(regexp: str) -> tuple[str, list[DynamicConfigValue]]:
    """Series whose legend matches `regexp` (the budget lines) are drawn dashed and red."""
    return regexp, [
        DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": "red"}),
        DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
    ]


def timeseries(
    panel_id: int,
    title: str,
    unit: str,
    description: str,
    queries: Sequence[Query],
    *,
    width: int = HALF,
    limit: float | None = None,
    budget_legend: str | None = None,
    min_value: float | None = None,
) -> Timeseries:
    """A time series panel with the project's defaults: unit, legend as a table, shared datasource."""
    panel = (
        Timeseries()
        .id(panel_id)
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .targets(_targets(queries))
        .height(PANEL_HEIGHT)
        .span(width)
        .thresholds(_thresholds(limit))
        .legend(common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.TABLE)
                .placement(common.LegendPlacement.BOTTOM).show_legend(True).calcs(["lastNotNull", "max"]))
        .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                 .sort(common.SortOrder.DESCENDING))
    )
    if limit is not None:
        panel = panel.thresholds_style(_limit_line())
    if budget_legend is not None:
        panel = panel.override_by_regexp(*_dashed_red(budget_legend))
    if min_value is not None:
        panel = panel.min(min_value)
    return panel


def target_up_panel(panel_id: int) -> StateTimeline:
    """Each target's reachability over time: 1 up (green), 0 down (red)."""
    mapping = ValueMap(options={
        "0": ValueMappingResult(text="down", color="red", index=0),
        "1": ValueMappingResult(text="up", color="green", index=1),
    })
    return (
        StateTimeline()
        .id(panel_id)
        .title("Target up")
        .description("Whether the daemon's last poll of the target's metrics page succeeded "
                     "(stepbudget_target_up). A target down for 5m raises StepBudgetTargetDown.")
        .unit("none")
        .datasource(DATASOURCE)
        .targets(_targets([Query(per_target("stepbudget_target_up"), WHO)]))
        .mappings([mapping])
        .thresholds(_thresholds(None))
        .height(PANEL_HEIGHT)
        .span(HALF)
    )


def query_variable(name: str, label: str, query: str) -> dash.QueryVariable:
    """A multi-value variable over one label of stepbudget_target_up; All matches any value."""
    return (
        dash.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def row(row_id: int, title: str) -> dash.Row:
    """A row with an explicit id: the builder's default 0 would repeat on every row."""
    return dash.Row(title).id(row_id)


def _layout(board: dash.Dashboard, rows: Sequence[tuple[str, Sequence[Panel]]], first_row_id: int) -> dash.Dashboard:
    """Append each row and its panels; the builder lays the panels out left to right."""
    for offset, (title, panels) in enumerate(rows):
        board = board.with_row(row(first_row_id + offset, title))
        for panel in panels:
            board = board.with_panel(panel)
    return board


def _base(uid: str, title: str, description: str) -> dash.Dashboard:
    return (
        dash.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        # Every stepbudget dashboard one click away, the variables and time range kept; the runbook beside them.
        .links([dash.DashboardLink("stepbudget").type(DashboardLinkType.DASHBOARDS).tags(TAGS).as_dropdown(False)
                .include_vars(True).keep_time(True),
                dash.DashboardLink("Runbook").type(DashboardLinkType.LINK).url(PACKAGED_RUNBOOK_BASE).target_blank(True)])
        .with_variable(dash.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(query_variable("cluster", "Cluster", "label_values(stepbudget_target_up, cluster)"))
        .with_variable(query_variable(
            "deployment", "Deployment", 'label_values(stepbudget_target_up{cluster=~"$cluster"}, deployment)'))
        .with_variable(query_variable(
            "model", "Model",
            'label_values(stepbudget_target_up{cluster=~"$cluster", deployment=~"$deployment"}, model_name)'))
    )


def stat(panel_id: int, title: str, unit: str, description: str, query: Query, *, limit: float | None) -> Stat:
    """A single number, red from `limit` on."""
    return (Stat().id(panel_id).title(title).unit(unit).datasource(DATASOURCE).description(description)
            .targets(_targets([query])).thresholds(_thresholds(limit)).height(PANEL_HEIGHT // 2).span(QUARTER))


def status_row(first_panel_id: int) -> tuple[str, list[Panel]]:
    """What on-call reads first, in the dashboard's first 30 seconds: anything firing, any pool over its token
    budget, how fast the speed objective's budget burns. Each always has a number (0 rather than no data)."""
    sel = POOL_SELECTOR
    utilization = f"deployment_model_name:stepbudget_token_budget_utilization:ratio{{{sel}}}"
    return ("Now", [
        stat(first_panel_id, "Firing stepbudget alerts", "none",
             "stepbudget alerts firing in Prometheus now, every pool and target (Alertmanager groups them by "
             "pool; docs/runbook.md has a section per alert).",
             Query(f"count({FIRING}) or vector(0)", "firing"), limit=1),
        stat(first_panel_id + 1, "Pools over their token budget", "none",
             "Pools (deployment and model) whose tokens in flight exceed the sum of their replicas' token budgets.",
             Query(f"count({utilization} > 1) or vector(0)", "pools"), limit=1),
        stat(first_panel_id + 2, "Highest pool token budget utilization", "percentunit",
             "The busiest pool's tokens in flight per token budget; over 100% its streams are slower than target.",
             Query(f"max({utilization})", "utilization"), limit=1),
        stat(first_panel_id + 3, "Fastest speed budget burn (1h)", "none",
             "The fastest pool's speed error budget burn over the last hour: 14.4 pages (with the 5m window), "
             "1 spends the month's budget in the month.",
             Query(f"max({SPEED_ERRORS}1h{{{sel}}} / on (cluster, deployment) group_left () {ALLOWED_ERRORS})",
                   "burn"),
             limit=14.4),
    ])


@dataclass(frozen=True)
class Column:
    """One column of the per-pool table: an instant query per pool, its header and unit."""

    header: str
    expr: str
    unit: str


def pool_columns(sel: str) -> list[Column]:
    """The per-pool table's columns, worst first: what on-call compares across pools at a glance."""
    rule = "deployment_model_name:stepbudget_"
    return [
        Column("Token budget used", f"{rule}token_budget_utilization:ratio{{{sel}}}", "percentunit"),
        Column("Tokens in flight", f"{rule}tokens_in_flight:sum{{{sel}}}", "short"),
        Column("Token budget", f"{rule}token_budget_tokens:sum{{{sel}}}", "short"),
        Column("Worst predicted step", f"{rule}predicted_step_seconds:max{{{sel}}}", "s"),
        Column("Worst measured step", f"{rule}measured_step_seconds:max{{{sel}}}", "s"),
        Column("Step budget", f"{rule}step_budget_seconds:min{{{sel}}}", "s"),
        Column("Replicas over budget", f"{rule}targets_over_budget:sum{{{sel}}}", "none"),
        Column("Replicas up", f"{rule}targets_up:sum{{{sel}}}", "none"),
        Column("Speed budget burn (1h)",
               f"{SPEED_ERRORS}1h{{{sel}}} / on (cluster, deployment) group_left () {ALLOWED_ERRORS}", "none"),
    ]


def pool_table(panel_id: int) -> Table:
    """Every pool in one row each (instant queries joined on their labels), sorted by token budget used."""
    columns = pool_columns(POOL_SELECTOR)
    queries = [PromQuery().expr(column.expr).instant().format(PromQueryFormat.TABLE).ref_id(chr(ord("A") + i))
               .datasource(DATASOURCE) for i, column in enumerate(columns)]
    renames = {f"Value #{chr(ord('A') + i)}": column.header for i, column in enumerate(columns)}
    table = (Table().id(panel_id).title("Pools now").unit("short").datasource(DATASOURCE).height(PANEL_HEIGHT).span(24)
             .description("One row per pool (deployment and model, all replicas), the busiest first: token budget "
                          "used over 100% means its streams are slower than target; replicas over budget say "
                          "whether one replica or the pool; the 1h burn pages at 14.4.")
             .targets(queries)
             .with_transformation(DataTransformerConfig(id_val="merge", options={}))
             .with_transformation(DataTransformerConfig(id_val="organize", options={
                 "excludeByName": {"Time": True}, "renameByName": renames}))
             .sort_by([common_builders.TableSortByFieldState().display_name(columns[0].header).desc(True)]))
    for column in columns:
        table = table.override_by_name(column.header, [DynamicConfigValue(id_val="unit", value=column.unit)])
    return table.override_by_name(columns[0].header, [
        DynamicConfigValue(id_val="thresholds", value={"mode": "absolute", "steps": [
            {"color": "green", "value": None}, {"color": "red", "value": 1}]}),
        DynamicConfigValue(id_val="custom.cellOptions", value={"type": "color-background"})])


def overview() -> dash.Dashboard:
    """Per target: is every stream inside its speed budget, and if not, why."""
    board = _base(
        "stepbudget-overview",
        "stepbudget / Overview",
        "Per model server: predicted and measured step time against the speed budget, tokens in "
        "flight against the token budget and KV capacity, and the signals behind each alert.",
    ).with_variable(query_variable(
        "namespace", "Namespace",
        f"label_values(stepbudget_target_up{{{POOL_SELECTOR}}}, namespace)")).with_variable(query_variable(
        "target", "Target",
        f'label_values(stepbudget_target_up{{{POOL_SELECTOR}, namespace=~"$namespace"}}, target)'))
    rows = [
        status_row(50),
        ("Step time against the budget", [
            timeseries(
                1, "Predicted vs measured step time", "s",
                "Predicted step time (from tokens in flight and prefill), measured mean inter-token latency "
                "(exact: ITL sum / count over the poll window), the ITL bucket the median lies in (more than "
                "half the steps above its low edge, at least half at or under its high edge: a histogram says "
                "no more), and the step budget (dashed red). Predicted above budget for 5m pages.",
                [Query(per_target("stepbudget_predicted_step_seconds"), f"{WHO} predicted"),
                 Query(per_target("stepbudget_measured_step_seconds"), f"{WHO} measured mean"),
                 Query(per_target("stepbudget_measured_step_median_lower_seconds"),
                       f"{WHO} median bucket low"),
                 Query(per_target("stepbudget_measured_step_median_upper_seconds"),
                       f"{WHO} median bucket high"),
                 Query(per_target("stepbudget_step_budget_seconds"), f"{WHO} budget")],
                budget_legend=".* budget$", min_value=0),
            timeseries(
                2, "Step time per budget", "percentunit",
                "Predicted and measured step time as a share of the step budget; above 100% every stream "
                "on the target is slower than its speed target.",
                [Query(f"target:stepbudget_predicted_step_per_budget:ratio{{{TARGET_SELECTOR}}}",
                       f"{WHO} predicted"),
                 Query(f"target:stepbudget_measured_step_per_budget:ratio{{{TARGET_SELECTOR}}}",
                       f"{WHO} measured")],
                limit=1, min_value=0),
            timeseries(
                3, "Predicted memory vs compute step", "s",
                "The two terms of the prediction: bytes read per step over bandwidth (memory) and FLOPs of "
                "decode plus prefill tokens over compute. Compute above memory means prompt chunks set the pace.",
                [Query(per_target("stepbudget_predicted_memory_step_seconds"), f"{WHO} memory"),
                 Query(per_target("stepbudget_predicted_compute_step_seconds"), f"{WHO} compute"),
                 Query(per_target("stepbudget_step_budget_seconds"), f"{WHO} budget")],
                budget_legend=".* budget$", min_value=0),
            timeseries(
                4, "Prediction error", "percentunit",
                "(predicted - measured) / measured. Outside ±15% for 15m raises StepBudgetPredictionDrift: "
                "refit with `stepbudget calibrate`.",
                [Query(per_target("stepbudget_prediction_error_ratio"), f"{WHO}")],
                limit=0.15),
        ]),
        ("Tokens in flight", [
            timeseries(
                5, "Tokens in flight vs token budget and KV capacity", "short",
                "Tokens in flight: the context every decode step reads, summed over the running requests (a "
                "prefix several requests share counted once for each); against the most that fits the step "
                "budget (token budget, dashed red). KV used: what the cache holds (a shared block once); "
                "against the KV capacity. Speed runs out at the budget, memory at capacity.",
                [Query(per_target("stepbudget_tokens_in_flight"), f"{WHO} in flight"),
                 Query(per_target("stepbudget_token_budget_tokens"), f"{WHO} token budget"),
                 Query(per_target("stepbudget_kv_cache_used_tokens"), f"{WHO} KV used"),
                 Query(per_target("stepbudget_kv_cache_capacity_tokens"), f"{WHO} KV capacity")],
                budget_legend=".* token budget$", min_value=0),
            timeseries(
                6, "Token budget utilization", "percentunit",
                "Tokens in flight as a share of the token budget. The chart's KEDA example scales replicas "
                "on the pool's value of this ratio.",
                [Query(per_target("stepbudget_token_budget_utilization_ratio"), f"{WHO}")],
                width=QUARTER, limit=1, min_value=0),
            timeseries(
                14, "KV shared by prefix caching", "percentunit",
                "Share of the tokens in flight whose KV another running request holds too: 1 - KV used / "
                "tokens in flight. N requests on one long shared prompt approach 1 - 1/N: the cache holds "
                "far less than each step reads.",
                [Query(per_target("stepbudget_kv_cache_shared_ratio"), f"{WHO}")],
                width=QUARTER, min_value=0).max(1),
        ]),
        ("Per-user speed", [
            timeseries(
                7, "Per-user tokens/s vs target", TOKENS_PER_SECOND,
                "Every decoding request gets one token per step: predicted and measured tokens/s per user, "
                "and the speed at the step budget (target tokens/s divided by headroom, dashed red).",
                [Query(per_target("stepbudget_predicted_user_tokens_per_second"), f"{WHO} predicted"),
                 Query(f"target:stepbudget_measured_user_tokens_per_second:mean{{{TARGET_SELECTOR}}}",
                       f"{WHO} measured"),
                 Query(f"1 / {per_target('stepbudget_step_budget_seconds')}", f"{WHO} speed at budget")],
                budget_legend=".* speed at budget$", min_value=0),
            timeseries(
                8, "Bytes read per step", "bytes",
                "Weights read once per step plus every running request's KV cache.",
                [Query(per_target("stepbudget_step_read_bytes"), f"{WHO}")], min_value=0),
        ]),
        ("Batch, cache and health", [
            timeseries(
                9, "Prefill tokens per step", "short",
                "Prompt tokens processed per engine step. High values with steps over budget while tokens "
                "in flight fit mean prefill interference: lower max_num_batched_tokens.",
                [Query(per_target("stepbudget_prefill_tokens_per_step"), f"{WHO}")], width=THIRD, min_value=0),
            timeseries(
                10, "Preemptions", "reqps",
                "Requests preempted per second (5m rate): the server dropped their KV cache to make room.",
                [Query(f'target:stepbudget_preemptions:rate5m{{{TARGET_SELECTOR}}}', f"{WHO}")],
                width=THIRD, min_value=0),
            timeseries(
                11, "KV cache usage", "percentunit",
                "Share of the KV cache held (memory: a block several requests share counted once). Above 95% "
                "for 10m raises StepBudgetKVCacheNearlyFull.",
                [Query(per_target("stepbudget_kv_cache_usage_ratio"), f"{WHO}")],
                width=THIRD, limit=0.95, min_value=0).max(1),
            target_up_panel(12),
            timeseries(
                13, "Effective bandwidth", "Bps",
                "Memory bandwidth the model uses for this target, and where it came from (configured, "
                "calibrated, or the default share of peak).",
                [Query(per_target("stepbudget_effective_bandwidth_bytes_per_second"), f"{WHO} ({{{{source}}}})")],
                min_value=0),
        ]),
        # A prefill-only server (P/D disaggregation) has no decode step: the panels above stay empty for it.
        ("Prefill servers (P/D disaggregation)", [
            timeseries(
                15, "Prefill tokens/s vs prefill capacity", TOKENS_PER_SECOND,
                "Prompt tokens a prefill-only server computed per second (prefix-cache hits excluded), and what "
                "its compute allows: effective compute / (2 x active parameters), dashed red.",
                [Query(per_target("stepbudget_prefill_tokens_per_second"), f"{WHO} computed"),
                 Query(per_target("stepbudget_prefill_capacity_tokens_per_second"), f"{WHO} capacity")],
                width=THIRD, budget_legend=".* capacity$", min_value=0),
            timeseries(
                16, "Prefill utilization", "percentunit",
                "Prefill tokens/s as a share of the prefill capacity. Above 90% for 10m raises "
                "StepBudgetPrefillOverCapacity.",
                [Query(per_target("stepbudget_prefill_utilization_ratio"), f"{WHO}")],
                width=THIRD, limit=0.9, min_value=0),
            timeseries(
                17, "Time to first token", "s",
                "Mean time to first token over each poll window (the server's TTFT histogram): what a prefill "
                "pool short of compute costs its users.",
                [Query(per_target("stepbudget_measured_time_to_first_token_seconds"), f"{WHO}")],
                width=THIRD, min_value=0),
        ]),
    ]
    return _layout(board, rows, first_row_id=101)


def pools() -> dash.Dashboard:
    """Per deployment and model: the pool's capacity in tokens in flight, from the recording rules."""
    sel = POOL_SELECTOR
    board = _base(
        "stepbudget-pools",
        "stepbudget / Pools",
        "Per deployment and model (all replicas together): tokens in flight against the pool's token "
        "budget and KV capacity, the worst replica's step time, and how many replicas are over budget.",
    )
    rows = [
        status_row(50),
        ("Pools", [pool_table(7)]),
        ("Pool capacity", [
            timeseries(
                1, "Pool tokens in flight vs token budget and KV capacity", "short",
                "Sum over the pool's replicas. Adding a replica adds its token budget. Tokens in flight (what "
                "the steps read) go against the token budget, KV used (what the caches hold, a prefix shared "
                "by several requests once) against the KV capacity.",
                [Query(f"deployment_model_name:stepbudget_tokens_in_flight:sum{{{sel}}}", "{{deployment}} in flight"),
                 Query(f"deployment_model_name:stepbudget_token_budget_tokens:sum{{{sel}}}",
                       "{{deployment}} token budget"),
                 Query(f"deployment_model_name:stepbudget_kv_cache_used_tokens:sum{{{sel}}}", "{{deployment}} KV used"),
                 Query(f"deployment_model_name:stepbudget_kv_cache_capacity_tokens:sum{{{sel}}}",
                       "{{deployment}} KV capacity")],
                budget_legend=".* token budget$", min_value=0),
            timeseries(
                2, "Pool token budget utilization", "percentunit",
                "Pool tokens in flight per pool token budget: the signal the KEDA example scales on.",
                [Query(f"deployment_model_name:stepbudget_token_budget_utilization:ratio{{{sel}}}", "{{deployment}}")],
                limit=1, min_value=0),
            timeseries(
                3, "Pool KV cache usage", "percentunit",
                "Pool KV used per pool KV capacity: memory held, a block shared by prefix caching counted once.",
                [Query(f"deployment_model_name:stepbudget_kv_cache_usage:ratio{{{sel}}}", "{{deployment}}")],
                limit=0.95, min_value=0).max(1),
            timeseries(
                4, "Worst step time vs budget", "s",
                "The slowest replica's predicted and measured step time against the tightest step budget.",
                [Query(f"deployment_model_name:stepbudget_predicted_step_seconds:max{{{sel}}}",
                       "{{deployment}} predicted (max)"),
                 Query(f"deployment_model_name:stepbudget_measured_step_seconds:max{{{sel}}}",
                       "{{deployment}} measured (max)"),
                 Query(f"deployment_model_name:stepbudget_step_budget_seconds:min{{{sel}}}", "{{deployment}} budget")],
                budget_legend=".* budget$", min_value=0),
        ]),
        ("Replicas", [
            timeseries(
                5, "Targets over budget", "none",
                "Replicas whose predicted step is over budget, replicas reachable, and all replicas.",
                [Query(f"deployment_model_name:stepbudget_targets_over_budget:sum{{{sel}}}",
                       "{{deployment}} over budget"),
                 Query(f"deployment_model_name:stepbudget_targets_up:sum{{{sel}}}", "{{deployment}} up"),
                 Query(f"deployment_model_name:stepbudget_targets:count{{{sel}}}", "{{deployment}} total")],
                min_value=0),
            timeseries(
                6, "Pool preemptions", "reqps",
                "Requests preempted per second over the pool (5m rate).",
                [Query(f"deployment_model_name:stepbudget_preemptions:rate5m{{{sel}}}", "{{deployment}}")],
                min_value=0),
        ]),
        ("Speed objective", [
            timeseries(
                8, "Speed error budget burn rate", "none",
                "How fast the pool spends the speed objective's error budget: the share of decode tokens under the "
                "per-user target over the window, per the share the objective allows (speed_objective). 1 spends "
                "the 30-day budget in 30 days. StepBudgetSpeedBudgetBurn pages at 14.4 over 1h (and 5m) or 6 "
                "over 6h (and 30m); StepBudgetSpeedBudgetSlowBurn tickets at 3 over 1d or 1 over 3d.",
                [Query(f"{SPEED_ERRORS}{window}{{{sel}}} / on (cluster, deployment) group_left () {ALLOWED_ERRORS}",
                       f"{{{{deployment}}}} {window}") for window in ("1h", "6h", "1d", "3d")],
                limit=1, min_value=0),
            timeseries(
                9, "Decode tokens under the speed target", "percentunit",
                "The speed objective's SLI: the share of decode tokens streamed in poll windows whose measured "
                "per-user speed (tokens per step / measured step) was under target_tokens_per_second, against "
                "the share the objective allows.",
                [Query(f"{SPEED_ERRORS}1h{{{sel}}}", "{{deployment}} 1h"),
                 Query(f"{SPEED_ERRORS}1d{{{sel}}}", "{{deployment}} 1d"),
                 Query(f"{ALLOWED_ERRORS.removeprefix('(').removesuffix(')')}", "{{deployment}} allowed")],
                budget_legend=".* allowed$", min_value=0),
        ]),
    ]
    return _layout(board, rows, first_row_id=105)


DASHBOARDS: dict[str, Callable[[], dash.Dashboard]] = {
    "stepbudget-overview": overview,
    "stepbudget-pools": pools,
}


def render(builder: dash.Dashboard) -> str:
    """The dashboard as the committed JSON text (sorted keys, stable across runs)."""
    return JSONEncoder(sort_keys=True, indent=2).encode(builder.build()) + "\n"


def rendered() -> dict[Path, str]:
    """Every dashboard file this module produces, by path."""
    return {OUTPUT_DIR / f"{name}.json": render(build()) for name, build in DASHBOARDS.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.build", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed JSON file differs")
    args = parser.parse_args(argv)
    stale = []
    for path, text in rendered().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print(f"dashboards out of date: {', '.join(stale)}; run `make dashboards`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
