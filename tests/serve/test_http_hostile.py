"""Hostile clients against the daemon's HTTP server (exporter/serve/server.py on guarded_http.py), over real
sockets on 127.0.0.1: they cannot hold it, and each is answered with its status.

- 200 slow and half-open clients at once (silent connections, heads trickled a byte at a time, bodies
  half sent, half-closed connections, clients that ask for /metrics and never read) leave /metrics and
  /-/healthy answering within 1 s, on the shipped limits, with no thread per connection.
- With short limits, each kind gets its answer: 408 for a head or body too slow, 413 for a body too
  large (declared: unread), 431 for a head too large, 503 past the connection cap, a reset past twice
  the cap, and a client that never reads its answer is cut off.
- An unauthenticated admission request (the daemon's real admission routes) is answered 401 from its
  headers: its body is never waited for nor asked for (no `100 Continue`), the handler never runs, and
  the connection is closed after the answer.

Every loop is bounded in count and in time; every socket is closed in a `finally`.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.serve.collector import PageRegistry
from exporter.serve.guarded_http import ServerLimits
from exporter.serve.server import Request, Response, StepBudgetServer
from tests.support.admission import daemon_with_admission

ANSWER_SECONDS = 1.0  # what /metrics and /-/healthy must answer within, hostile clients or not
WAIT_SECONDS = 5.0  # the most any wait for an answer or a close here lasts
PAGE_SAMPLES = 20_000  # a /metrics page of ~1 MB: a client that does not read it cannot take it in at once


class BigPage(Collector):
    """A fixed page of PAGE_SAMPLES gauges, with a generation, so the server caches it as the daemon's."""

    def describe(self) -> Iterable[Metric]:
        return []

    def generation(self) -> int:
        return 1

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("hostile_test_value", "a sample", labels=["target", "engine"])
        for index in range(PAGE_SAMPLES):
            family.add_metric([f"10.0.{index // 250}.{index % 250}:8000", "0"], float(index))
        yield family


