"""Prometheus-source mode on a remote-write backend (Mimir, Cortex, Thanos Receive): one scrape's series
can be answered from different batches.

Remote write spreads a scrape's series over parallel shards, each sending its own batches, so the
first series of a new scrape can be queryable before the rest, or the last one after. The source
asks the standard deviation of each target's sample times and skips a target whose series are from
two scrapes (tests/serve/test_prometheus_source.py shows a half-and-half tear). A deviation is a poor
measure of one straggler: m series of N, Δ seconds apart, give Δ·sqrt(m(N-m))/N, so with one series
of 545 at a 2 s scrape interval it is 0.086 s, under the 0.1 s tolerance, and the tear was read as
one scrape. The source now judges the gap a tear of one series would need to give that deviation.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from typing import Any

import pytest

from exporter.serve.prometheus_source import (
    SAMPLE_TIME_SPREAD_LABEL,
    SAMPLE_TIME_TOLERANCE_SECONDS,
    torn_gap_seconds,
)
from tests.support.clocks import ManualClock
from tests.support.pages import VllmState, vllm_page
from tests.support.prometheus_api import SCRAPED_AT, QueryApi, config, poller_for, scraped, success

ENGINES = 32  # a wide expert-parallel vLLM: one API server, 32 data-parallel engines
INTERVAL = 2.0  # its scrape interval
ITL_SUM = "vllm:inter_token_latency_seconds_sum"


@pytest.fixture
def api() -> Iterator[QueryApi]:
    server = QueryApi()
    yield server
    server.close()


def _engines(steps: float, itl_sum: float) -> list[VllmState]:
    count = steps * 8
    return [VllmState(engine=str(i), running=8, waiting=0, kv_usage_ratio=0.25, engine_steps=steps,
                      prompt_tokens=steps * 20, generation_tokens=count, itl_count=count, itl_sum=itl_sum,
                      itl_buckets={0.01: 0, 0.025: count, 0.05: count, 0.1: count}) for i in range(ENGINES)]


def _answer(states: list[VllmState], at: float, lagging: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """One target's answer, scraped at `at`, with engine 0's ITL sum still at `lagging`'s older
    scrape (its value and time) when given; the spread series is the population standard deviation
    of every series' sample time, as Prometheus's stddev computes it."""
    items = scraped(vllm_page(*states), "10.0.0.5:8000", at=at)
    times = [at] * sum(1 for item in items if "stepbudget_scrape_time" not in item["metric"])
    if lagging is not None:
        (item,) = [i for i in items if i["metric"].get("__name__") == ITL_SUM and i["metric"]["engine"] == "0"]
        item["value"] = [lagging["at"], repr(lagging["value"])]
        times[0] = lagging["at"]
    items.append({"metric": {"job": "vllm", "instance": "10.0.0.5:8000", SAMPLE_TIME_SPREAD_LABEL: "1"},
                  "value": [at, repr(statistics.pstdev(times))]})
    return items


def test_one_series_still_at_the_last_scrape_is_a_tear_however_many_series_the_target_has(
        api: QueryApi, clock: ManualClock) -> None:
    """Scrapes 1, 2, 3 two seconds apart; the daemon polls at 1 and 3. Scrape 1 -> 2: 100 steps of 20
    ms per engine, 2 -> 3: 100 of 30 ms; at the poll after 3, engine 0's ITL sum is still scrape 2's.
    Read as one scrape, engine 0's window is (sum 2 - sum 1) / (count 3 - count 1) = 16 s / 1,600 =
    10 ms, not 25 ms: the tear is skipped instead, and the next whole answer gives 25 ms."""
    poller, source = poller_for(config(api.url), clock)
    first, second, third = _engines(100, 16.0), _engines(200, 32.0), _engines(300, 32.0 + 24.0)
    try:
        api.serve(success(_answer(first, SCRAPED_AT)))
        clock.now = SCRAPED_AT + 0.5
        poller.poll_once()
        torn = _answer(third, SCRAPED_AT + 2 * INTERVAL, {"at": SCRAPED_AT + INTERVAL, "value": second[0].itl_sum})
        spread = float(torn[-1]["value"][1])
        series = sum(1 for item in torn if "stepbudget_scrape_time" not in item["metric"]) - 1  # less the spread
        assert series == 545 and spread == pytest.approx(INTERVAL * math.sqrt(series - 1) / series)
        assert spread < SAMPLE_TIME_TOLERANCE_SECONDS  # what the deviation alone let through
        api.serve(success(torn))
        clock.now = SCRAPED_AT + 2 * INTERVAL + 0.5
        poller.poll_once()
        readings = {reading.engine: reading for reading in poller.readings()}
        assert all(reading.target_up for reading in readings.values())
        assert readings["0"].measured_step_seconds is None  # the first poll's reading, kept: never 10 ms
        api.serve(success(_answer(third, SCRAPED_AT + 2 * INTERVAL)))
        clock.now = SCRAPED_AT + 2 * INTERVAL + 1.0
        poller.poll_once()
        readings = {reading.engine: reading for reading in poller.readings()}
        whole = (32.0 + 24.0 - 16.0) / ((300 - 100) * 8)
        assert whole == pytest.approx(0.025)
        assert all(reading.measured_step_seconds == pytest.approx(whole) for reading in readings.values())
    finally:
        poller.stop()
        source.close()


@pytest.mark.parametrize("series", [2, 57, 545, 20_000])
def test_the_judged_gap_is_a_straggler_s_and_a_whole_scrape_s_is_0(series: int) -> None:
    """One series of N a scrape behind reads as that scrape's gap, whatever N; more of them read as
    at least that gap (never less: the tolerance is never loosened); one scrape's N equal times as 0."""
    at = SCRAPED_AT
    one_behind = [at - INTERVAL, *[at] * (series - 1)]
    assert torn_gap_seconds(statistics.pstdev(one_behind), series) == pytest.approx(INTERVAL)
    half_behind = [at - INTERVAL] * (series // 2) + [at] * (series - series // 2)
    assert torn_gap_seconds(statistics.pstdev(half_behind), series) >= INTERVAL * (1 - 1e-9)
    assert torn_gap_seconds(statistics.pstdev([at] * series), series) == 0.0
