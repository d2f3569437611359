"""The shape of `exporter/`: no import cycle, no reach-ins to another module's `_private` names, and
layering: `exporter.capacity` imports nothing from serve, admission or the simulator.

Why: a cycle makes import order matter (a half-initialised module hands out missing names) and
lets wiring happen as a side effect of imports; a reach-in couples two modules through a name
one of them declared free to change. Both are invisible until they break, so these tests walk
the source with `ast` instead of trusting review.

What counts as an import: every `import` and `from ... import` in a module, at module level and
inside functions and classes alike (a function-level import runs too, only later). Relative
imports are resolved against the importing module's package; `from exporter.x import y` is an
edge to `exporter.x.y` when that is a module, else to `exporter.x`. Imports under
`if TYPE_CHECKING:` are left out of the cycle check: they never run, they only feed the type
checker. Importing `exporter.a.b` first runs `exporter/a/__init__.py`, so that package is an
edge too, except from modules inside `exporter.a` itself: while a package's `__init__` imports its
own submodules, Python already holds the package, which is how packages are meant to work.

Knots: counting the `if TYPE_CHECKING:` imports too (a type named from another module is still a
dependency a reader follows), no strongly connected set of modules (a knot: each reaches every
other) holds more than 3 modules. A bigger knot is a set that can only be read, changed and
tested as one.

The config is a leaf: `import exporter.serve.config` loads the config's own modules and the pure
capacity code it resolves a deployment's model and GPU with, nothing of the running daemon.

What counts as a reach-in: `from exporter.x import _y` or `x._y` (with `x` bound to an exporter
module) in any module other than `exporter.x` itself, dunders such as `__version__` excepted.
A private submodule (`exporter.serve.config._lines`) may be imported by the modules of its own
package only: that is how a package keeps a private implementation file.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.tools import REPO

PACKAGE_ROOT = REPO / "exporter"


@dataclass
class ModuleInfo:
    """One module of `exporter/`: its imports (edges) and the private names it takes from others."""

    name: str
    is_package: bool
    imports: set[str] = field(default_factory=set)
    reach_ins: list[str] = field(default_factory=list)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve_relative(importer: str, is_package: bool, module: str | None, level: int) -> str:
    """`from ..x import y` inside `importer` -> the absolute module `x` names."""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, module] if module else base)


def _private_module_allowed(importer: str, is_package: bool, target: str) -> bool:
    """A private submodule may be imported from inside its own package only."""
    parent = target.rpartition(".")[0]
    own_package = importer if is_package else importer.rpartition(".")[0]
    return own_package == parent or own_package.startswith(parent + ".")


class _Walker(ast.NodeVisitor):
    """Collects the imports and reach-ins of one module, skipping TYPE_CHECKING blocks for edges."""

    def __init__(self, info: ModuleInfo, modules: set[str], *, type_checking_too: bool = False) -> None:
        self.info = info
        self.modules = modules
        self.type_checking_too = type_checking_too  # count TYPE_CHECKING imports as edges as well
        self.aliases: dict[str, str] = {}  # local name -> exporter module it is bound to
        self.type_checking_depth = 0

    def _edge(self, target: str) -> None:
        if self.type_checking_depth and not self.type_checking_too:
            return
        own_package = self.info.name if self.info.is_package else self.info.name.rpartition(".")[0]
        parts = target.split(".")
        for depth in range(1, len(parts) + 1):
            module = ".".join(parts[:depth])
            is_own_ancestor = own_package == module or own_package.startswith(module + ".")
            if module in self.modules and module != self.info.name and (module == target or not is_own_ancestor):
                self.info.imports.add(module)

    def _check_private_module(self, target: str, line: int) -> None:
        last = target.rpartition(".")[2]
        if (target in self.modules and is_private(last)
                and not _private_module_allowed(self.info.name, self.info.is_package, target)):
            self.info.reach_ins.append(f"line {line}: imports private module {target}")

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self.type_checking_depth += 1
            for child in node.body:
                self.visit(child)
            self.type_checking_depth -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] != "exporter":
                continue
            self._edge(alias.name)
            self._check_private_module(alias.name, node.lineno)
            if alias.asname:
                self.aliases[alias.asname] = alias.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        source = (_resolve_relative(self.info.name, self.info.is_package, node.module, node.level)
                  if node.level else node.module or "")
        if source.split(".")[0] != "exporter":
            return
        self._check_private_module(source, node.lineno)
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            if submodule in self.modules:
                self._edge(submodule)
                self._check_private_module(submodule, node.lineno)
                self.aliases[alias.asname or alias.name] = submodule
                continue
            self._edge(source)
            if is_private(alias.name) and source != self.info.name:
                self.info.reach_ins.append(f"line {node.lineno}: from {source} import {alias.name}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        owner = _dotted(node.value)
        target = self.aliases.get(owner) if owner else None
        if target is None and owner and owner.split(".")[0] == "exporter" and owner in self.modules:
            target = owner
        if target is not None and target != self.info.name and is_private(node.attr):
            if f"{target}.{node.attr}" not in self.modules:
                self.info.reach_ins.append(f"line {node.lineno}: {owner}.{node.attr} ({target})")
        self.generic_visit(node)


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def analyse() -> dict[str, ModuleInfo]:
    modules = all_modules()
    names = set(modules)
    infos = {}
    for name, path in modules.items():
        info = ModuleInfo(name, path.name == "__init__.py")
        _Walker(info, names).visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        infos[name] = info
    return infos


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of nodes (first == last), or None; iterative DFS, three colours."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return [*path[path.index(child):], child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph.get(child, ()))))
    return None


def test_the_import_graph_of_exporter_has_no_cycle() -> None:
    graph = {name: info.imports for name, info in analyse().items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_module_reaches_into_another_modules_private_names() -> None:
    found = [f"{name}: {problem}" for name, info in analyse().items() for problem in info.reach_ins]
    assert not found, "reach-ins to private names:\n" + "\n".join(found)


# --- the walker itself, on made-up sources ---------------------------------------------------------


def _walk(source: str, name: str = "exporter.a", *, modules: set[str] | None = None) -> ModuleInfo:
    info = ModuleInfo(name, False)
    known = modules or {"exporter", "exporter.a", "exporter.b", "exporter.pkg", "exporter.pkg.c", "exporter.pkg._d"}
    _Walker(info, known).visit(ast.parse(source))
    return info


def test_the_walker_sees_function_level_relative_and_submodule_imports() -> None:
    info = _walk("def f():\n    from exporter import b\nfrom .pkg import c\nimport exporter.pkg\n")
    assert info.imports == {"exporter.b", "exporter.pkg.c", "exporter.pkg"}


def test_importing_a_submodule_runs_its_package_first() -> None:
    assert _walk("from exporter.pkg.c import thing\n").imports == {"exporter.pkg", "exporter.pkg.c"}
    assert _walk("from exporter.pkg._d import thing\n", "exporter.pkg.c").imports == {"exporter.pkg._d"}


def test_the_walker_skips_type_checking_imports_for_cycles() -> None:
    assert _walk("if TYPE_CHECKING:\n    from exporter.b import Thing\n").imports == set()


def test_the_walker_finds_reach_ins() -> None:
    info = _walk("from exporter import b\nfrom exporter.pkg.c import _hidden\nb._secret\nb.__doc__\n"
                 "import exporter.pkg._d\n")
    assert len(info.reach_ins) == 3, info.reach_ins
    assert _walk("from exporter.pkg import _d\n", "exporter.pkg.c").reach_ins == []


def test_find_cycle_prints_the_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# --- layering --------------------------------------------------------------------------------------

# Offline capacity planning is the base the daemon (serve), admission and the simulator build on: it
# may never depend on them, or `stepbudget plan` would load the daemon and a change to the pipeline
# could break the planner. TYPE_CHECKING imports count here too: a type from above is a dependency.
LAYERS_BELOW = {
    "exporter.capacity": ("exporter.serve", "exporter.admission", "exporter.simulator"),
}
# The daemon's data flows one way (docs/architecture.md, "The daemon's data flow"): poller -> engine
# adapters -> window -> derivation -> reading's consumers. A stage never imports a later one, so the
# fetch is changed and tested without the poll loop, and an adapter without the window it feeds.
FLOW_BELOW = {
    "exporter.serve.fetch": ("exporter.serve.poller",),
    "exporter.serve.engines": ("exporter.serve.poller", "exporter.serve.fetch", "exporter.serve.window",
                               "exporter.serve.derivation", "exporter.serve.reading"),
    "exporter.serve.window": ("exporter.serve.poller", "exporter.serve.derivation", "exporter.serve.reading"),
    "exporter.serve.reading": ("exporter.serve.poller", "exporter.serve.derivation"),
    "exporter.serve.derivation": ("exporter.serve.poller",),
}


def _all_imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """Every exporter module `name` imports, TYPE_CHECKING blocks included."""
    info = ModuleInfo(name, path.name == "__init__.py")
    _Walker(info, modules, type_checking_too=True).visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return info.imports


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layering_violations(modules: dict[str, Path],
                        layers: dict[str, tuple[str, ...]] = LAYERS_BELOW) -> list[str]:
    names = set(modules)
    return [f"{name} imports {target}"
            for name, path in modules.items()
            for lower, forbidden in layers.items() if _in(name, lower)
            for target in sorted(_all_imports(name, path, names))
            if any(_in(target, package) for package in forbidden)]


def test_capacity_imports_nothing_from_serve_admission_or_the_simulator() -> None:
    found = layering_violations(all_modules())
    assert not found, "layering (docs/architecture.md):\n" + "\n".join(found)


def test_the_daemon_pipeline_imports_only_its_earlier_stages() -> None:
    found = layering_violations(all_modules(), FLOW_BELOW)
    assert not found, "data flow (docs/architecture.md):\n" + "\n".join(found)


def test_the_layering_check_finds_an_upward_import(tmp_path: Path) -> None:
    path = tmp_path / "planner.py"
    path.write_text("from typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    from exporter.serve.config import Config\n"
                    "def f():\n    from exporter.simulator import engine\n")
    found = layering_violations({"exporter.capacity.planner": path, "exporter.serve.config": path,
                                 "exporter.simulator": path, "exporter.simulator.engine": path})
    assert found == ["exporter.capacity.planner imports exporter.serve.config",
                     "exporter.capacity.planner imports exporter.simulator",
                     "exporter.capacity.planner imports exporter.simulator.engine"], found


# --- knots: strongly connected sets, TYPE_CHECKING imports counted ----------------------------------

MAX_KNOT_MODULES = 3


def strongly_connected(graph: Mapping[str, Set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph`, each sorted; an edge to a node that is not a
    key of `graph` is ignored. Iterative, so a long import chain cannot hit the recursion limit."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = lowlink[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    lowlink[parent] = min(lowlink[parent], lowlink[node])
                if lowlink[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
            elif child not in graph:
                continue
            elif child not in index:
                index[child] = lowlink[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                lowlink[node] = min(lowlink[node], index[child])
    return components


def test_no_import_knot_holds_more_than_three_modules_type_checking_imports_counted() -> None:
    modules = all_modules()
    names = set(modules)
    graph = {name: _all_imports(name, path, names) for name, path in modules.items()}
    knots = sorted((knot for knot in strongly_connected(graph) if len(knot) > 1), key=len, reverse=True)
    largest = knots[0] if knots else []
    assert len(largest) <= MAX_KNOT_MODULES, (
        f"an import knot of {len(largest)} modules (TYPE_CHECKING imports counted): " + ", ".join(largest))


def test_strongly_connected_finds_each_knot() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a", "outside"}}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["d", "e"], ["f"]]
    assert strongly_connected({"a": set()}) == [["a"]]


# --- the config is a leaf ------------------------------------------------------------------------------

# Every exporter module `import exporter.serve.config` may load, with why. The config resolves each
# deployment's model and GPU at load time (so a bad one is a config error with its line), so the pure
# capacity math, the presets and the model-file readers are here; the poller, the fit, reading,
# discovery, the collector, the daemon and the engines are not.
CONFIG_MODULES = {
    "exporter": "the package: importing any submodule runs it first",
    "exporter.errors": "InputError, what every validator raises",
    "exporter.redaction": "a URL's credentials are redacted in the config's error messages",
    "exporter.suggest": "an unknown key or preset is answered with the closest names",
    "exporter.units": "sizes and durations (`80GB`, `15s`) read into base units",
    "exporter.config_validators": "the config's vocabulary: Key, Section, Where and the value validators",
    "exporter.capacity": "the capacity package: runs before its modules",
    "exporter.capacity.model": "the serving setup a deployment resolves to (ServingSetup)",
    "exporter.capacity.architecture": "the model's architecture; its tensor-parallel check runs at load",
    "exporter.capacity.kv_cache": "the KV cache's size and block layout, which the serving setup carries",
    "exporter.capacity.fit": "the calibration terms a deployment's `calibration` file is checked with",
    "exporter.capacity.presets": "the model and GPU presets a deployment names",
    "exporter.capacity.deployment": "resolves a deployment's model and GPU into its ServingSetup at load",
    "exporter.capacity.model_files": "finds a model's config.json named by its Hugging Face id",
    "exporter.serve": "the serve package: runs before its modules",
    "exporter.serve.alert_rules": "the packaged alert rules, which `alerting.rules` is checked against",
    "exporter.serve.config": "the parser and `check-config`",
    "exporter.serve.config_keys": "the key tables",
    "exporter.serve.config_model": "the dataclasses a config becomes",
    "exporter.serve.config_calibration": "a deployment's calibration file",
    "exporter.serve.online_settings": "`online_calibration`'s settings, config data",
    "exporter.serve.sharding": "declares the `shard` section the config lists",
    "exporter.admission": "the admission package: runs before its modules",
    "exporter.admission.sections": "declares the `admission` and `pools` sections the config lists",
    "exporter.admission.api": "the `admission` section's token file is read as the API reads it",
    "exporter.admission.book": "the `pools` section is built into the book's Pools",
}
NEVER_WITH_THE_CONFIG = ("exporter.serve.poller", "exporter.serve.online_calibration", "exporter.serve.online_fit",
                         "exporter.serve.reading", "exporter.serve.discovery", "exporter.serve.collector",
                         "exporter.serve.daemon", "exporter.serve.engines")


def test_importing_the_config_loads_only_config_modules() -> None:
    """In a fresh interpreter, so what other tests imported cannot hide what the config loads."""
    result = subprocess.run(
        [sys.executable, "-c", "import exporter.serve.config; import sys; "
                               "print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] == 'exporter')))"],
        capture_output=True, text=True, timeout=60, cwd=PACKAGE_ROOT.parent, check=True)
    loaded = set(result.stdout.split())
    assert "exporter.serve.config" in loaded
    assert not loaded & set(NEVER_WITH_THE_CONFIG), sorted(loaded & set(NEVER_WITH_THE_CONFIG))
    assert loaded <= CONFIG_MODULES.keys(), (
        f"the config loads modules off its list: {sorted(loaded - CONFIG_MODULES.keys())}")
    # A module the config no longer loads leaves the list, so the list says what the config needs.
    assert CONFIG_MODULES.keys() <= loaded, f"listed but not loaded: {sorted(CONFIG_MODULES.keys() - loaded)}"
