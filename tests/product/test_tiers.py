"""The test tiers hold: every marker is declared, `make test-quick` leaves out every tier it should, and
a test that drives an external tool is marked so, by tests/conftest.py or by hand."""

from __future__ import annotations

import ast
import inspect
import re
import sys
import tomllib
from collections.abc import Callable

import pytest
from _pytest.mark.expression import Expression  # pytest's own reading of `-m`; no public name for it

from tests.support import tools
from tests.support.tiers import function_reaches_tool, reaches_tool
from tests.support.tools import REPO, TOOL_MARKERS, require_tool

TIERS = {"e2e", "real_engine", "slow", "tools"}
BUILTIN_MARKERS = {"parametrize", "skipif", "skip", "xfail", "usefixtures", "filterwarnings"}
_THIS = sys.modules[__name__]  # its own tests name require_tool to try the guard


def _declared_in_pyproject() -> set[str]:
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    return {line.split(":")[0].strip() for line in markers}


def _declared() -> set[str]:
    conftest = (REPO / "tests" / "conftest.py").read_text()
    return _declared_in_pyproject() | set(re.findall(r'addinivalue_line\("markers", "(\w+):', conftest))


def _quick_expression() -> str:
    makefile = (REPO / "Makefile").read_text()
    match = re.search(r"^QUICK_MARKERS\s*:?=\s*(.+)$", makefile, re.MULTILINE)
    assert match, "the Makefile has no QUICK_MARKERS"
    assert '-m "$(QUICK_MARKERS)"' in makefile.split("\ntest-quick:", 1)[1].split("\n\n", 1)[0]
    return match.group(1).strip()


def _used_in_tests() -> dict[str, set[str]]:
    used: dict[str, set[str]] = {}
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "mark" and isinstance(node.value.value, ast.Name) \
                    and node.value.value.id == "pytest" and node.attr not in BUILTIN_MARKERS:
                used.setdefault(node.attr, set()).add(str(path.relative_to(REPO)))
    return used


def test_every_tier_marker_is_declared_in_pyproject() -> None:
    assert TIERS <= _declared_in_pyproject()


def test_every_marker_the_tests_use_is_declared() -> None:
    undeclared = {name: where for name, where in _used_in_tests().items() if name not in _declared()}
    assert not undeclared, f"markers used but not declared in pyproject.toml: {undeclared}"


def test_quick_expression_names_only_declared_markers() -> None:
    # `-m` takes any name: a misspelt marker there would quietly select every test it meant to leave out.
    names = set(re.findall(r"\w+", _quick_expression())) - {"not", "and", "or"}
    assert names <= _declared(), names - _declared()


@pytest.mark.parametrize("marker", sorted(TIERS))
def test_quick_leaves_out_every_tier(marker: str) -> None:
    expression = Expression.compile(_quick_expression())
    assert expression.evaluate(lambda name: False), "test-quick must select an unmarked test"
    assert not expression.evaluate(lambda name: name == marker), f"test-quick selects a test marked {marker}"


def test_require_tool_fails_a_test_without_a_tier_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tools, "running_markers", frozenset({"slow"}))
    with pytest.raises(pytest.fail.Exception, match="carries none of the markers"):
        require_tool("sh")
    monkeypatch.setattr(tools, "running_markers", frozenset({"tools"}))
    assert require_tool("sh").endswith("/sh")


def test_this_test_runs_unmarked() -> None:
    assert tools.running_markers is not None and not tools.running_markers & TOOL_MARKERS


def test_source_reading_follows_helpers_imports_and_fixtures() -> None:
    assert reaches_tool("tests.support.chart", "helm")  # require_tool in its body
    assert reaches_tool("tests.support.chart", "render")  # through a helper of its module
    assert reaches_tool("tests.conftest", "alertmanager")  # a fixture, through a helper imported from support
    assert not reaches_tool("tests.support.chart", "of_kind")
    assert not reaches_tool("tests.support.chart", "no_such_function")
    assert not function_reaches_tool(test_this_test_runs_unmarked)
    assert not function_reaches_tool(len)


def test_no_selected_test_names_require_tool_unmarked(request: pytest.FixtureRequest) -> None:
    # Under `make test-quick` the session holds the quick selection alone: none of it may name require_tool.
    unmarked = [item.nodeid for item in request.session.items
                if isinstance(item, pytest.Function) and item.module is not _THIS
                and "require_tool(" in _source(item.function)
                and not any(item.get_closest_marker(marker) for marker in TOOL_MARKERS)]
    assert not unmarked


def _source(function: Callable[..., object]) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""
