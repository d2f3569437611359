"""House rules the linters cannot check: every module says its one job, every suppression says why,
and tests share code only through tests/support/.

- Every module under `exporter/` opens with a docstring (its first line names the module's one job;
  docs/architecture.md lists them).
- Every `# type: ignore` and `# noqa` in `exporter/` and `tests/` names the codes it silences and,
  on the same line, the reason: `# type: ignore[override]  # urllib3's signature is untyped`,
  `# noqa: BLE001 - a target's failure must not stop the loop`. A bare one hides what it silences
  and why, so nobody can tell when it may go.
- The temporary lint exclusions in pyproject.toml (files being edited on other branches) name the
  same files for ruff and for mypy, so removing one list without the other cannot go unnoticed.
  Files in them are skipped by the suppression check too, until they land.
- No module under `tests/` imports a test module (`tests.test_*`, `tests.<folder>.test_*`, a relative
  `.test_*`, or `test_*`, which a sys.path entry could let through), at module level or inside a
  function: shared test code lives in `tests/support/`. A test module's helpers are its own to
  change; once another module imports them, renaming one breaks a file nobody looked at.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import tomllib
from pathlib import Path

from tests.support.tools import REPO

ROOT = REPO
PACKAGE = ROOT / "exporter"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))

# A type-ignore: its codes in brackets, then a second comment with the reason.
TYPE_IGNORE = re.compile(r"#\s*type:\s*ignore\b(?P<codes>\[[^\]]+\])?(?P<rest>.*)$")
# A no-QA: its codes after a colon, then ` - reason`, ` (reason)` or a second comment.
NOQA = re.compile(r"#\s*noqa\b(?P<codes>:\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)?(?P<rest>.*)$", re.IGNORECASE)
TYPE_IGNORE_REASON = re.compile(r"^\s*#\s*\S")
NOQA_REASON = re.compile(r"^\s*(?:-|\(|#)\s*\S")


def _ruff_excluded() -> list[str]:
    return list(PYPROJECT["tool"]["ruff"].get("extend-exclude", []))


def _temporarily_excluded_files() -> set[Path]:
    """The files the TEMPORARY ruff exclusions name (those under exporter/, tests/ and benchmarks/)."""
    files: set[Path] = set()
    for pattern in _ruff_excluded():
        if pattern.startswith(("exporter/", "tests/", "benchmarks/")) and pattern.endswith(".py"):
            files |= set(ROOT.glob(pattern))
    return files


def _mypy_ignored_modules() -> set[Path]:
    """The exporter files of the mypy overrides that set ignore_errors (the TEMPORARY block)."""
    files: set[Path] = set()
    for override in PYPROJECT["tool"]["mypy"].get("overrides", []):
        if not override.get("ignore_errors"):
            continue
        modules = override["module"]
        for module in [modules] if isinstance(modules, str) else modules:
            parts = module.split(".")
            if parts[-1] == "*":
                files |= set((ROOT.joinpath(*parts[:-1])).glob("*.py"))
            elif (package := ROOT.joinpath(*parts) / "__init__.py").exists():
                files.add(package)
            else:
                files.add(ROOT.joinpath(*parts).with_suffix(".py"))
    return files


def _comments(path: Path) -> list[tuple[int, str]]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    return [(token.start[0], token.string) for token in tokens if token.type == tokenize.COMMENT]


def is_bare(comment: str) -> bool:
    """A `type: ignore` or `noqa` comment that lacks its codes or its reason."""
    for pattern, reason in ((TYPE_IGNORE, TYPE_IGNORE_REASON), (NOQA, NOQA_REASON)):
        match = pattern.search(comment)
        if match and not (match["codes"] and reason.match(match["rest"])):
            return True
    return False


def bare_suppressions(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: {comment}" for line, comment in _comments(path) if is_bare(comment)]


def is_test_module(name: str) -> bool:
    """`tests.test_x`, `tests.serve.test_x` (any folder under tests/), `test_x`, or a relative `.test_x` or
    `..serve.test_x`: a module pytest collects tests from."""
    relative = name.startswith(".")
    parts = name.lstrip(".").split(".")
    if parts[0] == "tests" or relative:
        return any(part.startswith("test_") for part in parts)
    return parts[0].startswith("test_")


def imports_of_test_modules(path: Path) -> list[tuple[int, str]]:
    """Every import of a test module in `path`, at any depth (inside functions too): (line, the import)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            # `from tests import test_x` imports the module test_x: the imported names count as modules too.
            names = [module, *(f"{module.rstrip('.')}.{alias.name}" for alias in node.names)]
        else:
            continue
        if any(is_test_module(name) for name in names):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_every_module_opens_with_a_docstring() -> None:
    missing = [str(path.relative_to(ROOT)) for path in sorted(PACKAGE.rglob("*.py"))
               if not ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))]
    assert not missing, "modules without a docstring naming their one job:\n" + "\n".join(missing)


