"""Every structure the daemon keys by target, series or engine stays within its documented bound
(docs/operations.md, "Memory bounds") while targets come and go, and its size is exported
(`stepbudget_state_entries`, `stepbudget_state_max_entries`). Simulated time; the fetcher test connects
only to a closed port on 127.0.0.1."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from exporter.serve import daemon as daemon_module
from exporter.serve import fetch as fetch_module
from exporter.serve.alerting import PAGE_HOLD_SECONDS, AlertLoop
from exporter.serve.config import Tls, config_from_mapping
from exporter.serve.discovery import Target
from exporter.serve.fetch import FetchError, HttpFetcher
from exporter.serve.online_calibration import MAX_WINDOWS_PER_DEPLOYMENT, OnlineCalibrator, WindowHistory
from exporter.serve.online_fit_types import FitWindow
from exporter.serve.poller import Poller
from exporter.serve.reading import Reading
from exporter.serve.state_sizes import StateSizes
from tests.support.servers import free_port

POLL_SECONDS = 15.0


def pool_config(targets: list[str] | None = None) -> daemon_module.Config:
    return config_from_mapping({"listen": "127.0.0.1:0", "deployments": [{
        "name": "pool", "model": "qwen3-8b", "gpu": "h100-sxm",
        "targets": {"static": targets or ["http://127.0.0.1:9/metrics"]}}]})


def engine_reading(target: str, end_seconds: float, *, up: bool = True, predicted: float | None = None,
                   budget: float | None = None) -> Reading:
    return Reading(deployment="pool", target=target, model_name="qwen3-8b", engine="0", target_up=up,
                   last_success_timestamp_seconds=end_seconds, tokens_in_flight=20_000.0, requests_running=10.0,
                   measured_step_seconds=0.02, predicted_step_seconds=predicted, step_budget_seconds=budget)


# --- online calibration ------------------------------------------------------------------------------


def test_calibration_remembers_only_the_engines_of_the_last_poll() -> None:
    """Pods replaced at every poll (new addresses each time): 10 engines a poll for 200 polls. The engines
    remembered are the last poll's 10, not the 2,000 seen."""
    calibrator = OnlineCalibrator(pool_config().deployments)
    for poll in range(200):
        end = (poll + 1) * POLL_SECONDS
        readings = [engine_reading(f"10.{poll // 250}.{poll % 250}.{engine}:8000", end) for engine in range(10)]
        calibrator.observe(readings, end)
        assert calibrator.sizes()[1] == 10
    calibration = calibrator.deployments["pool"]
    assert calibration.engines_seen == 10
    calibrator.observe([], 201 * POLL_SECONDS)  # a poll with no window at all
    assert calibrator.sizes()[1] == 0


def test_a_window_published_again_is_still_taken_once() -> None:
    calibrator = OnlineCalibrator(pool_config().deployments)
    reading = engine_reading("10.0.0.1:8000", 100.0)
    calibrator.observe([reading], 100.0)
    calibrator.observe([reading], 115.0)  # no newer scrape: the same window again
    assert calibrator.sizes() == (1, 1)


def test_the_window_history_never_holds_more_than_its_maximum_even_without_refits() -> None:
    """1,000 engines at 15-s polls for 12 h (twice the 6-h history), never refitted: 2.88 million windows
    offered, at most (360 + 1) slices x 8 = 2,888 kept."""
    history = WindowHistory(6 * 3600.0)
    most = 0
    for poll in range(int(12 * 3600 / POLL_SECONDS)):
        end = (poll + 1) * POLL_SECONDS
        for engine in range(0, 1000, 50):  # 20 engines a poll stand in for 1,000: each slice still overflows
            history.add((f"10.0.{engine // 250}.{engine % 250}:8000",), FitWindow(end, 20_000.0, 10.0, 0.0, 0.02))
        most = max(most, len(history))
    assert MAX_WINDOWS_PER_DEPLOYMENT == (360 + 1) * 8
    assert most <= MAX_WINDOWS_PER_DEPLOYMENT
    # A window older than the whole history is not taken at all.
    before = len(history)
    history.add(("late",), FitWindow(60.0, 20_000.0, 10.0, 0.0, 0.02))
    assert len(history) == before


# --- the alert loop ----------------------------------------------------------------------------------


