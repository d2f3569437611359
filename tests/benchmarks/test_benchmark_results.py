"""benchmarks/results/ holds one current result per benchmark, and nothing cites a result that is gone
(the rule: benchmarks/README.md).

A file there is `NAME.json` or `NAME.md` of a script `benchmarks/NAME.py` that names it; a `.md` sits
beside its `.json` (it reports that run); a second run, a profile or a copy has no script that owns it,
so the folder cannot grow history again: git keeps that (`git log -- benchmarks/results/`)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.tools import REPO

BENCHMARKS = REPO / "benchmarks"
RESULTS = BENCHMARKS / "results"
OWNED_SUFFIXES = (".json", ".md")
# Where a citation of a result file may stand, and the files that are read for it.
CITING = ["README.md", "CHANGELOG.md", "Makefile", "docs", "tests", "benchmarks", "scripts", "exporter", "helm",
          "examples"]
CITED = re.compile(r"benchmarks/results/([A-Za-z0-9_.-]+)")
# A citation of an earlier run names the commit it was at ("... at commit 54bfaa1"), within this reach.
COMMIT_REACH = 60
AT_COMMIT = re.compile(r"\bcommit [0-9a-f]{7,40}\b")


def _result_files() -> list[Path]:
    return sorted(path for path in RESULTS.iterdir() if not path.name.startswith("."))


def _owner(path: Path) -> Path:
    return BENCHMARKS / f"{path.stem}.py"


def test_every_result_is_the_current_result_of_a_benchmark_that_names_it() -> None:
    strays = []
    for path in _result_files():
        script = _owner(path)
        if not path.is_file() or path.suffix not in OWNED_SUFFIXES:
            strays.append(f"{path.name}: not NAME.json or NAME.md")
        elif not script.is_file():
            strays.append(f"{path.name}: no benchmarks/{script.name} owns it")
        elif path.name not in script.read_text(encoding="utf-8"):
            strays.append(f"{path.name}: benchmarks/{script.name} does not name it as what it writes")
    assert not strays, ("benchmarks/results/ holds one current result per benchmark (benchmarks/README.md); an "
                        "earlier run stays in git, not beside the current one:\n" + "\n".join(strays))


def test_a_report_sits_beside_the_run_it_reports() -> None:
    lonely = [path.name for path in _result_files()
              if path.suffix == ".md" and not path.with_suffix(".json").is_file()]
    assert not lonely, f"a results .md reports the run in its .json, which is missing: {lonely}"


def test_the_rule_holds_the_folder_as_it_is() -> None:
    # The rule is not vacuous: the benchmarks that record results are all here, each with its json.
    names = {path.name for path in _result_files()}
    assert {"scale.json", "scale.md", "accuracy.json", "fetch_path.json", "real_vllm_online.json"} <= names
    assert all(path.with_suffix(".json").name in names for path in _result_files())


def _citing_files() -> list[Path]:
    found: list[Path] = []
    for entry in CITING:
        path = REPO / entry
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found += [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in {".py", ".md", ".yaml",
                                                                                          ".yml", ".json", ""}
                      and "__pycache__" not in p.parts and "data" not in p.relative_to(REPO).parts]
    return found


def test_nothing_cites_a_result_file_that_is_gone() -> None:
    dangling = []
    for path in _citing_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        where = str(path.relative_to(REPO))
        for match in CITED.finditer(text):
            name = match.group(1).rstrip(".")
            if not name or name.endswith("NAME.txt") or "." not in name or (RESULTS / name).exists():
                continue
            if AT_COMMIT.search(text[match.end():match.end() + COMMIT_REACH]):
                continue
            if where == f"benchmarks/{Path(name).stem}.py":
                continue  # a benchmark names what it will write before its first run
            line = text.count("\n", 0, match.start()) + 1
            dangling.append(f"{where}:{line}: benchmarks/results/{name}")
    assert not dangling, ("these cite a result no longer in benchmarks/results/: cite it at the commit that held "
                          "it (`benchmarks/results/NAME.md at commit 54bfaa1`, git log -- benchmarks/results/):\n"
                          + "\n".join(dangling))


def test_a_results_write_up_names_no_result_file_that_is_gone() -> None:
    # Inside results/ a write-up names its neighbours bare (`real_vllm_online.json`): each must be there.
    scripts = "|".join(sorted(re.escape(path.stem) for path in BENCHMARKS.glob("*.py")))
    named = re.compile(rf"`((?:{scripts})[A-Za-z0-9_]*\.(?:json|md)|profile_[A-Za-z0-9_]+\.txt)`")
    dangling = [f"{path.name}: {name}" for path in _result_files() if path.suffix == ".md"
                for name in named.findall(path.read_text(encoding="utf-8")) if not (RESULTS / name).exists()]
    assert not dangling, "a results write-up names a file that is gone (say it is in git's history):\n" + "\n".join(
        dangling)


def _history_available() -> bool:
    """A clone with its whole history: a shallow one cannot tell a commit that is gone from one it never
    fetched."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return False
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"], capture_output=True,
                          text=True, timeout=30, check=False)
    return done.returncode == 0 and done.stdout.strip() == "false"


def test_a_citation_at_a_commit_names_one_that_holds_the_file() -> None:
    """`benchmarks/results/NAME at commit X` sends a reader to `git show X:benchmarks/results/NAME`: X must be
    in main's history and hold NAME there. A branch that did not land once left citations of its commits."""
    if not _history_available():
        pytest.skip("needs the whole git history to look the cited commits up, and this is a shallow clone or a tree "
                    "without .git; test_nothing_cites_a_result_file_that_is_gone still checks every citation's form")
    cited: dict[tuple[str, str], str] = {}
    for path in _citing_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in CITED.finditer(text):
            name = match.group(1).rstrip(".")
            at = AT_COMMIT.search(text[match.end():match.end() + COMMIT_REACH])
            if at is not None and "." in name and not name.endswith("NAME.md"):
                cited.setdefault((at.group(0).split()[1], name), str(path.relative_to(REPO)))
    assert cited  # the rule is not vacuous: the results' write-ups cite earlier runs so
    missing = []
    for (commit, name), where in sorted(cited.items()):
        done = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}:benchmarks/results/{name}"],
                              capture_output=True, timeout=30, check=False)
        if done.returncode != 0:
            missing.append(f"{where}: benchmarks/results/{name} at commit {commit}")
    assert not missing, "these cite a commit this history lacks, or one without the file:\n" + "\n".join(missing)
