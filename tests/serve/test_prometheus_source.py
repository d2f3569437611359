"""`targets.prometheus` against a stub query API on 127.0.0.1: what each kind of answer does.

The stub answers `POST /api/v1/query` the way Prometheus, Thanos and Mimir do (same JSON), built
from real vLLM pages (tests/support/pages.py) with the labels a scrape adds. The live test
with a real Prometheus is tests/serve/test_prometheus_mode_live.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from exporter.serve.config import Config, ConfigError, config_from_mapping
from exporter.serve.discovery import Discovery
from exporter.serve.engines import read_page
from exporter.serve.poller import Poller
from exporter.serve.prometheus_source import (
    SAMPLE_TIME_SPREAD_LABEL,
    SCRAPE_TIME_LABEL,
    PrometheusSource,
    series_query,
)
from tests.support.clocks import ManualClock
from tests.support.pages import vllm_page
from tests.support.prometheus_api import SCRAPED_AT, QueryApi, busy, config, poller_for, scraped, success


@pytest.fixture
def api() -> Iterator[QueryApi]:
    server = QueryApi()
    yield server
    server.close()


# --- config -------------------------------------------------------------------------------------


def test_config_takes_a_selector_with_or_without_braces_and_inherits_auth() -> None:
    cfg = config_from_mapping({"deployments": [{
        "name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "auth": {"bearer_token_env": "TOKEN"},
        "targets": {"prometheus": {"url": "http://prom:9090/", "selector": '{job="vllm", namespace=~"llm-.*"}'}}}]})
    (deployment,) = cfg.deployments
    assert deployment.mode == "prometheus"
    assert deployment.prometheus is not None
    assert deployment.prometheus.selector == 'job="vllm", namespace=~"llm-.*"'
    assert deployment.prometheus.url == "http://prom:9090"  # the source joins /api/v1/query to it
    assert deployment.prometheus.auth.bearer_token_env == "TOKEN"
    assert "discovery prometheus" in cfg.summary()


def test_an_unverified_query_api_is_said_once_at_start_naming_it() -> None:
    with structlog.testing.capture_logs() as logs:
        poller_for(config("https://prom:9090", tls={"insecure_skip_verify": True}), ManualClock(0.0))
        poller_for(config("https://prom:9090"), ManualClock(0.0))  # verified: nothing to say
    said = [entry for entry in logs if entry["event"] == "tls_verification_disabled"]
    assert [(entry["target"], entry["log_level"]) for entry in said] == [("https://prom:9090", "warning")]


@pytest.mark.parametrize(("targets", "problem"), [
    ({"prometheus": {"url": "http://p:9090", "selector": "job=vllm"}}, "PromQL label matchers"),
    ({"prometheus": {"url": "http://p:9090", "selector": '__name__="up"'}}, "chooses the metric names"),
    ({"prometheus": {"url": "http://p:9090"}}, "missing required key 'selector'"),
    ({"prometheus": {"url": "http://p:9090", "selector": 'job="v"'}, "static": ["http://a:8000/metrics"]},
     "give it alone"),
])
def test_config_refuses_bad_prometheus_sections(targets: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        config_from_mapping({"deployments": [{"name": "c", "model": "qwen3-8b", "gpu": "h100-sxm",
                                               "targets": targets}]})


# --- the query ----------------------------------------------------------------------------------


def test_one_query_asks_for_every_wanted_name_up_and_scrape_times() -> None:
    query = series_query(["vllm:num_requests_running", "sglang:token_usage"], 'job="vllm"')
    times = " or ".join(f'label_replace(timestamp({name}{{job="vllm"}}), "stepbudget_sample_name", "{name}", "", "")'
                        for name in ("sglang:token_usage", "up", "vllm:num_requests_running"))
    assert query == ('{__name__=~"sglang:token_usage|up|vllm:num_requests_running",job="vllm"} or '
                     f'label_replace(timestamp(up{{job="vllm"}}), "{SCRAPE_TIME_LABEL}", "1", "", "") or '
                     f'label_replace(stddev by (cluster, job, instance) ({times}), "{SAMPLE_TIME_SPREAD_LABEL}", "1", '
                     '"", "")')


def test_targets_read_from_the_answer_give_the_pages_own_snapshots(api: QueryApi, clock: ManualClock) -> None:
    page_a, page_b = vllm_page(busy(100, 16.0)), vllm_page(busy(50, 9.0))
    api.serve(success(scraped(page_a, "10.0.0.5:8000", extra={"namespace": "llm", "pod": "vllm-0"}),
                      scraped(page_b, "10.0.0.6:8000")))
    clock.now = SCRAPED_AT + 1
    _, source = poller_for(config(api.url, tenant="team-a"), clock)
    answer = source.read()
    by_label = {outcome.target.target: outcome for outcome in answer.outcomes}
    assert set(by_label) == {"10.0.0.5:8000", "10.0.0.6:8000"}
    assert (by_label["10.0.0.5:8000"].target.namespace, by_label["10.0.0.5:8000"].target.pod) == ("llm", "vllm-0")
    # Prometheus's labels (job, instance, namespace, pod) are off: the same Snapshot as the page's.
    assert by_label["10.0.0.5:8000"].page.snapshots == read_page(page_a).snapshots
    assert by_label["10.0.0.6:8000"].page.snapshots == read_page(page_b).snapshots
    form, headers = api.requests[0]
    assert form["query"] == source.query and form["partial_response"] == "false"
    assert headers["x-scope-orgid"] == "team-a"


def test_an_instance_two_jobs_scrape_is_two_targets_named_with_their_jobs(api: QueryApi, clock: ManualClock) -> None:
    """`instance` alone names a target; where two jobs scrape one instance, each is `instance/job`."""
    page = vllm_page(busy(100, 16.0))
    api.serve(success(scraped(page, "10.0.0.5:8000"), scraped(page, "10.0.0.5:8000", extra={"job": "canary"}),
                      scraped(page, "10.0.0.6:8000")))
    clock.now = SCRAPED_AT + 1
    _, source = poller_for(config(api.url), clock)
    labels = sorted(outcome.target.target for outcome in source.read().outcomes)
    assert labels == ["10.0.0.5:8000/canary", "10.0.0.5:8000/vllm", "10.0.0.6:8000"]


def test_one_instance_in_two_clusters_is_two_targets_named_with_their_clusters(api: QueryApi,
                                                                               clock: ManualClock) -> None:
    """A global querier (Thanos, a federating Prometheus) holds each cluster's series with its `cluster`
    label: the same job and instance in two clusters are two servers, each read from its own series."""
    page_eu, page_us = vllm_page(busy(100, 16.0)), vllm_page(busy(50, 9.0))
    api.serve(success(scraped(page_eu, "10.0.0.5:8000", extra={"cluster": "prod-eu"}, spread=0.0),
                      scraped(page_us, "10.0.0.5:8000", extra={"cluster": "prod-us"}, spread=0.0),
                      scraped(page_us, "10.0.0.6:8000", extra={"cluster": "prod-us"}, spread=0.0)))
    clock.now = SCRAPED_AT + 1
    _, source = poller_for(config(api.url), clock)
    by_label = {outcome.target.target: outcome for outcome in source.read().outcomes}
    assert set(by_label) == {"prod-eu/10.0.0.5:8000", "prod-us/10.0.0.5:8000", "10.0.0.6:8000"}
    assert by_label["prod-eu/10.0.0.5:8000"].page.snapshots == read_page(page_eu).snapshots
    assert by_label["prod-us/10.0.0.5:8000"].page.snapshots == read_page(page_us).snapshots
    assert "cluster=prod-eu," in by_label["prod-eu/10.0.0.5:8000"].target.url


def test_windows_over_queries_match_windows_over_pages(api: QueryApi, clock: ManualClock) -> None:
    poller, _ = poller_for(config(api.url), clock)
    for steps, at in ((100, SCRAPED_AT), (300, SCRAPED_AT + 15)):
        api.serve(success(scraped(vllm_page(busy(steps, steps * 8 * 0.02)), "10.0.0.5:8000", at=at)))
        clock.now = at + 1
        poller.poll_once()
    (reading,) = poller.readings()
    assert reading.target_up and reading.target == "10.0.0.5:8000"
    assert reading.measured_step_seconds == pytest.approx(0.02)
    assert reading.prefill_tokens_per_step == pytest.approx(20.0)
    # 4,095 usable blocks of 16, less the 8 running requests' half-empty last blocks, as over pages.
    assert reading.tokens_in_flight == pytest.approx(0.25 * 4095 * 16 - 8 * 7.5)


def test_a_poll_with_no_newer_scrape_keeps_the_window(api: QueryApi, clock: ManualClock) -> None:
    poller, _ = poller_for(config(api.url), clock)
    for steps, at in ((100, SCRAPED_AT), (300, SCRAPED_AT + 15), (300, SCRAPED_AT + 15)):
        api.serve(success(scraped(vllm_page(busy(steps, steps * 8 * 0.02)), "10.0.0.5:8000", at=at)))
        clock.now = at + 5
        poller.poll_once()
    (reading,) = poller.readings()
    assert reading.measured_step_seconds == pytest.approx(0.02), "an empty window would blank it"


# --- failures are target failures ----------------------------------------------------------------


def failed_readings(api: QueryApi, clock: ManualClock, **prometheus: Any) -> tuple[list[Any], list[dict[str, Any]]]:
    """Poll once with a good answer, then once with the stub's current failure."""
    poller, _ = poller_for(config(api.url, **prometheus), clock)
    failure = api.answer
    api.serve(success(scraped(vllm_page(busy(100, 16.0)), "10.0.0.5:8000")))
    clock.now = SCRAPED_AT + 1
    poller.poll_once()
    api.answer = failure
    with structlog.testing.capture_logs() as logs:
        poller.poll_once()
    return list(poller.readings()), [line for line in logs if line["event"] == "target_down"]


