"""Hostile targets, served for real on loopback (benchmarks/fleet.py, one asyncio thread):
slow-loris servers are cut off at the poll timeout, a 100 MB page is cut off at the size cap
without being held in memory, and label values with quotes, newlines and unicode reach the export
exactly as the server meant them.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.fleet import HUGE_TOTAL_BYTES, Fleet, PageBook
from exporter.serve.collector import make_registry
from exporter.serve.config import Config, config_from_mapping
from exporter.serve.discovery import Discovery
from exporter.serve.fetch import HttpFetcher
from exporter.serve.poller import Poller
from exporter.serve.reading import Reading
from tests.support.clocks import ManualClock

TIMEOUT_SECONDS = 1.0
# What a poll may take past its timeout: thread hand-offs and the watchdog's wake-up, on a busy CI box.
SLACK_SECONDS = 0.75


def config_for(urls: list[str], **top: object) -> Config:
    return config_from_mapping({"timeout": f"{TIMEOUT_SECONDS:g}s", **top, "deployments": [
        {"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": urls}}]})


class Daemonless:
    """A real Poller and HttpFetcher (real monotonic clock: the poll's own measured duration is the point)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.fetcher = HttpFetcher(config.timeout_seconds, config.max_response_bytes)
        self.poller = Poller(config, Discovery(config.deployments, timeout_seconds=1.0), self.fetcher,
                             clock=ManualClock(), monotonic=time.monotonic)

    def poll(self) -> tuple[Reading, ...]:
        return self.poller.poll_once().readings

    def close(self) -> None:
        self.poller.stop()
        self.fetcher.close()


@pytest.fixture
def fleets() -> Iterator[list[Fleet]]:
    started: list[Fleet] = []
    yield started
    for fleet in started:
        fleet.close()


@pytest.mark.parametrize("mode, byte_seconds", [
    ("slow", 1.0),           # the head, then a byte a second: the first wait already outlasts the deadline
    ("slow", 0.2),           # bytes faster than any per-read timeout: only the overall deadline can stop it
    ("slow_headers", 0.2),   # the status line and headers themselves trickle
])
def test_slow_loris_poll_ends_at_the_timeout(fleets: list[Fleet], mode: str, byte_seconds: float) -> None:
    fleet = Fleet(1, lambda index, request: mode, slow_byte_seconds=byte_seconds)
    fleets.append(fleet)
    daemon = Daemonless(config_for(fleet.urls))
    try:
        [reading] = daemon.poll()
        state = daemon.poller.target_states()[0]
    finally:
        daemon.close()
    assert reading.target_up is False
    assert state.last_error is not None and "timed out" in state.last_error
    # The poller's own measurement of this poll: it lasted the timeout, and not much longer.
    assert reading.scrape_duration_seconds is not None
    assert TIMEOUT_SECONDS * 0.9 <= reading.scrape_duration_seconds <= TIMEOUT_SECONDS + SLACK_SECONDS


def test_a_100_megabyte_page_is_cut_off_at_the_cap_without_holding_it(fleets: list[Fleet]) -> None:
    fleet = Fleet(1, lambda index, request: "huge")
    fleets.append(fleet)
    config = config_for(fleet.urls)  # the default cap
    cap = config.max_response_bytes
    daemon = Daemonless(config)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        [reading] = daemon.poll()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        state = daemon.poller.target_states()[0]
        daemon.close()
    assert reading.target_up is False
    assert state.last_error == f"response over {cap} bytes"
    # Held at most the cap (the chunks read so far) plus one chunk and bookkeeping, never the page.
    assert peak - before < cap + 2 * 2**20, (peak - before, cap)
    assert fleet.bytes_sent < HUGE_TOTAL_BYTES / 4, "the fetch kept reading long after the cap"


@pytest.mark.parametrize("model_name", [
    'Qwen "quoted" model',
    "line one\nline two",
    "back\\slash \\n not a newline",
    "Ünïcödé 模型 🚀",
    'all "of\\ them\n at once ✓',
])
def test_label_values_round_trip_into_the_export(fleets: list[Fleet], model_name: str) -> None:
    """The server escapes the value (prometheus_client's renderer, as vLLM does); the daemon reads it,
    keeps it as the model_name label and escapes it again; Prometheus's parser reads back the same."""
    fleet = Fleet(1, book=PageBook(model_name=model_name))
    fleets.append(fleet)
    daemon = Daemonless(config_for(fleet.urls))
    try:
        [reading] = daemon.poll()
        text = generate_latest(make_registry(daemon.poller.readings, daemon.config.deployments)).decode()
    finally:
        daemon.close()
    assert reading.target_up is True and reading.model_name == model_name
    labels = [sample.labels for family in text_string_to_metric_families(text) for sample in family.samples
              if sample.name == "stepbudget_tokens_in_flight"]
    assert labels == [{"deployment": "chat", "target": fleet.urls[0].split("/")[2], "model_name": model_name,
                       "engine": "0"}]
