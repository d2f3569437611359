"""Daemon configs several test modules build the same way: a config file written for a test and the
smallest valid one (`write`, `MINIMAL`)."""

from __future__ import annotations

import textwrap
from pathlib import Path


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stepbudget.yaml"
    path.write_text(textwrap.dedent(text))
    return path


MINIMAL = """\
    deployments:
      - name: chat
        model: qwen3-8b
        gpu: h100-sxm
        targets:
          static: [http://10.0.0.5:8000/metrics]
"""
