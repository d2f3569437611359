"""A stand-in for an OpenAI-style `/v1/completions` on 127.0.0.1, for the load generator's tests without an
engine: it records every request body and streams one event per output token, each carrying
`usage.completion_tokens` so far (what the load generator counts, as vLLM streams it), then `[DONE]`."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler

from tests.support.servers import HandlerServer


class StandInCompletions:
    """Streams a token every `token_seconds` (0: all at once) and counts the requests open at once by their
    max_tokens (`open_by_max_tokens`, and the most there ever were: `most_open_by_max_tokens`)."""

    def __init__(self, token_seconds: float = 0.0) -> None:
        self.bodies: list[dict[str, object]] = []
        self.open_by_max_tokens: dict[int, int] = {}
        self.most_open_by_max_tokens: dict[int, int] = {}
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                max_tokens = int(body["max_tokens"])
                outer._opened(body, max_tokens)
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for n in range(1, max_tokens + 1):
                        if token_seconds:
                            time.sleep(token_seconds)
                        event = {"choices": [{"text": "x"}], "usage": {"completion_tokens": n}}
                        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                        self.wfile.flush()
                    self.wfile.write(b"data: [DONE]\n\n")
                finally:
                    with outer._lock:
                        outer.open_by_max_tokens[max_tokens] -= 1

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = HandlerServer(Handler)

    def _opened(self, body: dict[str, object], max_tokens: int) -> None:
        with self._lock:
            self.bodies.append(body)
            now = self.open_by_max_tokens[max_tokens] = self.open_by_max_tokens.get(max_tokens, 0) + 1
            self.most_open_by_max_tokens[max_tokens] = max(self.most_open_by_max_tokens.get(max_tokens, 0), now)

    @property
    def base_url(self) -> str:
        return self._server.base_url

    def requests(self) -> list[tuple[list[int], int]]:
        """(prompt ids, max_tokens) of every request so far."""
        with self._lock:
            bodies = list(self.bodies)
        return [(prompt_ids(body), int(str(body["max_tokens"]))) for body in bodies]

    def prompts(self) -> list[list[int]]:
        return [prompt for prompt, _ in self.requests()]

    def close(self) -> None:
        self._server.close()


def prompt_ids(body: dict[str, object]) -> list[int]:
    """A request body's prompt: the token ids the load generator sent."""
    prompt = body["prompt"]
    assert isinstance(prompt, list) and all(isinstance(token, int) for token in prompt), prompt
    return prompt
