"""The HTTP API of admission, independent of the HTTP server: POST /v1/admission and /v1/release
bodies parsed and answered, with the bearer token checked."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from exporter.admission.book import (
    MAX_REQUEST_TOKENS,
    AdmissionBook,
    AdmissionRequest,
    Decision,
)
from exporter.errors import InputError
from exporter.suggest import close_names

# --- the HTTP API: POST /v1/admission, POST /v1/release ------------------------------------------

MAX_BODY_BYTES = 64 * 1024
ADMISSION_KEYS = ("deployment", "pool", "prompt_tokens", "max_output_tokens")
RELEASE_KEYS = ("id",)


@dataclass(frozen=True)
class ApiResponse:
    """What the daemon's HTTP server sends: a status, extra headers and a JSON body."""

    status: int
    body: Mapping[str, Any]
    headers: tuple[tuple[str, str], ...] = ()

    def encoded(self) -> bytes:
        return json.dumps(self.body, separators=(",", ":")).encode("utf-8")


class BadRequest(InputError):
    """The request's JSON is wrong: 400 with this message."""


def read_token_file(path: str) -> str:
    """The bearer token gateways must send; an empty or unreadable file is a config error."""
    try:
        with open(path, encoding="utf-8") as handle:
            token = handle.read().strip()
    except OSError as error:
        raise InputError(f"admission.token_file {path!r}: cannot read it: {error.strerror or error}") from None
    if not token:
        raise InputError(f"admission.token_file {path!r}: the file is empty; put the bearer token in it")
    return token


class AdmissionApi:
    """The two POST handlers, independent of the HTTP server that carries them.

    Every request needs `Authorization: Bearer <token>` (the token from `admission.token_file`):
    anyone who can admit can also starve the pool, so the API is never open.
    """

    def __init__(self, book: AdmissionBook, token: str) -> None:
        if not token:
            raise InputError("the admission API needs a non-empty bearer token")
        self.book = book
        self._token = token.encode("utf-8")

    def admission(self, headers: Mapping[str, str], body: bytes) -> ApiResponse:
        return self._guarded(headers, body, self._admit)

    def release(self, headers: Mapping[str, str], body: bytes) -> ApiResponse:
        return self._guarded(headers, body, self._release)

    def refusal(self, headers: Mapping[str, str]) -> ApiResponse | None:
        """None when the headers carry the bearer token, else the 401 to answer: an HTTP server calls
        this on the headers alone, before it reads any byte of the body."""
        if self._authorized(headers):
            return None
        return ApiResponse(401, {"error": "missing or invalid bearer token (Authorization: Bearer <token>)"},
                           (("WWW-Authenticate", 'Bearer realm="stepbudget admission"'),))

    def _guarded(self, headers: Mapping[str, str], body: bytes,
                 handler: Callable[[Mapping[str, Any]], ApiResponse]) -> ApiResponse:
        refused = self.refusal(headers)
        if refused is not None:
            return refused
        try:
            return handler(parse_json_object(body))
        except InputError as error:
            return ApiResponse(400, {"error": str(error)})

    def _authorized(self, headers: Mapping[str, str]) -> bool:
        value = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
        scheme, _, token = value.strip().partition(" ")
        # Constant-time comparison: the token must not leak through response timing.
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8"), self._token)

    def _admit(self, document: Mapping[str, Any]) -> ApiResponse:
        decision = self.book.admit(parse_admission_request(document))
        return decision_response(decision)

    def _release(self, document: Mapping[str, Any]) -> ApiResponse:
        _reject_unknown_keys(document, RELEASE_KEYS)
        admission_id = document.get("id")
        if not isinstance(admission_id, str) or not admission_id:
            raise BadRequest("'id' must be the admission id string from POST /v1/admission")
        admission = self.book.release(admission_id)
        if admission is None:
            return ApiResponse(404, {"error": f"admission {admission_id!r} is unknown, already released, "
                                              "or its lease ran out", "released": False})
        return ApiResponse(200, {"released": True, "id": admission.id, "deployment": admission.deployment,
                                 "target": admission.target, "tokens": admission.tokens})


def parse_json_object(body: bytes) -> Mapping[str, Any]:
    if len(body) > MAX_BODY_BYTES:
        raise BadRequest(f"body of {len(body):,} bytes is over the {MAX_BODY_BYTES:,}-byte limit")
    try:
        document = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise BadRequest(f"body is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise BadRequest(f"body must be a JSON object, got {type(document).__name__}")
    return document


def _reject_unknown_keys(document: Mapping[str, Any], known: tuple[str, ...]) -> None:
    for name in document:
        if name not in known:
            raise BadRequest(f"unknown key {name!r}{close_names(str(name), known)}; known: {', '.join(known)}")


def _token_count(document: Mapping[str, Any], name: str, minimum: int) -> int:
    value = document.get(name)
    if value is None:
        raise BadRequest(f"missing {name!r}: a whole number of tokens")
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name!r} must be a whole number of tokens, got {value!r}")
    if value < minimum:
        raise BadRequest(f"{name!r} must be at least {minimum}, got {value}")
    if value > MAX_REQUEST_TOKENS:
        raise BadRequest(f"{name!r} of {value:,} is absurd: no model serves more than {MAX_REQUEST_TOKENS:,} tokens")
    return value


def parse_admission_request(document: Mapping[str, Any]) -> AdmissionRequest:
    _reject_unknown_keys(document, ADMISSION_KEYS)
    for name in ("deployment", "pool"):
        if name in document and not isinstance(document[name], str):
            raise BadRequest(f"{name!r} must be a string, got {document[name]!r}")
    return AdmissionRequest(
        prompt_tokens=_token_count(document, "prompt_tokens", 1),
        max_output_tokens=_token_count(document, "max_output_tokens", 1),
        deployment=document.get("deployment"),
        pool=document.get("pool"),
    )


def decision_response(decision: Decision) -> ApiResponse:
    body: dict[str, Any] = {
        "decision": decision.decision, "deployment": decision.deployment, "pool": decision.pool,
        "tokens": decision.context_tokens, "tokens_left": round(decision.tokens_left, 1), "reason": decision.reason,
    }
    if decision.admission is not None:
        admission = decision.admission
        body.update(id=admission.id, target=admission.target,
                    lease_seconds=round(admission.expires_at_seconds - admission.admitted_at_seconds, 3))
        return ApiResponse(200, body)
    body.update(retry_after_seconds=decision.retry_after_seconds, long_context_pool=decision.long_context_pool)
    headers = (("Retry-After", str(decision.retry_after_seconds)),) if decision.retry_after_seconds else ()
    return ApiResponse(429, body, headers)