@contextmanager
def serving(limits: ServerLimits | None = None) -> Iterator[StepBudgetServer]:
    registry = PageRegistry()
    registry.register(BigPage())
    server = StepBudgetServer("127.0.0.1", 0, registry, ready=lambda: True, limits=limits)
    server.register_route("POST", "/v1/echo", lambda request: Response(200, request.body))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def connect(port: int, *, receive_buffer: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if receive_buffer is not None:  # before connecting: the window the client offers
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.settimeout(WAIT_SECONDS)
        sock.connect(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return sock


def read_until_closed(sock: socket.socket, seconds: float = WAIT_SECONDS) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or `seconds` pass (False)."""
    data = b""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data, False
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def timed_get(port: int, path: str) -> tuple[int, float, int]:
    """(status, seconds, body bytes) of one GET on a fresh connection, a second's patience at most."""
    started = time.monotonic()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=ANSWER_SECONDS)
    try:
        connection.request("GET", path, headers={"Accept-Encoding": "identity"})
        answer = connection.getresponse()
        body = answer.read()
        return answer.status, time.monotonic() - started, len(body)
    finally:
        connection.close()


# --- 200 hostile clients at once, the shipped limits -------------------------------------------------


HOSTILE_KINDS = ("silent", "trickling_head", "half_sent_body", "half_closed", "not_reading")
PER_KIND = 40  # 5 kinds x 40 = 200 clients


def open_hostile(port: int, kind: str) -> socket.socket:
    sock = connect(port, receive_buffer=4096 if kind == "not_reading" else None)
    try:
        if kind == "trickling_head":
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        elif kind == "half_sent_body":
            sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n0123456789")
        elif kind == "half_closed":
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            sock.shutdown(socket.SHUT_WR)
        elif kind == "not_reading":
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: identity\r\n\r\n")
    except BaseException:
        sock.close()
        raise
    return sock


@pytest.mark.slow  # 2.5 s
def test_200_slow_and_half_open_clients_cannot_stop_metrics_or_healthy() -> None:
    threads_before = threading.active_count()
    limits = ServerLimits()  # the shipped defaults: 10-s head and body timeouts, 256 connections
    assert limits.max_connections > len(HOSTILE_KINDS) * PER_KIND
    with serving(limits) as server, ExitStack() as hostile:
        status, _, page_bytes = timed_get(server.port, "/metrics")
        assert status == 200 and page_bytes > 600_000  # big enough that a client not reading cannot take it
        clients = {kind: [hostile.enter_context(open_hostile(server.port, kind)) for _ in range(PER_KIND)]
                   for kind in HOSTILE_KINDS}
        timings: list[tuple[str, int, float]] = []
        started = time.monotonic()
        for _ in range(10):  # ~2-3 s of it, well inside the 10-s header timeout: every client still holds on
            for sock in clients["trickling_head"]:
                sock.send(b"x")  # one more byte of a header that never ends
            for path in ("/-/healthy", "/metrics"):
                status, seconds, _ = timed_get(server.port, path)
                timings.append((path, status, seconds))
            time.sleep(0.2)
        assert time.monotonic() - started < limits.header_timeout_seconds
        # A half-closed connection (the client said it sends no more) is let go at once, unanswered; every
        # other hostile client is still connected: none was answered or dropped yet.
        for sock in clients["half_closed"]:
            assert read_until_closed(sock, ANSWER_SECONDS) == (b"", True)
        assert server.open_connections() >= (len(HOSTILE_KINDS) - 1) * PER_KIND
        # No thread per connection: the event loop's thread and the handler pool, whatever the clients.
        assert threading.active_count() <= threads_before + 1 + limits.handler_threads
    assert all(status == 200 for _, status, _ in timings), timings
    slowest = max(seconds for _, _, seconds in timings)
    assert slowest < ANSWER_SECONDS, timings


# --- each hostile kind gets its answer (short limits) -------------------------------------------------


SHORT = ServerLimits(max_connections=8, header_timeout_seconds=0.4, body_timeout_seconds=0.4,
                     response_timeout_seconds=1.0, keep_alive_seconds=1, max_header_bytes=4096,
                     max_body_bytes=1000, write_chunk_bytes=16 * 1024)


@pytest.fixture
def short() -> Iterator[StepBudgetServer]:
    with serving(SHORT) as server:
        yield server


@pytest.mark.parametrize("sent", [
    b"",  # connected, silent
    b"GET /metrics HTTP/1.1\r\nHost: x\r\n",  # a head that stops half way
], ids=["silent", "half_head"])
def test_a_head_not_complete_in_time_is_408_and_closed(short: StepBudgetServer, sent: bytes) -> None:
    with connect(short.port) as sock:
        started = time.monotonic()
        sock.sendall(sent)
        answer, closed = read_until_closed(sock)
        waited = time.monotonic() - started
    assert status_of(answer) == 408 and closed
    assert SHORT.header_timeout_seconds * 0.9 <= waited < SHORT.header_timeout_seconds + 1.0


def test_a_head_that_trickles_forever_is_408_at_the_header_timeout(short: StepBudgetServer) -> None:
    """A byte every 50 ms: each read is quick, only the head's own deadline can end it."""
    with connect(short.port) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        started = time.monotonic()
        answer = b""
        for _ in range(100):  # 100 x 50 ms = 5 s at most
            try:
                sock.send(b"x")
            except OSError:
                break  # closed by the server
            sock.settimeout(0.05)
            try:
                answer += sock.recv(4096)
            except TimeoutError:
                continue
            if answer:
                break
        waited = time.monotonic() - started
    assert status_of(answer) == 408
    assert waited < SHORT.header_timeout_seconds + 1.0


def test_an_idle_keep_alive_connection_is_closed_without_a_word(short: StepBudgetServer) -> None:
    with connect(short.port) as sock:
        sock.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
        answer, closed = read_until_closed(sock, SHORT.keep_alive_seconds + SHORT.header_timeout_seconds + 1.0)
    assert closed and answer.count(b"HTTP/1.1 ") == 1 and status_of(answer) == 200


def test_a_body_not_complete_in_time_is_408_and_closed(short: StepBudgetServer) -> None:
    with connect(short.port) as sock:
        sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nhalf")
        answer, closed = read_until_closed(sock)
    assert status_of(answer) == 408 and closed


def test_a_declared_body_over_the_limit_is_413_before_it_is_sent(short: StepBudgetServer) -> None:
    with connect(short.port) as sock:
        sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n")  # no body at all
        answer, closed = read_until_closed(sock)
    assert status_of(answer) == 413 and closed


def test_a_chunked_body_over_the_limit_is_413(short: StepBudgetServer) -> None:
    chunk = b"x" * 600
    with connect(short.port) as sock:
        sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 2)
        answer, closed = read_until_closed(sock)
    assert status_of(answer) == 413 and closed


