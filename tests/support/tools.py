"""Find an external tool the tests drive for real (promtool, helm, ...).

A missing tool must never pass silently: under CI (`CI` set) the test fails with the install hint,
elsewhere it is skipped with a reason that `pytest -ra` prints.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The tests' data (captured pages, configs, charts), for a test module at any depth under tests/.
DATA = REPO / "tests" / "data"
TOOLS_BIN = REPO / ".tools" / "bin"
# The markers under which a test may drive an external tool: `make test-quick` selects none of them.
TOOL_MARKERS = frozenset({"tools", "e2e", "real_engine", "release_check"})
# The markers of the test running now (tests/conftest.py sets them), None outside a test.
running_markers: frozenset[str] | None = None


def require_tool(name: str) -> str:
    """Return the path of `name` (the repo's .tools/bin first, then PATH), or fail/skip.

    A test that carries none of TOOL_MARKERS fails here, tool or not: `make test-quick` would run it.
    """
    if running_markers is not None and not running_markers & TOOL_MARKERS:
        pytest.fail(f"this test drives {name} but carries none of the markers {sorted(TOOL_MARKERS)}: mark it "
                    "`tools` (conftest marks what it can see in the source; this call it could not)", pytrace=False)
    found = shutil.which(name, path=f"{TOOLS_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if found:
        return found
    message = f"{name} not found in {TOOLS_BIN} or on PATH; run `make tools`"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)
