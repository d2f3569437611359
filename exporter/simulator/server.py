"""The simulated server on loopback: vLLM's /metrics, a streaming /v1/completions, /v1/models.

The engine (engine.Simulator) runs in simulated time; one engine thread paces it against the wall
clock at `speed` (simulated seconds per wall second): it runs every step whose end the scaled wall
clock has passed, then sleeps until the next step ends (step / speed). A token is streamed when
the step that produced it ends, so a client timing the gaps between chunks at speed 1 measures the
step time, as it would against vLLM. The engine and the HTTP handlers share one lock.
With `paced=False` no engine thread runs: simulated time moves only when the caller says
(`ServerHandle.run_until`), so a test can poll the real HTTP page at exact simulated instants.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from exporter.errors import InputError
from exporter.logs import StructuredHTTPServer
from exporter.simulator.scenarios import Scenario
from exporter.simulator.simulation import Simulator
from exporter.simulator.spec import ServerSpec, SimRequest

# A string prompt has no tokenizer here: its length is approximated as one token per 4 characters
# (the usual rule of thumb for English BPE vocabularies). A list of token ids is exact.
CHARACTERS_PER_TOKEN = 4
_MAX_SLICE_SIMULATED_SECONDS = 0.5  # release the lock at least this often when catching up
_IDLE_WAIT_SECONDS = 0.05
_STREAM_POLL_SECONDS = 0.25


def prompt_token_count(prompt: Any) -> int:
    """Tokens in an OpenAI `prompt`: a string (approximate) or a list of token ids (exact)."""
    if isinstance(prompt, str):
        return max(1, math.ceil(len(prompt) / CHARACTERS_PER_TOKEN))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt)
    raise InputError("'prompt' must be a non-empty string or a non-empty list of token ids "
                     "(the simulator serves one prompt per request)")


class PacedEngine:
    """Runs a Simulator against the wall clock in a thread."""

    def __init__(self, simulator: Simulator, speed: float, paced: bool = True) -> None:
        if not speed > 0:
            raise InputError(f"--speed must be greater than 0, got {speed!r}")
        self.simulator = simulator
        self.speed = speed
        self.paced = paced
        self.lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._wall_origin = time.monotonic()
        self._simulated_origin = simulator.now_seconds
        self._thread = threading.Thread(target=self._loop, name="simulator-engine", daemon=True)

    def start(self) -> None:
        self._wall_origin = time.monotonic()
        self._simulated_origin = self.simulator.now_seconds
        if self.paced:
            self._thread.start()

    def run_until(self, t_seconds: float) -> None:
        """Advance simulated time by hand (an unpaced engine)."""
        with self.lock:
            self.simulator.run_until(t_seconds)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def target_seconds(self) -> float:
        """Where simulated time should be now, by the wall clock."""
        return self._simulated_origin + (time.monotonic() - self._wall_origin) * self.speed

    def submit(self, prompt_tokens: int, max_tokens: int, **callbacks: Any) -> SimRequest:
        with self.lock:
            now = self.simulator.now_seconds
            request = self.simulator.submit(prompt_tokens, max_tokens,
                                            arrival_seconds=max(now, self.target_seconds()) if self.paced else now,
                                            **callbacks)
        self._wake.set()
        return request

    def abort(self, request: SimRequest) -> None:
        with self.lock:
            self.simulator.abort(request)

    def _loop(self) -> None:
        ran_to = self.simulator.now_seconds
        while not self._stop.is_set():
            target = self.target_seconds()
            # Catch up in slices so HTTP handlers get the lock between them.
            limit = min(target, ran_to + _MAX_SLICE_SIMULATED_SECONDS)
            with self.lock:
                self.simulator.run_until(limit)
                next_event = self.simulator.next_event_seconds()
            ran_to = limit
            if limit < target:
                continue
            wait = _IDLE_WAIT_SECONDS if next_event is None else min(
                _IDLE_WAIT_SECONDS, max(0.0, (next_event - self.target_seconds()) / self.speed))
            if wait > 0:
                self._wake.wait(wait)
            self._wake.clear()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _SimulatorHTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet by default
        if self.server.access_log:
            super().log_message(format, *args)

    # --- GET ---------------------------------------------------------------------------

    def do_GET(self) -> None:  # http.server naming
        path = self.path.split("?", 1)[0]
        engine = self.server.engine
        if path == "/metrics":
            with engine.lock:
                body = engine.simulator.render_metrics()
            self._send(200, body, CONTENT_TYPE_LATEST)
        elif path in ("/health", "/ping"):
            self._send(200, b"", "text/plain")
        elif path == "/v1/models":
            simulator = engine.simulator
            name = simulator.spec.model_name
            self._send_json(200, {"object": "list", "data": [{
                "id": name, "object": "model", "created": int(self.server.started_unix), "owned_by": "vllm",
                "root": name, "parent": None, "max_model_len": simulator.spec.max_model_len}]})
        elif path == "/version":
            self._send_json(200, {"version": f"{engine.simulator.spec.vllm_version}-stepbudget-simulator"})
        else:
            self._not_found(path)

    # --- POST /v1/completions ------------------------------------------------------------

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path != "/v1/completions":
            self._not_found(path)
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise InputError("the request body must be a JSON object")
            name = self.server.engine.simulator.spec.model_name
            if body.get("model") not in (None, name):
                self._error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
                return
            prompt_tokens = prompt_token_count(body.get("prompt"))
            max_tokens = body.get("max_tokens", 16)
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
                raise InputError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        except (ValueError, InputError) as error:
            self._error(400, str(error), "BadRequestError")
            return
        # ignore_eos is accepted and has no effect: simulated requests never stop early.
        events: queue.Queue[tuple[str, str | None]] = queue.Queue()

        def on_token(request: SimRequest) -> None:
            done = request.output_tokens >= request.max_tokens
            events.put(("token", request.finish_reason_at_max if done else None))

        def on_finish(request: SimRequest) -> None:
            events.put(("end", request.finish_reason))

        try:
            request = self.server.engine.submit(prompt_tokens, max_tokens, on_token=on_token, on_finish=on_finish)
        except InputError as error:
            self._error(400, str(error), "BadRequestError")
            return
        if body.get("stream"):
            self._stream(request, events, name)
        else:
            self._complete(request, events, name)

    def _next_event(self, events: queue.Queue[tuple[str, str | None]]) -> tuple[str, str | None] | None:
        while not self.server.engine.stopping:
            try:
                return events.get(timeout=_STREAM_POLL_SECONDS)
            except queue.Empty:
                continue
        return None

    def _stream(self, request: SimRequest, events: queue.Queue[tuple[str, str | None]], name: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        created = int(time.time())
        try:
            while True:
                event = self._next_event(events)
                if event is None:
                    break
                kind, reason = event
                if kind == "token":
                    self._chunk(self._event(request.request_id, created, name, " tok", reason))
                    continue
                if reason not in (None, request.finish_reason_at_max):  # left or aborted without a token
                    self._chunk(self._event(request.request_id, created, name, "", reason))
                break
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            self.server.engine.abort(request)  # the client went away: vLLM aborts the request
            self.close_connection = True

    @staticmethod
    def _event(request_id: str, created: int, name: str, text: str, reason: str | None) -> bytes:
        payload = {"id": request_id, "object": "text_completion", "created": created, "model": name,
                   "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason,
                                "stop_reason": None}]}
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _complete(self, request: SimRequest, events: queue.Queue[tuple[str, str | None]], name: str) -> None:
        reason: str | None = None
        while True:
            event = self._next_event(events)
            if event is None or event[0] == "end":
                reason = None if event is None else event[1]
                break
        self._send_json(200, {
            "id": request.request_id, "object": "text_completion", "created": int(time.time()), "model": name,
            "choices": [{"index": 0, "text": " tok" * request.output_tokens, "logprobs": None,
                         "finish_reason": reason, "stop_reason": None}],
            "usage": {"prompt_tokens": request.prompt_tokens, "completion_tokens": request.output_tokens,
                      "total_tokens": request.prompt_tokens + request.output_tokens}})

    # --- helpers -------------------------------------------------------------------------

    def _error(self, status: int, message: str, kind: str) -> None:
        self._send_json(status, {"object": "error", "message": message, "type": kind, "param": None, "code": status})

    def _not_found(self, path: str) -> None:
        """vLLM's 404 body."""
        self._send_json(404, {"object": "error", "message": f"Not Found: {path}", "type": "NotFoundError", "code": 404})

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _SimulatorHTTPServer(StructuredHTTPServer):
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], engine: PacedEngine, access_log: bool) -> None:
        super().__init__(address, _Handler)
        self.engine = engine
        self.access_log = access_log
        self.started_unix = time.time()


