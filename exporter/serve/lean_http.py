"""A lean keep-alive HTTP/1.1 GET for plain `http://` targets.

Why not urllib3 here: per request it builds header objects, reads the head through http.client's
email parser, checks the connection, clones its timeout and wraps the body in layers of readers.
For one 19 KB page that was 0.33 ms of CPU against 0.05 ms for the same GET over a bare socket
(benchmarks/results/scale.md), a third of what the daemon pays per target-poll. A poll needs
little of HTTP: one GET per target on a kept-alive connection, a status, a body framed by
Content-Length, chunked encoding or the end of the connection, maybe gzip. That is all this does;
https stays on urllib3 (TLS is its job), and so do the failure reasons: the errors raised here are
urllib3's own exception types with urllib3's own messages, so fetch.py names them exactly as it
names urllib3's (tests/serve/test_lean_http.py compares the two on the same hostile servers).

Protocol reference: RFC 9112 (HTTP/1.1 message syntax: status line, header fields, chunked
transfer coding, message body length in section 6.3), read as CPython's http.client reads it
(Lib/http/client.py: `_read_status`, `_read_chunked`, 1xx answers skipped, lines ending in LF or
CRLF).
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
import zlib
from collections.abc import Callable

from urllib3.exceptions import DecodeError, IncompleteRead, ProtocolError

CHUNK_BYTES = 65536
MAX_HEAD_BYTES = 65536  # http.client's _MAXLINE is per line; a whole head past this is no metrics server
MAX_LINE_BYTES = 65536
_NO_BODY_STATUSES = frozenset({204, 304})


class LeanPool:
    """Idle keep-alive sockets to one (host, port), as many as fetches ran on it at once.

    Every socket operation is bounded by `timeout_seconds` (the socket's own timeout); `track` is
    told each socket a fetch uses, so the fetch watchdog can shut it down at the overall deadline.
    """

    def __init__(self, host: str, port: int | None, timeout_seconds: float,
                 track: Callable[[socket.socket], None]) -> None:
        # urllib3's parse_url keeps an IPv6 literal's brackets: the socket wants the bare address.
        self._address = (host.strip("[]"), port or 80)
        # RFC 9112 section 3.2: Host is the authority, the port left out when it is the default.
        host_text = f"[{host}]" if ":" in host and not host.startswith("[") else host
        self.host_header = host_text if port in (None, 80) else f"{host_text}:{port}"
        self._timeout_seconds = timeout_seconds
        self._track = track
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._closed = True
        for sock in idle:
            sock.close()

    def get(self, path: str, headers: dict[str, str]) -> LeanResponse:
        """Sends `GET path` and reads the status line and headers; the body is left to the response.

        Raises ConnectionError (connect), TimeoutError, or urllib3's ProtocolError, as urllib3 would.
        """
        lines = [f"GET {path} HTTP/1.1", f"Host: {self.host_header}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        try:
            sock = self._checkout()
        except OSError as error:
            if isinstance(error, TimeoutError):
                raise
            # urllib3's NewConnectionError wording, less its connection object's repr.
            raise ConnectionError(f"Failed to establish a new connection: {error}") from None
        try:
            self._track(sock)
            sock.sendall(request)
            return _read_head(sock, self)
        except OSError as error:
            sock.close()
            if isinstance(error, TimeoutError):
                raise
            raise ProtocolError("Connection aborted.", error) from None  # as urllib3's urlopen words it
        except BaseException:
            sock.close()
            raise

    def checkin(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(sock)
                return
        sock.close()

    def _checkout(self) -> socket.socket:
        while True:
            with self._lock:
                sock = self._idle.pop() if self._idle else None
            if sock is None:
                break
            if _still_open(sock):
                return sock
            sock.close()  # the server hung up while it was idle (uvicorn's keep-alive is 5 s): reconnect
        sock = socket.create_connection(self._address, timeout=self._timeout_seconds)
        # As urllib3 does: the request is one small write; never wait for Nagle.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


def _still_open(sock: socket.socket) -> bool:
    """An idle keep-alive socket is usable only if nothing is waiting on it: readable means the
    server closed it (or sent something unasked, which would garble the next answer)."""
    poller = select.poll()  # not select.select: descriptors past 1024 are routine at 5,000 targets
    poller.register(sock, select.POLLIN)
    return not poller.poll(0)


def _remote_closed() -> ProtocolError:
    return ProtocolError("Connection aborted.",
                         http.client.RemoteDisconnected("Remote end closed connection without response"))


def _read_head(sock: socket.socket, pool: LeanPool) -> LeanResponse:
    """Reads until the end of a final (non-1xx) head; the bytes after it are the body's start."""
    buffer = b""
    while True:
        end, skip = _head_end(buffer)
        while end < 0:
            data = sock.recv(CHUNK_BYTES)
            if not data:
                if not buffer:
                    raise _remote_closed()
                raise ProtocolError("Connection aborted.", http.client.IncompleteRead(buffer))
            buffer += data
            if len(buffer) > MAX_HEAD_BYTES:
                raise ProtocolError("Connection aborted.", http.client.LineTooLong("header line"))
            end, skip = _head_end(buffer)
        head, buffer = buffer[:end], buffer[end + skip:]
        response = _parse_head(head.decode("iso-8859-1"), sock, pool, buffer)
        if response is not None:
            return response


def _head_end(buffer: bytes) -> tuple[int, int]:
    """Where the head ends (the index of the blank line's LF before it) and how long that end is."""
    crlf = buffer.find(b"\n\r\n")
    # A bare-LF end can only come first if it lies before the CRLF one: never scan the body for it.
    lf = buffer.find(b"\n\n", 0, crlf + 2) if crlf >= 0 else buffer.find(b"\n\n")
    if lf >= 0:
        return lf, 2
    return crlf, 3 if crlf >= 0 else 0


def _parse_head(head: str, sock: socket.socket, pool: LeanPool, rest: bytes) -> LeanResponse | None:
    lines = head.split("\n")
    status_line = lines[0] + "\n"  # as http.client reads it, to name it in BadStatusLine
    parts = status_line.split(None, 2)
    version = parts[0] if parts else ""
    if not version.startswith("HTTP/") or len(parts) < 2:
        raise ProtocolError("Connection aborted.", http.client.BadStatusLine(status_line))
    try:
        status = int(parts[1])
    except ValueError:
        raise ProtocolError("Connection aborted.", http.client.BadStatusLine(status_line)) from None
    if not 100 <= status <= 999:
        raise ProtocolError("Connection aborted.", http.client.BadStatusLine(status_line))
    if 100 <= status < 200:
        return None  # an interim answer (100 Continue): the real one follows, as http.client skips it
    headers: dict[str, str] = {}
    name = ""
    for raw in lines[1:]:
        line = raw.rstrip("\r")
        if not line:
            continue
        if line[0] in " \t" and name:  # obsolete line folding (RFC 9112 section 5.2)
            headers[name] += " " + line.strip()
            continue
        field, _, value = line.partition(":")
        name = field.strip().lower()
        value = value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return LeanResponse(status, version, headers, sock, pool, rest)


class LeanResponse:
    """One answer: status and headers read, the body read by `read1` one receive at a time."""

    def __init__(self, status: int, version: str, headers: dict[str, str], sock: socket.socket,
                 pool: LeanPool, rest: bytes) -> None:
        self.status = status
        self.headers = headers
        self._sock: socket.socket | None = sock
        self._pool = pool
        self._buffer = rest
        self._complete = False
        connection = headers.get("connection", "").lower()
        self._reusable = version == "HTTP/1.1" and "close" not in connection
        self._length: int | None = None
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self._chunk_left = 0
        self._chunk_started = False
        self._body_bytes = 0  # Content-Length body bytes so far, for the reason when it is cut short
        if status in _NO_BODY_STATUSES:
            self._length = 0
        elif not self._chunked:
            declared = headers.get("content-length", "")
            if declared.isdigit():
                self._length = int(declared)
            else:
                self._reusable = False  # the body ends where the connection does
        encoding = headers.get("content-encoding", "").strip().lower()
        self._decoder: _Decoder | None = _Decoder(encoding) if encoding in ("gzip", "x-gzip", "deflate") else None

    def header(self, name: str) -> str:
        return self.headers.get(name.lower(), "")

    def read1(self) -> bytes:
        """The next decoded piece of the body, from at most one receive; b"" at its end.

        Raises urllib3's ProtocolError (with http.client's IncompleteRead and the like inside, as
        urllib3 words them) for a body cut short or badly framed, TimeoutError or OSError for the socket.
        """
        try:
            return self._read1()
        except TimeoutError:
            raise
        except OSError as error:  # as urllib3's _error_catcher words it
            raise ProtocolError(f"Connection broken: {error!r}", error) from None

    def redirect_location(self) -> str | None:
        """Where a redirect points (urllib3's REDIRECT_STATUSES), None for any other answer."""
        if self.status in (301, 302, 303, 307, 308):
            return self.headers.get("location") or None
        return None

    def _read1(self) -> bytes:
        decoder = self._decoder
        while True:
            if decoder is not None and decoder.pending:
                out = decoder.more()
                if out:
                    return out
            raw = self._raw()
            if decoder is None:
                return raw
            if not raw:
                return decoder.finish()
            out = decoder.feed(raw)
            if out:
                return out

    def finish(self, *, reuse: bool) -> None:
        """Back to the pool if the body was read to its end and the connection may be kept; else closed."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if reuse and self._complete and self._reusable and not self._buffer:
            self._pool.checkin(sock)
        else:
            sock.close()

    # --- the body's framing ------------------------------------------------------------------

    def _raw(self) -> bytes:
        """The next undecoded body bytes with the framing taken off; b"" at the body's end."""
        if self._complete:
            return b""
        if self._chunked:
            return self._raw_chunked()
        length = self._length
        if length is None:  # to the end of the connection
            data = self._take(CHUNK_BYTES)
            if not data:
                self._complete = True
            return data
        if length == 0:
            self._complete = True
            return b""
        data = self._take(length)
        if not data:
            # urllib3's own check and wording (response.py's _raw_read, enforce_content_length).
            raise _broken(IncompleteRead(self._body_bytes, length))
        self._body_bytes += len(data)
        self._length = length - len(data)
        if self._length == 0:
            self._complete = True
        return data

    def _raw_chunked(self) -> bytes:
        # Framed and failed as http.client's read1 does it (Lib/http/client.py `_read1_chunked`,
        # `_get_chunk_left`, `_read_next_chunk_size`), which is what urllib3 reads chunked bodies with.
        if self._chunk_left == 0:
            if self._chunk_started:
                self._toss_crlf()
            line = self._line()
            self._chunk_started = True
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise _broken(http.client.IncompleteRead(b"")) from None
            if size < 0:
                raise _broken(http.client.IncompleteRead(b""))
            if size == 0:
                # Trailer fields up to the blank line; a server hanging up here has still sent the body.
                while True:
                    trailer = self._line()
                    if trailer in (b"\r\n", b"\n", b""):
                        self._reusable = self._reusable and trailer != b""
                        break
                self._complete = True
                return b""
            self._chunk_left = size
        data = self._take(self._chunk_left)
        if not data:
            raise _broken(http.client.IncompleteRead(b""))
        self._chunk_left -= len(data)
        return data

    def _take(self, most: int) -> bytes:
        buffer = self._buffer
        if buffer:
            if len(buffer) <= most:
                self._buffer = b""
                return buffer
            self._buffer = buffer[most:]
            return buffer[:most]
        sock = self._sock
        if sock is None:
            return b""
        return sock.recv(min(most, CHUNK_BYTES))

    def _line(self) -> bytes:
        """The next framing line with its line end, as readline gives it (b"" at the connection's end)."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line, self._buffer = self._buffer[:end + 1], self._buffer[end + 1:]
                return line
            if len(self._buffer) > MAX_LINE_BYTES:
                raise _broken(http.client.LineTooLong("chunk size"))
            data = self._sock.recv(CHUNK_BYTES) if self._sock is not None else b""
            if not data:
                line, self._buffer = self._buffer, b""
                return line
            self._buffer += data

    def _toss_crlf(self) -> None:
        """The two bytes after a chunk's data (CR LF), tossed unread as http.client does."""
        got = b""
        while len(got) < 2:
            data = self._take(2 - len(got))
            if not data:
                raise _broken(http.client.IncompleteRead(got, 2 - len(got)))
            got += data


def _broken(error: Exception) -> ProtocolError:
    return ProtocolError(f"Connection broken: {error!r}", error)


class _Decoder:
    """gzip or deflate, inflating at most CHUNK_BYTES per call: a gzip bomb is never held whole."""

    def __init__(self, encoding: str) -> None:
        self._encoding = encoding
        self._deflate = encoding == "deflate"
        # deflate: zlib-wrapped as RFC 9110 says, or raw as some servers send it (urllib3 takes both).
        self._inflate = zlib.decompressobj(zlib.MAX_WBITS if self._deflate else 16 + zlib.MAX_WBITS)
        self._first = True

    @property
    def pending(self) -> bool:
        return bool(self._inflate.unconsumed_tail)

    def more(self) -> bytes:
        return self._run(self._inflate.unconsumed_tail)

    def feed(self, data: bytes) -> bytes:
        return self._run(data)

    def finish(self) -> bytes:
        try:
            return self._inflate.flush()
        except zlib.error as error:
            raise ProtocolError(f"Connection broken: {error!r}", error) from None

    def _run(self, data: bytes) -> bytes:
        try:
            out = self._inflate.decompress(data, CHUNK_BYTES)
        except zlib.error as error:
            if self._deflate and self._first:
                self._inflate = zlib.decompressobj(-zlib.MAX_WBITS)
                self._first = False
                return self._run(data)
            raise DecodeError(f"Received response with content-encoding: {self._encoding}, but failed to decode it.",
                              error) from None
        self._first = False
        return out
