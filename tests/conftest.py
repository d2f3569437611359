"""Shared fixtures: a free port, an injected clock, hand-driven pollers, a real HTTP page server on
127.0.0.1, and a real Alertmanager. Generic on purpose: any test module may use them. The helpers they
are built from, and that tests import, live in tests/support.

Also the test tiers: a test that drives an external tool (through `require_tool`, in its own body, a
helper or a fixture) is marked `tools` here; one that calls it at run time without a tier marker fails.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import requests

from tests.support import tools
from tests.support.alertmanager import ALERTMANAGER_CONFIG, Alertmanager
from tests.support.clocks import ManualClock, SteppingClock
from tests.support.e2e.stack import alertmanager_binary
from tests.support.pollers import MakePoller
from tests.support.processes import stop_process
from tests.support.servers import PageServer, free_port, wait_until
from tests.support.tiers import function_reaches_tool

if TYPE_CHECKING:
    from exporter.serve.config import Config


def pytest_configure(config: pytest.Config) -> None:
    """Markers of the slow release checks, here so that pyproject's marker list stays the project's own."""
    config.addinivalue_line("markers", "artifacts: builds the sdist and wheel and runs the wheel in a clean venv")
    config.addinivalue_line("markers", "release_check: make release-check's OCI registry and image checks")


def _drives_tool(item: pytest.Function) -> bool:
    fixturedefs = item._fixtureinfo.name2fixturedefs  # pytest has no public way to the fixtures
    return function_reaches_tool(item.function) or any(
        function_reaches_tool(fixturedef.func) for defs in fixturedefs.values() for fixturedef in defs)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `tools` every test that drives an external tool, as far as the source shows, and `slow` the
    release checks (a wheel installed in a clean venv, an image built)."""
    for item in items:
        if isinstance(item, pytest.Function) and _drives_tool(item):
            item.add_marker(pytest.mark.tools)
        if item.get_closest_marker("artifacts") or item.get_closest_marker("release_check"):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    """Let `require_tool` see the running test's markers, to fail a test that drives a tool unmarked."""
    tools.running_markers = frozenset(marker.name for marker in item.iter_markers())
    try:
        yield
    finally:
        tools.running_markers = None


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def make_poller() -> Iterator[MakePoller]:
    """Pollers driven by hand (`poll_once`) with injected clocks; stopped after the test."""
    from exporter.serve.discovery import Discovery
    from exporter.serve.fetch import HttpFetcher
    from exporter.serve.poller import Poller

    started: list[tuple[Poller, HttpFetcher]] = []

    def make(config: Config, clock: Callable[[], float], step: float = 0.125, **kwargs: object) -> Poller:
        fetcher = HttpFetcher(config.timeout_seconds, config.max_response_bytes)
        poller = Poller(config, Discovery(config.deployments, timeout_seconds=1.0), kwargs.pop("fetch", fetcher),
                        clock=clock, monotonic=SteppingClock(step), **kwargs)
        started.append((poller, fetcher))
        return poller

    yield make
    for poller, fetcher in started:
        poller.stop()
        fetcher.close()


@pytest.fixture
def page_server() -> Iterator[PageServer]:
    server = PageServer()
    yield server
    server.close()


@pytest.fixture
def make_page_server() -> Iterator[Callable[[], PageServer]]:
    servers: list[PageServer] = []

    def make() -> PageServer:
        servers.append(PageServer())
        return servers[-1]

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[Alertmanager]:
    """A real `prometheus-alertmanager` on 127.0.0.1 (fails under CI if missing, skips otherwise)."""
    binary = alertmanager_binary()
    config = tmp_path / "alertmanager.yml"
    config.write_text(ALERTMANAGER_CONFIG)
    am_port = free_port()
    process = subprocess.Popen(
        [str(binary), f"--config.file={config}", f"--storage.path={tmp_path / 'am-data'}",
         f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ},
    )
    manager = Alertmanager(f"http://127.0.0.1:{am_port}")
    try:
        def ready() -> bool:
            if process.poll() is not None:
                pytest.fail(f"alertmanager exited: {process.stderr.read().decode()[-2000:] if process.stderr else ''}")
            return requests.get(f"{manager.url}/-/ready", timeout=1).status_code == 200

        wait_until(ready, timeout_seconds=20)
        yield manager
    finally:
        stop_process(process)
        if process.stderr:
            process.stderr.close()
