"""`stepbudget demo --duration N`: simulated pools, calibration, the real daemon and the view, end
to end on 127.0.0.1 (non-default ports), ending cleanly with a summary."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

from exporter.demo import free_port_from
from exporter.simulator import AGENTS_JOIN_SECONDS
from tests.conftest import free_port

SPEED = 20.0  # the agents join 6 s of wall time after the pools start
DURATION_SECONDS = 12


def test_demo_runs_for_its_duration_and_reports_the_agents_pool_over_budget() -> None:
    assert AGENTS_JOIN_SECONDS / SPEED < DURATION_SECONDS - 3  # the agents are in for several polls
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "exporter.cli", "demo", "--duration", str(DURATION_SECONDS), "--speed", str(SPEED),
         "--port", str(port), "--poll-interval", "1s"],
        capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr + result.stdout[-2000:]
    out = result.stdout
    assert f"the daemon's metrics: http://127.0.0.1:{port}/metrics" in out
    assert "effective bandwidth" in out and "per-step overhead" in out  # calibrated first
    summary = out[out.rindex("summary after"):]
    agents = re.search(r"agents-pool \(agents-join.*?\): OVER BUDGET in (\d+) of (\d+) polls", summary)
    assert agents, summary
    assert int(agents.group(1)) >= 2
    assert re.search(r"chat-pool \(steady-chat.*?\): within budget in all \d+ polls", summary), summary
    # Everything it started is gone: its daemon port is free again.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))


def test_demo_bad_duration_is_bad_input() -> None:
    result = subprocess.run([sys.executable, "-m", "exporter.cli", "demo", "--duration", "soon"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "--duration: cannot read 'soon' as a duration" in result.stderr


def test_a_busy_daemon_port_moves_to_the_next_free_one() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = int(busy.getsockname()[1])
        chosen = free_port_from(port)
        assert chosen != port and port < chosen < port + 50
    assert free_port_from(port) == port  # free again once its listener is gone
