"""The daemon's and the simulator's HTTP servers log a failed request as one structured line, never as a
traceback on stderr. Real servers on 127.0.0.1 and a real client: after one keep-alive request the client
closes with SO_LINGER 0, so the kernel sends a reset and the server's wait for the next request line
raises ConnectionResetError (Prometheus dropping its scrape connection looks the same to the server).
The simulator's (http.server) logs that as one debug line; the daemon's (uvicorn on asyncio) takes a reset
as the connection's end, with no line at all."""

from __future__ import annotations

import http.client
import http.server
import logging
import socket
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from exporter.logs import StructuredHTTPServer
from exporter.serve.server import StepBudgetServer
from exporter.simulator.server import start_server


@contextmanager
def _daemon_server() -> Iterator[int]:
    server = StepBudgetServer("127.0.0.1", 0, CollectorRegistry(), ready=lambda: True)
    server.start()
    try:
        yield server.port
    finally:
        server.stop()


@contextmanager
def _simulator_server() -> Iterator[int]:
    with start_server(paced=False) as handle:
        yield handle.port


def _one_request_then_reset(port: int) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    connection.request("GET", "/metrics")
    answer = connection.getresponse()
    answer.read()
    assert answer.status == 200
    assert connection.sock is not None  # HTTP/1.1: the connection is kept for the next request
    connection.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()


def _lines_when(logs: list[dict[str, Any]], event: str, timeout_seconds: float = 10.0) -> list[dict[str, Any]]:
    """The server's handler thread logs after the reset reaches it: wait for it (a guard, not a pace)."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        found = [line for line in logs if line["event"] == event]
        if found:
            return found
        time.sleep(0.01)
    return []


def test_a_client_that_resets_its_connection_leaves_the_daemon_silent_and_serving(
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    with capture_logs() as logs, _daemon_server() as port:
        _one_request_then_reset(port)
        _one_request_then_reset(port)  # the first reset has been taken: a second connection is served
    assert logs == []
    assert [record for record in caplog.records if record.levelno >= logging.WARNING] == []
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "Exception" not in captured.err


@pytest.mark.parametrize("serving", [_simulator_server], ids=["simulator"])
def test_a_client_that_resets_its_connection_is_one_debug_line(
        serving: Callable[[], AbstractContextManager[int]], capsys: pytest.CaptureFixture[str]) -> None:
    with capture_logs() as logs, serving() as port:
        _one_request_then_reset(port)
        (line,) = _lines_when(logs, "client_disconnected")
    assert line["log_level"] == "debug"
    assert line["reason"].startswith("ConnectionResetError")
    assert line["client"].startswith("127.0.0.1:")
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "Exception occurred" not in captured.err


def test_any_other_request_error_is_one_error_line_with_its_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    server = StructuredHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    try:
        with capture_logs() as logs:
            try:
                raise ValueError("a handler bug")
            except ValueError:
                server.handle_error(None, ("127.0.0.1", 40000))
    finally:
        server.server_close()
    (line,) = logs
    assert (line["event"], line["log_level"], line["client"]) == ("http_request_failed", "error", "127.0.0.1:40000")
    assert line["exc_info"] is True
    assert capsys.readouterr().err == ""


def test_a_process_that_never_configures_logging_prints_nothing_for_a_disconnect(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`stepbudget simulate` and the demo never configure structlog, whose default prints every level to
    stdout; a disconnect there is no line at all (an error still is one)."""
    configured = structlog.get_config()
    structlog.reset_defaults()  # as a fresh process has it
    server = StructuredHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError:
            server.handle_error(None, ("127.0.0.1", 40000))
        assert capsys.readouterr() == ("", "")
        try:
            raise ValueError("a handler bug")
        except ValueError:
            server.handle_error(None, ("127.0.0.1", 40000))
        assert "http_request_failed" in capsys.readouterr().out
    finally:
        server.server_close()
        structlog.configure(**configured)
