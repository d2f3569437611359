"""Shared fixtures: free ports, an injected clock, a real HTTP page server on 127.0.0.1, a vLLM V1
page builder, and a real Alertmanager. Generic on purpose: any test module may use them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import pytest
import requests

from tests.tools import require_tool

if TYPE_CHECKING:
    from exporter.config import Config
    from exporter.poller import Poller


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def port() -> int:
    return free_port()


class ManualClock:
    """An injected clock: time moves only when a test says so."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


class SteppingClock:
    """A monotonic clock that moves `step` seconds at every read: a fetch (two reads) lasts `step`."""

    def __init__(self, step: float) -> None:
        self.step, self.now = step, 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


MakePoller = Callable[..., "Poller"]


@pytest.fixture
def make_poller() -> Iterator[MakePoller]:
    """Pollers driven by hand (`poll_once`) with injected clocks; stopped after the test."""
    from exporter.discovery import Discovery
    from exporter.poller import HttpFetcher, Poller

    started: list[tuple[Poller, HttpFetcher]] = []

    def make(config: "Config", clock: Callable[[], float], step: float = 0.125, **kwargs: object) -> Poller:
        fetcher = HttpFetcher(config.timeout_seconds, config.max_response_bytes)
        poller = Poller(config, Discovery(config.deployments, timeout_seconds=1.0), kwargs.pop("fetch", fetcher),
                        clock=clock, monotonic=SteppingClock(step), **kwargs)
        started.append((poller, fetcher))
        return poller

    yield make
    for poller, fetcher in started:
        poller.stop()
        fetcher.close()


# --- a real HTTP server answering what the test sets -------------------------------------------------

Responder = Callable[[BaseHTTPRequestHandler], None]


def send_text(handler: BaseHTTPRequestHandler, body: bytes | str, status: int = 200,
              content_type: str = "text/plain; version=0.0.4") -> None:
    data = body.encode() if isinstance(body, str) else body
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """A client hanging up early (what a size cap or a deadline does) is no error here."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class PageServer:
    """A stdlib HTTP server on 127.0.0.1; `respond(handler)` (settable) answers every GET."""

    def __init__(self) -> None:
        self.respond: Responder = lambda handler: send_text(handler, "")
        self.requests: list[dict[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                server.requests.append({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
                try:
                    server.respond(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        self._httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/metrics"

    def serve_text(self, text: str | bytes, status: int = 200) -> None:
        self.respond = lambda handler: send_text(handler, text, status)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


@pytest.fixture
def page_server() -> Iterator[PageServer]:
    server = PageServer()
    yield server
    server.close()


@pytest.fixture
def make_page_server() -> Iterator[Callable[[], PageServer]]:
    servers: list[PageServer] = []

    def make() -> PageServer:
        servers.append(PageServer())
        return servers[-1]

    yield make
    for server in servers:
        server.close()


# --- vLLM V1 page builder ----------------------------------------------------------------------------


@dataclass
class VllmState:
    """The numbers a vLLM V1 server's /metrics page shows for one engine."""

    model_name: str = "Qwen/Qwen3-8B"
    engine: str = "0"
    running: float = 0
    waiting: float = 0
    kv_usage_ratio: float = 0.0
    num_gpu_blocks: int = 4096
    block_size: int = 16
    preemptions: float = 0
    prompt_tokens: float = 0
    generation_tokens: float = 0
    engine_steps: float = 0  # count of vllm:iteration_tokens_total
    iteration_tokens_sum: float = 0
    # vllm:iteration_tokens_total's cumulative counts per finite upper bound (vLLM's edges); none: +Inf only.
    iteration_buckets: dict[float, float] = field(default_factory=dict)
    # vllm:prompt_tokens_by_source_total{source="local_compute"} (0.16 on); None: the family is absent.
    prompt_tokens_computed: float | None = None
    cache_dtype: str = "auto"
    # ITL histogram: cumulative counts per upper bound (the +Inf count is itl_count).
    itl_buckets: dict[float, float] = field(default_factory=lambda: {0.01: 0, 0.025: 0, 0.05: 0, 0.1: 0})
    itl_count: float = 0
    itl_sum: float = 0.0


def _number(value: float) -> str:
    return repr(float(value)) if value == value and abs(value) != float("inf") else ("NaN" if value != value else ("+Inf" if value > 0 else "-Inf"))