def test_the_alert_loop_forgets_series_that_leave_and_holds_the_page_only_for_the_hold() -> None:
    config = pool_config()
    loop = AlertLoop(config.alerting, poll_interval_seconds=POLL_SECONDS, post=lambda *args: None)
    now = 1_800_000_000.0
    # 1,000 targets, half of them present at each poll (flapping in and out of discovery), none over budget.
    for poll in range(20):
        now += POLL_SECONDS
        readings = [engine_reading(f"t{i}", now, predicted=0.01, budget=0.02) for i in range(1000)
                    if (i + poll) % 2 == 0]
        loop.evaluate(readings, now)
        series, _ = loop.sizes()
        assert series == 500  # the last poll's: a series that left is forgotten at once
    # Over budget at their last reading, then gone: held for the page's 30 minutes, then forgotten.
    loop.evaluate([engine_reading(f"hot{i}", now, predicted=0.05, budget=0.02) for i in range(10)], now)
    assert loop.sizes()[0] == 10
    now += PAGE_HOLD_SECONDS
    loop.evaluate([], now)
    assert loop.sizes()[0] == 10  # within the hold
    now += POLL_SECONDS
    loop.evaluate([], now)
    assert loop.sizes()[0] == 0


# --- the fetcher's caches ----------------------------------------------------------------------------


def test_the_fetchers_caches_are_cleared_past_their_maximum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch_module, "MAX_CACHED_REQUESTS", 10)
    port = free_port()  # nothing listens there: each fetch fails at once
    fetcher = HttpFetcher(1.0, 1 << 20)
    try:
        most = (0, 0)
        for index in range(50):
            with pytest.raises(FetchError):
                fetcher(f"http://127.0.0.{1 + index % 25}:{port}/metrics/{index}", bearer_token=None, tls=Tls())
            pools, routes = fetcher.sizes()
            most = (max(most[0], pools), max(most[1], routes))
    finally:
        fetcher.close()
    assert most[0] <= 11 and most[1] <= 11


def test_the_fetcher_keeps_only_the_pools_of_the_polls_targets() -> None:
    """Pods replaced at every poll: 5 targets a poll, new addresses each time, for 20 polls. The fetcher
    keeps the pools and routes of the last poll's 5 (each a closed port on 127.0.0.1), not the 100 seen."""
    port = free_port()
    config = pool_config()
    fetcher = HttpFetcher(1.0, 1 << 20)

    class Replaced:
        poll = 0

        def discover(self) -> list[Target]:
            return [Target("pool", f"http://127.0.{1 + self.poll}.{i + 1}:{port}/metrics",
                           f"127.0.{1 + self.poll}.{i + 1}:{port}") for i in range(5)]

    discovery = Replaced()
    poller = Poller(config, discovery, fetcher)
    try:
        for poll in range(20):
            discovery.poll = poll
            result = poller.poll_once()
            assert [reading.target_up for reading in result.readings] == [False] * 5
            assert fetcher.sizes() == (5, 5)
    finally:
        poller.stop()
        fetcher.close()


# --- the exported sizes --------------------------------------------------------------------------------


def test_state_sizes_export_the_last_sample_and_change_generation_only_when_it_does() -> None:
    entries = {"a": 3, "b": 5}
    sizes = StateSizes()
    sizes.watch("a", lambda: entries["a"], 10)
    sizes.watch("b", lambda: entries["b"])
    with pytest.raises(ValueError):
        sizes.watch("a", lambda: 0)
    generation = sizes.generation()
    entries["a"] = 4
    assert sizes.generation() == generation  # not sampled yet: the page is the same
    sizes.sample()
    assert sizes.generation() != generation
    families = {family.name: {tuple(sample.labels.values()): sample.value for sample in family.samples}
                for family in sizes.collect()}
    assert families == {"stepbudget_state_entries": {("a",): 4.0, ("b",): 5.0},
                        "stepbudget_state_max_entries": {("a",): 10.0}}


def test_the_daemon_exports_every_structures_size_and_bound() -> None:
    daemon = daemon_module.build_daemon(pool_config())
    try:
        daemon_module.start_serving(daemon)
        daemon.poller.poll_once()  # the target (a closed port) is down: still one target polled
        page = generate_latest(daemon.server.registry).decode()
    finally:
        daemon.server.stop()
        daemon.poller.stop()
        daemon.fetcher.close()
    for structure in ("poller_targets", "fetch_pools", "fetch_routes", "alert_series", "alerts",
                      "calibration_windows", "calibration_engines", "http_connections"):
        assert f'stepbudget_state_entries{{structure="{structure}"}}' in page, structure
    assert 'stepbudget_state_entries{structure="poller_targets"} 1.0' in page
    assert f'stepbudget_state_max_entries{{structure="fetch_pools"}} {fetch_module.MAX_CACHED_REQUESTS + 1}.0' in page
    limits = daemon.server.limits
    assert f'stepbudget_state_max_entries{{structure="http_connections"}} {2 * limits.max_connections}.0' in page
    assert (f'stepbudget_state_max_entries{{structure="calibration_windows"}} {MAX_WINDOWS_PER_DEPLOYMENT}.0'
            in page)
