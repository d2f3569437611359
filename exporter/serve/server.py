"""The daemon's HTTP server: /metrics, /-/healthy, /-/ready, a landing page, and a route table.

A small route table (method, path) -> handler lets other modules (admission: `POST /v1/admission`,
`POST /v1/release`) add endpoints with `register_route` without editing this file.
"""

from __future__ import annotations

import functools
import gzip
import html
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.openmetrics import exposition as openmetrics

from exporter import __version__
from exporter.logs import StructuredHTTPServer
from exporter.serve.exposition_writer import render_openmetrics, render_text

log = structlog.get_logger("stepbudget.server")

MAX_REQUEST_BODY_BYTES = 1 << 20
# zlib's default: within a few percent of level 9's size on /metrics pages at a fraction of its time.
GZIP_LEVEL = 6


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Response]


@dataclass(frozen=True)
class TargetRow:
    """One line of the landing page."""

    deployment: str
    target: str
    kind: str | None
    up: bool
    detail: str


@dataclass
class _Encoded:
    """One format of the page as last rendered, and the registry generation it was rendered at."""

    generation: tuple[object, ...]
    encoder: Callable[[CollectorRegistry], bytes]
    body: bytes
    gzipped: bytes | None = None

    def compressed(self) -> bytes:
        """The body gzip-compressed, compressed once per render."""
        if self.gzipped is None:
            self.gzipped = gzip.compress(self.body, compresslevel=GZIP_LEVEL)
        return self.gzipped


class MetricsPage:
    """The encoded /metrics page, kept until a poll or an admission change alters it.

    Why: at 1,000 targets the page is ~3 MB and ~22,000 samples; encoding it costs far more than a
    poll's worth of anything else the server does, and between two polls it cannot change. The
    registry's `generation()` (exporter/serve/collector.py's PageRegistry) says when it did; a registry
    without one is rendered at every request, as before. One lock: concurrent scrapes after a poll
    wait for one render instead of each doing it.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._lock = threading.Lock()
        self._encoded: dict[str, _Encoded] = {}  # content type -> page
        self.renders = 0  # pages encoded so far (for tests and the benchmark)

    def response(self, accept: str, accept_encoding: str) -> Response:
        """The page in the format `accept` asks for, gzip-compressed when `accept_encoding` allows."""
        encoder, content_type = choose_encoder(accept)
        if encoder is generate_latest:
            # The plain text format: the same bytes, written without per-sample label escaping
            # (exporter/serve/exposition_writer.py).
            encoder = render_text
        elif isinstance(encoder, functools.partial) and encoder.func is openmetrics.generate_latest:
            # OpenMetrics, what Prometheus asks for first: the same bytes, written the same way.
            encoder = functools.partial(render_openmetrics, *encoder.args, **encoder.keywords)
        with self._lock:
            encoded = self._current(encoder, content_type)
            if not gzip_accepted(accept_encoding):
                return Response(200, encoded.body, content_type)
            return Response(200, encoded.compressed(), content_type, {"Content-Encoding": "gzip"})

    def refresh(self) -> None:
        """Re-render every format served so far, if the page changed (a poll listener calls this, so
        the first scrape after a poll is served at once)."""
        with self._lock:
            for content_type, encoded in list(self._encoded.items()):
                fresh = self._current(encoded.encoder, content_type)
                if encoded.gzipped is not None:  # served compressed before: compress now, not at the scrape
                    fresh.compressed()

    def _current(self, encoder: Callable[[CollectorRegistry], bytes], content_type: str) -> _Encoded:
        generation = getattr(self._registry, "generation", lambda: None)()
        encoded = self._encoded.get(content_type)
        if generation is not None and encoded is not None and encoded.generation == generation:
            return encoded
        # The generation is read before rendering: a change during the render leaves the next
        # request a newer generation than the one stored, so it renders again.
        encoded = _Encoded(generation or (), encoder, encoder(self._registry))
        self.renders += 1
        if generation is not None:
            self._encoded[content_type] = encoded
        return encoded


class StepBudgetServer:
    """Serves the registry and the routes; `ready()` says whether the first poll finished."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, *,
                 ready: Callable[[], bool], targets: Callable[[], list[TargetRow]] = list) -> None:
        self._registry = registry
        self.metrics_page = MetricsPage(registry)
        self._ready = ready
        self._targets = targets
        self.routes: dict[tuple[str, str], Handler] = {
            ("GET", "/metrics"): self._metrics,
            ("GET", "/-/healthy"): lambda request: Response(200, b"OK\n"),
            ("GET", "/-/ready"): self._ready_route,
            ("GET", "/"): self._landing,
        }
        self._httpd = StructuredHTTPServer((host, port), _make_handler(self))
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def registry(self) -> CollectorRegistry:
        """The served registry, for extensions that add a collector (admission)."""
        return self._registry

    def register_route(self, method: str, path: str, handler: Handler) -> None:
        """Add an endpoint, e.g. `register_route("POST", "/v1/admission", handle)`."""
        key = (method.upper(), path)
        if key in self.routes:
            raise ValueError(f"route {method} {path} is already registered")
        self.routes[key] = handler

    def start(self) -> None:
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="stepbudget-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and free the port; safe whether or not `start` was called."""
        if self._thread is not None:
            self._httpd.shutdown()  # waits for serve_forever to return: only if it runs
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()

    # --- built-in routes ------------------------------------------------------------------------

    def _metrics(self, request: Request) -> Response:
        return self.metrics_page.response(request.headers.get("accept", ""), request.headers.get("accept-encoding", ""))

    def _ready_route(self, request: Request) -> Response:
        if self._ready():
            return Response(200, b"Ready\n")
        return Response(503, b"Not ready: the first poll has not finished\n")

    def _landing(self, request: Request) -> Response:
        rows = "".join(
            f"<tr><td>{html.escape(row.deployment)}</td><td>{html.escape(row.target)}</td>"
            f"<td>{html.escape(row.kind or '?')}</td><td>{'up' if row.up else 'DOWN'}</td>"
            f"<td>{html.escape(row.detail)}</td></tr>"
            for row in self._targets()
        )
        page = (
            "<!doctype html><html><head><meta charset='utf-8'><title>stepbudget</title></head><body>"
            f"<h1>stepbudget {html.escape(__version__)}</h1>"
            "<p><a href='/metrics'>/metrics</a> · <a href='/-/healthy'>/-/healthy</a> · "
            "<a href='/-/ready'>/-/ready</a></p>"
            "<table border='1' cellpadding='4'><tr><th>deployment</th><th>target</th><th>engine</th>"
            "<th>state</th><th>detail</th></tr>"
            f"{rows or '<tr><td colspan=5>no targets discovered yet</td></tr>'}</table></body></html>"
        )
        return Response(200, page.encode(), "text/html; charset=utf-8")


