"""The ASGI middleware in a Starlette gateway served by uvicorn, all on 127.0.0.1: the gateway asks
a running stepbudget daemon (real HTTP, through AdmissionClient) and forwards admitted requests
to the simulated vLLM server the admission chose, streaming the answer back.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from exporter.admission.book import AdmissionBook
from exporter.admission.client import AdmissionClient
from exporter.admission.integrations.asgi import (
    STATE_KEY,
    AdmissionMiddleware,
    estimate_prompt_tokens,
)
from tests.support.admission import daemon_with_admission
from tests.support.servers import free_port

TOKEN = "gateway-token-456"
TIMEOUT_SECONDS = 10.0


class SignallingClient(AdmissionClient):
    """Sets an event at every release, so the test waits on it instead of sleeping."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]  # AdmissionClient's own arguments, passed through
        self.released = threading.Event()

    def release(self, admission_id: str) -> bool:
        try:
            return super().release(admission_id)
        finally:
            self.released.set()


@dataclass
class Stack:
    daemon_url: str
    book: AdmissionBook
    forwarded: list[str]  # targets the gateway app forwarded to


def gateway_app(client: AdmissionClient, forwarded: list[str], *, fail_open: bool = True) -> Starlette:
    async def completions(request: Request) -> Response:
        ticket = getattr(request.state, STATE_KEY, None)
        if ticket is None:
            forwarded.append("unadmitted")
            return JSONResponse({"served": "unadmitted"})
        forwarded.append(ticket.target)
        body = await request.body()
        upstream = await asyncio.to_thread(requests.post, f"http://{ticket.target}/v1/completions", data=body,
                                           stream=True, timeout=TIMEOUT_SECONDS)
        return StreamingResponse(upstream.iter_content(chunk_size=None), upstream.status_code,
                                 media_type=upstream.headers.get("content-type"), headers={"x-target": ticket.target})

    async def models(request: Request) -> Response:
        return JSONResponse({"data": []})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models, methods=["GET", "POST"])],
                     middleware=[Middleware(AdmissionMiddleware, client=client, deployment="chat",
                                            fail_open=fail_open)])


@pytest.fixture()
def served_gateway() -> Iterator[Callable[[Starlette], str]]:
    """Serve ASGI apps with uvicorn on pre-bound 127.0.0.1 sockets; stop them all at the end."""
    running: list[tuple[uvicorn.Server, threading.Thread, socket.socket]] = []

    def serve(app: Starlette) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        running.append((server, thread, sock))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield serve
    for server, thread, sock in running:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        assert not thread.is_alive()


@pytest.fixture()
def stack(tmp_path: Path) -> Iterator[Stack]:
    with daemon_with_admission(tmp_path, TOKEN, simulator_speed=20.0) as running:  # 20x: short streams
        yield Stack(running.url, running.api.book, [])


def test_an_admitted_stream_holds_its_tokens_until_the_last_byte(stack: Stack, served_gateway) -> None:
    client = SignallingClient(stack.daemon_url, TOKEN, timeout_seconds=TIMEOUT_SECONDS)
    gateway = served_gateway(gateway_app(client, stack.forwarded))
    body = {"model": "qwen3-8b", "prompt": "x" * 4000, "max_tokens": 20, "stream": True}
    expected_tokens = 4000 // 4 + 20  # the estimate: 4 characters per token, plus the output limit
    assert estimate_prompt_tokens(body) + 20 == expected_tokens
    with requests.post(f"{gateway}/v1/completions", json=body, stream=True, timeout=TIMEOUT_SECONDS) as answer:
        assert answer.status_code == 200
        target = answer.headers["x-target"]
        lines = answer.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith(b"data: ")
        assert stack.book.accounted_tokens("chat", target) == expected_tokens
        rest = [line for line in lines if line]
    assert rest[-1] == b"data: [DONE]"
    assert client.released.wait(TIMEOUT_SECONDS)
    assert stack.book.accounted_tokens("chat", target) == 0
    assert stack.forwarded == [target]


def test_a_client_that_goes_away_mid_stream_releases_its_admission(stack: Stack, served_gateway) -> None:
    client = SignallingClient(stack.daemon_url, TOKEN, timeout_seconds=TIMEOUT_SECONDS)
    gateway = served_gateway(gateway_app(client, stack.forwarded))
    # 100,000 tokens take minutes even at 20x: only the hang-up can end this admission in time.
    body = {"prompt": "x" * 400, "max_tokens": 100_000, "stream": True}
    answer = requests.post(f"{gateway}/v1/completions", json=body, stream=True, timeout=TIMEOUT_SECONDS)
    target = answer.headers["x-target"]
    assert next(line for line in answer.iter_lines() if line).startswith(b"data: ")
    assert stack.book.accounted_tokens("chat", target) == 400 // 4 + 100_000
    answer.close()  # the client hangs up
    assert client.released.wait(TIMEOUT_SECONDS)
    assert stack.book.accounted_tokens("chat", target) == 0


def test_a_request_that_does_not_fit_gets_429_and_never_reaches_the_app(stack: Stack, served_gateway) -> None:
    client = AdmissionClient(stack.daemon_url, TOKEN, timeout_seconds=TIMEOUT_SECONDS)
    gateway = served_gateway(gateway_app(client, stack.forwarded))
    account = stack.book.targets()[0]
    holder = client.admit(int(account.tokens_left) - 500, 1, deployment="chat")  # leaves 499 tokens
    assert holder.admitted
    answer = requests.post(f"{gateway}/v1/completions", timeout=TIMEOUT_SECONDS,
                           json={"prompt": "x" * 4000, "max_tokens": 20})
    assert answer.status_code == 429
    assert int(answer.headers["retry-after"]) >= 1
    error = answer.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and error["code"] == "admission_refused"
    assert stack.forwarded == []
    assert holder.id and client.release(holder.id)


def test_other_paths_and_methods_pass_through_without_asking(stack: Stack, served_gateway) -> None:
    client = AdmissionClient(stack.daemon_url, TOKEN, timeout_seconds=TIMEOUT_SECONDS)
    gateway = served_gateway(gateway_app(client, stack.forwarded))
    assert requests.get(f"{gateway}/v1/models", timeout=TIMEOUT_SECONDS).status_code == 200
    assert requests.post(f"{gateway}/v1/models", json={"prompt": "x"}, timeout=TIMEOUT_SECONDS).status_code == 200
    assert sum(stack.book.decision_counts().values()) == 0


@pytest.mark.parametrize(("fail_open", "status"), [(True, 200), (False, 503)])
def test_an_unreachable_daemon_fails_open_or_closed(fail_open: bool, status: int, served_gateway) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # a port nothing listens on
    forwarded: list[str] = []
    gateway = served_gateway(gateway_app(AdmissionClient(dead, TOKEN, timeout_seconds=0.5), forwarded,
                                         fail_open=fail_open))
    answer = requests.post(f"{gateway}/v1/completions", json={"prompt": "hello", "max_tokens": 5},
                           timeout=TIMEOUT_SECONDS)
    assert answer.status_code == status
    assert forwarded == (["unadmitted"] if fail_open else [])


def test_the_prompt_estimate_counts_chat_messages_and_content_parts() -> None:
    body = {"messages": [{"role": "system", "content": "a" * 40},
                         {"role": "user", "content": [{"type": "text", "text": "b" * 80}, {"type": "image_url"}]}]}
    assert estimate_prompt_tokens(body) == (40 + 80) // 4 + 2 * 4
    assert estimate_prompt_tokens({"prompt": ["abcd", "efgh"]}) == 2
    assert estimate_prompt_tokens({}) == 1