@pytest.mark.parametrize(("payload", "status", "reason"), [
    ({"status": "error", "errorType": "timeout", "error": "query timed out in expression evaluation"}, 503,
     "query failed (HTTP 503): timeout: query timed out"),
    ({"status": "error", "errorType": "bad_data", "error": "invalid regular expression"}, 400, "bad_data"),
    (success([], warnings=["No StoreAPIs matched for this query"]), 200, "partial response: No StoreAPIs"),
    ({"status": "success", "data": {"resultType": "matrix", "result": []}}, 200, "unexpected answer"),
])
def test_query_errors_and_partial_answers_make_every_target_down(api: QueryApi, clock: ManualClock,
                                                                 payload: dict[str, Any], status: int,
                                                                 reason: str) -> None:
    api.serve(payload, status)
    readings, logs = failed_readings(api, clock)
    (reading,) = readings
    assert not reading.target_up and reading.target == "10.0.0.5:8000"
    (line,) = logs
    assert reason in line["reason"] and line["reason"].startswith("prometheus ")


def test_html_from_a_proxy_is_a_failure_not_a_crash(api: QueryApi, clock: ManualClock) -> None:
    api.answer = lambda form, headers: (502, b"<html>bad gateway</html>")
    readings, logs = failed_readings(api, clock)
    assert not readings[0].target_up
    assert "HTTP 502: not a Prometheus API answer" in logs[0]["reason"]


