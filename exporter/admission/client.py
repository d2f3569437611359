"""A small client for gateway authors: ask stepbudget's admission API before sending a request.

    client = AdmissionClient("http://stepbudget:9421", token, timeout_seconds=0.5)
    try:
        with client.admitted(prompt_tokens=1800, max_output_tokens=512, pool="auto") as ticket:
            forward(request, to=ticket.target)          # released when the block exits
    except AdmissionRefused as refused:
        answer_429(retry_after=refused.result.retry_after_seconds,
                   or_send_to=refused.result.long_context_pool)

Every call has a timeout (connect and read): a gateway must never hang on its admission check.
A daemon that cannot be reached raises AdmissionUnavailable; whether to send the request anyway
(fail open) is the gateway's choice (the ASGI middleware in exporter.admission.integrations.asgi fails open
by default: admission protects speed, it must not become an outage of its own).
Standard library only (http.client, one keep-alive connection per thread): a gateway pays about
half a millisecond per decision on loopback (benchmarks/results/admission.md), and needs none of
the daemon's dependencies.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

DEFAULT_TIMEOUT_SECONDS = 1.0


class AdmissionError(Exception):
    """The admission API answered with an error (400/401/5xx): `status` and the daemon's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"admission API {status}: {message}")
        self.status = status
        self.message = message


class AdmissionUnavailable(AdmissionError):
    """The daemon could not be reached in time (connection refused, timeout, reset)."""


@dataclass(frozen=True)
class AdmissionResult:
    """The daemon's answer to POST /v1/admission (see docs/admission.md for each field)."""

    decision: str  # admitted | refused | redirected
    deployment: str
    pool: str | None
    tokens: int
    tokens_left: float
    reason: str
    id: str | None = None
    target: str | None = None
    lease_seconds: float | None = None
    retry_after_seconds: int | None = None
    long_context_pool: str | None = None

    @property
    def admitted(self) -> bool:
        return self.decision == "admitted"

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> AdmissionResult:
        names = cls.__dataclass_fields__
        return cls(**{name: value for name, value in body.items() if name in names})


class AdmissionRefused(Exception):
    """Raised by `AdmissionClient.admitted` when the request does not fit; `result` says why,
    when to ask again (`retry_after_seconds`) and which long-context pool would take it."""

    def __init__(self, result: AdmissionResult) -> None:
        super().__init__(f"{result.decision}: {result.reason}")
        self.result = result


class AdmissionClient:
    """Thread-safe: each thread keeps its own keep-alive connection to the daemon."""

    def __init__(self, url: str, token: str, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be greater than zero, got {timeout_seconds!r}")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http(s)://HOST[:PORT][/PREFIX], got {url!r}")
        self.url = url.rstrip("/")
        self.timeout_seconds = timeout_seconds
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                         "Accept": "application/json"}
        self._local = threading.local()
        self._connections: list[http.client.HTTPConnection] = []
        self._connections_lock = threading.Lock()

    def admit(self, prompt_tokens: int, max_output_tokens: int, *, deployment: str | None = None,
              pool: str | None = None) -> AdmissionResult:
        """Ask; a refusal is a result (decision `refused`/`redirected`), not an exception."""
        body: dict[str, Any] = {"prompt_tokens": prompt_tokens, "max_output_tokens": max_output_tokens}
        if deployment is not None:
            body["deployment"] = deployment
        if pool is not None:
            body["pool"] = pool
        status, answer = self._post("/v1/admission", body)
        if status in (200, 429):
            return AdmissionResult.from_json(answer)
        raise AdmissionError(status, str(answer.get("error", answer)))

    def release(self, admission_id: str) -> bool:
        """True when released; False when the daemon no longer knows the id (already released,
        or its lease ran out): either way it no longer holds budget."""
        status, answer = self._post("/v1/release", {"id": admission_id})
        if status == 200:
            return True
        if status == 404:
            return False
        raise AdmissionError(status, str(answer.get("error", answer)))

    @contextmanager
    def admitted(self, prompt_tokens: int, max_output_tokens: int, *, deployment: str | None = None,
                 pool: str | None = None) -> Iterator[AdmissionResult]:
        """Admit for the duration of the block and release on exit, even when the block raises.
        Raises AdmissionRefused when the request does not fit."""
        result = self.admit(prompt_tokens, max_output_tokens, deployment=deployment, pool=pool)
        if not result.admitted or result.id is None:
            raise AdmissionRefused(result)
        try:
            yield result
        finally:
            self.release(result.id)

    def close(self) -> None:
        with self._connections_lock:
            for connection in self._connections:
                connection.close()
            self._connections.clear()
        self._local = threading.local()

    def __enter__(self) -> AdmissionClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            # The socket timeout bounds the connect and every read: no call waits longer.
            connection = kind(self._host, self._port, timeout=self.timeout_seconds)
            self._local.connection = connection
            with self._connections_lock:
                self._connections.append(connection)
        return connection

    def _post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        payload = json.dumps(body).encode("utf-8")
        for attempt in (1, 2):
            connection = self._connection()
            reused = connection.sock is not None
            try:
                connection.request("POST", self._prefix + path, payload, self._headers)
                response = connection.getresponse()
                raw = response.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as error:
                connection.close()
                # A keep-alive connection the daemon closed while idle: the request never reached
                # it, so sending it once more on a fresh connection cannot admit twice.
                if not (reused and attempt == 1):
                    raise AdmissionUnavailable(0, f"{self.url}{path}: {type(error).__name__}: {error}") from None
            except (OSError, http.client.HTTPException) as error:
                connection.close()
                raise AdmissionUnavailable(0, f"{self.url}{path}: {type(error).__name__}: {error}") from None
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = {"error": raw.decode("utf-8", "replace").strip()[:200] or response.reason}
        if not isinstance(answer, dict):
            answer = {"error": repr(answer)[:200]}
        return response.status, answer
