"""`targets.prometheus` against a real Prometheus on 127.0.0.1 scraping simulated vLLM servers.

Two daemons watch the same two servers: one fetches their pages, the other reads the same
series from Prometheus's query API. The servers are held still between rounds (simulated time
moves only when the test advances it), so both daemons read the same server state: the one
fetched directly, the other as Prometheus scraped it once the round's advance was done. Their
exported tokens in flight, capacity, running requests, measured step and prefill per step must
agree within 2%. Then the failures: a query Prometheus refuses, and Prometheus stopped, give
`stepbudget_target_up 0` and a `target_down` log line with the reason, never a crash or a number
that was not read.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import structlog
import yaml
from prometheus_client.parser import text_string_to_metric_families

from exporter.serve.config import Config, config_from_mapping
from exporter.serve.daemon import Daemon, build_daemon, start_serving
from exporter.serve.prometheus_source import SAMPLE_TIME_SPREAD_LABEL
from exporter.simulator.scenarios import builtin_scenarios
from exporter.simulator.server import ServerHandle, start_server
from tests.support.processes import stop_process
from tests.support.servers import free_port, wait_until
from tests.support.tools import require_tool

pytestmark = pytest.mark.e2e

SCRAPE_INTERVAL = "500ms"
ROUND_SIMULATED_SECONDS = 4.0
HELD_POLL_TRIES = 5
COMPARED = ("stepbudget_tokens_in_flight", "stepbudget_kv_cache_capacity_tokens", "stepbudget_requests_running",
            "stepbudget_measured_step_seconds", "stepbudget_prefill_tokens_per_step")
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def servers() -> Iterator[list[ServerHandle]]:
    """Two simulated vLLM servers under steady chat load, held still until the test advances them."""
    scenario = builtin_scenarios()["steady-chat"]
    handles = [start_server(scenario=scenario, paced=False) for _ in range(2)]
    try:
        for handle in handles:
            handle.run_until(20.0)  # past the 10 s ramp: every chat is running
        yield handles
    finally:
        for handle in handles:
            handle.stop()


def start_prometheus(targets: list[str], directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = require_tool("prometheus")
    config = {"global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL},
              "scrape_configs": [{"job_name": "vllm", "static_configs": [{"targets": targets}]}]}
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [binary, f"--config.file={directory / 'prometheus.yml'}", f"--storage.tsdb.path={directory / 'data'}",
         f"--web.listen-address={address}"],
        stdout=subprocess.DEVNULL, stderr=(directory / "prometheus.log").open("w"))
    return process, f"http://{address}"


@pytest.fixture
def prometheus(servers: list[ServerHandle], tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    process, base = start_prometheus([f"127.0.0.1:{handle.port}" for handle in servers], tmp_path)
    try:
        yield process, base
    finally:
        stop_process(process)


def daemon_config(targets: dict[str, Any]) -> Config:
    return config_from_mapping({
        "listen": "127.0.0.1:0", "poll_interval": "1s", "timeout": "2s", "stale_after": "60s",
        "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": targets}],
    })


@pytest.fixture
def started() -> Iterator[Callable[[Config], Daemon]]:
    """Daemons built as `serve` builds them, their /metrics served, polled by the test (no scheduler)."""
    daemons: list[Daemon] = []

    def start(config: Config) -> Daemon:
        daemon = build_daemon(config)
        start_serving(daemon)
        daemons.append(daemon)
        return daemon

    yield start
    for daemon in daemons:
        daemon.poller.stop()
        daemon.server.stop()
        daemon.fetcher.close()
        for source in daemon.sources:
            source.close()


def exported(daemon: Daemon) -> Series:
    """Every sample of the daemon's own /metrics, by name and labels."""
    text = requests.get(f"http://127.0.0.1:{daemon.server.port}/metrics", timeout=5).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def scrape_times(base: str) -> dict[str, float]:
    """When Prometheus last scraped each target successfully. `timestamp()` of a bare selector is
    the sample's own time; of an expression (`up == 1`) it would be the evaluation time."""
    answer = requests.get(f"{base}/api/v1/query", params={"query": 'timestamp(up{job="vllm"})'}, timeout=5).json()
    healthy = requests.get(f"{base}/api/v1/query", params={"query": 'up{job="vllm"} == 1'}, timeout=5).json()
    up = {item["metric"]["instance"] for item in healthy["data"]["result"]}
    return {item["metric"]["instance"]: float(item["value"][1]) for item in answer["data"]["result"]
            if item["metric"]["instance"] in up}


def advance_and_wait_for_scrapes(servers: list[ServerHandle], base: str, until: float) -> None:
    """Move every server to simulated time `until`, then wait until Prometheus scraped each after that."""
    for handle in servers:
        handle.run_until(until)
    moved = time.time()
    wait_until(lambda: len(times := scrape_times(base)) == len(servers) and min(times.values()) > moved,
               timeout_seconds=30.0, interval_seconds=0.1)