def test_a_slow_prometheus_fails_within_the_timeout(api: QueryApi, clock: ManualClock) -> None:
    def slow(form: dict[str, str], headers: dict[str, str]) -> tuple[int, bytes]:
        time.sleep(3)
        return 200, json.dumps(success([])).encode()

    api.answer = slow
    started = time.monotonic()
    readings, logs = failed_readings(api, clock)
    assert time.monotonic() - started < 2.9  # the 1 s timeout, not the 3 s answer
    assert not readings[0].target_up and "timed out" in logs[0]["reason"]


def test_an_answer_over_the_size_limit_is_refused(api: QueryApi, clock: ManualClock) -> None:
    page = vllm_page(busy(100, 16.0))
    api.serve(success(*(scraped(page, f"10.0.0.{n}:8000") for n in range(3))))
    cfg = config(api.url, max_response_bytes="10KB")
    poller, _ = poller_for(cfg, clock)
    with structlog.testing.capture_logs() as logs:
        poller.poll_once()
    (reading,) = poller.readings()
    assert not reading.target_up
    assert "answer over 10000 bytes" in next(line["reason"] for line in logs if line["event"] == "target_down")


def test_a_target_prometheus_cannot_scrape_is_down(api: QueryApi, clock: ManualClock) -> None:
    page = vllm_page(busy(100, 16.0))
    api.serve(success(scraped(page, "10.0.0.5:8000"), scraped(page, "10.0.0.6:8000", up=0)))
    clock.now = SCRAPED_AT + 1
    poller, _ = poller_for(config(api.url), clock)
    poller.poll_once()
    up = {reading.target: reading.target_up for reading in poller.readings()}
    assert up == {"10.0.0.5:8000": True, "10.0.0.6:8000": False}
    (state,) = [s for s in poller.target_states() if s.target.target == "10.0.0.6:8000"]
    assert state.last_error == "Prometheus cannot scrape it (up 0)"


