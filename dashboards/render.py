"""Draw a dashboard's panels from a real Prometheus, laid out as Grafana lays them out, into one PNG.

Not Grafana: a faithful stand-in for a reader of docs/ who has none. Each panel's own queries (the
committed JSON's, the dashboard variables and interval macros substituted as Grafana would) are asked
of the Prometheus the run filled: a time series panel draws every series over the run with its legend
format, a stat panel prints its last value, a state timeline draws its values as steps, a table
prints its instant rows; units follow the panel's (`s` in ms, `percentunit` in %). Rows are headings.

`tests/product/test_e2e_stack.py` renders both dashboards from its stack when STEPBUDGET_RENDER_DASHBOARDS
names a folder (`make dashboard-images` writes docs/dashboards/).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

GRID_COLUMNS = 24
ROW_UNITS = 30  # Grafana's grid row is 30 px
TIMEOUT_SECONDS = 10.0
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")

Substitute = Callable[[str], str]


@dataclass(frozen=True)
class Series:
    name: str
    times: list[float]
    values: list[float]


def _get(url: str, path: str, params: Mapping[str, str]) -> list[dict[str, Any]]:
    response = requests.get(f"{url}{path}", params=params, timeout=TIMEOUT_SECONDS)
    payload = response.json()
    if payload.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {params.get('query')!r}: {payload}")
    result: list[dict[str, Any]] = payload["data"]["result"]
    return result


def legend(fmt: str, labels: Mapping[str, str]) -> str:
    """Grafana's legend format: {{label}} replaced by the series' label (empty where it has none)."""
    text = _LEGEND_LABEL.sub(lambda match: labels.get(match.group(1), ""), fmt or "").strip()
    return text or ", ".join(f"{key}={value}" for key, value in sorted(labels.items()) if key != "__name__")


def range_series(url: str, expr: str, fmt: str, start: float, end: float, step: float) -> list[Series]:
    result = _get(url, "/api/v1/query_range",
                  {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"})
    return [Series(legend(fmt, item["metric"]), [float(t) - start for t, _ in item["values"]],
                   [float(v) for _, v in item["values"]]) for item in result]


def instant_rows(url: str, expr: str, at: float) -> list[tuple[dict[str, str], float]]:
    return [(dict(item["metric"]), float(item["value"][1]))
            for item in _get(url, "/api/v1/query", {"query": expr, "time": f"{at:.3f}"})]


def scaled(unit: str) -> tuple[float, str]:
    """A panel unit as a factor and suffix to print with."""
    return {"s": (1e3, " ms"), "percentunit": (100.0, "%"), "Bps": (1e-9, " GB/s"), "bytes": (1e-9, " GB")}.get(
        unit, (1.0, "" if unit in ("short", "none", "") else f" {unit.removeprefix('suffix: ')}"))


def _number(value: float, unit: str) -> str:
    factor, suffix = scaled(unit)
    return "n/a" if math.isnan(value) else f"{value * factor:.4g}{suffix}"


def _panels(dashboard: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from _panels(panel)


def _override_unit(panel: Mapping[str, Any], name: str) -> str | None:
    for override in panel.get("fieldConfig", {}).get("overrides", []):
        if override.get("matcher", {}).get("options") == name:
            for prop in override.get("properties", []):
                if prop.get("id") == "unit":
                    return str(prop["value"])
    return None


@dataclass(frozen=True)
class Drawn:
    path: Path
    failed: list[str]  # "panel title: why" for each panel whose query Prometheus refused (drawn with the reason)


def render_dashboard(dashboard: Mapping[str, Any], url: str, substitute: Substitute, start: float, end: float,
                     path: Path, step: float = 5.0) -> Drawn:
    """The dashboard drawn to `path` (PNG): every panel with the data Prometheus holds between start and end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in _panels(dashboard) if p.get("gridPos")]
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    scale = 0.42  # inches per grid row unit
    figure = plt.figure(figsize=(GRID_COLUMNS * 0.95, bottom * scale))
    failed: list[str] = []
    figure.suptitle(f"{dashboard.get('title', '')}: a run of the e2e stack, {int(end - start)} s", fontsize=16)
    for panel in panels:
        grid = panel["gridPos"]
        left, width = grid["x"] / GRID_COLUMNS, grid["w"] / GRID_COLUMNS
        top, height = 1 - grid["y"] / bottom, grid["h"] / bottom
        box = [left + 0.01, top - height + 0.025, width - 0.02, height - 0.05]
        kind = panel.get("type")
        if kind == "row":
            figure.text(left + 0.005, top - 0.01, panel.get("title", ""), fontsize=14, weight="bold", va="top")
            continue
        axes = figure.add_axes(box)
        axes.set_title(panel.get("title", ""), fontsize=10, loc="left")
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        queries = [(substitute(t["expr"]), t.get("legendFormat", ""))
                   for t in panel.get("targets", []) if t.get("expr")]
        try:
            {"timeseries": _timeseries, "statetimeline": _timeseries, "stat": _stat, "table": _table}.get(
                str(kind), _stat)(axes, panel, queries, url, start, end, step, unit)
        except (RuntimeError, requests.RequestException, ValueError) as error:
            failed.append(f"{panel.get('title', '')}: {error}")
            axes.text(0.5, 0.5, f"query failed: {error}"[:120], ha="center", va="center", fontsize=8, wrap=True)
            axes.set_axis_off()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=60)
    plt.close(figure)
    return Drawn(path, failed)


