"""Stopping what a test started: every process a test starts, it stops."""

from __future__ import annotations

import subprocess
from typing import Any


def stop_process(process: subprocess.Popen[Any]) -> None:
    """Stop a process a test started: SIGTERM, then SIGKILL if it has not exited within 10 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
