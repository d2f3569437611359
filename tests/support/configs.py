"""Daemon configs several test modules build the same way: a config file written for a test and the
smallest valid one (`write`, `MINIMAL`), and a Config polling one vLLM target (`make_config`)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from exporter.serve.config import Config, config_from_mapping


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


def make_config(url: str) -> Config:
    return config_from_mapping({
        "poll_interval": "15s", "stale_after": "60s",
        "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": [url]}}],
    })
