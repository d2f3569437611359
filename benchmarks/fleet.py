"""A fleet of fake vLLM servers on loopback, served by ONE asyncio thread: the benchmark's and the
soak test's targets, cheap enough that they do not eat the CPU being measured.

Each target is its own address (127.0.1.1, 127.0.1.2, ... on one port; all of 127.0.0.0/8 is
loopback on Linux), like pods in a fleet. Every target serves a realistic vLLM page (the
simulator's renderer: ~24 KB, python_*/process_* families, `_created` series, every histogram) whose
counters advance at each request, or misbehaves as told: refuse, 500, garbage, slow (a byte at a
time), truncated, huge (an endless stream). Pages are rendered once per step and shared by every
target, so serving costs a memcpy, not a render.

`python -m benchmarks.fleet --count N` runs one in its own process and prints `ready PORT`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

MODES = ("ok", "refuse", "500", "garbage", "slow", "slow_headers", "truncated", "huge")
SLOW_BYTE_SECONDS = 0.25  # slow mode trickles one byte this often (faster than any read timeout)
HUGE_CHUNK_BYTES = 65536
HUGE_TOTAL_BYTES = 100 * 2**20  # the most a huge target will send, if nobody hangs up
SLOW_TOTAL_SECONDS = 60.0


def address_of(index: int) -> str:
    """Target `index`'s loopback address: 127.0.1.1 ... 127.0.1.250, 127.0.2.1, ..."""
    return f"127.0.{1 + index // 250}.{1 + index % 250}"


class PageBook:
    """vLLM pages whose counters advance one step per page: page n is what a server shows at poll n."""

    def __init__(self, model_name: str = "Qwen/Qwen3-8B") -> None:
        from exporter.simulator.vllm_metrics import VllmPage

        self._page = VllmPage("latest", model_name, 40960, created_unix_seconds=1_764_000_000.0)
        self._counters = self._page.add_engine("0", {"block_size": "16", "num_gpu_blocks": "27000",
                                                     "gpu_memory_utilization": "0.9", "kv_cache_size_tokens": "432000"})
        self._pages: list[bytes] = []
        self._lock = threading.Lock()
        self._random = random.Random(7)

    def page(self, number: int) -> bytes:
        with self._lock:
            while len(self._pages) <= number:
                self._advance()
                self._pages.append(self._page.render())
            return self._pages[number]

    def _advance(self) -> None:
        """One poll interval of a busy server: 40 streams, a few prompts, some steps."""
        counters = self._counters
        rng = self._random
        counters.running = 40 + rng.randint(-5, 5)
        counters.waiting = rng.randint(0, 3)
        counters.kv_usage_ratio = round(rng.uniform(0.2, 0.6), 4)
        counters.prompt_tokens += 8000
        counters.generation_tokens += 40 * 15 * 35
        for _ in range(50):
            counters.histograms["itl"].observe(rng.uniform(0.02, 0.04), 400)
            counters.histograms["iteration_tokens"].observe(float(rng.choice((40, 41, 2048))), 10)
            counters.histograms["ttft"].observe(rng.uniform(0.05, 0.5))
        counters.request_success["stop"] = counters.request_success.get("stop", 0.0) + 3


Behaviour = Callable[[int, int], str]  # (target index, request number) -> mode


def always_ok(index: int, request: int) -> str:
    return "ok"


@dataclass
class _Target:
    index: int
    requests: int = 0
    server: asyncio.AbstractServer | None = None
    writers: set[asyncio.StreamWriter] = field(default_factory=set)