def _make_handler(server: StepBudgetServer) -> type[BaseHTTPRequestHandler]:
    class _Handler(BaseHTTPRequestHandler):
        server_version = f"stepbudget/{__version__}"
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes; with Nagle on, the body waits for the client's
        # delayed ACK (40 ms on Linux) on every keep-alive request. TCP_NODELAY sends it at once.
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def _dispatch(self, method: str) -> None:
            path, _, query = self.path.partition("?")
            handler = server.routes.get((method, path))
            if handler is None:
                known = any(route_path == path for _, route_path in server.routes)
                self._send(Response(405 if known else 404, b"Method not allowed\n" if known else b"Not found\n"))
                return
            length_text = self.headers.get("Content-Length", "0") or "0"
            length = int(length_text) if length_text.isdigit() else -1
            if length < 0 or length > MAX_REQUEST_BODY_BYTES:
                self._send(Response(413, b"Request body too large or malformed\n"))
                return
            body = self.rfile.read(length) if length else b""
            request = Request(method, path, query, {k.lower(): v for k, v in self.headers.items()}, body)
            try:
                response = handler(request)
            except Exception:
                log.exception("http_handler_failed", method=method, path=path)
                response = Response(500, b"Internal error\n")
            self._send(response)

        def _send(self, response: Response) -> None:
            self.send_response(response.status)
            self.send_header("Content-Type", response.content_type)
            self.send_header("Content-Length", str(len(response.body)))
            for name, value in response.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(response.body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # scrapes every 15 s would flood the log; failures are logged by the handlers

    return _Handler
