"""`targets.prometheus` against a stub query API on 127.0.0.1: what each kind of answer does.

The stub answers `POST /api/v1/query` the way Prometheus, Thanos and Mimir do (same JSON), built
from real vLLM pages (tests/support/pages.py) with the labels a scrape adds. The live test
with a real Prometheus is tests/test_prometheus_mode_live.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from exporter.serve.config import Config, ConfigError, config_from_mapping
from exporter.serve.discovery import Discovery
from exporter.serve.engines import read_page, wanted_names
from exporter.serve.poller import Poller
from exporter.serve.prometheus_source import SCRAPE_TIME_LABEL, PrometheusSource, series_query
from tests.support.clocks import ManualClock
from tests.support.pages import VllmState, vllm_page

SCRAPED_AT = 1_800_000_000.0


class QueryApi:
    """A stub Prometheus query API: `answer(form, headers) -> (status, body)`, requests recorded."""

    def __init__(self) -> None:
        self.answer: Callable[[dict[str, str], dict[str, str]], tuple[int, bytes]] = lambda form, headers: (200, b"{}")
        self.requests: list[tuple[dict[str, str], dict[str, str]]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # http.server naming
                length = int(self.headers.get("Content-Length", 0))
                form = {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode()).items()}
                headers = {k.lower(): v for k, v in self.headers.items()}
                api.requests.append((form, headers))
                status, body = api.answer(form, headers)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def serve(self, payload: dict[str, Any], status: int = 200) -> None:
        body = json.dumps(payload).encode()
        self.answer = lambda form, headers: (status, body)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


@pytest.fixture
def api() -> Iterator[QueryApi]:
    server = QueryApi()
    yield server
    server.close()


def scraped(page: str, instance: str, *, up: float = 1.0, at: float = SCRAPED_AT,
            extra: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One target's part of an answer: its wanted samples, `up` and `timestamp(up)`, as a scrape labels them."""
    target = {"job": "vllm", "instance": instance, **(extra or {})}
    items = [{"metric": {"__name__": "up", **target}, "value": [at, f"{up:g}"]},
             {"metric": {**target, SCRAPE_TIME_LABEL: "1"}, "value": [at, f"{at:.3f}"]}]
    if up != 1:
        return items
    wanted = wanted_names("auto")
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name in wanted:
                items.append({"metric": {"__name__": sample.name, **sample.labels, **target},
                              "value": [at, repr(sample.value) if sample.value == sample.value else "NaN"]})
    return items


def success(*parts: list[dict[str, Any]], warnings: list[str] | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {"status": "success",
                               "data": {"resultType": "vector", "result": [item for part in parts for item in part]}}
    if warnings:
        payload["warnings"] = warnings
    return payload


def busy(steps: float, itl_sum: float) -> VllmState:
    count = steps * 8
    return VllmState(running=8, waiting=1, kv_usage_ratio=0.25, engine_steps=steps, prompt_tokens=steps * 20,
                     generation_tokens=count, itl_count=count, itl_sum=itl_sum,
                     itl_buckets={0.01: 0, 0.025: count, 0.05: count, 0.1: count})


def config(url: str, **prometheus: Any) -> Config:
    return config_from_mapping({
        "poll_interval": "1s", "timeout": "1s", "stale_after": "60s",
        "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                         "targets": {"prometheus": {"url": url, "selector": 'job="vllm"', **prometheus}}}],
    })


def poller_for(cfg: Config, clock: ManualClock) -> tuple[Poller, PrometheusSource]:
    (deployment,) = cfg.deployments
    source = PrometheusSource(deployment, timeout_seconds=cfg.timeout_seconds,
                              stale_after_seconds=cfg.stale_after_seconds, clock=clock)
    poller = Poller(cfg, Discovery(cfg.deployments, timeout_seconds=1.0), fetch=lambda *a, **k: "",
                    clock=clock, sources=[source])
    return poller, source


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
    assert query == ('{__name__=~"sglang:token_usage|up|vllm:num_requests_running",job="vllm"} or '
                     f'label_replace(timestamp(up{{job="vllm"}}), "{SCRAPE_TIME_LABEL}", "1", "", "")')


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
    assert reading.tokens_in_flight == pytest.approx(0.25 * 4096 * 16)


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
