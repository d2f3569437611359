"""The /metrics text writer (exporter/serve/exposition_writer.py) writes exactly the bytes
prometheus_client's generate_latest writes: for the daemon's own families, the admission families,
odd label values and numbers, and the families it leaves to generate_latest (timestamps, `_created`,
non-legacy names); and the OpenMetrics writer, exactly what prometheus_client's openmetrics
generate_latest writes."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from exporter.serve import exposition_writer
from exporter.serve.exposition_writer import render_openmetrics, render_text
from exporter.serve.server import MetricsPage
from tests.support.clocks import ManualClock
from tests.support.configs import make_config
from tests.support.pages import VllmState, vllm_page
from tests.support.pollers import MakePoller
from tests.support.servers import PageServer


class Families(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        return self.metrics


def registry_of(*metrics: Metric) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families(list(metrics)))
    return registry


def daemon_registry(page_server: PageServer, clock: ManualClock, make_poller: MakePoller) -> CollectorRegistry:
    """The daemon's registry after two polls, with the admission families holding one admitted request."""
    from exporter.admission.book import AdmissionBook, AdmissionRequest, DeploymentPolicy
    from exporter.admission.metrics import AdmissionCollector
    from exporter.serve.collector import make_registry

    config = make_config(page_server.url)
    poller = make_poller(config, clock)
    registry = make_registry(poller.readings, config.deployments)
    book = AdmissionBook([DeploymentPolicy("chat", 50.0)], clock=clock, lease_floor_seconds=60.0)
    registry.register(AdmissionCollector(book))
    for running in (2, 5):
        page_server.serve_text(vllm_page(VllmState(running=running, kv_usage_ratio=0.5)))
        poller.poll_once()
        clock.advance(15)
    book.reconcile("chat", "a:8000", 10_000, 100)
    assert book.admit(AdmissionRequest(100, 50, deployment="chat")).admitted
    return registry


def test_the_daemons_page_is_written_byte_for_byte_as_prometheus_client_writes_it(
        page_server: PageServer, clock: ManualClock, make_poller: MakePoller, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = daemon_registry(page_server, clock, make_poller)
    expected = generate_latest(registry)
    # Every family of the daemon's page on the fast path: equal bytes alone would hold if the writer
    # handed every family back to generate_latest.
    fallbacks: list[str] = []
    monkeypatch.setattr(exposition_writer, "generate_latest",
                        lambda one: fallbacks.extend(m.name for m in one.collect()) or generate_latest(one))
    assert render_text(registry) == expected
    assert fallbacks == []
    assert render_text(registry) == expected  # label texts remembered: the same bytes
    assert MetricsPage(registry).response("", "").body == expected
    assert b"stepbudget_requests_running{" in expected and b"stepbudget_admission_decisions_total{" in expected


def client_library_registry() -> CollectorRegistry:
    """prometheus_client's own metric types (with `_created`, units, an exemplar) beside families
    either writer leaves to prometheus_client: a timestamp, UTF-8 and colon names."""
    from prometheus_client.samples import Exemplar

    registry = CollectorRegistry(auto_describe=False)
    Counter("requests", "Requests \"quoted\".", ["path"], registry=registry).labels("/a\\b\"c\nd").inc(3)
    Gauge("temperature", "Help with \\ and\nnewline.", registry=registry).set(1e22)
    Histogram("latency_seconds", "Latency.", registry=registry, buckets=(0.1, 1.0)).observe(0.5)  # _created
    Info("build", "Build.", registry=registry).info({"version": "1.2"})
    Gauge("size", "With a unit.", unit="bytes", registry=registry).set(3)
    odd = Metric("odd", "Non-legacy sample name and a timestamp.", "gauge")
    odd.add_sample("odd", {"a": "1"}, 1.0, timestamp=1.7e9)
    utf8 = Metric("my.metric", "A UTF-8 name and a colon: name.", "gauge")
    utf8.add_sample("my.metric", {"label.name": "x"}, 2.0)
    utf8.add_sample("my:metric", {}, 3.0)
    exemplar = Metric("hits", "An exemplar.", "counter")
    exemplar.add_sample("hits_total", {}, 4.0, exemplar=Exemplar({"trace": "t"}, 1.0))
    registry.register(Families([odd, utf8, exemplar]))
    return registry


def test_client_library_metrics_and_the_families_left_to_generate_latest() -> None:
    registry = client_library_registry()
    assert render_text(registry) == generate_latest(registry)


NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**20, 10**20),
                    st.sampled_from([0.0, -0.0, 1e6, 1234567.0, 1e7, 123456789.123, 1e-7, 5e-324,
                                     1.7976931348623157e308]))


