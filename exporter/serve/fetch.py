"""Fetching one /metrics page: the HTTP GET the poller sends to each target, bounded so that no
server, however slow, large or hostile, can hold a fetch worker.

Why its own module: how a page is fetched (keep-alive pools, the lean HTTP/1.1 client, TLS,
redirects, the watchdog and the size cap) changes for reasons of its own (a urllib3 release, a
hostile server), apart from what the poll loop does with the page (exporter/serve/poller.py).
It knows nothing of the poller: the poller calls it through `Fetch`.

A fetch is bounded by a (connect, read) timeout AND an overall deadline checked between chunks (a
server trickling a byte a second cannot hold a worker), and by a size cap.

Measured against a well-kept alternative, pycurl's multi interface (benchmarks/fetch_path.py, result in
benchmarks/results/fetch_path.json: 19 KB pages over keep-alive http on 127.0.0.1, a 2-core VM, the
medians of 3 rounds of 6 cycles): pycurl used 0.026 ms of CPU a page where this client used 0.085 ms
at 1,000 targets and 0.045 ms at 5,000, with the same or lower wall time and RSS and no error in
either. pycurl is cheaper on the fetch alone. This client is kept for now: the saving is 2-7% of the
daemon's ~0.75 ms of CPU per target-poll (benchmarks/results/scale.md), pycurl would add a C extension
with its own libcurl and TLS stack as a runtime dependency, and the benchmark does not yet cover what
this module is for besides speed (https, trickling and oversized pages, the watchdog, the error reasons
tests/serve/test_lean_http.py and tests/serve/test_hostile.py hold it to).
"""

from __future__ import annotations

import heapq
import itertools
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable
from urllib.parse import urljoin

import structlog
from urllib3 import exceptions as urllib3_exceptions
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import LocationValueError
from urllib3.response import BaseHTTPResponse
from urllib3.util import Timeout, make_headers, parse_url

from exporter import __version__
from exporter.logs import say_tls_verification_is_off
from exporter.redaction import redact
from exporter.serve.config import Tls
from exporter.serve.engines import wanted_names
from exporter.serve.engines.exposition import WantedLines
from exporter.serve.lean_http import LeanPool, LeanResponse

# The poller's logger, as before the fetch had a module of its own: the log lines keep their source.
log = structlog.get_logger("stepbudget.poller")

CHUNK_BYTES = 65536
# The most fetches in flight at once: the poller's worker threads, and each keep-alive pool's depth.
MAX_FETCH_WORKERS = 32
MAX_CACHED_REQUESTS = 100_000
MAX_REDIRECTS = 5


