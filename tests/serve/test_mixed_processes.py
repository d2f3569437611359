"""One process per target: a URL whose pages come from more than one process is reported as
mixed (a log line, stepbudget_target_mixed_processes 1, a note) and no window is computed from the mix;
a process that started after the previous poll is a restart (that window measures nothing).

Times are Unix seconds around T0 = 1,800,000,000 (the ManualClock's start), picked by hand; the
simulated replicas run in simulated time (`paced=False`), moved by the test.
"""

from __future__ import annotations

import http.client
import itertools
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

import pytest
import structlog
from structlog.testing import capture_logs

from exporter.serve.config import config_from_mapping
from exporter.serve.engines import read_page
from exporter.serve.process_identity import (
    CLOCK_TOLERANCE_SECONDS,
    STEADY_POLLS_TO_CLEAR,
    ProcessWatch,
    judge,
)
from exporter.serve.snapshot import Snapshot
from exporter.serve.window import compute_window
from exporter.simulator.scenarios import builtin_scenarios
from exporter.simulator.server import ServerHandle, start_server
from tests.support.clocks import ManualClock
from tests.support.pollers import MakePoller, scrape
from tests.support.servers import PageServer, send_text
from tests.support.tools import REPO

T0 = 1_800_000_000.0


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


def snapshot(start: float | None, created: float | None, generated: float = 1000.0) -> Snapshot:
    return Snapshot(kind="vllm", model_name="m", engine="0", process_start_seconds=start, created_seconds=created,
                    generation_tokens_total=generated)


def test_the_page_says_which_process_wrote_it() -> None:
    """vLLM 0.32.0's real page: `process_start_time_seconds 1.7961153198e+09`, and its generation-token
    counter created 99.45 s later, once the model was loaded (`vllm:generation_tokens_created`)."""
    page = (REPO / "tests/data/vllm-0.32.0-cpu/vllm-0.32.0-cpu_REAL_idle.prom").read_text()
    (engine,) = read_page(page).snapshots
    assert engine.process_start_seconds == 1796115319.8
    assert engine.created_seconds == 1796115419.250786
    # SGLang's page (multiprocess mode) carries neither: nothing to compare, never a verdict.
    sglang = (REPO / "tests/data/genuine/sglang-0.5.23_GENUINE_multiprocess_dp1_t0.prom").read_text()
    assert {(s.process_start_seconds, s.created_seconds) for s in read_page(sglang).snapshots} == {(None, None)}


@pytest.mark.parametrize(("now", "kind"), [
    ((T0 - 1000, T0 - 900), "same"),
    ((T0 + 5, T0 + 70), "restart"),  # started after the previous poll (T0)
    ((T0 - 1000, T0 + 3), "restart"),  # a new process in the same 10 ms tick: its counters are newer
    ((T0 - 20, T0 - 20), "restart"),  # 20 s "before" the poll: the server's clock behind, within 30 s
    ((T0 - 1000, T0 - 500), "mixed"),  # one start (one host process), another _created: another replica
    ((T0 - 5000, None), "mixed"),  # started before the one the previous poll read
    ((None, None), "unknown"),
])
def test_a_page_from_another_process_is_a_restart_or_a_mix_by_when_that_process_started(
        now: tuple[float | None, float | None], kind: str) -> None:
    previous = {("m", "0"): snapshot(T0 - 1000, T0 - 900)}
    verdict = judge(previous, [snapshot(*now)], previous_poll_seconds=T0)
    assert verdict.kind == kind
    assert CLOCK_TOLERANCE_SECONDS == 30.0


def test_a_restart_measures_nothing_even_when_the_new_counters_are_larger() -> None:
    """The old process had sampled 1,000 tokens; the new one, started after, 5,000 by the next poll: no
    counter went backwards, yet 5,000 - 1,000 is no delta of anything."""
    window = compute_window(snapshot(T0 - 1000, T0 - 900, generated=1000), snapshot(T0 + 5, T0 + 70, generated=5000))
    assert window.counter_reset and window.measured_step_mean_seconds is None
    assert window.notes[0].startswith("server restarted (another process wrote the page: ")