def compared(series: Series) -> dict[tuple[str, str], float]:
    return {(name, dict(labels)["target"]): value for (name, labels), value in series.items()
            if name in COMPARED and dict(labels).get("deployment") == "chat"}


def test_prometheus_mode_exports_what_direct_polling_exports(servers: list[ServerHandle], prometheus: tuple,
                                                             started: Callable[[Config], Daemon]) -> None:
    _process, base = prometheus
    direct = started(daemon_config({"static": [f"{handle.url}/metrics" for handle in servers]}))
    via_prometheus = started(daemon_config({"prometheus": {"url": base, "selector": 'job="vllm"'}}))
    wait_until(lambda: len(scrape_times(base)) == len(servers), timeout_seconds=40.0, interval_seconds=0.2)

    simulated = 20.0
    for _ in range(3):  # the first poll has no window yet; the next two each measure one
        simulated += ROUND_SIMULATED_SECONDS
        advance_and_wait_for_scrapes(servers, base, simulated)
        direct.poller.poll_once()
        via_prometheus.poller.poll_once()
        pages, queried = compared(exported(direct)), compared(exported(via_prometheus))
    assert set(queried) == set(pages)
    assert {name for name, _ in pages} == set(COMPARED), "every compared figure is exported"
    for key, value in pages.items():
        assert value > 0, key
        assert queried[key] == pytest.approx(value, rel=0.02), key

    # Prometheus commits a scrape at once: each target's series carry one sample time (deviation 0).
    (source,) = via_prometheus.sources
    answer = requests.post(f"{base}/api/v1/query", data={"query": source.query}, timeout=5).json()
    deviations = {item["metric"]["instance"]: float(item["value"][1]) for item in answer["data"]["result"]
                  if SAMPLE_TIME_SPREAD_LABEL in item["metric"]}
    assert deviations == {f"127.0.0.1:{handle.port}": 0.0 for handle in servers}

    # A poll that finds no newer scrape keeps the last window: the measured step does not blank. Prometheus
    # scrapes every 500 ms, and a scrape of the servers held still is a newer one with nothing new in it (an
    # idle window, rightly without a measured step): a round counts only where no scrape came between the
    # export kept and the poll after it, and a round that met one moves the servers on and tries again.
    for _ in range(HELD_POLL_TRIES):
        simulated += ROUND_SIMULATED_SECONDS
        advance_and_wait_for_scrapes(servers, base, simulated)
        via_prometheus.poller.poll_once()
        held, scraped = exported(via_prometheus), scrape_times(base)
        via_prometheus.poller.poll_once()
        if scrape_times(base) == scraped:
            break
    else:
        pytest.fail(f"Prometheus scraped during each of {HELD_POLL_TRIES} held polls")
    assert {name for name, _ in compared(held)} == set(COMPARED)
    assert compared(exported(via_prometheus)) == compared(held)


def test_query_errors_and_a_stopped_prometheus_are_target_failures(servers: list[ServerHandle], prometheus: tuple,
                                                                   started: Callable[[Config], Daemon]) -> None:
    process, base = prometheus
    good = started(daemon_config({"prometheus": {"url": base, "selector": 'job="vllm"'}}))
    # An invalid regular expression passes the config's check but Prometheus refuses the query (HTTP 400).
    refused = started(daemon_config({"prometheus": {"url": base, "selector": 'job=~"(vllm"'}}))
    wait_until(lambda: len(scrape_times(base)) == len(servers), timeout_seconds=40.0, interval_seconds=0.2)
    advance_and_wait_for_scrapes(servers, base, 24.0)
    good.poller.poll_once()
    advance_and_wait_for_scrapes(servers, base, 28.0)
    with structlog.testing.capture_logs() as logs:
        good.poller.poll_once()
        refused.poller.poll_once()
    assert all(reading.target_up for reading in good.poller.readings())
    assert len({reading.target for reading in good.poller.readings()}) == len(servers)
    (down,) = refused.poller.readings()  # no target known yet: one named after Prometheus itself
    assert not down.target_up and down.target == base.removeprefix("http://")
    assert down.tokens_in_flight is None and down.measured_step_seconds is None
    refusal = [line for line in logs if line["event"] == "target_down" and line["deployment"] == "chat"]
    assert refusal and "bad_data" in refusal[0]["reason"], refusal

    stop_process(process)
    with structlog.testing.capture_logs() as logs:
        good.poller.poll_once()
    readings = good.poller.readings()
    assert len({reading.target for reading in readings}) == len(servers)
    assert not any(reading.target_up for reading in readings)
    reasons = {line["reason"] for line in logs if line["event"] == "target_down"}
    assert reasons and all("Connection refused" in reason for reason in reasons), reasons
    series = exported(good)
    ups = [value for (name, _), value in series.items() if name == "stepbudget_target_up"]
    assert ups == [0.0] * len(servers)