def test_a_body_within_the_limit_is_read_and_answered(short: StepBudgetServer) -> None:
    with connect(short.port) as sock:
        sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")
        answer, closed = read_until_closed(sock)
    assert status_of(answer) == 200 and answer.endswith(b"\r\n\r\nhello") and closed


def test_a_head_over_the_limit_is_431_and_closed(short: StepBudgetServer) -> None:
    with connect(short.port) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (SHORT.max_header_bytes + 10))
        answer, closed = read_until_closed(sock)
    assert status_of(answer) == 431 and closed


def test_past_the_connection_cap_requests_are_503_and_past_twice_it_connections_are_reset(
        short: StepBudgetServer) -> None:
    cap = SHORT.max_connections
    with ExitStack() as held:
        idle = [held.enter_context(connect(short.port)) for _ in range(cap)]
        assert len(idle) == cap
        for _ in range(50):  # the loop has taken every connection in (50 x 20 ms at most)
            if short.open_connections() >= cap:
                break
            time.sleep(0.02)
        one_more = held.enter_context(connect(short.port))
        one_more.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
        answer, closed = read_until_closed(one_more)
        assert status_of(answer) == 503 and closed
        # Up to twice the cap, connections are held (to be told 503); past it, reset at once.
        waiting = [held.enter_context(connect(short.port)) for _ in range(cap)]
        assert len(waiting) == cap
        past = held.enter_context(connect(short.port))
        answer, closed = read_until_closed(past, 2.0)
        assert answer == b"" and closed
    # Once they are gone, the server serves again.
    for _ in range(50):
        if short.open_connections() == 0:
            break
        time.sleep(0.02)
    assert timed_get(short.port, "/-/healthy")[0] == 200


def test_a_client_that_never_reads_its_answer_is_cut_off(short: StepBudgetServer) -> None:
    with connect(short.port, receive_buffer=4096) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: identity\r\n\r\n")
        for _ in range(100):  # the server gives up within the response timeout (100 x 50 ms at most)
            if short.open_connections() == 0:
                break
            time.sleep(0.05)
        assert short.open_connections() == 0
    assert timed_get(short.port, "/-/healthy")[0] == 200


def test_an_answer_not_ready_within_the_response_timeout_is_408(short: StepBudgetServer) -> None:
    release = threading.Event()

    def stuck(request: Request) -> Response:
        release.wait(WAIT_SECONDS)  # a handler stuck past the response timeout (1 s here)
        return Response(200, b"late")

    short.register_route("GET", "/stuck", stuck)
    try:
        with connect(short.port) as sock:
            started = time.monotonic()
            sock.sendall(b"GET /stuck HTTP/1.1\r\nHost: x\r\n\r\n")
            answer, closed = read_until_closed(sock)
            waited = time.monotonic() - started
    finally:
        release.set()
    assert status_of(answer) == 408 and closed and b"late" not in answer
    assert SHORT.response_timeout_seconds * 0.9 <= waited < SHORT.response_timeout_seconds + 1.0