def test_a_mixed_target_stays_mixed_until_one_process_answers_20_polls_in_a_row() -> None:
    a, b = snapshot(T0 - 1000, T0 - 900), snapshot(T0 - 1000, T0 - 500)
    watch = ProcessWatch()
    assert not watch.observe({}, [a], None)  # first poll: nothing to compare
    assert watch.observe({("m", "0"): a}, [b], T0)
    assert "Point stepbudget at the pods" in watch.reason
    for poll in range(1, STEADY_POLLS_TO_CLEAR):
        assert watch.observe({("m", "0"): b}, [b], T0 + 15 * poll), poll
    # One replica restarting says nothing of how many answer: the count starts over.
    restarted = snapshot(T0 + 400, T0 + 470)
    assert watch.observe({("m", "0"): b}, [restarted], T0 + 300) and watch.steady_polls == 0
    for poll in range(1, STEADY_POLLS_TO_CLEAR):
        assert watch.observe({("m", "0"): restarted}, [restarted], T0 + 500 + 15 * poll)
    assert not watch.observe({("m", "0"): restarted}, [restarted], T0 + 900)
    assert STEADY_POLLS_TO_CLEAR == 20


# --- a Service in front of two simulated replicas ----------------------------------------------------


@pytest.fixture
def replicas() -> Iterator[list[ServerHandle]]:
    """Two simulated vLLM servers under steady chat load, held still until the test advances them.
    Both run in this process (one process_start_time_seconds); their counters were created at
    T0 - 7200 (replica a) and T0 - 3600 (replica b), two replicas started an hour apart."""
    handles = [start_server(scenario=builtin_scenarios()["steady-chat"], paced=False) for _ in range(2)]
    try:
        for handle, created in zip(handles, (T0 - 7200, T0 - 3600), strict=True):
            handle.simulator.page.created_unix_seconds = created
            handle.run_until(20.0)  # past the 10 s ramp: every chat is running
        yield handles
    finally:
        for handle in handles:
            handle.stop()


def round_robin(proxy: PageServer, backends: list[ServerHandle]) -> None:
    """The proxy answers each GET with the next backend's /metrics, in turn (a ClusterIP Service)."""
    turns = itertools.count()

    def relay(handler: BaseHTTPRequestHandler) -> None:
        backend = backends[next(turns) % len(backends)]
        connection = http.client.HTTPConnection(backend.host, backend.port, timeout=5)
        try:
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            body = response.read()
        finally:
            connection.close()
        send_text(handler, body, response.status, response.getheader("Content-Type") or "text/plain")

    proxy.respond = relay


@pytest.mark.slow  # 1.3 s
def test_a_service_in_front_of_two_replicas_is_reported_mixed_at_the_second_poll_with_no_window(
        replicas: list[ServerHandle], page_server: PageServer, clock: ManualClock, make_poller: MakePoller) -> None:
    """Poll 1 reads replica a through the proxy, poll 2 replica b (counters created at T0 - 3600, long
    before poll 1 at T0 + 15, which a answered): mixed at poll 2, and every poll after, with no measured
    step, no prefill per step and no counter reset; replica a polled directly measures its step all along."""
    round_robin(page_server, replicas)
    direct = replicas[0].url + "/metrics"
    service = page_server.url
    config = config_from_mapping({"poll_interval": "15s", "deployments": [
        {"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": [service, direct]}}]})
    poller = make_poller(config, clock)
    service_label, direct_label = (urlsplit(url).netloc for url in (service, direct))
    with capture_logs() as logs:
        for poll in range(1, 7):
            for handle in replicas:
                handle.run_until(20.0 + 15 * poll)
            clock.now = T0 + 15 * poll
            readings = {reading.target: reading for reading in poller.poll_once().readings}
            marks = {labels["target"]: value
                     for labels, value in scrape(config, poller)["stepbudget_target_mixed_processes"]}
            through, straight = readings[service_label], readings[direct_label]
            assert through.target_up and straight.target_up
            assert marks[direct_label] == 0.0
            if poll == 1:
                assert marks[service_label] == 0.0
                continue
            assert marks[service_label] == 1.0, poll
            assert through.measured_step_seconds is None and through.prefill_tokens_per_step is None, poll
            assert through.prediction_error_ratio is None
            assert any(note.startswith("pages from different processes at one URL") for note in through.notes)
            assert through.tokens_in_flight is not None  # the page's gauges: the replica that answered
            assert straight.measured_step_seconds is not None, poll
    assert len(page_server.requests) == 6  # each poll went through the proxy once: a, b, a, b, a, b
    [mixed] = [line for line in logs if line["event"] == "target_mixed_processes"]
    assert mixed["target"] == service_label
    assert f"the counters' _created {T0 - 7200:.3f} then {T0 - 3600:.3f}" in mixed["reason"]
    assert "headless Service" in mixed["reason"]
    assert [line for line in logs if line["event"] == "counter_reset"] == []
