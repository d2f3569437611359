"""Soak: the poller under its real scheduler, 200 loopback targets, a quarter of them failing in
rotating ways (refused, HTTP 500, garbage, slow-loris, truncated, endless), many short cycles.

Proves: every cycle completes and polls every target; the scheduler never skips a run because one
was stuck; memory and the thread count do not grow after warm-up (the fetch pool within its bound);
the healthy three quarters stay up every cycle and the failing quarter is down every cycle.

Memory is watched two ways, both cheap enough to leave the cycle's timing alone (tracemalloc would
more than double the CPU of a cycle and starve the healthy targets into timeouts): the count of
live small-object blocks after a full collection (`sys.getallocatedblocks`, exact for leaked Python
objects: one per target per cycle would add thousands) and the resident set (for big buffers such as
pages, with room for allocator fragmentation).
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest

from benchmarks.fleet import Fleet
from exporter.serve.config import config_from_mapping
from exporter.serve.discovery import Discovery
from exporter.serve.fetch import MAX_FETCH_WORKERS, HttpFetcher
from exporter.serve.poller import Poller, PollResult

pytestmark = pytest.mark.slow  # a minute: 200 targets

TARGETS = 200
FAILING_EVERY = 4  # target i fails when i % 4 == 0: a quarter of the fleet
FAILURES = ("refuse", "500", "garbage", "slow", "truncated", "huge")
POLL_INTERVAL_SECONDS = 2.5
TIMEOUT_SECONDS = 1.0
SOAK_SECONDS = 60.0
WARM_UP_CYCLES = 5
# Leaking one object per target per cycle adds TARGETS blocks a cycle; measured noise is ~300 blocks.
BLOCK_GROWTH_LIMIT = TARGETS * 5
# Leaking one ~26 KB page per target per cycle adds 5 MB a cycle; fragmentation adds well under 0.5 MB.
RSS_GROWTH_LIMIT_BYTES = 24 * 2**20
FETCH_POOL_PREFIX = "stepbudget-fetch_"  # the pool's thread_name_prefix and ThreadPoolExecutor's "_N"


@dataclass
class Observations:
    cycle: int = 0
    blocks: list[int] = field(default_factory=list)
    rss_bytes: list[int] = field(default_factory=list)
    stopped: bool = False
    threads: list[int] = field(default_factory=list)  # all but the fetch pool's
    fetch_threads: list[int] = field(default_factory=list)
    up_healthy: list[int] = field(default_factory=list)
    up_failing: list[int] = field(default_factory=list)
    readings: list[int] = field(default_factory=list)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def failure_of(index: int, cycle: int) -> str:
    """The healthy three quarters say "ok"; each failing target takes the next failure every cycle."""
    if index % FAILING_EVERY:
        return "ok"
    return FAILURES[(index // FAILING_EVERY + cycle) % len(FAILURES)]


def test_soak_200_targets_a_quarter_failing(caplog: pytest.LogCaptureFixture) -> None:
    seen = Observations()
    fleet = Fleet(TARGETS, lambda index, request: failure_of(index, seen.cycle),
                  refusing=lambda index: failure_of(index, seen.cycle) == "refuse")
    for number in range(int(SOAK_SECONDS / POLL_INTERVAL_SECONDS) + 10):
        fleet.book.page(number)  # render every page the soak will serve now, outside the measurement
    config = config_from_mapping({
        "poll_interval": f"{POLL_INTERVAL_SECONDS:g}s", "timeout": f"{TIMEOUT_SECONDS:g}s",
        "max_response_bytes": "1MiB",
        "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": fleet.urls}}],
    })
    healthy = {url.split("/")[2] for index, url in enumerate(fleet.urls) if index % FAILING_EVERY}
    fetcher = HttpFetcher(config.timeout_seconds, config.max_response_bytes)
    poller = Poller(config, Discovery(config.deployments, timeout_seconds=1.0), fetcher)

    def after_each_cycle(result: PollResult) -> None:
        if seen.stopped:
            return  # a cycle still in flight at the end: the fleet is going away
        up = {reading.target for reading in result.readings if reading.target_up}
        seen.readings.append(len(result.readings))
        seen.up_healthy.append(len(up & healthy))
        seen.up_failing.append(len(up - healthy))
        seen.cycle += 1
        fleet.refresh_refusing()  # the next cycle's refused targets stop listening
        gc.collect()
        seen.blocks.append(sys.getallocatedblocks())
        seen.rss_bytes.append(resident_bytes())
        # The fetch pool (a ThreadPoolExecutor, threads named stepbudget-fetch_N) starts a few workers and
        # adds some when fetches are slow, up to MAX_FETCH_WORKERS, and keeps them: it may grow after
        # warm-up, within that bound. Every other thread must stay as many as at warm-up.
        names = [thread.name for thread in threading.enumerate()]
        seen.fetch_threads.append(sum(1 for name in names if name.startswith(FETCH_POOL_PREFIX)))
        seen.threads.append(len(names) - seen.fetch_threads[-1])

    poller.add_listener(after_each_cycle)
    caplog.set_level(logging.WARNING, logger="apscheduler")
    try:
        poller.start()
        time.sleep(SOAK_SECONDS)  # the soak itself: real cycles under the real scheduler
    finally:
        seen.stopped = True
        poller.stop()
        fetcher.close()
        fleet.close()

    cycles = len(seen.readings)
    assert cycles >= SOAK_SECONDS / POLL_INTERVAL_SECONDS - 2, f"only {cycles} cycles completed"
    skipped = [record.getMessage() for record in caplog.records if record.name.startswith("apscheduler")]
    assert skipped == [], "the scheduler skipped or missed runs: a poll was stuck"
    assert all(count == TARGETS for count in seen.readings)
    assert all(up == len(healthy) for up in seen.up_healthy), seen.up_healthy
    assert all(up == 0 for up in seen.up_failing), seen.up_failing
    blocks = seen.blocks[WARM_UP_CYCLES:]
    assert max(blocks) - blocks[0] < BLOCK_GROWTH_LIMIT, seen.blocks
    rss = seen.rss_bytes[WARM_UP_CYCLES:]
    assert max(rss) - rss[0] < RSS_GROWTH_LIMIT_BYTES, [round(b / 2**20, 1) for b in seen.rss_bytes]
    assert max(seen.threads[WARM_UP_CYCLES:]) <= seen.threads[WARM_UP_CYCLES], seen.threads
    assert max(seen.fetch_threads) <= MAX_FETCH_WORKERS, seen.fetch_threads