class FetchError(Exception):
    """A fetch failed; `reason` is the short phrase logged and shown on the landing page."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@runtime_checkable
class AuthorizedFetch(Protocol):
    """A fetch that sends any `Authorization` header (HttpFetcher): what basic auth needs. A plain Fetch
    (tests' fakes, the simulated gateway) is called with bearer tokens only."""

    def fetch_authorized(self, url: str, *, authorization: str | None, tls: Tls) -> str: ...


class Fetch(Protocol):
    def __call__(self, url: str, *, bearer_token: str | None, tls: Tls) -> str: ...


# --- the overall deadline -------------------------------------------------------------------------
#
# requests' timeouts are per socket operation: a server that trickles one byte per second never
# trips them, in the headers or in the body. Two guards make the deadline hold:
#  - the body is read one recv at a time with the (injectable) clock checked between reads;
#  - a watchdog thread shuts down the sockets of a fetch still running at its deadline, which
#    unblocks a recv stuck anywhere (TLS handshake, status line, headers, body).
# The fetch's sockets are known through urllib3 connection classes that report them.

_fetch_sockets = threading.local()  # .armed: the current thread's fetch, whose sockets are collected


def _track(sock: socket.socket | None) -> None:
    armed: _Armed | None = getattr(_fetch_sockets, "armed", None)
    if sock is None or armed is None or sock in armed.sockets:
        return
    armed.sockets.append(sock)
    if armed.fired:
        # Connected after the watchdog shut the others down (it sets `fired`, then copies the list):
        # shut this one too, or it could hold the fetch for a whole socket timeout past the deadline.
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _TrackedHTTPConnection(HTTPConnection):
    def connect(self) -> None:
        super().connect()
        _track(self.sock)

    def request(self, *args: object, **kwargs: object) -> None:
        _track(self.sock)  # a reused keep-alive connection is not connected again
        super().request(*args, **kwargs)  # type: ignore[arg-type]  # passed through unchanged


class _TrackedHTTPSConnection(HTTPSConnection):
    def connect(self) -> None:
        super().connect()
        _track(self.sock)

    def request(self, *args: object, **kwargs: object) -> None:
        _track(self.sock)
        super().request(*args, **kwargs)  # type: ignore[arg-type]  # passed through unchanged


class _TrackedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _TrackedHTTPConnection


class _TrackedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _TrackedHTTPSConnection


@dataclass
class _Armed:
    deadline: float
    sockets: list[socket.socket]
    fired: bool = False
    done: bool = False


class _Watchdog:
    """One thread for all fetches: at a fetch's deadline, shut its sockets down."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._heap: list[tuple[float, int, _Armed]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, timeout_seconds: float) -> _Armed:
        armed = _Armed(time.monotonic() + timeout_seconds, [])
        with self._condition:
            heapq.heappush(self._heap, (armed.deadline, next(self._order), armed))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stepbudget-fetch-watchdog", daemon=True)
                self._thread.start()
            if self._heap[0][2] is armed:
                # Wake the watchdog only for a new earliest deadline: with one timeout for every
                # fetch that is only the first of a poll, not a thread switch per target.
                self._condition.notify()
        return armed

    def disarm(self, armed: _Armed) -> None:
        with self._condition:
            armed.done = True  # left in the heap; dropped when its deadline comes

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._heap:
                    self._condition.wait()
                deadline, _, armed = self._heap[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._condition.wait(wait)
                    continue
                heapq.heappop(self._heap)
                if armed.done:
                    continue
                armed.fired = True
                sockets = list(armed.sockets)
            for sock in sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed


_WATCHDOG = _Watchdog()


class HttpFetcher:
    """GET over keep-alive pools (one per target), with timeouts, an overall deadline and a size cap:
    lean_http.py's client for `http://` (a third of urllib3's CPU per page), urllib3 for `https://`
    (and for both with `lean_http=False`, which tests compare the lean client against).

    Why urllib3 and not `requests`: a `requests.Session` send re-merges headers, cookies, hooks and
    adapter settings at every call, ~0.6 ms of CPU per page against ~0.3 ms for the same keep-alive
    GET through a urllib3 pool (benchmarks/results/profile_hotpath_before.txt at commit 54bfaa1). Everything a fetch
    needs is fixed per target, so it is built once: the pool (host, port, TLS settings), the path,
    the headers per bearer token. Targets are connected to directly, as Prometheus does: the proxy
    environment variables are not read. Redirects are followed (at most MAX_REDIRECTS), the bearer
    token only to the same host, as `requests` did.
    """

    def __init__(self, timeout_seconds: float, max_response_bytes: int, *,
                 clock: Callable[[], float] = time.monotonic, lean_http: bool = True) -> None:
        self.timeout_seconds = timeout_seconds
        self.max_response_bytes = max_response_bytes
        self._clock = clock
        self._timeout = Timeout(connect=timeout_seconds, read=timeout_seconds)
        self._lean_http = lean_http
        self._pools: dict[tuple[str, str, int | None, Tls], _Pool] = {}
        self._routes: dict[tuple[str, Tls], tuple[_Pool, str, str]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
            self._routes.clear()
        for pool in pools:
            pool.close()

    def sizes(self) -> tuple[int, int]:
        """(pools, routes) cached: those of the URLs last kept (`retain`), each at most
        MAX_CACHED_REQUESTS + 1 (cleared whole past it)."""
        with self._lock:
            return len(self._pools), len(self._routes)

    def retain(self, urls: set[str]) -> None:
        """Forget the routes of every URL but these (the poll's targets) and close the pools no route
        uses: a pod that left takes its keep-alive sockets with it, not at the cache's cap."""
        with self._lock:
            self._routes = {key: route for key, route in self._routes.items() if key[0] in urls}
            used = {id(route[0]) for route in self._routes.values()}
            gone = {key: pool for key, pool in self._pools.items() if id(pool) not in used}
            for key in gone:
                del self._pools[key]
        for pool in gone.values():
            pool.close()

    def __call__(self, url: str, *, bearer_token: str | None, tls: Tls) -> str:
        return self.fetch_authorized(url, authorization=f"Bearer {bearer_token}" if bearer_token else None, tls=tls)

    def fetch_authorized(self, url: str, *, authorization: str | None, tls: Tls) -> str:
        """GET `url` with this `Authorization` header value (bearer or basic: config.Auth.authorization)."""
        armed = _WATCHDOG.arm(self.timeout_seconds)
        _fetch_sockets.armed = armed
        try:
            text = self._fetch(url, authorization, tls)
        except FetchError:
            if armed.fired:
                raise FetchError(f"timed out after {self.timeout_seconds:g}s") from None
            raise
        finally:
            _WATCHDOG.disarm(armed)
            _fetch_sockets.armed = None
        if armed.fired:  # a body cut short by the watchdog can read as a clean end: never use it
            raise FetchError(f"timed out after {self.timeout_seconds:g}s")
        return text

    def _fetch(self, url: str, authorization: str | None, tls: Tls) -> str:
        deadline = self._clock() + self.timeout_seconds
        response = self._get(url, authorization, tls)
        body = None
        complete = False
        try:
            if response.status != 200:
                raise FetchError(f"HTTP {response.status}")
            # No refusal on a declared Content-Length: past the cap the families read may still fit.
            body, complete, notes = self._read_body(response, deadline)
        finally:
            response.finish(reuse=complete)
        # The text exposition format is UTF-8 whatever the header says (Prometheus's exposition_formats
        # spec): never guess ISO-8859-1 for a text/plain without charset, which would garble names.
        text = body.decode("utf-8", errors="replace")
        return FetchedPage(text, notes) if notes else text

    def _get(self, url: str, authorization: str | None, tls: Tls) -> _Answer:
        """The response to GET `url`, after at most MAX_REDIRECTS redirects; errors as FetchError."""
        origin = None
        for _ in range(MAX_REDIRECTS + 1):
            pool, path, here = self._route(url, tls)
            origin = origin or here
            # Like `requests`: credentials go to the target's own host only, never where it redirects.
            response = _send(pool, path, _headers(authorization if here == origin else None), self._timeout)
            location = response.redirect_location()
            if not location:
                return response
            response.finish(reuse=False)
            url = urljoin(url, location)
        raise FetchError(f"more than {MAX_REDIRECTS} redirects")

    def _route(self, url: str, tls: Tls) -> tuple[_Pool, str, str]:
        """(pool, request path, origin) for a URL: parsed once per (URL, TLS settings), not per poll."""
        key = (url, tls)
        route = self._routes.get(key)
        if route is None:
            try:
                parsed = parse_url(url)
            except LocationValueError as error:
                raise FetchError(redact(f"request failed: invalid URL {url!r}: {error}")) from None
            if parsed.scheme not in ("http", "https") or not parsed.host:
                raise FetchError(f"request failed: not an http(s) URL: {redact(url)!r}")
            route = (self._pool(parsed.scheme, parsed.host, parsed.port, tls), parsed.request_uri,
                     f"{parsed.scheme}://{parsed.host}:{parsed.port}")
            with self._lock:
                if len(self._routes) > MAX_CACHED_REQUESTS:
                    self._routes.clear()  # targets come and go: never grow without bound
                self._routes[key] = route
        return route

    def _pool(self, scheme: str, host: str, port: int | None, tls: Tls) -> _Pool:
        """One keep-alive pool per (scheme, host, port, TLS settings), as deep as the fetch workers."""
        key = (scheme, host, port, tls if scheme == "https" else Tls())
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                if len(self._pools) > MAX_CACHED_REQUESTS:
                    for old in self._pools.values():
                        old.close()
                    self._pools.clear()
                    self._routes.clear()
                if scheme == "http" and self._lean_http:
                    pool = LeanPool(host, port, self.timeout_seconds, _track)
                else:
                    pool = _new_pool(scheme, host, port, tls, self._timeout)
                self._pools[key] = pool
        return pool

    def _read_body(self, response: _Answer, deadline: float) -> tuple[bytes, bool, tuple[str, ...]]:
        """(the body, whether it was read to its end, notes on what was left out).

        Up to `max_response_bytes` the body is kept whole (the scanner looks at the names of the lines
        it does not read, and no more). Past it, the page goes through WantedLines: only the lines of
        the families the engine adapters read are kept, and only they and lines of no family count
        against the cap. If even those pass it, the page is cut there: the families before the cut
        are read (a note says so), or, with none of them, the fetch fails as before. A page of
        families the daemon does not read is bounded by the fetch's deadline, not by the cap.
        """
        cap = self.max_response_bytes
        chunks: list[bytes] = []
        size = 0
        wanted: WantedLines | None = None
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise FetchError(f"timed out after {self.timeout_seconds:g}s reading the body")
            try:
                # read1: return what one recv gives, so the deadline is checked between trickled bytes.
                chunk = response.read1()
            except Exception as error:
                if "timed out" in str(error).lower():
                    raise FetchError(f"timed out after {self.timeout_seconds:g}s reading the body") from None
                raise FetchError(f"body read failed: {_short(error)}") from None
            if not chunk:
                break
            if wanted is not None:
                if not wanted.feed(chunk):
                    break
                continue
            size += len(chunk)
            chunks.append(chunk)
            if size > cap:
                wanted = WantedLines(wanted_names("auto"), cap)
                while chunks and wanted.feed(chunks.pop(0)):
                    pass
                chunks.clear()
                if wanted.over:
                    break
        if wanted is None:
            return b"".join(chunks), True, ()
        if wanted.over and not wanted.kept_any:
            raise FetchError(f"response over {cap} bytes")
        if wanted.over:
            note = (f"page over max_response_bytes ({cap} bytes) even without the families stepbudget does not "
                    "read: cut there, the families after the cut are missing (raise max_response_bytes)")
        else:
            note = (f"page over max_response_bytes ({cap} bytes): only the families stepbudget reads were kept "
                    f"(the largest family skipped: {wanted.largest_skipped() or 'none'})")
        return wanted.text(), not wanted.over, (note,)


class FetchedPage(str):
    """A page's text with `notes` on what the fetch left out (past the size cap), which the poller adds
    to the page's problems: one log line per change, and the reason when the page cannot be read."""

    notes: tuple[str, ...]

    def __new__(cls, text: str, notes: tuple[str, ...] = ()) -> FetchedPage:
        page = super().__new__(cls, text)
        page.notes = notes
        return page


class _Urllib3Answer:
    """A urllib3 response as the fetch reads it (LeanResponse's few methods): https, or every
    scheme when the lean client is off."""

    def __init__(self, response: BaseHTTPResponse) -> None:
        self._response = response
        self.status = response.status

    def header(self, name: str) -> str:
        return str(self._response.headers.get(name, ""))

    def redirect_location(self) -> str | None:
        return self._response.get_redirect_location() or None

    def read1(self) -> bytes:
        return self._response.read1(CHUNK_BYTES, decode_content=True)

    def finish(self, *, reuse: bool) -> None:
        _finish(self._response, reuse=reuse)


_Answer = LeanResponse | _Urllib3Answer
_Pool = LeanPool | HTTPConnectionPool


# Ask for the text format: some servers answer OpenMetrics or protobuf on content negotiation. Public: the
# fetch-path benchmark sends the same headers from its other client.
BASE_HEADERS = {"User-Agent": f"stepbudget/{__version__}", "Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1",
                 **make_headers(accept_encoding=True)}


def _headers(authorization: str | None) -> dict[str, str]:
    if not authorization:
        return BASE_HEADERS
    return {**BASE_HEADERS, "Authorization": authorization}


def _new_pool(scheme: str, host: str, port: int | None, tls: Tls, timeout: Timeout) -> HTTPConnectionPool:
    """A pool whose connections report their sockets to the watchdog; TLS verified unless told not
    to (the CA file given, else the system's trust store), with the client certificate when one is given."""
    if scheme == "http":
        return _TrackedHTTPPool(host, port, timeout=timeout, maxsize=MAX_FETCH_WORKERS, retries=False)
    verify = tls.verify
    if verify is False:
        say_tls_verification_is_off(log, f"{host}:{port}" if port else host)  # once: a pool lives with its target
        return _TrackedHTTPSPool(host, port, timeout=timeout, maxsize=MAX_FETCH_WORKERS, retries=False,
                                 cert_reqs="CERT_NONE", assert_hostname=False,
                                 cert_file=tls.cert_file, key_file=tls.key_file)
    return _TrackedHTTPSPool(host, port, timeout=timeout, maxsize=MAX_FETCH_WORKERS, retries=False,
                             cert_reqs="CERT_REQUIRED", ca_certs=verify if isinstance(verify, str) else None,
                             cert_file=tls.cert_file, key_file=tls.key_file)


def _send(pool: _Pool, path: str, headers: dict[str, str], timeout: Timeout) -> _Answer:
    """One GET, no retries (a failed poll is retried by the next poll); urllib3's errors (and the
    lean client's, worded as urllib3's) named as FetchError reasons, as `requests` named them before."""
    try:
        if isinstance(pool, LeanPool):
            return pool.get(path, headers)
        return _Urllib3Answer(pool.urlopen("GET", path, headers=headers, timeout=timeout, retries=False,
                                           redirect=False, preload_content=False, decode_content=True,
                                           assert_same_host=False))
    except urllib3_exceptions.SSLError as error:
        raise FetchError(f"TLS error: {_short(error)}") from None
    except urllib3_exceptions.NewConnectionError as error:  # before timeouts: it subclasses ConnectTimeoutError
        raise FetchError(f"connection failed: {_short(error)}") from None
    except (urllib3_exceptions.TimeoutError, TimeoutError):
        raise FetchError(f"timed out after {timeout.read_timeout:g}s") from None
    except (urllib3_exceptions.ProtocolError, OSError) as error:
        raise FetchError(f"connection failed: {_short(error)}") from None
    except urllib3_exceptions.HTTPError as error:
        raise FetchError(f"request failed: {_short(error)}") from None


def _finish(response: BaseHTTPResponse, *, reuse: bool) -> None:
    """Hand the connection back to its pool: kept alive when the body was read to its end, closed
    otherwise (a half-read body must never be the start of the next answer)."""
    if not reuse:
        response.close()
    response.release_conn()


def _short(error: BaseException) -> str:
    text = str(error)
    # urllib3 nests the useful part: "... (Caused by NewConnectionError('...: [Errno 111] Connection refused'))"
    for marker in ("Connection refused", "Name or service not known", "No route to host",
                   "Connection reset", "Remote end closed", "certificate verify failed"):
        if marker in text:
            return marker
    return text[:200]
