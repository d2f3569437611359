"""Free ports, waiting on real processes, and a real HTTP server on 127.0.0.1 answering what the test sets."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(condition: Callable[[], object], timeout_seconds: float = 10.0,
               interval_seconds: float = 0.05) -> object:
    """Poll `condition` until it returns something truthy; fail the test after the timeout.

    For waiting on real external processes (a server starting up), never for asserting speed.
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            value = condition()
        except (requests.RequestException, OSError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_seconds}s: {getattr(condition, '__name__', condition)}")
        time.sleep(interval_seconds)


Responder = Callable[[BaseHTTPRequestHandler], None]


def send_text(handler: BaseHTTPRequestHandler, body: bytes | str, status: int = 200,
              content_type: str = "text/plain; version=0.0.4") -> None:
    data = body.encode() if isinstance(body, str) else body
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any) -> None:
        """A client hanging up early (what a size cap or a deadline does) is no error here."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


class HandlerServer:
    """A threaded stdlib HTTP server on `host` and a free port serving `handler`, until `close()`: what every
    stand-in server of the suite runs on."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], host: str = "127.0.0.1") -> None:
        self.httpd = _QuietServer((host, 0), handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)


class PageServer:
    """A stdlib HTTP server on 127.0.0.1; `respond(handler)` (settable) answers every GET."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.respond: Responder = lambda handler: send_text(handler, "")
        self.requests: list[dict[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                server.requests.append({"path": self.path, "client_port": str(self.client_address[1]),
                                        **{k.lower(): v for k, v in self.headers.items()}})
                try:
                    server.respond(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = HandlerServer(Handler, host)

    @property
    def url(self) -> str:
        return f"{self._server.base_url}/metrics"

    def wrap_tls(self, context: ssl.SSLContext) -> None:
        """Serve HTTPS from now on (the handshake runs at accept; a client refusing it is no error)."""
        self._server.httpd.socket = context.wrap_socket(self._server.httpd.socket, server_side=True)

    def serve_text(self, text: str | bytes, status: int = 200) -> None:
        self.respond = lambda handler: send_text(handler, text, status)

    def close(self) -> None:
        self._server.close()

