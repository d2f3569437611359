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
TOOLS_BIN = REPO / ".tools" / "bin"


def require_tool(name: str) -> str:
    """Return the path of `name` (the repo's .tools/bin first, then PATH), or fail/skip."""
    found = shutil.which(name, path=f"{TOOLS_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if found:
        return found
    message = f"{name} not found in {TOOLS_BIN} or on PATH; run `make tools`"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)
