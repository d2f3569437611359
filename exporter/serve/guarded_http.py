"""The daemon's HTTP transport: uvicorn's h11 server with the limits a hostile client meets.

Why uvicorn (asyncio, one thread for every connection) and not http.server (one thread per connection):
there, 40 half-sent requests held 40 threads for as long as their clients liked, and the bearer token was
checked only after the body was read; enough of them and /metrics and the probes went with them. Here a
connection costs a few kilobytes and no thread, and each limit is uvicorn's own where it has one:

  what                                   mechanism                                      answer
  more than `max_connections` open       uvicorn's `limit_concurrency`                  503, closed
  more than twice that many              `connection_made` here                         reset at once
  head (request line + headers) larger   h11's `max_incomplete_event_size`, with the    431, closed
    than `max_header_bytes`                status h11 hints (uvicorn says 400)
  head not complete `header_timeout`     a timer here (uvicorn has only an idle one)    408, closed
    after the connection opened or the
    previous answer was sent
  idle keep-alive past `keep_alive`      uvicorn's `timeout_keep_alive`                 closed
  body over the route's limit            declared: before reading; chunked: counted     413, closed
  body not in `body_timeout`             asyncio.timeout around the reads               408, closed
  answer not handed to the socket within a timer here                                   408 or reset
    `response_timeout` of the head
  no or a wrong bearer token             the route's `authorize`, before any body read  401, closed
                                          (no `100 Continue` is ever sent for it)

Answers are written in `write_chunk_bytes` pieces, each after the socket took the last (uvicorn's flow
control): a client that does not read holds one piece, never a whole 3 MB page. A connection whose answer
cannot be flushed is reset at the next deadline instead of lingering.

uvicorn is used through its public Config/Server and one subclass of its h11 protocol (`GuardedH11`),
which relies on these parts of uvicorn 0.55 (pinned in pyproject.toml, tested in
tests/serve/test_http_hostile.py):
`handle_events` creates `self.cycle` for each request head, `on_response_complete` is called once an
answer is written, `send_400_response` is called inside `except h11.RemoteProtocolError`, and
`self.connections` is the server's set of open connections.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_HEADER_TIMEOUT_SECONDS = 10.0
DEFAULT_BODY_TIMEOUT_SECONDS = 10.0
DEFAULT_RESPONSE_TIMEOUT_SECONDS = 60.0
DEFAULT_KEEP_ALIVE_SECONDS = 5
DEFAULT_MAX_HEADER_BYTES = 16 * 1024  # h11's own default; nginx allows 8 KB per header line
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_WRITE_CHUNK_BYTES = 64 * 1024
DEFAULT_HANDLER_THREADS = 4


@dataclass(frozen=True)
class ServerLimits:
    """Every bound of the daemon's HTTP server (docs/operations.md, "The HTTP server")."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout_seconds: float = DEFAULT_HEADER_TIMEOUT_SECONDS
    body_timeout_seconds: float = DEFAULT_BODY_TIMEOUT_SECONDS
    response_timeout_seconds: float = DEFAULT_RESPONSE_TIMEOUT_SECONDS
    keep_alive_seconds: int = DEFAULT_KEEP_ALIVE_SECONDS
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    write_chunk_bytes: int = DEFAULT_WRITE_CHUNK_BYTES
    handler_threads: int = DEFAULT_HANDLER_THREADS

    def __post_init__(self) -> None:
        for name in ("max_connections", "keep_alive_seconds", "max_header_bytes", "max_body_bytes",
                     "write_chunk_bytes", "handler_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("header_timeout_seconds", "body_timeout_seconds", "response_timeout_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be above 0, got {getattr(self, name)}")

    @property
    def reset_above_connections(self) -> int:
        """Past this many open connections a new one is reset without a word: up to it, the ones past
        `max_connections` are held (at most the header timeout) only to be told 503."""
        return 2 * self.max_connections


def plain_answer(status: int, text: str) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, for moments h11 has no request to answer."""
    body = text.encode("utf-8")
    phrase = HTTPStatus(status).phrase
    return (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode("latin-1") + body


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol plus a head deadline, a response deadline, a hard connection ceiling and
    the status h11 hints for a refused head (431 for one too large). `limits` is set by `protocol_for`."""

    limits: ServerLimits = ServerLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._served = 0  # answers completed on this connection
        self._heard = False  # bytes received since the last answer (or since the connection opened)

    # --- uvicorn's hooks ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn's own signature
        super().connection_made(transport)
        if len(self.connections) > self.limits.reset_above_connections:
            transport.abort()  # connection_lost takes it out of `connections`
            return
        # The most an answer may leave queued in this process for a client that reads slowly.
        transport.set_write_buffer_limits(high=self.limits.write_chunk_bytes)
        self._arm(self.limits.header_timeout_seconds, self._head_overdue)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._heard = True
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and not self.transport.is_closing():
            # A request's head was read: its answer must be on its way within the response timeout.
            self._arm(self.limits.response_timeout_seconds, self._response_overdue)

    def on_response_complete(self) -> None:
        self._served += 1
        self._heard = False
        super().on_response_complete()
        # The next head (keep-alive), or, for a connection being closed, the flush of this answer.
        self._arm(self.limits.header_timeout_seconds, self._head_overdue)

    def send_400_response(self, msg: str) -> None:
        """uvicorn answers every unreadable head 400; h11 says which status fits (431: the head is too
        large, 501: a transfer coding it does not know). Called inside uvicorn's `except` for it."""
        error = sys.exc_info()[1]
        status = getattr(error, "error_status_hint", 400)
        if status == 400 or not isinstance(status, int):
            super().send_400_response(msg)
            return
        self.transport.write(plain_answer(status, HTTPStatus(status).description + "\n"))
        self.transport.close()

    # --- deadlines ----------------------------------------------------------------------------

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, then)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_overdue(self) -> None:
        self._deadline = None
        transport = self.transport
        if transport.is_closing():
            transport.abort()  # still closing: the peer does not read what is left of the last answer
        elif self._served and not self._heard:
            transport.close()  # an idle keep-alive connection: nothing to answer
        else:
            transport.write(plain_answer(408, "Request Timeout: the request line and headers took too long\n"))
            transport.close()

    def _response_overdue(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and not self.transport.is_closing():
            # Nothing sent yet (the body is still trickling in, or the handler is still working).
            cycle.disconnected = True  # what the application sends later goes nowhere
            cycle.message_event.set()
            self.transport.write(plain_answer(408, "Request Timeout: the request took too long\n"))
            self.transport.close()
        else:
            self.transport.abort()  # half an answer sent and the client stopped reading: nothing else to say


def protocol_for(limits: ServerLimits) -> type[GuardedH11]:
    """A GuardedH11 for these limits (uvicorn builds the protocol itself, from the class)."""
    return type("GuardedH11ForServer", (GuardedH11,), {"limits": limits})


# --- the ASGI side: bodies read under limits, answers written in pieces ---------------------------

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyRefused(Exception):
    """The body cannot be read: `status` (408, 413) says why; the connection is closed after it."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


class Disconnected(Exception):
    """The client left before its body was read."""


def declared_length(headers: Mapping[str, str]) -> int | None:
    """The body length a request declares (h11 has checked it is a number); None for a chunked body."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return None
    return int(headers.get("content-length", "0") or "0")


async def read_body(receive: Receive, headers: Mapping[str, str], max_bytes: int, timeout_seconds: float) -> bytes:
    """The whole body, at most `max_bytes`, within `timeout_seconds`; BodyRefused (413 or 408) else.
    A declared length over the limit is refused before anything is read."""
    length = declared_length(headers)
    if length is not None and length > max_bytes:
        raise BodyRefused(413, f"Content Too Large: the body is over {max_bytes:,} bytes\n")
    if length == 0:
        return b""
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_seconds):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise Disconnected
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > max_bytes:
                    raise BodyRefused(413, f"Content Too Large: the body is over {max_bytes:,} bytes\n")
                parts.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(parts)
    except TimeoutError:
        raise BodyRefused(408, f"Request Timeout: the body took over {timeout_seconds:g}s\n") from None


async def send_answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]],
                      chunk_bytes: int, *, close: bool = False) -> None:
    """Status, headers and the body in `chunk_bytes` pieces, each sent once the socket took the last."""
    all_headers = [*headers, (b"content-length", str(len(body)).encode("ascii"))]
    if close:
        all_headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    if not body:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    for start in range(0, len(body), chunk_bytes):
        end = start + chunk_bytes
        await send({"type": "http.response.body", "body": body[start:end], "more_body": end < len(body)})