def test_a_scrape_older_than_stale_after_is_down(api: QueryApi, clock: ManualClock) -> None:
    api.serve(success(scraped(vllm_page(busy(100, 16.0)), "10.0.0.5:8000")))
    clock.now = SCRAPED_AT + 120
    poller, _ = poller_for(config(api.url), clock)
    poller.poll_once()
    (reading,) = poller.readings()
    assert not reading.target_up and reading.tokens_in_flight is None


def test_prometheus_down_before_any_answer_shows_one_target_named_after_it(clock: ManualClock) -> None:
    from tests.support.servers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    poller, _ = poller_for(config(url), clock)
    with structlog.testing.capture_logs() as logs:
        poller.poll_once()
    (reading,) = poller.readings()
    assert not reading.target_up and reading.target == url.removeprefix("http://")
    assert "Connection refused" in next(line["reason"] for line in logs if line["event"] == "target_down")


def test_bearer_token_is_sent_to_the_query_api(api: QueryApi, clock: ManualClock,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROM_TOKEN", "s3cret")
    api.serve(success(scraped(vllm_page(busy(100, 16.0)), "10.0.0.5:8000")))
    poller, _ = poller_for(config(api.url, auth={"bearer_token_env": "PROM_TOKEN"}), clock)
    poller.poll_once()
    assert api.requests[0][1]["authorization"] == "Bearer s3cret"


def test_basic_auth_is_sent_to_the_query_api(api: QueryApi, clock: ManualClock,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROM_PASSWORD", "s3cret")
    api.serve(success(scraped(vllm_page(busy(100, 16.0)), "10.0.0.5:8000")))
    auth = {"basic_auth": {"username": "reader", "password_env": "PROM_PASSWORD"}}
    poller, _ = poller_for(config(api.url, auth=auth), clock)
    [reading] = poller.poll_once().readings
    assert reading.target_up
    assert api.requests[0][1]["authorization"] == "Basic cmVhZGVyOnMzY3JldA=="  # base64 of "reader:s3cret"
    monkeypatch.delenv("PROM_PASSWORD")
    clock.advance(1)
    with capture_logs() as logs:
        [reading] = poller.poll_once().readings
    assert not reading.target_up and len(api.requests) == 1  # no query without the password
    [line] = [line for line in logs if line["event"] == "target_down"]
    assert line["reason"] == ("prometheus basic_auth.password_env: environment variable PROM_PASSWORD is not set")


# --- staleness follows the scrape interval ------------------------------------------------------


class ScrapingPrometheus:
    """A Prometheus scraping one target every `interval` seconds, each scrape queryable `lag` seconds
    after it started (the scrape's duration plus ingestion); the stub answers with the newest scrape
    queryable at the injected clock's time, its counters 60 steps of 20 ms further per scrape."""

    def __init__(self, api: QueryApi, clock: ManualClock, *, interval: float, lag: float) -> None:
        self.interval, self.lag, self.clock = interval, lag, clock
        self.stopped_after: int | None = None  # the last scrape taken, once scraping stops
        api.answer = lambda form, headers: (200, json.dumps(self.answer()).encode())

    def newest(self) -> int:
        index = int((self.clock.now - SCRAPED_AT - self.lag) // self.interval)
        return index if self.stopped_after is None else min(index, self.stopped_after)

    def answer(self) -> dict[str, Any]:
        index = self.newest()
        steps = 100 + 60 * index
        return success(scraped(vllm_page(busy(steps, steps * 8 * 0.02)), "10.0.0.5:8000",
                               at=SCRAPED_AT + index * self.interval))


def stale_source(cfg: Config, clock: ManualClock, stale_after_seconds: float) -> tuple[Poller, PrometheusSource]:
    """A poller over a source built with its own `stale_after` (the config would refuse some of them)."""
    (deployment,) = cfg.deployments
    source = PrometheusSource(deployment, timeout_seconds=cfg.timeout_seconds,
                              stale_after_seconds=stale_after_seconds, clock=clock)
    poller = Poller(cfg, Discovery(cfg.deployments, timeout_seconds=1.0), fetch=lambda *a, **k: "",
                    clock=clock, sources=[source])
    return poller, source


def test_a_poll_on_the_scrapes_blind_phase_reads_the_target_once_its_interval_is_seen(
        api: QueryApi, clock: ManualClock) -> None:
    """The issue's numbers: scrape and poll every 60 s, `stale_after` 60 s, each poll 1 s after a
    scrape started and 2 s before its samples are queryable, so every poll sees a 61 s old scrape.
    Before, the target never produced a reading; now a 61 s old scrape is fresh for a target scraped
    every 60 s (two intervals of age allowed): only the first poll, before two scrapes are seen, is down."""
    ScrapingPrometheus(api, clock, interval=60.0, lag=3.0)
    poller, _ = stale_source(config(api.url), clock, stale_after_seconds=60.0)
    up, steps = [], []
    for poll in range(10):
        clock.now = SCRAPED_AT + 60.0 * (poll + 1) + 1.0  # scrape `poll` is the newest queryable: 61 s old
        poller.poll_once()
        (reading,) = poller.readings()
        up.append(reading.target_up)
        steps.append(reading.measured_step_seconds)
    assert up == [False] + [True] * 9
    # Polls 2 and on read a new scrape each; from poll 3 each has a window: 60 steps of 20 ms each.
    assert steps[:2] == [None, None] and steps[2:] == [pytest.approx(0.02)] * 8


def test_a_poll_every_half_scrape_interval_no_longer_flaps(api: QueryApi, clock: ManualClock) -> None:
    """A config check-config accepts: poll 30 s, `stale_after` 60 s, scrape 60 s, lag 3 s. Every other poll
    saw a 61 s old scrape and marked the target down (a `target_down` line a minute, `target_up` 0 half
    the time); now only the first such poll, before the interval is known, is down."""
    ScrapingPrometheus(api, clock, interval=60.0, lag=3.0)
    cfg = config_from_mapping({"poll_interval": "30s", "timeout": "1s", "stale_after": "60s",
                               "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                                                "targets": {"prometheus": {"url": api.url,
                                                                           "selector": 'job="vllm"'}}}]})
    poller, _ = poller_for(cfg, clock)
    up = []
    with structlog.testing.capture_logs() as logs:
        for poll in range(12):
            clock.now = SCRAPED_AT + 61.0 + 30.0 * poll  # ages 61, 31, 61, 31, ...
            poller.poll_once()
            up.append(poller.readings()[0].target_up)
    assert up == [False] + [True] * 11
    assert len([line for line in logs if line["event"] == "target_down"]) == 1
    (said,) = [line for line in logs if line["event"] == "staleness_follows_scrape_interval"]
    assert (said["scrape_interval_seconds"], said["max_scrape_age_seconds"]) == (60.0, 120.0)


