"""/metrics is encoded once per poll, not once per scrape: the cached page (exporter/serve/server.py's
MetricsPage) is served byte for byte until a poll or an admission change alters it, in every format
asked for (text, OpenMetrics, gzip).

The model server is a real HTTP server on 127.0.0.1; time is a ManualClock.
"""

from __future__ import annotations

import gzip
import http.client
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from exporter.admission.book import AdmissionBook, AdmissionRequest, DeploymentPolicy
from exporter.admission.metrics import AdmissionCollector
from exporter.serve.collector import StepBudgetCollector, make_registry
from exporter.serve.poller import Poller
from exporter.serve.server import MetricsPage, StepBudgetServer
from tests.support.clocks import ManualClock
from tests.support.configs import make_config
from tests.support.pages import VllmState, vllm_page
from tests.support.pollers import MakePoller
from tests.support.servers import PageServer

OPEN_METRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


@pytest.fixture
def collects(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per run of the stepbudget collector."""
    runs: list[int] = []
    original = StepBudgetCollector.collect

    def counted(self: StepBudgetCollector) -> Iterator[object]:
        runs.append(1)
        return original(self)

    monkeypatch.setattr(StepBudgetCollector, "collect", counted)
    return runs


def polled_page(page_server: PageServer, clock: ManualClock, make_poller: MakePoller) -> tuple[MetricsPage, Poller]:
    """A MetricsPage over one polled vLLM target (2 running, half the KV cache used), and its poller."""
    config = make_config(page_server.url)
    poller = make_poller(config, clock)
    page = MetricsPage(make_registry(poller.readings, config.deployments))
    page_server.serve_text(vllm_page(VllmState(running=2, kv_usage_ratio=0.5)))
    poller.poll_once()
    return page, poller


def test_scrapes_between_polls_get_the_same_bytes_without_running_the_collector(
        page_server: PageServer, clock: ManualClock, make_poller: MakePoller, collects: list[int]) -> None:
    page, poller = polled_page(page_server, clock, make_poller)
    first = page.response("", "").body
    assert page.response("", "").body == first and len(collects) == 1
    page_server.serve_text(vllm_page(VllmState(running=7, kv_usage_ratio=0.25)))
    clock.advance(15)
    poller.poll_once()
    second = page.response("", "").body
    assert second != first and len(collects) == 2
    assert b"stepbudget_requests_running{" in second and b"} 7.0\n" in second
    assert page.response("", "").body == second and len(collects) == 2


def test_each_format_is_cached_apart_and_gzip_round_trips(
        page_server: PageServer, clock: ManualClock, make_poller: MakePoller, collects: list[int]) -> None:
    page, _poller = polled_page(page_server, clock, make_poller)
    plain = page.response("", "")
    zipped = page.response("", "deflate, gzip;q=0.9")
    assert zipped.headers == {"Content-Encoding": "gzip"} and "Content-Encoding" not in plain.headers
    assert gzip.decompress(zipped.body) == plain.body and zipped.content_type == plain.content_type
    open_metrics = page.response(OPEN_METRICS, "gzip")
    assert open_metrics.content_type.startswith("application/openmetrics-text")
    assert gzip.decompress(open_metrics.body).rstrip().endswith(b"# EOF")
    assert page.response(OPEN_METRICS, "").body == gzip.decompress(open_metrics.body)
    assert len(collects) == 2  # one render per format, whatever the encoding
    assert page.response("", "gzip").body == zipped.body and len(collects) == 2


def test_refresh_renders_the_served_formats_once_after_a_poll(
        page_server: PageServer, clock: ManualClock, make_poller: MakePoller, collects: list[int]) -> None:
    config = make_config(page_server.url)
    poller = make_poller(config, clock)
    page = MetricsPage(make_registry(poller.readings, config.deployments))
    page.refresh()  # nothing served yet: nothing rendered
    assert collects == []
    page_server.serve_text(vllm_page(VllmState(running=2, kv_usage_ratio=0.5)))
    poller.poll_once()
    before = page.response("", "gzip").body
    page.refresh()  # no poll since: nothing to do
    assert len(collects) == 1
    page_server.serve_text(vllm_page(VllmState(running=3, kv_usage_ratio=0.5)))
    clock.advance(15)
    poller.poll_once()
    page.refresh()
    assert len(collects) == 2
    after = page.response("", "gzip").body
    assert after != before and len(collects) == 2


def test_an_admission_decision_or_an_expired_lease_invalidates_the_page(
        page_server: PageServer, clock: ManualClock, make_poller: MakePoller, collects: list[int]) -> None:
    config = make_config(page_server.url)
    poller = make_poller(config, clock)
    registry = make_registry(poller.readings, config.deployments)
    book = AdmissionBook([DeploymentPolicy("chat", 50.0)], clock=clock, lease_floor_seconds=60.0)
    registry.register(AdmissionCollector(book))
    page = MetricsPage(registry)
    page_server.serve_text(vllm_page(VllmState(running=2, kv_usage_ratio=0.5)))
    poller.poll_once()
    book.reconcile("chat", "a:8000", 10_000, 100)
    first = page.response("", "").body
    assert page.response("", "").body == first and len(collects) == 1
    assert book.admit(AdmissionRequest(100, 50, deployment="chat")).admitted
    admitted = page.response("", "").body
    assert admitted != first and len(collects) == 2
    assert b'stepbudget_admission_decisions_total{decision="admitted",deployment="chat"} 1.0' in admitted
    assert b'stepbudget_admitted_tokens{deployment="chat",target="a:8000"} 250.0' in admitted
    clock.advance(3600)  # the lease runs out: its tokens leave the page
    expired = page.response("", "").body
    assert b'stepbudget_admitted_tokens{deployment="chat",target="a:8000"} 100.0' in expired
    assert page.response("", "").body == expired and len(collects) == 3


def test_a_registry_that_cannot_say_what_changed_is_rendered_at_every_scrape(collects: list[int]) -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StepBudgetCollector(tuple, ()))
    page = MetricsPage(registry)
    assert page.response("", "").body == page.response("", "").body
    assert len(collects) == 2


def test_the_server_answers_gzip_when_asked_and_plain_otherwise(
        page_server: PageServer, clock: ManualClock, make_poller: MakePoller) -> None:
    config = make_config(page_server.url)
    poller = make_poller(config, clock)
    server = StepBudgetServer("127.0.0.1", 0, make_registry(poller.readings, config.deployments),
                              ready=lambda: poller.ready)
    page_server.serve_text(vllm_page(VllmState(running=2, kv_usage_ratio=0.5)))
    poller.poll_once()
    server.start()
    try:
        bodies = {}
        for encoding in ("gzip", "identity"):
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
            connection.request("GET", "/metrics", headers={"Accept-Encoding": encoding})
            answer = connection.getresponse()
            bodies[encoding] = (answer.getheader("Content-Encoding"), answer.read())
            connection.close()
    finally:
        server.stop()
    assert bodies["gzip"][0] == "gzip" and bodies["identity"][0] is None
    assert gzip.decompress(bodies["gzip"][1]) == bodies["identity"][1]
    assert b"stepbudget_tokens_in_flight{" in bodies["identity"][1]
