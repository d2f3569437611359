"""`stepbudget demo --duration N`: simulated pools, calibration, the real daemon and the view, end
to end on 127.0.0.1 (non-default ports), ending cleanly with a summary."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.demo import free_port_from, parameter_views, parameters_line, si_rate
from exporter.serve.collector import make_registry
from exporter.serve.config import config_from_mapping
from exporter.serve.online_fit_types import Held
from exporter.serve.setups_in_use import InUse, SetupsInUse
from exporter.simulator import AGENTS_JOIN_SECONDS
from tests.support.servers import free_port

SPEED = 20.0  # the agents join 6 s of wall time after the pools start
DURATION_SECONDS = 12


@pytest.mark.slow  # 15 s: the demo's whole run
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
    assert "  parameters        source calibrated" in out  # the parameters in use and their source
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


# --- the demo leaves nothing behind however it ends ---------------------------------------------


def _children(pid: int) -> set[int]:
    """The direct children of `pid` (every thread's), from /proc."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(child) for child in (task / "children").read_text().split()}
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _start_demo(port: int) -> tuple[subprocess.Popen[str], set[int]]:
    """`stepbudget demo` running until stopped, and the processes it started (its daemon)."""
    demo = subprocess.Popen([sys.executable, "-m", "exporter.cli", "demo", "--speed", "20", "--port", str(port),
                             "--poll-interval", "1s"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    assert demo.stdout is not None
    for line in demo.stdout:  # the daemon answers /-/ready before this line is printed
        if "the daemon's metrics:" in line or time.monotonic() > deadline:
            break
    # Keep reading its view, so a full pipe never blocks it.
    threading.Thread(target=demo.stdout.read, daemon=True).start()
    children = _children(demo.pid)
    assert children, "the demo started no daemon process"
    return demo, children


def _stop_leftovers(demo: subprocess.Popen[str], children: set[int]) -> None:
    """Whatever the test did, nothing it started outlives it (by pid, only ours)."""
    for pid in children:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    if demo.poll() is None:
        demo.kill()
    demo.wait(timeout=30)


def _gone_within(pids: set[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.slow  # 4 s
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sighup_stops_the_demo_and_everything_it_started() -> None:
    """Closing `make demo`'s terminal sends SIGHUP: the demo ends cleanly and frees its port."""
    port = free_port()
    demo, children = _start_demo(port)
    try:
        assert not _port_is_free(port)  # the daemon listens there
        demo.send_signal(signal.SIGHUP)
        assert demo.wait(timeout=30) == 0
        assert _gone_within(children, 15), "the daemon outlived the demo"
        assert _port_is_free(port)
    finally:
        _stop_leftovers(demo, children)


@pytest.mark.slow  # 4 s
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_killing_the_demo_takes_its_daemon_with_it() -> None:
    """SIGKILL leaves the demo no chance to clean up: the kernel's parent-death signal stops the daemon."""
    port = free_port()
    demo, children = _start_demo(port)
    try:
        demo.kill()
        demo.wait(timeout=30)
        assert _gone_within(children, 15), "the daemon outlived the killed demo"
        deadline = time.monotonic() + 10
        while not _port_is_free(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _port_is_free(port)
    finally:
        _stop_leftovers(demo, children)


def test_rates_are_shown_at_the_scale_of_the_device() -> None:
    """A CPU host's 12.3 GB/s and 9.14e10 FLOP/s read as such, not as 0.01 TB/s and 0 TFLOP/s."""
    assert si_rate(3.35e12, "B/s") == "3.35 TB/s"
    assert si_rate(12.3e9, "B/s") == "12.30 GB/s"
    assert si_rate(9.14e10, "FLOP/s") == "91.40 GFLOP/s"
    assert si_rate(0.0, "B/s") == "0 B/s"


def test_the_view_names_a_term_the_online_fit_held_at_its_seed() -> None:
    """The daemon's own page (its collector), read as the view reads it: the bandwidth held at the
    calibrated seed, the overhead fitted. Before, the view printed the last sample's source alone, so a
    held bandwidth read `source online` or `source calibrated` by the order of the families."""
    deployment = config_from_mapping({"deployments": [{
        "name": "pool", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": ["http://127.0.0.1:9"]}}]}
    ).deployments[0]
    setup = replace(deployment.resolved.setup, step_overhead_seconds=9.5e-3)
    setups_in_use = SetupsInUse()
    setups_in_use.set(deployment.name, InUse(setup, "online", 14, 0.048, (Held(
        "bandwidth_bytes_per_second", "bandwidth_at_peak", "the windows' best fit read 3.35e+03 GB/s"),),
        "calibrated"))
    page = generate_latest(make_registry(lambda: [], [deployment], setups_in_use=setups_in_use)).decode()
    samples = [sample for family in text_string_to_metric_families(page) for sample in family.samples]
    line = parameters_line(parameter_views(samples)["pool"])
    assert line.startswith("  parameters        source online, fitted from 14 windows (median residual 4.8%): ")
    assert "overhead 9.50 ms" in line
    assert line.endswith("\n                    bandwidth held at the seed: bandwidth_at_peak")
