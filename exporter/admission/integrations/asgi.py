"""ASGI middleware: admission in front of an OpenAI-compatible gateway (Starlette, FastAPI, and any
ASGI3 app; LiteLLM's proxy server is a FastAPI app, so it takes it the same way).

    from starlette.middleware import Middleware
    app = Starlette(routes=..., middleware=[Middleware(
        AdmissionMiddleware, client=AdmissionClient(url, token, timeout_seconds=0.5), pool="auto")])

For every POST to a completions path it estimates the prompt's tokens, takes the output limit from
`max_completion_tokens`/`max_tokens`, and asks stepbudget. Admitted: the request goes on, with the
answer in `request.state.stepbudget_admission` (its `target` says which server has room), and the
admission is released when the response's last byte is sent, or when the app fails or the client
goes away. Refused: 429 with `Retry-After` and an OpenAI-style error naming the long-context pool,
and the app never sees the request. The daemon unreachable: the request goes on unadmitted
(`fail_open=True`, the default) or gets 503.

Pure ASGI (no framework import): the blocking client runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import structlog

from exporter.admission.client import AdmissionClient, AdmissionError, AdmissionResult

log = structlog.get_logger("stepbudget.admission.asgi")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_PATHS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_MAX_OUTPUT_TOKENS = 1024
# OpenAI's rule of thumb: a token is about four characters of English text. Give a tokenizer-based
# counter for exact numbers; the estimate errs by tens of percent, not by orders of magnitude.
CHARACTERS_PER_TOKEN = 4
# Each chat message costs a few tokens of role and separators (OpenAI's cookbook counts 3-4).
TOKENS_PER_MESSAGE = 4
STATE_KEY = "stepbudget_admission"


def estimate_prompt_tokens(document: MutableMapping[str, Any]) -> int:
    """Prompt tokens of a completions or chat completions body, from its characters."""
    texts: list[str] = []
    messages = 0
    prompt = document.get("prompt")
    if isinstance(prompt, str):
        texts.append(prompt)
    elif isinstance(prompt, list):
        texts += [item for item in prompt if isinstance(item, str)]
    for message in document.get("messages") or []:
        if not isinstance(message, dict):
            continue
        messages += 1
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):  # content parts: {"type": "text", "text": ...}
            texts += [part.get("text", "") for part in content if isinstance(part, dict)]
    characters = sum(len(text) for text in texts)
    return max(1, math.ceil(characters / CHARACTERS_PER_TOKEN) + TOKENS_PER_MESSAGE * messages)


def max_output_tokens(document: MutableMapping[str, Any], default: int) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = document.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


class AdmissionMiddleware:
    def __init__(self, app: App, *, client: AdmissionClient, deployment: str | None = None, pool: str | None = None,
                 paths: Iterable[str] = DEFAULT_PATHS,
                 count_prompt_tokens: Callable[[MutableMapping[str, Any]], int] = estimate_prompt_tokens,
                 default_max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS, fail_open: bool = True) -> None:
        self.app = app
        self.client = client
        self.deployment = deployment
        self.pool = pool
        self.paths = frozenset(paths)
        self.count_prompt_tokens = count_prompt_tokens
        self.default_max_output_tokens = default_max_output_tokens
        self.fail_open = fail_open

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in self.paths:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        replay = _replaying(body, receive)
        try:
            document = json.loads(body)
        except ValueError:
            document = None
        if not isinstance(document, dict):
            await self.app(scope, replay, send)  # not ours to judge: the app answers a malformed body
            return
        try:
            result = await asyncio.to_thread(
                self.client.admit, self.count_prompt_tokens(document),
                max_output_tokens(document, self.default_max_output_tokens),
                deployment=self.deployment, pool=self.pool)
        except AdmissionError as error:
            log.warning("admission_unavailable", error=str(error), fail_open=self.fail_open)
            if self.fail_open:
                await self.app(scope, replay, send)
            else:
                await _send_json(send, 503, {"error": {"message": "admission service unavailable",
                                                      "type": "service_unavailable"}}, ())
            return
        if not result.admitted or result.id is None:
            await _send_refusal(send, result)
            return
        scope.setdefault("state", {})[STATE_KEY] = result
        await self._run_admitted(scope, replay, send, result.id)

    async def _run_admitted(self, scope: Scope, receive: Receive, send: Send, admission_id: str) -> None:
        released = False

        def release() -> None:
            # Handed to a worker thread and not awaited: frameworks cancel the response task as
            # soon as the last byte is out (Starlette's StreamingResponse stops on the disconnect
            # that follows it), and an awaited release would be cancelled before it ran.
            nonlocal released
            if not released:
                released = True
                asyncio.get_running_loop().run_in_executor(None, self._release_quietly, admission_id)

        async def send_and_release_at_end(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release()

        try:
            await self.app(scope, receive, send_and_release_at_end)
        finally:
            release()  # the app failed, or the client went away mid-stream

    def _release_quietly(self, admission_id: str) -> None:
        try:
            self.client.release(admission_id)
        except AdmissionError as error:  # its lease runs out on the daemon instead
            log.warning("admission_release_failed", id=admission_id, error=str(error))


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """The app reads the body we already consumed, then whatever comes next (a disconnect)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_refusal(send: Send, result: AdmissionResult) -> None:
    headers = (("retry-after", str(result.retry_after_seconds)),) if result.retry_after_seconds else ()
    message = result.reason
    if result.long_context_pool:
        message += f"; the long-context pool {result.long_context_pool!r} takes it (slower streaming)"
    await _send_json(send, 429, {"error": {
        "message": message, "type": "rate_limit_exceeded", "code": f"admission_{result.decision}",
        "retry_after_seconds": result.retry_after_seconds, "long_context_pool": result.long_context_pool,
    }}, headers)


async def _send_json(send: Send, status: int, body: dict[str, Any], headers: Iterable[tuple[str, str]]) -> None:
    payload = json.dumps(body).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw_headers += [(name.encode(), value.encode()) for name, value in headers]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