@dataclass
class ServerHandle:
    """A running simulated server: `.url`, `.simulator`, `.stop()`."""

    url: str
    host: str
    port: int
    engine: PacedEngine
    _http: _SimulatorHTTPServer
    _thread: threading.Thread

    @property
    def simulator(self) -> Simulator:
        return self.engine.simulator

    def run_until(self, t_seconds: float) -> None:
        """Advance simulated time to `t_seconds` (a server started with `paced=False`)."""
        self.engine.run_until(t_seconds)

    def stop(self) -> None:
        self.engine.stop()
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(host: str = "127.0.0.1", port: int = 0, scenario: Scenario | None = None, speed: float = 1.0,
                 spec: ServerSpec | None = None, *, access_log: bool = False, paced: bool = True,
                 record_steps: bool = False) -> ServerHandle:
    """Start a simulated server in this process (port 0 picks a free port). Stop it with `.stop()`.

    `paced=False`: no engine thread; simulated time moves only by `ServerHandle.run_until`."""
    simulator = Simulator(spec or ServerSpec(), scenario, record_steps=record_steps)
    engine = PacedEngine(simulator, speed, paced)
    try:
        http = _SimulatorHTTPServer((host, port), engine, access_log)
    except OSError as error:
        raise InputError(f"cannot listen on {host}:{port}: {error.strerror}") from error
    engine.start()
    thread = threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.1},
                              name=f"simulator-http-{http.server_address[1]}", daemon=True)
    thread.start()
    bound_port = int(http.server_address[1])
    return ServerHandle(f"http://{host}:{bound_port}", host, bound_port, engine, http, thread)