def test_every_type_ignore_and_noqa_names_its_codes_and_reason() -> None:
    skipped = _temporarily_excluded_files()
    paths = [path for folder in (PACKAGE, ROOT / "tests") for path in sorted(folder.rglob("*.py"))
             if path not in skipped and "data" not in path.relative_to(ROOT).parts]
    found = [problem for path in paths for problem in bare_suppressions(path)]
    assert not found, "suppressions without codes or a reason on the line:\n" + "\n".join(found)


def test_no_test_module_imports_another_test_module() -> None:
    paths = [path for path in sorted((ROOT / "tests").rglob("*.py")) if "data" not in path.relative_to(ROOT).parts]
    found = [f"{path.relative_to(ROOT)}:{line}: {statement}"
             for path in paths for line, statement in imports_of_test_modules(path)]
    assert not found, "imports of a test module (move what is shared into tests/support/):\n" + "\n".join(found)


def test_the_temporary_exclusions_name_the_same_files_for_ruff_and_mypy() -> None:
    ruff = {path for path in _temporarily_excluded_files() if PACKAGE in path.parents}
    assert ruff == _mypy_ignored_modules(), (
        "ruff-only: " + ", ".join(sorted(str(p.relative_to(ROOT)) for p in ruff - _mypy_ignored_modules()))
        + "; mypy-only: " + ", ".join(sorted(str(p.relative_to(ROOT)) for p in _mypy_ignored_modules() - ruff)))


# --- the checker itself, on made-up files ----------------------------------------------------------


def _bare(tmp_path: Path, source: str) -> list[str]:
    path = tmp_path / "module.py"
    path.write_text(source, encoding="utf-8")
    return [comment for _, comment in _comments(path) if is_bare(comment)]


def test_the_checker_accepts_suppressions_with_codes_and_reasons(tmp_path: Path) -> None:
    assert _bare(tmp_path, "x = f()  # type: ignore[override]  # urllib3's signature is untyped\n"
                           "y = 1  # noqa: BLE001 - a target's failure must not stop the loop\n"
                           "z = 2  # noqa: E501 (a URL)\n"
                           "w = 3  # noqa: E402  # after sys.path\n"
                           "s = '# type: ignore in a string is no comment'\n") == []


def test_the_checker_finds_bare_suppressions(tmp_path: Path) -> None:
    found = _bare(tmp_path, "a = f()  # type: ignore\n"
                            "b = f()  # type: ignore[arg-type]\n"
                            "c = f()  # type: ignore  # no codes\n"
                            "d = 1  # noqa\n"
                            "e = 1  # noqa: E501\n"
                            "g = 1  # noqa - no codes\n")
    assert len(found) == 6, found


def _imports(tmp_path: Path, source: str) -> list[str]:
    path = tmp_path / "module.py"
    path.write_text(source, encoding="utf-8")
    return [statement for _, statement in imports_of_test_modules(path)]


def test_the_import_checker_accepts_support_and_other_modules(tmp_path: Path) -> None:
    assert _imports(tmp_path, "import os\n"
                              "from tests.support.configs import MINIMAL, write\n"
                              "from tests.support import pages\n"
                              "from exporter.serve import config\n"
                              "import tests.support.chart\n"
                              "from . import support\n") == []


def test_the_import_checker_finds_test_modules_at_any_depth(tmp_path: Path) -> None:
    found = _imports(tmp_path, "from tests.test_config import MINIMAL, write\n"
                               "import tests.test_collector\n"
                               "import test_simulator as sim\n"
                               "from test_metrics_page import make_config\n"
                               "from tests import test_helm_chart\n"
                               "from .test_simulator_page import _structure\n"
                               "def helper() -> None:\n"
                               "    from tests.test_admission_http import daemon_with_admission\n"
                               "class Helper:\n"
                               "    def method(self) -> None:\n"
                               "        import tests.test_sharding\n")
    assert found == ["from tests.test_config import MINIMAL, write", "import tests.test_collector",
                     "import test_simulator as sim", "from test_metrics_page import make_config",
                     "from tests import test_helm_chart", "from .test_simulator_page import _structure",
                     "from tests.test_admission_http import daemon_with_admission", "import tests.test_sharding"], found