def _timeseries(axes: Any, panel: Mapping[str, Any], queries: Sequence[tuple[str, str]], url: str, start: float,
                end: float, step: float, unit: str) -> None:
    factor, suffix = scaled(unit)
    drawn = 0
    for expr, fmt in queries:
        for series in range_series(url, expr, fmt, start, end, step):
            dashed = re.search(r"budget|allowed|capacity", series.name) is not None
            axes.plot(series.times, [v * factor for v in series.values], label=series.name[:60],
                      linestyle="--" if dashed else "-", drawstyle="steps-post" if panel.get("type") ==
                      "statetimeline" else "default")
            drawn += 1
    axes.set_xlabel("seconds into the run", fontsize=8)
    axes.set_ylabel(suffix.strip() or unit, fontsize=8)
    axes.tick_params(labelsize=8)
    if drawn:
        axes.legend(fontsize=7, loc="upper left")
    else:
        axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)


def _stat(axes: Any, panel: Mapping[str, Any], queries: Sequence[tuple[str, str]], url: str, start: float,
          end: float, step: float, unit: str) -> None:
    values = [value for expr, _ in queries for _, value in instant_rows(url, expr, end)]
    text = ", ".join(_number(value, unit) for value in values) or "no data"
    axes.text(0.5, 0.45, text, ha="center", va="center", fontsize=22, transform=axes.transAxes)
    axes.set_axis_off()


def _table(axes: Any, panel: Mapping[str, Any], queries: Sequence[tuple[str, str]], url: str, start: float,
           end: float, step: float, unit: str) -> None:
    """Instant queries joined on their labels, one row per label set, columns named as the panel renames them."""
    renames: dict[str, str] = {}
    for transformation in panel.get("transformations", []):
        renames.update(transformation.get("options", {}).get("renameByName", {}))
    headers = [renames.get(f"Value #{t.get('refId')}", f"Value #{t.get('refId')}") for t in panel.get("targets", [])
               if t.get("expr")]
    rows: dict[tuple[tuple[str, str], ...], dict[str, float]] = {}
    for header, (expr, _) in zip(headers, queries, strict=True):
        for labels, value in instant_rows(url, expr, end):
            key = tuple(sorted((k, v) for k, v in labels.items() if k in ("cluster", "deployment", "model_name")))
            rows.setdefault(key, {})[header] = value
    cells = [[" ".join(v for _, v in key)] + [_number(row.get(h, math.nan), _override_unit(panel, h) or "short")
                                               for h in headers] for key, row in rows.items()]
    axes.set_axis_off()
    if not cells:
        axes.text(0.5, 0.5, "no data", ha="center", va="center")
        return
    table = axes.table(cellText=cells, colLabels=["pool", *headers], loc="center", cellLoc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    table.scale(1, 1.6)