# Label names starting with "__" are reserved for Prometheus's own use, and prometheus_client's parser
# (which reads both pages back) refuses them: the daemon never writes one.
LABEL_NAMES = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,6}", fullmatch=True).filter(
    lambda name: not name.startswith("__"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.dictionaries(LABEL_NAMES,
                                          st.text(max_size=12), max_size=4), NUMBERS), max_size=8),
       st.sampled_from(["gauge", "counter", "info", "unknown", "summary", "histogram", "stateset"]),
       st.text(max_size=20))
@pytest.mark.slow  # 1.3 s
def test_fuzz_any_labels_and_numbers_give_the_same_bytes(samples: list[tuple[dict[str, str], float]], kind: str,
                                                        documentation: str) -> None:
    family = Metric("fam", documentation, kind)
    name = {"counter": "fam_total", "info": "fam_info"}.get(kind, "fam")
    for labels, value in samples:
        family.add_sample(name, labels, value)
    registry = registry_of(family)
    written = render_text(registry)
    assert written == generate_latest(registry)
    parsed = [s for f in text_string_to_metric_families(written.decode()) for s in f.samples]
    assert len(parsed) == len(samples)
    for sample, (labels, value) in zip(parsed, samples, strict=True):
        assert sample.labels == labels
        assert sample.value == float(value) or (math.isnan(sample.value) and math.isnan(value))


# --- OpenMetrics (what Prometheus asks for first) ------------------------------------------------------

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_the_daemons_page_in_openmetrics_is_written_byte_for_byte_as_prometheus_client_writes_it(
        page_server: PageServer, clock: ManualClock, make_poller: MakePoller, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = daemon_registry(page_server, clock, make_poller)
    expected = openmetrics_latest(registry)
    fallbacks: list[str] = []
    original = exposition_writer.openmetrics.generate_latest
    monkeypatch.setattr(exposition_writer.openmetrics, "generate_latest",
                        lambda one, **kw: fallbacks.extend(m.name for m in one.collect()) or original(one, **kw))
    assert render_openmetrics(registry) == expected
    assert fallbacks == []  # every family on the fast path
    assert render_openmetrics(registry) == expected  # label texts remembered: the same bytes
    monkeypatch.undo()
    page = MetricsPage(registry).response(PROMETHEUS_ACCEPT, "")
    assert page.content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert page.body == expected
    assert b"stepbudget_requests_running{" in expected and expected.endswith(b"# EOF\n")


def test_openmetrics_client_library_metrics_and_the_families_left_to_prometheus_client() -> None:
    from prometheus_client.openmetrics.exposition import ALLOWUTF8

    registry = client_library_registry()
    assert render_openmetrics(registry) == openmetrics_latest(registry)
    # Other escapings and versions are prometheus_client's own.
    assert render_openmetrics(registry, escaping=ALLOWUTF8) == openmetrics_latest(registry, escaping=ALLOWUTF8)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.dictionaries(LABEL_NAMES,
                                          st.text(max_size=12), max_size=4), NUMBERS), max_size=8),
       st.sampled_from(["gauge", "counter", "info", "unknown", "summary", "histogram", "stateset"]),
       st.text(max_size=20))
@pytest.mark.slow  # 1.3 s
def test_fuzz_openmetrics_any_labels_and_numbers_give_the_same_bytes(
        samples: list[tuple[dict[str, str], float]], kind: str, documentation: str) -> None:
    family = Metric("fam", documentation, kind)
    name = {"counter": "fam_total", "info": "fam_info"}.get(kind, "fam")
    for labels, value in samples:
        family.add_sample(name, labels, value)
    registry = registry_of(family)
    assert render_openmetrics(registry) == openmetrics_latest(registry)
