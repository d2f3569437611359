"""Server kinds have one source, the adapter registry (`exporter.serve.engines.ADAPTERS`).

Why: the config key `kind`, the `--kind` flag, the chart's values schema and `kind: auto` once each
held their own copy of ("auto", "vllm", "sglang", "tgi"), so a new adapter had to be added in four
places, and a forgotten one refused a kind the page reader understood. These tests register a fake
fourth adapter and show every one of them accepts it, and fail if a copy is hard-coded again.
"""

from __future__ import annotations

import argparse
import ast
import json

import pytest

from exporter.serve import config_schema, daemon, engines
from exporter.serve.config import ConfigError, config_from_mapping, server_kind
from exporter.serve.engines import ADAPTERS, read_page, server_kinds
from exporter.serve.engines.families import Adapter, EngineLabels, FamilySpec
from tests.support.tools import REPO

ROOT = REPO
REGISTRY = ROOT / "exporter" / "serve" / "engines" / "__init__.py"

FAKE = Adapter(
    kind="fakeserve",
    specs=(
        FamilySpec("requests_running", ("fakeserve_running",), "gauge"),
        FamilySpec("requests_waiting", ("fakeserve_waiting",), "gauge"),
        FamilySpec("kv_cache_capacity_tokens", ("fakeserve_kv_capacity",), "gauge"),
    ),
    roles=EngineLabels(model=("model",), engine=None),
)
FAKE_PAGE = ('fakeserve_running{model="m"} 3\n'
             'fakeserve_waiting{model="m"} 1\n'
             'fakeserve_kv_capacity{model="m"} 4096\n')


@pytest.fixture
def fake_registered(monkeypatch: pytest.MonkeyPatch) -> Adapter:
    """The registry with a fourth adapter, as a new engine module would add it."""
    monkeypatch.setitem(ADAPTERS, FAKE.kind, FAKE)
    return FAKE


def deployment_with_kind(kind: str) -> dict[str, object]:
    return {"deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "kind": kind,
                             "targets": {"static": ["http://10.0.0.5:8000/metrics"]}}]}


def kind_flag_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    daemon.build_parser(parser)
    return parser


def test_the_kinds_are_auto_and_the_registry() -> None:
    assert server_kinds() == ("auto", *ADAPTERS)
    assert set(ADAPTERS) == {adapter.kind for adapter in ADAPTERS.values()}


def test_a_registered_adapter_is_accepted_by_the_config(fake_registered: Adapter) -> None:
    config = config_from_mapping(deployment_with_kind(fake_registered.kind))
    assert config.deployments[0].kind == fake_registered.kind


def test_an_unregistered_kind_is_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match="expected one of auto, "):
        config_from_mapping(deployment_with_kind("fakeserve"))


def test_a_registered_adapter_is_accepted_by_the_kind_flag(fake_registered: Adapter) -> None:
    assert kind_flag_parser().parse_args(["--kind", fake_registered.kind]).kind == fake_registered.kind


def test_an_unregistered_kind_is_refused_by_the_kind_flag() -> None:
    with pytest.raises(argparse.ArgumentError):
        kind_flag_parser().parse_args(["--kind", "fakeserve"])


def test_the_schema_enum_follows_the_registry(fake_registered: Adapter) -> None:
    assert config_schema.parser_schema(server_kind) == {"enum": [*server_kinds()]}
    assert fake_registered.kind in config_schema.parser_schema(server_kind)["enum"]


def test_auto_detection_picks_a_registered_adapter(fake_registered: Adapter) -> None:
    reading = read_page(FAKE_PAGE)
    assert reading.kind == fake_registered.kind
    [snapshot] = reading.snapshots
    assert (snapshot.model_name, snapshot.requests_running, snapshot.kv_cache_capacity_tokens) == ("m", 3, 4096)
    assert read_page(FAKE_PAGE, fake_registered.kind).kind == fake_registered.kind


def test_without_the_adapter_its_page_is_no_engines() -> None:
    with pytest.raises(engines.PageError, match="no known engine metrics"):
        read_page(FAKE_PAGE)


def test_the_committed_chart_schema_lists_the_registry() -> None:
    """The chart's values.schema.json is generated; its `kind` enums are the registry's, plus null."""
    schema = (ROOT / "helm" / "stepbudget" / "values.schema.json").read_text()
    enums = [node["enum"] for node in _walk(json.loads(schema)) if "kind" in node.get("properties", {})
             for node in [node["properties"]["kind"]] if "enum" in node]
    assert enums and all(enum == [*server_kinds(), None] for enum in enums), enums


def test_operations_doc_names_every_kind() -> None:
    [row] = [line for line in (ROOT / "docs" / "operations.md").read_text().splitlines()
             if line.startswith("| `kind` |")]
    assert all(f"`{kind}`" in row for kind in server_kinds()), row


def test_no_copy_of_the_kind_names_outside_the_registry() -> None:
    """A tuple, list or set literal naming two or more registered kinds is a copy of the registry."""
    kinds = set(ADAPTERS)
    copies = []
    for path in sorted((ROOT / "exporter").rglob("*.py")):
        if path == REGISTRY:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                named = {elt.value for elt in node.elts if isinstance(elt, ast.Constant)} & kinds
                if len(named) >= 2:
                    copies.append(f"{path.relative_to(ROOT)}:{node.lineno}: {sorted(named)}")
    assert copies == []


def _walk(node: object) -> list[dict[str, object]]:
    """Every JSON object under `node`, `node` included."""
    if isinstance(node, dict):
        return [node, *(found for value in node.values() for found in _walk(value))]
    if isinstance(node, list):
        return [found for value in node for found in _walk(value)]
    return []
