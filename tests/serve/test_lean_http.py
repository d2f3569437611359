"""The lean HTTP/1.1 client for `http://` targets (exporter/serve/lean_http.py), against real
servers on 127.0.0.1: it reads what urllib3 read (chunked, gzip, bodies framed by the connection's
end), keeps and renews connections, bounds every socket operation, and fails with the very reason
urllib3's path gives for the same broken answer (the reason is what `target_down` logs).
"""

from __future__ import annotations

import gzip
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler

import pytest

from exporter.serve.config import Tls
from exporter.serve.fetch import FetchError, HttpFetcher
from exporter.serve.lean_http import LeanPool
from tests.support.servers import PageServer, send_text

Respond = Callable[[BaseHTTPRequestHandler], None]


def fetch(url: str, *, lean: bool, timeout_seconds: float = 2.0, cap_bytes: int = 100_000) -> str:
    fetcher = HttpFetcher(timeout_seconds, cap_bytes, lean_http=lean)
    try:
        return fetcher(url, bearer_token=None, tls=Tls())
    finally:
        fetcher.close()


def reason(url: str, *, lean: bool) -> str:
    with pytest.raises(FetchError) as caught:
        fetch(url, lean=lean)
    return caught.value.reason


def raw(data: bytes, *, then_close: bool = True) -> Respond:
    """Writes `data` as the whole answer, status line and all, then hangs up."""
    def respond(handler: BaseHTTPRequestHandler) -> None:
        handler.wfile.write(data)
        handler.wfile.flush()
        handler.close_connection = then_close
    return respond


def chunked(pieces: list[bytes], *, extension: bytes = b"", trailer: bytes = b"",
            encoding: str | None = None) -> Respond:
    def respond(handler: BaseHTTPRequestHandler) -> None:
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
        if encoding:
            head += f"Content-Encoding: {encoding}\r\n".encode()
        handler.wfile.write(head + b"\r\n")
        for piece in pieces:
            handler.wfile.write(f"{len(piece):x}".encode() + extension + b"\r\n" + piece + b"\r\n")
            handler.wfile.flush()
        handler.wfile.write(b"0\r\n" + trailer + b"\r\n")
    return respond


@pytest.fixture
def server() -> Iterator[PageServer]:
    page_server = PageServer()
    yield page_server
    page_server.close()


# --- the same failure, the same reason ---------------------------------------------------------------