def test_a_target_prometheus_stopped_scraping_is_down_after_two_of_its_intervals(
        api: QueryApi, clock: ManualClock) -> None:
    """Staleness still bites: scrapes every 60 s stop at scrape 2 (taken at +120 s); with two intervals
    allowed the target is up while that scrape is at most 120 s old and down, naming both, after."""
    prometheus = ScrapingPrometheus(api, clock, interval=60.0, lag=3.0)
    poller, _ = stale_source(config(api.url), clock, stale_after_seconds=60.0)
    for poll in range(3):  # scrapes 0, 1, 2, each read 10 s after it started
        clock.now = SCRAPED_AT + 60.0 * poll + 10.0
        poller.poll_once()
    prometheus.stopped_after = 2
    clock.now = SCRAPED_AT + 120.0 + 119.0
    poller.poll_once()
    assert poller.readings()[0].target_up
    clock.now = SCRAPED_AT + 120.0 + 125.0
    with structlog.testing.capture_logs() as logs:
        poller.poll_once()
    assert not poller.readings()[0].target_up
    (line,) = [line for line in logs if line["event"] == "target_down"]
    assert line["reason"] == "Prometheus's last scrape of it is 125s old (it scrapes it every 60s; 120s allowed)"


# --- one scrape's series from different remote-write batches -------------------------------------


def torn(page: str, at: float, spread: float) -> list[dict[str, Any]]:
    """One target's answer whose series' sample times have a standard deviation of `spread` seconds."""
    return scraped(page, "10.0.0.5:8000", at=at, spread=spread)