class Fleet:
    """`count` targets on loopback, all served by one event-loop thread; `close()` stops it."""

    def __init__(self, count: int, behaviour: Behaviour = always_ok, *, book: PageBook | None = None,
                 refusing: Callable[[int], bool] | None = None, slow_byte_seconds: float = SLOW_BYTE_SECONDS) -> None:
        self.count = count
        self.slow_byte_seconds = slow_byte_seconds
        self.behaviour = behaviour
        self.book = book or PageBook()
        self.bytes_sent = 0
        self._refusing = refusing or (lambda index: False)
        self._targets = [_Target(i) for i in range(count)]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleet", daemon=True)
        self._thread.start()
        self.port = self._call(self._start())

    @property
    def urls(self) -> list[str]:
        return [f"http://{address_of(i)}:{self.port}/metrics" for i in range(self.count)]

    def requests_served(self, index: int) -> int:
        return self._targets[index].requests

    def refresh_refusing(self) -> None:
        """Open or close each target's listener as `refusing(index)` now says (a refused connect is real)."""
        self._call(self._sync_listeners())

    def close(self) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    # --- inside the loop ------------------------------------------------------------------------

    def _call(self, coroutine: object) -> object:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=120)  # type: ignore[arg-type]

    async def _start(self) -> int:
        for _attempt in range(20):
            probe = socket.socket()
            probe.bind((address_of(0), 0))
            port = probe.getsockname()[1]
            probe.close()
            try:
                self.port = port
                await self._sync_listeners()
                return port
            except OSError:
                await self._stop()
        raise OSError("no port free on every fleet address")

    async def _sync_listeners(self) -> None:
        for target in self._targets:
            refuse = self._refusing(target.index)
            if refuse and target.server is not None:
                target.server.close()
                target.server = None
                for writer in list(target.writers):
                    writer.transport.abort()
            elif not refuse and target.server is None:
                target.server = await asyncio.start_server(
                    lambda r, w, t=target: self._serve(t, r, w), address_of(target.index), self.port,
                    reuse_address=True, backlog=64)

    async def _stop(self) -> None:
        for target in self._targets:
            if target.server is not None:
                target.server.close()
                target.server = None
            for writer in list(target.writers):
                writer.transport.abort()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, target: _Target, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        target.writers.add(writer)
        try:
            while True:
                try:
                    await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                mode = self.behaviour(target.index, target.requests)
                target.requests += 1
                if not await self._answer(mode, target, writer):
                    return
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            target.writers.discard(writer)
            writer.transport.abort()

    async def _answer(self, mode: str, target: _Target, writer: asyncio.StreamWriter) -> bool:
        """Writes one answer; False when the connection must close after it."""
        if mode == "refuse":  # connected just before the listener closed: hang up without a word
            return False
        if mode == "ok":
            body = self.book.page(target.requests - 1)
            await self._send(writer, _head(200, len(body)) + body)
            return True
        if mode == "500":
            await self._send(writer, _head(500, 21) + b"internal server error")
            return True
        if mode == "garbage":
            body = random.Random(target.requests).randbytes(4096)
            await self._send(writer, _head(200, len(body)) + body)
            return True
        if mode == "truncated":
            body = self.book.page(target.requests - 1)
            await self._send(writer, _head(200, len(body)) + body[: len(body) // 2])
            return False  # hang up mid-body
        if mode in ("slow", "slow_headers"):
            # slow: the head at once, then the body a byte at a time; slow_headers: the head itself trickles.
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n"
            trickle = b"#" * 100000
            if mode == "slow":
                await self._send(writer, head)
            else:
                trickle = head + trickle
            for index in range(int(SLOW_TOTAL_SECONDS / self.slow_byte_seconds)):
                await asyncio.sleep(self.slow_byte_seconds)
                await self._send(writer, trickle[index:index + 1])
            return False
        if mode == "huge":
            await self._send(writer, b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                                     b"Transfer-Encoding: chunked\r\n\r\n")
            line = b"# " + b"x" * 61 + b"\n"
            chunk = line * (HUGE_CHUNK_BYTES // len(line))
            framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
            for _ in range(HUGE_TOTAL_BYTES // len(chunk)):
                await self._send(writer, framed)
            await self._send(writer, b"0\r\n\r\n")
            return False
        raise ValueError(f"unknown mode {mode!r}")

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        if writer.transport.is_closing():
            raise ConnectionResetError("the client hung up")
        writer.write(data)
        await writer.drain()
        self.bytes_sent += len(data)


def _head(status: int, length: int) -> bytes:
    reason = {200: "OK", 500: "Internal Server Error"}[status]
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, required=True)
    args = parser.parse_args(argv)
    fleet = Fleet(args.count)
    fleet.book.page(0)
    print(f"ready {fleet.port}", flush=True)
    try:
        sys.stdin.read()  # runs until the parent closes our stdin
    finally:
        fleet.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