def test_unknown_paths_and_methods_are_404_and_405(short: StepBudgetServer) -> None:
    assert timed_get(short.port, "/nope")[0] == 404
    with connect(short.port) as sock:
        sock.sendall(b"DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        answer, _ = read_until_closed(sock)
    assert status_of(answer) == 405


# --- admission: the token before the body --------------------------------------------------------------


TOKEN = "gateway-token-123"


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-token", "Basic Z2F0ZXdheTp4"])
def test_an_unauthenticated_admission_body_is_never_read(tmp_path: Path, authorization: str | None) -> None:
    with daemon_with_admission(tmp_path, TOKEN) as running:
        port = running.daemon.server.port
        head = ("POST /v1/admission HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: 50000\r\nExpect: 100-continue\r\n"
                + (f"Authorization: {authorization}\r\n" if authorization else "") + "\r\n")
        with connect(port) as sock:
            started = time.monotonic()
            sock.sendall(head.encode())  # the head only: not one byte of the 50,000 it announces
            answer, closed = read_until_closed(sock)
            waited = time.monotonic() - started
        assert running.api.book.sizes().open_admissions == 0
        decisions = running.api.book.decision_counts()
    assert status_of(answer) == 401 and closed
    assert b"100 Continue" not in answer  # the body was never asked for
    assert waited < ANSWER_SECONDS  # answered from the head, not after a body timeout
    assert answer.count(b"HTTP/1.1 ") == 1
    assert b"bearer token" in answer
    assert sum(decisions.values()) == 0  # the handler never ran


def test_an_authenticated_admission_asks_for_its_body_and_is_answered(tmp_path: Path) -> None:
    body = json.dumps({"deployment": "chat", "prompt_tokens": 100, "max_output_tokens": 10}).encode()
    with daemon_with_admission(tmp_path, TOKEN) as running, connect(running.daemon.server.port) as sock:
        sock.sendall((f"POST /v1/admission HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
                      f"Expect: 100-continue\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n").encode())
        sock.settimeout(WAIT_SECONDS)
        interim = sock.recv(4096)
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n")
        sock.sendall(body)
        answer, closed = read_until_closed(sock)
    assert status_of(answer) == 200 and closed and b'"decision":"admitted"' in answer


def test_an_admission_body_over_the_api_limit_is_413_unread(tmp_path: Path) -> None:
    with daemon_with_admission(tmp_path, TOKEN) as running, connect(running.daemon.server.port) as sock:
        sock.sendall((f"POST /v1/admission HTTP/1.1\r\nHost: x\r\nContent-Length: {64 * 1024 + 1}\r\n"
                      f"Authorization: Bearer {TOKEN}\r\n\r\n").encode())
        answer, closed = read_until_closed(sock)
    assert status_of(answer) == 413 and closed


def test_handlers_see_the_request_as_before(short: StepBudgetServer) -> None:
    seen: list[Request] = []

    def record(request: Request) -> Response:
        seen.append(request)
        return Response(201, b"made", "text/plain", {"X-Extra": "1"})

    short.register_route("POST", "/v1/record", record)
    connection = http.client.HTTPConnection("127.0.0.1", short.port, timeout=WAIT_SECONDS)
    try:
        connection.request("POST", "/v1/record?a=1&b=2", body=b"abc", headers={"X-Thing": "yes"})
        answer = connection.getresponse()
        assert (answer.status, answer.read(), answer.getheader("X-Extra")) == (201, b"made", "1")
        assert answer.getheader("Server", "").startswith("stepbudget/")
    finally:
        connection.close()
    (request,) = seen
    assert (request.method, request.path, request.query, request.body) == ("POST", "/v1/record", "a=1&b=2", b"abc")
    assert request.headers["x-thing"] == "yes" and request.headers["content-length"] == "3"