def test_a_target_whose_series_come_from_two_scrapes_is_skipped_that_poll(api: QueryApi, clock: ManualClock) -> None:
    """Mimir answered some of scrape 2's series and the rest from scrape 1 (sample times 15 s apart):
    reading them would mix two scrapes' counters into one window. That poll keeps the last window
    (target up, measured step unchanged) and says why; the next consistent answer is read."""
    poller, _ = poller_for(config(api.url), clock)
    for steps, at in ((100, SCRAPED_AT), (300, SCRAPED_AT + 15)):
        api.serve(success(torn(vllm_page(busy(steps, steps * 8 * 0.02)), at, 0.0)))
        clock.now = at + 1
        poller.poll_once()
    # Scrape 2 (100 more steps of 30 ms) half ingested: its ITL histogram beside scrape 1's step counters.
    mixed = busy(300, 300 * 8 * 0.02)
    whole = busy(400, 300 * 8 * 0.02 + 100 * 8 * 0.03)
    mixed.itl_count, mixed.itl_sum, mixed.itl_buckets = whole.itl_count, whole.itl_sum, whole.itl_buckets
    api.serve(success(torn(vllm_page(mixed), SCRAPED_AT + 30, 15.0)))
    clock.now = SCRAPED_AT + 31
    with structlog.testing.capture_logs() as logs:
        poller.poll_once()
    (reading,) = poller.readings()
    assert reading.target_up and reading.measured_step_seconds == pytest.approx(0.02)
    (said,) = [line for line in logs if line["event"] == "scrape_torn"]
    assert said["target"] == "10.0.0.5:8000" and "(standard deviation 15s)" in said["reason"]
    # Scrape 2 fully ingested: read, a window over scrapes 1 and 2 (100 steps of 30 ms).
    api.serve(success(torn(vllm_page(busy(400, 300 * 8 * 0.02 + 100 * 8 * 0.03)), SCRAPED_AT + 30, 0.0)))
    clock.now = SCRAPED_AT + 35
    with structlog.testing.capture_logs() as logs:
        poller.poll_once()
    (reading,) = poller.readings()
    assert reading.target_up and reading.measured_step_seconds == pytest.approx(0.03)
    assert [line["event"] for line in logs if line["event"].startswith("scrape_")] == ["scrape_consistent"]


def test_a_torn_target_with_nothing_to_keep_or_torn_for_too_long_is_down(api: QueryApi, clock: ManualClock) -> None:
    poller, _ = poller_for(config(api.url), clock)
    page = vllm_page(busy(100, 16.0))
    api.serve(success(torn(page, SCRAPED_AT, 15.0)))
    clock.now = SCRAPED_AT + 1
    with structlog.testing.capture_logs() as logs:
        poller.poll_once()
    assert not poller.readings()[0].target_up, "never read: no window to keep"
    (line,) = [line for line in logs if line["event"] == "target_down"]
    assert line["reason"].startswith("its series carry different sample times (standard deviation 15s)")
    api.serve(success(torn(page, SCRAPED_AT + 15, 0.0)))
    clock.now = SCRAPED_AT + 16
    poller.poll_once()
    assert poller.readings()[0].target_up
    # Torn at every poll from +30 s: skipped while the tear is no older than stale_after (60 s), then down.
    for at in (30, 45, 60, 75, 90):
        api.serve(success(torn(page, SCRAPED_AT + at, 15.0)))
        clock.now = SCRAPED_AT + at + 1
        poller.poll_once()
        assert poller.readings()[0].target_up
    api.serve(success(torn(page, SCRAPED_AT + 105, 15.0)))
    clock.now = SCRAPED_AT + 106
    poller.poll_once()
    assert not poller.readings()[0].target_up


# --- the query's own timeout ---------------------------------------------------------------------


@pytest.mark.slow  # 2 s
def test_the_query_has_its_own_timeout_longer_than_a_page_fetch(api: QueryApi, clock: ManualClock) -> None:
    """`timeout` (1 s) bounds a page fetch; a deployment's query takes its own `query_timeout` (3 s):
    an answer after 1.5 s is read, where before it failed at the page fetch's 1 s."""
    body = json.dumps(success(scraped(vllm_page(busy(100, 16.0)), "10.0.0.5:8000"))).encode()

    def slow(form: dict[str, str], headers: dict[str, str]) -> tuple[int, bytes]:
        time.sleep(1.5)
        return 200, body

    api.answer = slow
    clock.now = SCRAPED_AT + 1
    poller, _ = poller_for(config(api.url, query_timeout="3s"), clock)
    poller.poll_once()
    assert poller.readings()[0].target_up
    poller, _ = poller_for(config(api.url, query_timeout="500ms"), clock)
    started = time.monotonic()
    poller.poll_once()
    assert time.monotonic() - started < 1.4 and not poller.readings()[0].target_up
