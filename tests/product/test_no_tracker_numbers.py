"""The code, tests and docs say what is, in their own words: no numbered items of a tracker that is not in the
repository (a newcomer cannot follow "issue N" or "stop N"; the history they name lives in git).

Upstream trackers are cited by their project (`vllm#36318`, a capture file named after its upstream issue), so
only our own bare "issue N" / "stop N" / "item N of issue N" are refused."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.tools import REPO

# Where a reader meets the project, the benchmarks' current results included (their history is in git's).
SCANNED = ["exporter", "tests", "docs", "scripts", "helm", "rules", "benchmarks", "README.md", "Makefile"]
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".tpl", ".txt", ".sh", ""}
TRACKER_ITEM = re.compile(r"\b(?:issue|stop)s? #?\d+\b", re.IGNORECASE)


def _files() -> list[Path]:
    found: list[Path] = []
    for entry in SCANNED:
        for path in sorted(REPO.glob(entry)):
            found += [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return [p for p in found if p.suffix in SUFFIXES and "__pycache__" not in p.parts and "data" not in p.parts]


def test_the_scan_reads_the_tree() -> None:
    names = {str(p.relative_to(REPO)) for p in _files()}
    assert {"README.md", "docs/operations.md", "exporter/cli.py", "tests/product/test_no_tracker_numbers.py"} <= names


def test_no_tracker_numbers_in_code_tests_or_docs() -> None:
    hits = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
            for path in _files()
            for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if TRACKER_ITEM.search(line)]
    assert not hits, "say what the code does, not which tracker item asked for it:\n" + "\n".join(hits)


def test_the_pattern_finds_what_it_refuses_and_not_upstream_citations() -> None:
    number = "21"  # kept apart from the words, so this file passes its own scan
    assert TRACKER_ITEM.search(f"as asked in Issue {number}, item 4") and TRACKER_ITEM.search(f"until stop {number}")
    assert not TRACKER_ITEM.search("vllm#36318 and a capture named after issue13485")
