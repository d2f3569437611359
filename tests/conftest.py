"""Shared fixtures: a free port, an injected clock, hand-driven pollers, a real HTTP page server on
127.0.0.1, and a real Alertmanager. Generic on purpose: any test module may use them. The helpers they
are built from, and that tests import, live in tests/support.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import requests

from tests.support.alertmanager import ALERTMANAGER_CONFIG, Alertmanager
from tests.support.clocks import ManualClock, SteppingClock
from tests.support.e2e.stack import alertmanager_binary
from tests.support.pollers import MakePoller
from tests.support.processes import stop_process
from tests.support.servers import PageServer, free_port, wait_until

if TYPE_CHECKING:
    from exporter.serve.config import Config


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
    from exporter.serve.poller import HttpFetcher, Poller

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