BROKEN = {
    "hangs up without an answer": raw(b""),
    "garbage status line": raw(b"SSH-2.0-OpenSSH_9.2\r\n\r\n"),
    "status not a number": raw(b"HTTP/1.1 abc OK\r\n\r\n"),
    "body shorter than Content-Length": raw(b"HTTP/1.1 200 OK\r\nContent-Length: 400\r\n\r\n" + b"#" * 100),
    "bad chunk size": raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n"),
    "chunked cut at a chunk's start": raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"),
    "not gzip though it says so": raw(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 9\r\n\r\n"
                                      b"not gzip!"),
    "HTTP 404": raw(b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found"),
    "HTTP 503 over HTTP/1.0": raw(b"HTTP/1.0 503 Service Unavailable\r\n\r\nbusy"),
    "redirect loop": raw(b"HTTP/1.1 302 Found\r\nLocation: /metrics\r\nContent-Length: 0\r\n\r\n", then_close=False),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_answer_gives_the_reason_urllib3_gave(server: PageServer, case: str) -> None:
    server.respond = BROKEN[case]
    lean, urllib3 = reason(server.url, lean=True), reason(server.url, lean=False)
    assert lean == urllib3
    assert lean  # a reason is never empty: it is the log line's


def test_the_reasons_a_log_reader_sees(server: PageServer) -> None:
    """A few of the reasons above, written out: the phrases the runbook tells operators to look for."""
    expected = {
        "hangs up without an answer": "connection failed: Remote end closed",
        "HTTP 404": "HTTP 404",
        "redirect loop": "more than 5 redirects",
        "body shorter than Content-Length": "body read failed: ('Connection broken: IncompleteRead(100 bytes read, "
                                            "300 more expected)', IncompleteRead(100 bytes read, 300 more expected))",
    }
    for case, phrase in expected.items():
        server.respond = BROKEN[case]
        assert reason(server.url, lean=True) == phrase, case


def test_refused_and_unanswered_connections_fail_like_urllib3s() -> None:
    with socket.socket() as listener:  # bound, never listening: the kernel refuses the connection
        listener.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"
        assert reason(url, lean=True) == reason(url, lean=False) == "connection failed: Connection refused"


def test_every_socket_operation_is_bounded_without_the_watchdog(server: PageServer) -> None:
    """The pool alone (no watchdog tracking it): a server that accepts and never answers ends the
    GET at the socket's own timeout."""
    release = threading.Event()
    server.respond = lambda handler: release.wait(10)
    host, port = server.url.split("/")[2].split(":")
    pool = LeanPool(host, int(port), 0.2, track=lambda sock: None)
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            pool.get("/metrics", {})
    finally:
        release.set()
        pool.close()
    assert time.monotonic() - started < 5  # the 10 s the server would have held it


# --- bodies it reads -------------------------------------------------------------------------------

def test_chunked_bodies_with_extensions_trailers_and_gzip(server: PageServer) -> None:
    page = "".join(f"vllm:num_requests_running{{engine=\"{i}\"}} {i}.0\n" for i in range(400))
    pieces = [page[start:start + 1000].encode() for start in range(0, len(page), 1000)]
    server.respond = chunked(pieces, extension=b";name=value", trailer=b"X-Checksum: none\r\n")
    assert fetch(server.url, lean=True) == page
    packed = gzip.compress(page.encode())
    server.respond = chunked([packed[start:start + 700] for start in range(0, len(packed), 700)], encoding="gzip")
    assert fetch(server.url, lean=True) == page


def test_a_body_framed_by_the_end_of_the_connection(server: PageServer) -> None:
    """HTTP/1.0 style: no Content-Length, no chunking; the body is everything until the server hangs up."""
    server.respond = raw(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nx 1\ny 2\n")
    assert fetch(server.url, lean=True) == "x 1\ny 2\n"


def test_interim_answers_are_skipped_and_bare_newlines_read(server: PageServer) -> None:
    server.respond = raw(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\nContent-Length: 4\n\nx 1\n")
    assert fetch(server.url, lean=True) == "x 1\n"


def test_deflate_zlib_wrapped_or_raw(server: PageServer) -> None:
    import zlib

    page = b"x 1\n" * 50
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    for body in (zlib.compress(page), raw_deflate.compress(page) + raw_deflate.flush()):
        server.respond = raw(b"HTTP/1.1 200 OK\r\nContent-Encoding: deflate\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert fetch(server.url, lean=True) == page.decode()


# --- connections --------------------------------------------------------------------------------

def test_the_connection_is_kept_renewed_when_the_server_closes_it_and_dropped_when_it_says_close(
        server: PageServer) -> None:
    answers = iter(["keep", "keep", "hang up after", "keep", "say close", "keep"])

    def respond(handler: BaseHTTPRequestHandler) -> None:
        answer = next(answers)
        if answer == "say close":
            handler.send_response(200)
            handler.send_header("Connection", "close")
            handler.send_header("Content-Length", "4")
            handler.end_headers()
            handler.wfile.write(b"x 1\n")
            return
        send_text(handler, "x 1\n")
        # An idle keep-alive timeout (uvicorn closes after 5 s), without a word to the client.
        handler.close_connection = answer == "hang up after"

    server.respond = respond
    fetcher = HttpFetcher(2.0, 1000)
    try:
        for _ in range(6):
            assert fetcher(server.url, bearer_token=None, tls=Tls()) == "x 1\n"
            time.sleep(0.05)  # lets a hang-up reach the client before the next fetch
    finally:
        fetcher.close()
    ports = [request["client_port"] for request in server.requests]
    # One connection for the first three; a new one after the server hung up; another after "close".
    assert ports[0] == ports[1] == ports[2] != ports[3] == ports[4] != ports[5]
    assert server.requests[0]["host"] == server.url.split("/")[2]


def test_a_body_left_half_read_never_starts_the_next_answer(server: PageServer) -> None:
    """Over the size cap the fetch stops mid-body; that connection is closed, not reused."""
    bodies = iter([b"# " + b"x" * 3000 + b"\n", b"x 1\n"])
    server.respond = lambda handler: send_text(handler, next(bodies))
    fetcher = HttpFetcher(2.0, 1000)
    try:
        with pytest.raises(FetchError, match="response over 1000 bytes"):
            fetcher(server.url, bearer_token=None, tls=Tls())
        assert fetcher(server.url, bearer_token=None, tls=Tls()) == "x 1\n"
    finally:
        fetcher.close()
    first, second = server.requests
    assert first["client_port"] != second["client_port"]


def test_a_socket_connected_after_the_deadline_is_shut_at_once(server: PageServer) -> None:
    """The watchdog shuts a fetch's sockets at its deadline; one the fetch connects after that (a
    redirect's next hop) is shut as it is handed over, not left to its own socket timeout."""
    from exporter.serve import fetch

    armed = fetch._WATCHDOG.arm(0.01)
    for _ in range(500):  # the watchdog's own thread fires it; wait for that, 5 s at most
        if armed.fired:
            break
        time.sleep(0.01)
    assert armed.fired
    host, port = server.url.split("/")[2].split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    fetch._fetch_sockets.armed = armed
    try:
        fetch._track(sock)
        started = time.monotonic()
        assert sock.recv(10) == b""  # shut: the end at once, not a 5 s wait for a server that says nothing
        assert time.monotonic() - started < 1
    finally:
        fetch._fetch_sockets.armed = None
        fetch._WATCHDOG.disarm(armed)
        sock.close()
