"""docs/operations.md's "Exported metrics" names every family the collector exports, and nothing else.

Why: README sends readers there for every exported metric, and families were added to
exporter/serve/collector.py without a line there. The collector's families are read off its source
(every string that is exactly a `stepbudget_...` name: the per-target table, the `*_METRIC`
constants and the families built inline); a scrape of a live registry checks that reading.
Per-target families each have a table row; per-deployment ones may be named in the prose under it.
"""

from __future__ import annotations

import ast
import re

from exporter.serve.collector import PER_TARGET, make_registry
from exporter.serve.config import config_from_mapping
from tests.support.tools import REPO

ROOT = REPO
COLLECTOR = ROOT / "exporter" / "serve" / "collector.py"
NAME = re.compile(r"stepbudget_[a-z_]+")


def collector_families() -> set[str]:
    """Every family name in the collector's source; an info family once, as its `_info` sample."""
    names = {node.value for node in ast.walk(ast.parse(COLLECTOR.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value)}
    return {name for name in names if f"{name}_info" not in names}


def exported_section() -> str:
    text = (ROOT / "docs" / "operations.md").read_text()
    return text.split("\n## Exported metrics\n", 1)[1].split("\n## ", 1)[0]


def table_names() -> set[str]:
    """The names in the section's first table's rows (the metric column)."""
    rows = [line.split(" | ")[0] for line in exported_section().splitlines() if line.startswith("| `stepbudget_")]
    return {name for row in rows for name in NAME.findall(row)}


def documented(name: str, mentioned: set[str]) -> bool:
    return name in mentioned or f"{name}_info" in mentioned or name.removesuffix("_info") in mentioned


def test_every_family_is_in_the_section() -> None:
    mentioned = set(NAME.findall(exported_section()))
    assert sorted(name for name in collector_families() if not documented(name, mentioned)) == []


def test_every_per_target_family_has_a_table_row() -> None:
    rows = table_names()
    assert sorted(spec.name for spec in PER_TARGET if spec.name not in rows) == []


def test_every_table_row_names_a_real_family() -> None:
    families = collector_families() | {name.removesuffix("_info") for name in collector_families()}
    assert sorted(name for name in table_names() if not documented(name, families)) == []


def test_the_source_reading_covers_what_a_scrape_exports() -> None:
    """The families a registry with one deployment exports are among those read off the source."""
    config = config_from_mapping({"deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                                                   "targets": {"static": ["http://10.0.0.5:8000/metrics"]}}]})
    registry = make_registry(list, config.deployments, deployment_targets=lambda: [("chat", 1)])
    samples = {sample.name for family in registry.collect() for sample in family.samples}
    assert samples, "the registry exported nothing"
    families = collector_families()
    assert sorted(name for name in samples if not documented(name, families)) == []