def vllm_page(*states: VllmState) -> str:
    """A vLLM V1 page (current-era names, `engine` label, `_created` series) for the given engines."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, dict[str, str], float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for sample_name, labels, value in samples:
            text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            lines.append(f"{sample_name}{{{text}}} {_number(value)}")

    def ids(state: VllmState) -> dict[str, str]:
        return {"model_name": state.model_name, "engine": state.engine}

    family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
           [("vllm:num_requests_running", ids(s), s.running) for s in states])
    family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
           [("vllm:num_requests_waiting", ids(s), s.waiting) for s in states])
    family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           [("vllm:kv_cache_usage_perc", ids(s), s.kv_usage_ratio) for s in states])
    family("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
           [("vllm:num_preemptions_total", ids(s), s.preemptions) for s in states])
    family("vllm:num_preemptions_created", "gauge", "Cumulative number of preemption from the engine.",
           [("vllm:num_preemptions_created", ids(s), 1.7959705e9) for s in states])
    family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
           [("vllm:prompt_tokens_total", ids(s), s.prompt_tokens) for s in states])
    family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
           [("vllm:generation_tokens_total", ids(s), s.generation_tokens) for s in states])
    computed = [s for s in states if s.prompt_tokens_computed is not None]
    if computed:
        family("vllm:prompt_tokens_by_source_total", "counter", "Number of prompt tokens by source.",
               [("vllm:prompt_tokens_by_source_total", {**ids(s), "source": source}, value) for s in computed
                for source, value in (("local_compute", s.prompt_tokens_computed),
                                      ("local_cache_hit", s.prompt_tokens - (s.prompt_tokens_computed or 0)),
                                      ("external_kv_transfer", 0.0))])
    iteration: list[tuple[str, dict[str, str], float]] = []
    for s in states:
        iteration += [("vllm:iteration_tokens_total_bucket", {**ids(s), "le": repr(float(le))}, count)
                      for le, count in sorted(s.iteration_buckets.items())]
        iteration += [("vllm:iteration_tokens_total_bucket", {**ids(s), "le": "+Inf"}, s.engine_steps),
                      ("vllm:iteration_tokens_total_count", ids(s), s.engine_steps),
                      ("vllm:iteration_tokens_total_sum", ids(s), s.iteration_tokens_sum)]
    family("vllm:iteration_tokens_total", "histogram", "Histogram of number of tokens per engine_step.", iteration)
    itl: list[tuple[str, dict[str, str], float]] = []
    for s in states:
        for bound, count in sorted(s.itl_buckets.items()):
            itl.append(("vllm:inter_token_latency_seconds_bucket", {**ids(s), "le": repr(float(bound))}, count))
        itl += [("vllm:inter_token_latency_seconds_bucket", {**ids(s), "le": "+Inf"}, s.itl_count),
                ("vllm:inter_token_latency_seconds_count", ids(s), s.itl_count),
                ("vllm:inter_token_latency_seconds_sum", ids(s), s.itl_sum)]
    family("vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.", itl)
    # vLLM's front end sums num_gpu_blocks over its data-parallel engines and writes the sum on every
    # engine's series (0.33.0 vllm/v1/engine/core_client.py l. 873-877).
    summed_blocks = sum(s.num_gpu_blocks for s in states)
    family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
           [("vllm:cache_config_info", {"block_size": str(s.block_size), "cache_dtype": s.cache_dtype, "engine": s.engine,
                                        "num_gpu_blocks": str(summed_blocks), "gpu_memory_utilization": "0.9"}, 1.0)
            for s in states])
    return "\n".join(lines) + "\n"


# --- a real Alertmanager --------------------------------------------------------------------------------

ALERTMANAGER_CONFIG = """\
route:
  receiver: "null"
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: "null"
"""


@dataclass
class Alertmanager:
    url: str

    def alerts(self) -> list[dict[str, object]]:
        response = requests.get(f"{self.url}/api/v2/alerts", timeout=5)
        response.raise_for_status()
        return response.json()


def stop_process(process: "subprocess.Popen[Any]") -> None:
    """Stop a process a test started: SIGTERM, then SIGKILL if it has not exited within 10 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_until(condition: Callable[[], object], timeout_seconds: float = 10.0, interval_seconds: float = 0.05) -> object:
    """Poll `condition` until it returns something truthy; fail the test after the timeout.

    For waiting on real external processes (a server starting up), never for asserting speed.
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            value = condition()
        except (requests.RequestException, OSError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_seconds}s: {getattr(condition, '__name__', condition)}")
        time.sleep(interval_seconds)


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[Alertmanager]:
    """A real `prometheus-alertmanager` on 127.0.0.1 (fails under CI if missing, skips otherwise)."""
    binary = require_tool("prometheus-alertmanager") if not shutil.which("alertmanager") else shutil.which("alertmanager")
    config = tmp_path / "alertmanager.yml"
    config.write_text(ALERTMANAGER_CONFIG)
    am_port = free_port()
    process = subprocess.Popen(
        [str(binary), f"--config.file={config}", f"--storage.path={tmp_path / 'am-data'}",
         f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ},
    )
    manager = Alertmanager(f"http://127.0.0.1:{am_port}")
    try:
        def ready() -> bool:
            if process.poll() is not None:
                pytest.fail(f"alertmanager exited: {process.stderr.read().decode()[-2000:] if process.stderr else ''}")
            return requests.get(f"{manager.url}/-/ready", timeout=1).status_code == 200

        wait_until(ready, timeout_seconds=20)
        yield manager
    finally:
        stop_process(process)
        if process.stderr:
            process.stderr.close()
