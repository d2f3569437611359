"""Which tests drive an external tool: read from the source, so that conftest can mark them `tools`.

A function drives a tool when its body names `require_tool`, or a function that does: one of its own
module, one it imports from another module under tests/ (`from tests.support.chart import render`,
`import tests.support.chart as chart` then `chart.render`), or a method of its own class (`self.x`).
A test drives one when its function or any fixture it uses does. What the source does not show (a name
built at run time) is caught when the test runs: `require_tool` fails a test that carries no tier
marker (tests/conftest.py).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from functools import cache
from pathlib import Path

from tests.support.tools import REPO

TOOL_FUNCTION = "require_tool"


def _module_path(module: str) -> Path | None:
    path = REPO.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _absolute(module: str | None, level: int, importer: str) -> str:
    if not level:
        return module or ""
    package = importer.split(".")[: -level]
    return ".".join([*package, *([module] if module else [])])


class _Module:
    """One module's functions (by qualified name), the names each refers to, and what its imports bind."""

    def __init__(self, name: str, tree: ast.Module) -> None:
        self.name = name
        self.refs: dict[str, set[str]] = {}
        self.imported: dict[str, tuple[str, str]] = {}  # local name -> (module, name)
        self.modules: dict[str, str] = {}  # local name -> module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(node.module, node.level, name)
                for alias in node.names:
                    local = alias.asname or alias.name
                    if _module_path(f"{source}.{alias.name}"):
                        self.modules[local] = f"{source}.{alias.name}"
                    else:
                        self.imported[local] = (source, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.modules[alias.asname] = alias.name
                    else:
                        self.modules.setdefault(alias.name.split(".")[0], alias.name.split(".")[0])
                        self.modules[alias.name] = alias.name
        for node in tree.body:
            self._add(node, "")

    def _add(self, node: ast.stmt, prefix: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            self.refs[prefix + node.name] = self._names(node, prefix)
        elif isinstance(node, ast.ClassDef):
            for child in node.body:
                self._add(child, f"{prefix}{node.name}.")

    def _names(self, function: ast.AST, prefix: str) -> set[str]:
        names: set[str] = set()
        for node in ast.walk(function):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                dotted = _dotted(node)
                if dotted and dotted[0] in ("self", "cls") and prefix and len(dotted) == 2:
                    names.add(prefix + dotted[1])
                elif dotted:
                    names.add(".".join(dotted))
        return names


def _dotted(node: ast.expr) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


@cache
def _parsed(module: str) -> _Module | None:
    path = _module_path(module)
    if path is None or not module.startswith("tests"):
        return None
    return _Module(module, ast.parse(path.read_text(), str(path)))


def reaches_tool(module: str, qualname: str) -> bool:
    """Whether `module.qualname` (a function under tests/) calls `require_tool`, directly or through others."""
    return _reaches(module, qualname, frozenset())


def _reaches(module: str, qualname: str, seen: frozenset[tuple[str, str]]) -> bool:
    parsed = _parsed(module)
    if parsed is None or (module, qualname) in seen or qualname not in parsed.refs:
        return False
    seen = seen | {(module, qualname)}
    for name in parsed.refs[qualname]:
        if name == TOOL_FUNCTION or parsed.imported.get(name) == ("tests.support.tools", TOOL_FUNCTION):
            return True
        if name in parsed.refs and _reaches(module, name, seen):
            return True
        if name in parsed.imported and _reaches(*parsed.imported[name], seen):
            return True
        head, _, attribute = name.rpartition(".")
        if head in parsed.modules and _reaches(parsed.modules[head], attribute, seen):
            return True
    return False


def function_reaches_tool(function: Callable[..., object]) -> bool:
    """`reaches_tool` for a function object (a test's, or a fixture's); False for one not under tests/."""
    function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    if code is None:
        return False
    path = Path(code.co_filename).resolve()
    if not path.is_relative_to(REPO / "tests"):
        return False
    # Named by its path from the repository, as pytest imports it (tests/ and its folders are packages).
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return reaches_tool(module, function.__qualname__)
