"""N vLLM targets behind ONE loopback server, one path each (`/t/0/metrics`, `/t/1/metrics`, ...),
every one serving the same realistic vLLM V1 page (tests/data/vllm/vllm_v1_RECONSTRUCTED_single_process.txt,
~19 KB, ~180 samples) whose counters and histograms advance once per poll interval: what the
process benchmark (benchmarks/scale.py) points the daemon and a real Prometheus at.

Why one server and paths (not benchmarks/fleet.py's one address per target): both clients then
reach every target through one host:port, the way a sidecar or a Prometheus behind one ingress
would, and the server is one asyncio thread whose cost stays small beside the two measured.

The page advances with time, not per request (page n is shown from n intervals after start), so
the daemon and Prometheus read the same page at the same moment and each daemon poll sees one
interval's worth of new counts: windows are never empty. Requests are counted per client (by
User-Agent: `stepbudget/...` or `Prometheus/...`), with the time of each class's first request;
`GET /_counts` answers them as JSON.

`python -m benchmarks.path_fleet --count N [--interval S]` prints `ready PORT` and serves until its
stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "tests" / "data" / "vllm" / "vllm_v1_RECONSTRUCTED_single_process.txt"

# What one poll interval (15 s) of a busy server adds: observations per histogram, increments per counter.
HISTOGRAM_STEP = {"vllm:inter_token_latency_seconds": 6000, "vllm:iteration_tokens_total": 200,
                  "vllm:time_to_first_token_seconds": 12, "vllm:e2e_request_latency_seconds": 12,
                  "vllm:request_prompt_tokens": 12}
COUNTER_STEP = {"vllm:prompt_tokens_total": 6000.0, "vllm:generation_tokens_total": 6000.0,
                "vllm:prefix_cache_queries_total": 6000.0, "vllm:prefix_cache_hits_total": 2000.0,
                'vllm:request_success_total{engine="0",finished_reason="stop"': 12.0,
                "process_cpu_seconds_total": 15.0}


class AdvancingPage:
    """The base page with every counter and histogram moved on by `step` intervals.

    A histogram's new observations all land in one bucket (the one holding its mean, or its middle
    bucket while empty), so each bucket, `_count` and `_sum` stay consistent: cumulative buckets
    never decrease and `+Inf` equals `_count`.
    """

    def __init__(self, text: str) -> None:
        self._lines = text.splitlines()
        self._hot = self._hot_buckets()
        self._cache: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def _hot_buckets(self) -> dict[str, float]:
        edges: dict[str, list[float]] = {}
        count: dict[str, float] = {}
        total: dict[str, float] = {}
        for line in self._lines:
            name, value = _name_value(line)
            for family in HISTOGRAM_STEP:
                if name == family + "_bucket":
                    edge = float(line.split('le="', 1)[1].split('"', 1)[0])
                    if math.isfinite(edge):
                        edges.setdefault(family, []).append(edge)
                elif name == family + "_count":
                    count[family] = value
                elif name == family + "_sum":
                    total[family] = value
        hot = {}
        for family, bounds in edges.items():
            mean = total[family] / count[family] if count.get(family) else None
            hot[family] = next((edge for edge in bounds if mean is not None and edge >= mean), bounds[len(bounds) // 2])
        return hot

    def page(self, step: int) -> bytes:
        with self._lock:
            cached = self._cache.get(step)
            if cached is None:
                cached = self._cache[step] = self._render(step)
            return cached

    def _render(self, step: int) -> bytes:
        out = []
        for line in self._lines:
            if line.startswith("#") or not line:
                out.append(line)
                continue
            name, value = _name_value(line)
            head = line.rsplit(" ", 1)[0]
            added = 0.0
            for family, per_step in HISTOGRAM_STEP.items():
                if name == family + "_bucket":
                    if float(line.split('le="', 1)[1].split('"', 1)[0]) >= self._hot[family]:
                        added = per_step * step
                elif name == family + "_count":
                    added = per_step * step
                elif name == family + "_sum":
                    added = per_step * step * self._hot[family]
            for key, per_step_value in COUNTER_STEP.items():
                if head == key or (head.startswith(key) and head[len(key)] in "{,"):
                    added = per_step_value * step
            out.append(f"{head} {value + added!r}" if added else line)
        return ("\n".join(out) + "\n").encode()


def _name_value(line: str) -> tuple[str, float]:
    head, _, value = line.rpartition(" ")
    try:
        return head.split("{", 1)[0], float(value)
    except ValueError:
        return head.split("{", 1)[0], math.nan


class PathFleet:
    def __init__(self, count: int, interval_seconds: float) -> None:
        self.count = count
        self.interval_seconds = interval_seconds
        self.book = AdvancingPage(PAGE.read_text())
        self.started = time.monotonic()
        self.requests: dict[str, int] = {}
        self.first_request: dict[str, float] = {}

    def step(self) -> int:
        return int((time.monotonic() - self.started) // self.interval_seconds)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1] if len(lines[0].split(" ")) > 1 else ""
                agent = next((line.split(":", 1)[1].strip() for line in lines[1:]
                              if line.lower().startswith("user-agent:")), "")
                if path == "/_counts":
                    body = json.dumps({"requests": self.requests, "first_request": self.first_request,
                                       "now": time.monotonic()}).encode()
                elif path.startswith("/t/") and path.endswith("/metrics"):
                    client = agent.split("/", 1)[0] or "other"
                    self.requests[client] = self.requests.get(client, 0) + 1
                    self.first_request.setdefault(client, time.monotonic())
                    body = self.book.page(self.step())
                else:
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.transport.abort()


async def _run(fleet: PathFleet, stop: asyncio.Event) -> None:
    server = await asyncio.start_server(fleet.serve, "127.0.0.1", 0, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    fleet.book.page(0)
    print(f"ready {port}", flush=True)
    await stop.wait()
    server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--interval", type=float, default=15.0)
    args = parser.parse_args(argv)
    fleet = PathFleet(args.count, args.interval)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()
    loop.run_until_complete(_run(fleet, stop))
    return 0


if __name__ == "__main__":
    sys.exit(main())
