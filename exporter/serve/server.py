"""The daemon's HTTP server: /metrics, /-/healthy, /-/ready, a landing page, and a route table.

A small route table (method, path) -> handler lets other modules (admission: `POST /v1/admission`,
`POST /v1/release`) add endpoints with `register_route` without editing this file; a route may say who
may call it (`authorize`, checked on the headers before any byte of the body is read) and how large
its body may be.

The transport is uvicorn's h11 server on one asyncio thread, with the limits of
exporter/serve/guarded_http.py (timeouts, sizes, a connection cap). Handlers are plain functions: the
probes run on the event loop (they only read a flag), every other handler on a small thread pool, so a
/metrics render never stalls the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gzip
import html
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import structlog
import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.openmetrics import exposition as openmetrics

from exporter import __version__
from exporter.serve.exposition_writer import render_openmetrics, render_text
from exporter.serve.guarded_http import (
    BodyRefused,
    Disconnected,
    Receive,
    Scope,
    Send,
    ServerLimits,
    protocol_for,
    read_body,
    send_answer,
)

log = structlog.get_logger("stepbudget.server")

# How long `stop` lets answers in flight finish before it cancels them.
GRACEFUL_STOP_SECONDS = 2
# A backlog as deep as uvicorn's: connections the kernel queues while the loop is busy.
LISTEN_BACKLOG = 2048
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
# Who may call a route, from the request's headers (lower-cased names) alone: None lets the request in,
# a Response (401) answers it, before any byte of its body is read.
Authorize = Callable[[Mapping[str, str]], "Response | None"]


@dataclass(frozen=True)
class Route:
    handler: Handler
    authorize: Authorize | None = None
    max_body_bytes: int | None = None  # None: the server's limit
    on_loop: bool = False  # runs on the event loop: for handlers that only read a value


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
    """Serves the registry and the routes; `ready()` says whether the first poll finished.

    The listening socket is bound here (a port in use fails the daemon's start, and `port` is known at
    once); `start` serves it from a thread of its own, `stop` closes everything it opened."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, *,
                 ready: Callable[[], bool], targets: Callable[[], list[TargetRow]] = list,
                 limits: ServerLimits | None = None) -> None:
        self._registry = registry
        self.metrics_page = MetricsPage(registry)
        self._ready = ready
        self._targets = targets
        self.limits = limits or ServerLimits()
        self.routes: dict[tuple[str, str], Route] = {
            ("GET", "/metrics"): Route(self._metrics),
            ("GET", "/-/healthy"): Route(lambda request: Response(200, b"OK\n"), on_loop=True),
            ("GET", "/-/ready"): Route(self._ready_route, on_loop=True),
            ("GET", "/"): Route(self._landing),
        }
        self._socket = _listen(host, port)
        config = uvicorn.Config(
            self._asgi, http=protocol_for(self.limits), ws="none", lifespan="off", interface="asgi3",
            loop="asyncio", log_config=None, access_log=False, proxy_headers=False, server_header=False,
            headers=[("server", f"stepbudget/{__version__}")],
            limit_concurrency=self.limits.max_connections + 1,  # uvicorn counts the asking connection too
            timeout_keep_alive=self.limits.keep_alive_seconds,
            h11_max_incomplete_event_size=self.limits.max_header_bytes,
            timeout_graceful_shutdown=GRACEFUL_STOP_SECONDS, backlog=LISTEN_BACKLOG,
        )
        self._uvicorn = uvicorn.Server(config)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._socket.getsockname()[1])

    @property
    def registry(self) -> CollectorRegistry:
        """The served registry, for extensions that add a collector (admission)."""
        return self._registry

    def open_connections(self) -> int:
        """Connections open now (served, or waiting for their head or their 503)."""
        return len(self._uvicorn.server_state.connections)

    def register_route(self, method: str, path: str, handler: Handler, *, authorize: Authorize | None = None,
                       max_body_bytes: int | None = None) -> None:
        """Add an endpoint, e.g. `register_route("POST", "/v1/admission", handle, authorize=check)`:
        `authorize` sees the headers before the body is read; `max_body_bytes` caps the body (413)."""
        key = (method.upper(), path)
        if key in self.routes:
            raise ValueError(f"route {method} {path} is already registered")
        self.routes[key] = Route(handler, authorize, max_body_bytes)

    def start(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=self.limits.handler_threads,
                                                               thread_name_prefix="stepbudget-http-handler")
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._socket]},
                                        name="stepbudget-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and free the port; safe whether or not `start` was called, and twice."""
        if self._thread is not None:
            self._uvicorn.should_exit = True  # uvicorn's loop checks it every 0.1 s, then closes everything
            self._thread.join(timeout=GRACEFUL_STOP_SECONDS + 5)
            self._thread = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._socket.close()

    # --- the ASGI application -----------------------------------------------------------------------

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no lifespan, no websockets: uvicorn is told so, nothing else arrives
        method, path = str(scope["method"]), str(scope["path"])
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        route = self.routes.get((method, path))
        if route is None:
            known = any(route_path == path for _, route_path in self.routes)
            await self._answer(send, Response(405 if known else 404,
                                              b"Method not allowed\n" if known else b"Not found\n"), close=True)
            return
        if route.authorize is not None:
            refusal = route.authorize(headers)
            if refusal is not None:  # the body is never read: the connection closes after the answer
                await self._answer(send, refusal, close=True)
                return
        limit = self.limits.max_body_bytes if route.max_body_bytes is None else route.max_body_bytes
        try:
            body = await read_body(receive, headers, limit, self.limits.body_timeout_seconds)
        except BodyRefused as refused:
            await self._answer(send, Response(refused.status, refused.text.encode()), close=True)
            return
        except Disconnected:
            return
        query = bytes(scope.get("query_string", b"")).decode("latin-1")
        request = Request(method, path, query, headers, body)
        if route.on_loop:
            response = _handle(route.handler, request)
        else:
            executor = self._executor
            if executor is None:  # stopping
                return
            response = await asyncio.get_running_loop().run_in_executor(executor, _handle, route.handler, request)
        await self._answer(send, response)

    async def _answer(self, send: Send, response: Response, *, close: bool = False) -> None:
        headers = [(b"content-type", response.content_type.encode("latin-1"))]
        headers += [(name.lower().encode("latin-1"), value.encode("latin-1"))
                    for name, value in response.headers.items()]
        await send_answer(send, response.status, response.body, headers, self.limits.write_chunk_bytes, close=close)

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


def _handle(handler: Handler, request: Request) -> Response:
    try:
        return handler(request)
    except Exception:
        log.exception("http_handler_failed", method=request.method, path=request.path)
        return Response(500, b"Internal error\n")


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket (IPv4 unless the host is an IPv6 literal; "" is every interface)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets on Linux
    return sock
