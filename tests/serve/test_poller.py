"""The poller under failure: every way a model server can misbehave gives `stepbudget_target_up 0`
or a clearly logged partial reading, never a crash and never a wrong number exported as valid.

Every fetch goes to a real HTTP(S) server on 127.0.0.1 (or none, for a refused connection). Time is
injected: the poll clock is a ManualClock, the fetch deadline's clock
is injected where the test is about the deadline.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from exporter.serve.config import Config, Tls, config_from_mapping
from exporter.serve.fetch import FetchError, HttpFetcher
from exporter.serve.reading import Reading
from tests.support.clocks import ManualClock
from tests.support.pages import VllmState, vllm_page
from tests.support.pollers import MakePoller
from tests.support.servers import PageServer, free_port, send_text
from tests.support.tools import require_tool

TRUNCATED_MARK = "vllm:inter_token_latency_seconds_bucket"


def make_config(urls: list[str], **top: object) -> Config:
    return config_from_mapping({
        "poll_interval": "15s", "stale_after": "60s", "timeout": "2s", **top,
        "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": urls}}],
    })


def busy_page() -> str:
    # 4 requests past their prefill, none finished, holding what the cache holds: 0.2 of 4,095 usable blocks of
    # 16 less half a block each, 13,074 tokens = 500 prompt + 12,574 sampled on the request counters.
    return vllm_page(VllmState(running=4, kv_usage_ratio=0.2, itl_count=100, itl_sum=2.0, engine_steps=50,
                               prompt_tokens=500, generation_tokens=12574, first_tokens=4,
                               itl_buckets={0.01: 10, 0.025: 80, 0.05: 100, 0.1: 100}))


def only_reading(readings: tuple[Reading, ...]) -> Reading:
    assert len(readings) == 1, readings
    return readings[0]


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


# --- fetch level: refused, silent, failing, authenticated and TLS servers, all real ---------------------


def test_fetch_connection_refused_is_a_fetch_error() -> None:
    fetcher = HttpFetcher(1.0, 1000)
    try:
        with pytest.raises(FetchError, match="connection failed: Connection refused"):
            fetcher(f"http://127.0.0.1:{free_port()}/metrics", bearer_token=None, tls=Tls())
    finally:
        fetcher.close()


def test_fetch_timeout_is_a_fetch_error(page_server: PageServer) -> None:
    """A server that accepts and never answers: the read timeout (or the watchdog) ends the fetch."""
    release = threading.Event()
    page_server.respond = lambda handler: release.wait(10)
    fetcher = HttpFetcher(0.3, 1000)
    try:
        with pytest.raises(FetchError, match=r"timed out after 0.3s"):
            fetcher(page_server.url, bearer_token=None, tls=Tls())
    finally:
        release.set()
        fetcher.close()


def test_fetch_http_500_is_a_fetch_error(page_server: PageServer) -> None:
    page_server.serve_text("oops", status=500)
    fetcher = HttpFetcher(1.0, 1000)
    try:
        with pytest.raises(FetchError, match="HTTP 500"):
            fetcher(page_server.url, bearer_token=None, tls=Tls())
        page_server.serve_text("x 1\n")
        assert fetcher(page_server.url, bearer_token=None, tls=Tls()) == "x 1\n"  # the pool recovers
    finally:
        fetcher.close()


def test_fetch_sends_the_bearer_token_and_keeps_the_connection(page_server: PageServer) -> None:
    page_server.serve_text("x 1\n")
    fetcher = HttpFetcher(1.0, 1000)
    try:
        assert fetcher(page_server.url, bearer_token="s3cret", tls=Tls()) == "x 1\n"
        fetcher(page_server.url, bearer_token=None, tls=Tls())
    finally:
        fetcher.close()
    first, second = page_server.requests
    assert first["authorization"] == "Bearer s3cret" and "authorization" not in second
    assert first["accept"].startswith("text/plain;version=0.0.4") and "gzip" in first["accept-encoding"]
    assert first["user-agent"].startswith("stepbudget/")
    assert first["client_port"] == second["client_port"], "each poll of a target reuses its connection"


def test_redirects_are_followed_and_the_token_stays_on_its_host(page_server: PageServer) -> None:
    """`/metrics` -> `/metrics/` (Starlette's slash redirect) is followed with the token; a redirect to
    another host (127.0.0.2 is another loopback address) gets no token."""
    other = PageServer(host="127.0.0.2")
    try:
        other.serve_text("y 2\n")

        def redirect(handler: BaseHTTPRequestHandler) -> None:
            target = other.url if handler.path == "/away" else "/metrics/"
            if handler.path.endswith("/"):
                send_text(handler, "x 1\n")
                return
            handler.send_response(307)
            handler.send_header("Location", target)
            handler.send_header("Content-Length", "0")
            handler.end_headers()

        page_server.respond = redirect
        fetcher = HttpFetcher(1.0, 1000)
        try:
            assert fetcher(page_server.url, bearer_token="s3cret", tls=Tls()) == "x 1\n"
            away = page_server.url.replace("/metrics", "/away")
            assert fetcher(away, bearer_token="s3cret", tls=Tls()) == "y 2\n"
        finally:
            fetcher.close()
        assert [r["authorization"] for r in page_server.requests] == ["Bearer s3cret"] * 3
        assert "authorization" not in other.requests[0]
    finally:
        other.close()


def test_tls_verifies_with_the_ca_file_and_skips_only_when_told(tmp_path, page_server: PageServer) -> None:
    """A real TLS server with a self-signed certificate: refused by default, read with the
    certificate as `ca_file`, read without verification when `insecure_skip_verify` is set."""
    import ssl
    import subprocess

    openssl = require_tool("openssl")  # installed by `make tools`; a failure, not a skip, under CI
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    page_server.wrap_tls(context)
    page_server.serve_text("x 1\n")
    url = page_server.url.replace("http://", "https://")
    fetcher = HttpFetcher(2.0, 1000)
    try:
        with pytest.raises(FetchError, match="TLS error: certificate verify failed"):
            fetcher(url, bearer_token=None, tls=Tls())
        assert fetcher(url, bearer_token="s3cret", tls=Tls(ca_file=str(cert))) == "x 1\n"
        # Unverified, as asked: said once in the logs, naming the target, and never as a bare
        # Python warning on stderr (urllib3's InsecureRequestWarning), however many fetches.
        with capture_logs() as logs, warnings.catch_warnings(record=True) as python_warnings:
            warnings.simplefilter("default")
            for _ in range(3):
                assert fetcher(url, bearer_token=None, tls=Tls(insecure_skip_verify=True)) == "x 1\n"
    finally:
        fetcher.close()
    assert [r.get("authorization") for r in page_server.requests] == ["Bearer s3cret", None, None, None]
    said = [entry for entry in logs if entry["event"] == "tls_verification_disabled"]
    assert [entry["target"] for entry in said] == [url.removeprefix("https://").rstrip("/").split("/")[0]]
    assert not [w for w in python_warnings if "Unverified HTTPS request" in str(w.message)]


def test_basic_auth_goes_with_every_poll_and_stays_on_its_host(tmp_path, page_server: PageServer, clock: ManualClock,
                                                               make_poller: MakePoller) -> None:
    """A deployment's basic_auth: the password file read at each poll (a rotated Secret works), the header
    sent to the target and across its own redirects, never to another host; a password that cannot be
    read fails the target with a reason naming the key, not the value."""
    other = PageServer(host="127.0.0.2")
    try:
        other.serve_text(busy_page())

        def redirect(handler: BaseHTTPRequestHandler) -> None:
            handler.send_response(307)
            handler.send_header("Location", other.url if handler.path == "/away" else "/metrics/")
            handler.send_header("Content-Length", "0")
            handler.end_headers()

        page_server.respond = lambda handler: (send_text(handler, busy_page()) if handler.path.endswith("/")
                                               else redirect(handler))
        password = tmp_path / "password"
        password.write_text("hunter2\n")
        config = config_from_mapping({
            "poll_interval": "15s", "stale_after": "60s", "timeout": "2s",
            "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                             "auth": {"basic_auth": {"username": "scraper", "password_file": str(password)}},
                             "targets": {"static": [page_server.url, page_server.url.replace("/metrics", "/away")]}}],
        })
        poller = make_poller(config, clock)
        assert all(reading.target_up for reading in poller.poll_once().readings)
        password.write_text("rotated")
        clock.advance(15)
        poller.poll_once()
        password.unlink()
        clock.advance(15)
        with capture_logs() as logs:
            readings = poller.poll_once().readings
    finally:
        other.close()
    # base64 of "scraper:hunter2" and of "scraper:rotated" (RFC 7617)
    sent = sorted(request["authorization"] for request in page_server.requests)
    assert sent == ["Basic c2NyYXBlcjpodW50ZXIy"] * 3 + ["Basic c2NyYXBlcjpyb3RhdGVk"] * 3
    assert len(other.requests) == 2 and not any("authorization" in request for request in other.requests)
    assert not any(reading.target_up for reading in readings)
    reasons = {line["reason"] for line in logs if line["event"] == "target_down"}
    assert reasons == {f"basic_auth.password_file {password}: cannot be read: No such file or directory"}


def test_mutual_tls_presents_the_client_certificate(tmp_path, page_server: PageServer) -> None:
    """A TLS server that requires a client certificate: refused without `cert_file`, read with it."""
    import ssl
    import subprocess

    openssl = require_tool("openssl")
    server_cert, server_key = tmp_path / "server.pem", tmp_path / "server.key"
    client_cert, client_key = tmp_path / "client.pem", tmp_path / "client.key"
    for cert, key, subject in ((server_cert, server_key, "/CN=127.0.0.1"), (client_cert, client_key, "/CN=stepbudget")):
        subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", subject, "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(server_cert, server_key)
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(client_cert)
    page_server.wrap_tls(context)
    page_server.serve_text("x 1\n")
    url = page_server.url.replace("http://", "https://")
    fetcher = HttpFetcher(2.0, 1000)
    try:
        with pytest.raises(FetchError):
            fetcher(url, bearer_token=None, tls=Tls(ca_file=str(server_cert)))
        mutual = Tls(ca_file=str(server_cert), cert_file=str(client_cert), key_file=str(client_key))
        assert fetcher(url, bearer_token=None, tls=mutual) == "x 1\n"
    finally:
        fetcher.close()
    assert len(page_server.requests) == 1


# --- fetch level, real servers -------------------------------------------------------------------------


def test_slow_loris_server_cannot_hold_a_worker_past_the_deadline(page_server: PageServer) -> None:
    """A server trickling one byte at a time never trips the per-read timeout; the overall deadline
    (checked between reads on the injected clock, one second per check) stops the fetch."""
    stop = threading.Event()
    sent: list[int] = []

    def trickle(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/plain")
        handler.end_headers()
        while not stop.is_set() and len(sent) < 2000:
            handler.wfile.write(b"#")
            handler.wfile.flush()
            sent.append(1)
            stop.wait(0.01)

    page_server.respond = trickle
    ticks = iter(range(10_000))
    fetcher = HttpFetcher(5.0, 1 << 20, clock=lambda: float(next(ticks)))
    try:
        with pytest.raises(FetchError, match="timed out after 5s reading the body"):
            fetcher(page_server.url, bearer_token=None, tls=Tls())
        assert len(sent) < 2000  # stopped long before the server finished
    finally:
        stop.set()
        fetcher.close()


@pytest.mark.parametrize("chunked", [False, True])
def test_page_over_the_size_cap_is_refused(page_server: PageServer, chunked: bool) -> None:
    """Declared (Content-Length) or not (chunked), reading stops past max_response_bytes."""
    body = ("# " + "x" * 98 + "\n").encode() * 300  # 30,000 bytes

    def huge(handler: BaseHTTPRequestHandler) -> None:
        if not chunked:
            send_text(handler, body)
            return
        handler.send_response(200)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        for start in range(0, len(body), 4096):
            piece = body[start:start + 4096]
            handler.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        handler.wfile.write(b"0\r\n\r\n")

    page_server.respond = huge
    fetcher = HttpFetcher(2.0, 10_000)
    try:
        with pytest.raises(FetchError, match="response over 10000 bytes"):
            fetcher(page_server.url, bearer_token=None, tls=Tls())
    finally:
        fetcher.close()


# --- the poll cycle under each failure ------------------------------------------------------------------


def test_refused_connection_gives_up_0_and_one_log_line(clock: ManualClock, make_poller: MakePoller) -> None:
    url = f"http://127.0.0.1:{free_port()}/metrics"
    poller = make_poller(make_config([url]), clock)
    with capture_logs() as logs:
        first = only_reading(poller.poll_once().readings)
        clock.advance(15)
        poller.poll_once()
    assert first.target_up is False and first.labels == {"deployment": "chat", "target": url[7:-8]}
    down = [line for line in logs if line["event"] == "target_down"]
    assert len(down) == 1, "a target down for many polls logs once, not every poll"
    assert down[0]["target"] == url[7:-8] and "Connection refused" in down[0]["reason"]


def test_slow_server_times_out(page_server: PageServer, clock: ManualClock, make_poller: MakePoller) -> None:
    release = threading.Event()

    def stall(handler: BaseHTTPRequestHandler) -> None:
        release.wait(10)

    page_server.respond = stall
    poller = make_poller(make_config([page_server.url], timeout="250ms"), clock)
    try:
        with capture_logs() as logs:
            reading = only_reading(poller.poll_once().readings)
    finally:
        release.set()
    assert reading.target_up is False
    assert "timed out" in next(line for line in logs if line["event"] == "target_down")["reason"]


@pytest.mark.parametrize("body, status, reason", [
    ("internal error", 500, "HTTP 500"),
    ("<!doctype html><html><body><h1>Welcome to nginx!</h1></body></html>", 200, ""),
    (bytes(range(256)) * 8, 200, ""),
    ("", 200, ""),
    ("# HELP vllm:num_requests_running Number of requests\n# TYPE vllm:num_requests_running gauge\n"
     "process_cpu_seconds_total 12.5\n", 200, "no known engine metrics"),
])
def test_unusable_pages_give_up_0_never_a_crash(page_server: PageServer, clock: ManualClock, make_poller: MakePoller,
                                                body: str | bytes, status: int, reason: str) -> None:
    page_server.serve_text(body, status)
    poller = make_poller(make_config([page_server.url]), clock)
    with capture_logs() as logs:
        reading = only_reading(poller.poll_once().readings)
    assert reading.target_up is False
    assert reading.tokens_in_flight is None and reading.predicted_step_seconds is None
    [line] = [line for line in logs if line["event"] == "target_down"]
    assert reason in line["reason"] and line["reason"]


def test_good_then_failing_target_keeps_values_until_stale_after(page_server: PageServer, clock: ManualClock,
                                                                  make_poller: MakePoller) -> None:
    poller = make_poller(make_config([page_server.url], stale_after="60s"), clock)
    page_server.serve_text(busy_page())
    good = only_reading(poller.poll_once().readings)
    good_at = clock.now
    page_server.serve_text("boom", 500)
    clock.advance(30)
    fresh = only_reading(poller.poll_once().readings)
    assert fresh.target_up is False and fresh.tokens_in_flight == good.tokens_in_flight
    assert fresh.labels == good.labels, "a down target keeps its identity labels"
    clock.advance(31)  # 61 s after the last success
    stale = only_reading(poller.poll_once().readings)
    assert stale.target_up is False and stale.labels == good.labels
    assert stale.tokens_in_flight is None and stale.predicted_step_seconds is None and stale.requests_running is None
    assert stale.last_success_timestamp_seconds == good_at
    page_server.serve_text(busy_page())
    clock.advance(15)
    with capture_logs() as logs:
        back = only_reading(poller.poll_once().readings)
    assert back.target_up is True and back.tokens_in_flight == pytest.approx(0.2 * 4095 * 16 - 4 * 7.5)
    assert any(line["event"] == "target_up" for line in logs)


def test_one_timed_out_poll_at_a_slow_interval_keeps_the_values(page_server: PageServer, clock: ManualClock,
                                                                 make_poller: MakePoller) -> None:
    """60 s polls with a 2 s timeout: the poll that times out ends 62 s after the last success. The
    fixed 60 s `stale_after` dropped the values there (and the alerts' `for` timers with them); not
    given, it now follows the poll interval (2 x 60 s + 2 s = 122 s); a given 60 s is refused (test_config)."""
    poller = make_poller(make_config([page_server.url], poll_interval="60s", stale_after=None), clock)
    assert poller.config.stale_after_seconds == 122
    page_server.serve_text(busy_page())
    good = only_reading(poller.poll_once().readings)
    page_server.serve_text("boom", 500)
    clock.advance(62)  # as the poll that timed out ends
    kept = only_reading(poller.poll_once().readings)
    assert kept.target_up is False and kept.tokens_in_flight == good.tokens_in_flight
    clock.advance(60)  # a second failed poll, 122 s on: past stale_after
    assert only_reading(poller.poll_once().readings).tokens_in_flight is None


def test_histogram_cut_off_mid_page(page_server: PageServer, clock: ManualClock, make_poller: MakePoller) -> None:
    """A page cut inside the ITL histogram: the step time is never measured from half a histogram."""
    poller = make_poller(make_config([page_server.url]), clock)
    page_server.serve_text(busy_page())
    poller.poll_once()
    more = VllmState(running=4, kv_usage_ratio=0.2, itl_count=300, itl_sum=6.0, engine_steps=80, prompt_tokens=900,
                     itl_buckets={0.01: 30, 0.025: 240, 0.05: 300, 0.1: 300})
    page = vllm_page(more)
    cut = page.index(TRUNCATED_MARK) + page[page.index(TRUNCATED_MARK):].index("\n", 1) + 20
    page_server.serve_text(page[:cut])
    clock.advance(15)
    with capture_logs() as logs:
        readings = poller.poll_once().readings
    reading = only_reading(readings)
    assert reading.target_up is True  # what the page still says is usable...
    assert reading.requests_running == 4
    # ...but half a histogram measures nothing.
    assert reading.measured_step_seconds is None and reading.measured_step_median_seconds is None
    assert reading.prediction_error_ratio is None
    assert any("inter_token_latency" in note for note in reading.notes)
    assert any(line["event"] == "page_problem" and "truncated" in line["reason"] for line in logs)


def test_nan_and_inf_values_are_left_out(page_server: PageServer, clock: ManualClock, make_poller: MakePoller) -> None:
    poller = make_poller(make_config([page_server.url]), clock)
    page_server.serve_text(vllm_page(VllmState(running=float("inf"), waiting=3, kv_usage_ratio=float("nan"))))
    with capture_logs() as logs:
        reading = only_reading(poller.poll_once().readings)
    assert reading.target_up is True
    assert reading.requests_running is None and reading.kv_cache_usage_ratio is None
    assert reading.tokens_in_flight is None
    assert reading.predicted_step_seconds is None and reading.token_budget_utilization_ratio is None
    assert reading.requests_waiting == 3
    assert any(line["event"] == "reading_partial" for line in logs)


def test_counter_going_backwards_measures_nothing_for_that_window(page_server: PageServer, clock: ManualClock,
                                                                   make_poller: MakePoller) -> None:
    """A server restart resets its counters: no negative step time or prefill rate is exported."""
    poller = make_poller(make_config([page_server.url]), clock)
    page_server.serve_text(busy_page())
    poller.poll_once()
    restarted = VllmState(running=1, kv_usage_ratio=0.01, itl_count=10, itl_sum=0.15, engine_steps=5, prompt_tokens=40,
                          preemptions=0, itl_buckets={0.01: 1, 0.025: 10, 0.05: 10, 0.1: 10}, first_tokens=1)
    page_server.serve_text(vllm_page(restarted))
    clock.advance(15)
    with capture_logs() as logs:
        reading = only_reading(poller.poll_once().readings)
    assert [line["event"] for line in logs] == ["counter_reset"]
    assert reading.target_up is True
    assert reading.measured_step_seconds is None and reading.prefill_tokens_per_step is None
    assert reading.preemptions_total == 0  # the server's own counter value; Prometheus handles resets
    # The next window, from the restarted counters, measures again: (0.45-0.15)/(30-10).
    again = VllmState(running=1, kv_usage_ratio=0.01, itl_count=30, itl_sum=0.45, engine_steps=25, prompt_tokens=40,
                      itl_buckets={0.01: 1, 0.025: 30, 0.05: 30, 0.1: 30}, first_tokens=1)
    page_server.serve_text(vllm_page(again))
    clock.advance(15)
    assert only_reading(poller.poll_once().readings).measured_step_seconds == pytest.approx((0.45 - 0.15) / (30 - 10))


def test_routine_window_gaps_are_quiet_but_a_page_without_the_histogram_is_logged(
        page_server: PageServer, clock: ManualClock, make_poller: MakePoller) -> None:
    """A first poll or an idle window measures nothing, as expected: no log line per target. A page
    that lacks the ITL histogram can never measure: that is said once."""
    poller = make_poller(make_config([page_server.url]), clock)
    page_server.serve_text(busy_page())
    with capture_logs() as logs:
        poller.poll_once()  # first poll: no window yet
        clock.advance(15)
        poller.poll_once()  # same counters: an idle window
    assert [line["event"] for line in logs if line["event"] == "reading_partial"] == []
    page = busy_page()
    without_itl = "\n".join(line for line in page.splitlines() if "inter_token_latency" not in line) + "\n"
    page_server.serve_text(without_itl)
    with capture_logs() as logs:
        for _ in range(3):
            clock.advance(15)
            poller.poll_once()
    [line] = [line for line in logs if line["event"] == "reading_partial"]
    assert line["left_out"] == ["measured_step_seconds", "measured_step_median_seconds",
                                "measured_step_median_lower_seconds", "measured_step_median_upper_seconds",
                                "prediction_error_ratio"]
    assert any("inter_token_latency" in note for note in line["notes"])


def test_page_overrides_config_is_said_only_where_the_page_differs(
        page_server: PageServer, clock: ManualClock, make_poller: MakePoller) -> None:
    """Two deployments with equal setups read one page: while it agrees with the config (bfloat16 is the
    16 bits "auto" means, blocks of 16) nothing is said; an fp8 page is said once per target."""
    config = config_from_mapping({"poll_interval": "15s", "stale_after": "60s", "deployments": [
        {"name": name, "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": [page_server.url]}}
        for name in ("a", "b")]})
    poller = make_poller(config, clock)
    page_server.serve_text(vllm_page(VllmState(running=4, kv_usage_ratio=0.5, cache_dtype="bfloat16")))
    with capture_logs() as logs:
        poller.poll_once()
    assert [line for line in logs if line["event"] == "page_overrides_config"] == []
    page_server.serve_text(vllm_page(VllmState(running=4, kv_usage_ratio=0.5, cache_dtype="fp8")))
    with capture_logs() as logs:
        for _ in range(2):
            clock.advance(15)
            poller.poll_once()
    said = [line for line in logs if line["event"] == "page_overrides_config"]
    assert sorted((line["deployment"], line["page_kv_cache_dtype"], line["page_block_size"]) for line in said) == [
        ("a", "fp8", 16), ("b", "fp8", 16)]


def test_failing_target_does_not_disturb_the_healthy_one(make_page_server, clock: ManualClock,
                                                          make_poller: MakePoller) -> None:
    healthy, broken = make_page_server(), make_page_server()
    healthy.serve_text(busy_page())
    broken.serve_text(bytes(range(256)))
    poller = make_poller(make_config([healthy.url, broken.url]), clock)
    readings = {r.target: r for r in poller.poll_once().readings}
    assert readings[healthy.url[7:-8]].target_up is True
    assert readings[broken.url[7:-8]].target_up is False


def test_engine_detection_is_logged_once(page_server: PageServer, clock: ManualClock, make_poller: MakePoller) -> None:
    poller = make_poller(make_config([page_server.url]), clock)
    page_server.serve_text(busy_page())
    with capture_logs() as logs:
        poller.poll_once()
        clock.advance(15)
        poller.poll_once()
    detected = [line for line in logs if line["event"] == "kind_detected"]
    assert len(detected) == 1 and detected[0]["kind"] == "vllm"


def test_scheduler_runs_the_poll_and_stops(page_server: PageServer, make_poller: MakePoller) -> None:
    """The real BackgroundScheduler: one instance at a time, coalesced, polls at once on start."""
    page_server.serve_text(busy_page())
    poller = make_poller(make_config([page_server.url], poll_interval="1h", stale_after="3h"), time.time)
    done = threading.Event()
    poller.add_listener(lambda result: done.set())
    poller.start()
    try:
        assert done.wait(10), "the first poll did not run"
        job = poller._scheduler.get_job("poll")  # type: ignore[attr-defined]  # apscheduler is untyped: _scheduler is held as object
        assert job.max_instances == 1 and job.coalesce is True and job.misfire_grace_time == 3600
        assert job.trigger.interval.total_seconds() == 3600
        assert poller.ready
    finally:
        poller.stop()


# --- logs ------------------------------------------------------------------------------------------------


def test_logs_are_json_lines_with_stdlib_loggers_bridged_and_scheduler_overruns_thinned() -> None:
    import io
    import json
    import logging

    from exporter.logs import EveryMinuteAtMost, configure_logging

    stream = io.StringIO()
    configure_logging("json", stream=stream)
    try:
        structlog.get_logger("stepbudget.test").warning("target_down", target="10.0.0.5:8000", reason="HTTP 500")
        logging.getLogger("urllib3.connectionpool").warning("Connection pool is full")
        logging.getLogger("apscheduler.executors.default").info("Running job poll")  # noise: dropped
        lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    finally:
        logging.getLogger().handlers.clear()
    assert lines[0]["event"] == "target_down" and lines[0]["target"] == "10.0.0.5:8000"
    assert lines[0]["level"] == "warning"
    assert lines[1]["event"] == "Connection pool is full" and lines[1]["logger"] == "urllib3.connectionpool"
    assert len(lines) == 2

    clock = ManualClock()
    thinning = EveryMinuteAtMost("maximum number of running instances reached", clock=clock)

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("apscheduler.scheduler", logging.WARNING, __file__, 1, message, None, None)

    overrun = "Execution of job skipped: maximum number of running instances reached (1)"
    passed = []
    for _ in range(30):  # one overrun warning a second for 30 s, then 31 s later another
        passed.append(thinning.filter(record(overrun)))
        clock.advance(1)
    clock.advance(31)
    last = record(overrun)
    assert passed.count(True) == 1 and thinning.filter(last)
    assert "(and 29 more like it in the last 60s)" in last.getMessage()
    assert thinning.filter(record("something else")) and thinning.filter(record("something else"))


@pytest.mark.parametrize("stage", ["headers", "body"])
def test_trickling_server_is_cut_at_the_real_deadline(page_server: PageServer, stage: str) -> None:
    """Real clock this time: a server trickling its headers (no per-read timeout ever trips, and the
    body loop never starts) or its body is cut by the fetch watchdog at the deadline. Without it
    this fetch would run until the server stops, then succeed."""
    stop = threading.Event()
    sent: list[int] = []

    def trickle(handler: BaseHTTPRequestHandler) -> None:
        handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
        if stage == "body":
            handler.wfile.write(b"Content-Type: text/plain\r\nContent-Length: 400\r\n\r\n")
        for _ in range(400):  # 20 s at most
            if stop.wait(0.05):
                return
            handler.wfile.write(b"X" if stage == "headers" else b"#")
            handler.wfile.flush()
            sent.append(1)

    page_server.respond = trickle
    fetcher = HttpFetcher(0.3, 1 << 20)
    try:
        with pytest.raises(FetchError, match=r"timed out after 0.3s"):
            fetcher(page_server.url, bearer_token=None, tls=Tls())
        assert len(sent) < 400, "the fetch ended only because the server stopped"
    finally:
        stop.set()
        fetcher.close()


def test_gzip_pages_are_read_and_the_cap_counts_decoded_bytes(page_server: PageServer) -> None:
    """prometheus_client compresses when asked (requests asks); a small compressed page that
    inflates past the cap (a gzip bomb) is refused like any large page."""
    import gzip

    def gzipped(body: bytes):
        def respond(handler: BaseHTTPRequestHandler) -> None:
            data = gzip.compress(body)
            handler.send_response(200)
            handler.send_header("Content-Encoding", "gzip")
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
        return respond

    fetcher = HttpFetcher(2.0, 100_000)
    try:
        page = busy_page()
        page_server.respond = gzipped(page.encode())
        assert fetcher(page_server.url, bearer_token=None, tls=Tls()) == page
        bomb = b"# " + b"0" * 1_000_000 + b"\n"
        assert len(gzip.compress(bomb)) < 100_000
        page_server.respond = gzipped(bomb)
        with pytest.raises(FetchError, match="response over 100000 bytes"):
            fetcher(page_server.url, bearer_token=None, tls=Tls())
    finally:
        fetcher.close()


@pytest.mark.slow  # 1.8 s
def test_stopping_mid_cycle_logs_one_line_not_a_traceback_per_target(clock: ManualClock,
                                                                       make_poller: MakePoller) -> None:
    """A rolling restart stops the daemon mid-poll: the queued fetches are cancelled. That is routine,
    so it is one info line naming how many targets were not polled, and no half cycle is published.
    Depending on timing, stop() lands while fetches wait in the queue (cancelled) or while the cycle is
    still submitting them (never submitted); both are the same abandoned targets."""
    from exporter.serve.fetch import MAX_FETCH_WORKERS

    queued = 5
    urls = [f"http://127.0.0.1:1/{index}/metrics" for index in range(MAX_FETCH_WORKERS + queued)]
    entered, release = threading.Semaphore(0), threading.Event()

    def blocking_fetch(url: str, *, bearer_token: str | None, tls: Tls) -> str:
        entered.release()
        release.wait(timeout=10)
        return busy_page()

    poller = make_poller(make_config(urls), clock, fetch=blocking_fetch)
    results = []
    with capture_logs() as logs:
        cycle = threading.Thread(target=lambda: results.append(poller.poll_once()))
        cycle.start()
        for _ in range(MAX_FETCH_WORKERS):  # every worker is busy; the rest wait in the queue
            assert entered.acquire(timeout=10)
        poller.stop()
        release.set()
        cycle.join(timeout=10)
    assert not cycle.is_alive()
    assert [line for line in logs if line["event"] == "poll_target_crashed"] == []
    (abandoned,) = [line for line in logs if line["event"] == "poll_cycle_abandoned"]
    assert abandoned["targets_not_polled"] == queued
    assert results[0].readings == () and poller.readings() == ()


def test_a_cycle_whose_worker_still_waits_for_a_thread_when_stop_comes_ends(clock: ManualClock,
                                                                            make_poller: MakePoller) -> None:
    """stop() cancels the fetch workers still queued for one of the pool's threads, and the cycle must
    still end: concurrent.futures.wait() never counts a future cancelled that way as done, and a CI run
    hung at exit on a poll in flight at shutdown. The pool is held full here (reaching into the Poller
    for it) so that the cycle's one worker must queue; a spy on the pool's submit says when it has."""
    from exporter.serve.fetch import MAX_FETCH_WORKERS

    poller = make_poller(make_config(["http://127.0.0.1:1/metrics"]), clock,
                         fetch=lambda url, *, bearer_token, tls: busy_page())
    pool = poller._executor
    holding, release = threading.Semaphore(0), threading.Event()

    def hold() -> None:
        holding.release()
        release.wait(timeout=10)

    for _ in range(MAX_FETCH_WORKERS):
        pool.submit(hold)
    for _ in range(MAX_FETCH_WORKERS):
        assert holding.acquire(timeout=10)
    queued, submit = threading.Event(), pool.submit

    def submit_and_tell(*args: Any, **kwargs: Any) -> Any:
        future = submit(*args, **kwargs)
        queued.set()
        return future

    pool.submit = submit_and_tell  # type: ignore[method-assign]  # a spy over the pool's own submit, for this test
    results = []
    with capture_logs() as logs:
        cycle = threading.Thread(target=lambda: results.append(poller.poll_once()), daemon=True)
        cycle.start()
        assert queued.wait(timeout=10)
        poller.stop()
        release.set()
        cycle.join(timeout=10)
    assert not cycle.is_alive(), "the cycle waits forever on the worker stop() cancelled"
    (abandoned,) = [line for line in logs if line["event"] == "poll_cycle_abandoned"]
    assert abandoned["targets_not_polled"] == 1
    assert results[0].readings == () and poller.readings() == ()


def test_bearer_token_file_is_read_once_per_poll_and_a_missing_one_fails_each_target(
        tmp_path, clock: ManualClock, make_poller: MakePoller, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every target of a deployment gets its token; the file is read once per poll, not once per
    target, and still at every poll (Kubernetes rotates it in place)."""
    from exporter.serve.config import Auth

    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    reads = []
    original = Auth.bearer_token

    def counted(self: Auth) -> str | None:
        reads.append(self.bearer_token_file)
        return original(self)

    monkeypatch.setattr(Auth, "bearer_token", counted)
    urls = [f"http://127.0.0.1:1/{index}/metrics" for index in range(3)]
    sent: list[tuple[str, str | None]] = []

    def fetch(url: str, *, bearer_token: str | None, tls: Tls) -> str:
        sent.append((url, bearer_token))
        return busy_page()

    config = config_from_mapping({
        "poll_interval": "15s", "stale_after": "60s", "timeout": "2s",
        "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                         "auth": {"bearer_token_file": str(token_file)}, "targets": {"static": urls}}],
    })
    poller = make_poller(config, clock, fetch=fetch)
    poller.poll_once()
    assert sorted(sent) == [(url, "first") for url in sorted(urls)]
    assert reads == [str(token_file)]
    token_file.write_text("rotated\n")
    sent.clear()
    poller.poll_once()
    assert sorted(sent) == [(url, "rotated") for url in sorted(urls)]
    assert len(reads) == 2
    token_file.unlink()
    sent.clear()
    with capture_logs() as logs:
        readings = poller.poll_once().readings
    assert sent == [] and len(readings) == 3 and not any(reading.target_up for reading in readings)
    down = [line for line in logs if line["event"] == "target_down"]
    assert len(down) == 3 and all(line["reason"].startswith("FileNotFoundError") for line in down)


def test_pages_are_read_as_utf8_even_without_a_charset(page_server: PageServer) -> None:
    """`Content-Type: text/plain; version=0.0.4` names no charset; the format is UTF-8 all the same."""
    model_name = "Qwen/Qwen3-8B-中文-ü"
    page = f'vllm:num_requests_running{{engine="0",model_name="{model_name}"}} 3.0\n'
    page_server.serve_text(page.encode("utf-8"))
    fetcher = HttpFetcher(timeout_seconds=2.0, max_response_bytes=1 << 20)
    try:
        text = fetcher(page_server.url, bearer_token=None, tls=Tls())
    finally:
        fetcher.close()
    assert model_name in text


# --- how many fetches run at once --------------------------------------------------------------------


class InFlight:
    """A fetch that counts how many run at once (and can hold each until released)."""

    def __init__(self, hold_seconds: float = 0.0, release: threading.Event | None = None) -> None:
        self.hold_seconds, self.release = hold_seconds, release
        self.now = self.most = 0
        self.entered = threading.Semaphore(0)
        self._lock = threading.Lock()

    def __call__(self, url: str, *, bearer_token: str | None, tls: Tls) -> str:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        self.entered.release()
        try:
            if self.release is not None:
                self.release.wait(timeout=10)
            elif self.hold_seconds:
                time.sleep(self.hold_seconds)
            return busy_page()
        finally:
            with self._lock:
                self.now -= 1


def test_fast_targets_are_polled_by_a_few_workers(clock: ManualClock, make_poller: MakePoller) -> None:
    """Pages that answer at once: the few starting workers read them all (no thread contention)."""
    from exporter.serve.poller import FAST_FETCH_WORKERS

    fetch = InFlight()
    poller = make_poller(make_config([f"http://127.0.0.1:1/{index}/metrics" for index in range(60)]), clock,
                         fetch=fetch)
    readings = poller.poll_once().readings
    assert len(readings) == 60 and all(reading.target_up for reading in readings)
    assert 1 <= fetch.most <= FAST_FETCH_WORKERS


def test_hanging_targets_each_get_a_worker_up_to_the_most(clock: ManualClock, make_poller: MakePoller) -> None:
    """Targets that hold their fetch (a dead server up to the timeout): each slow fetch is covered by
    another worker, so the hung ones cannot starve the rest, up to MAX_FETCH_WORKERS at once."""
    from exporter.serve.fetch import MAX_FETCH_WORKERS
    from exporter.serve.poller import FAST_FETCH_WORKERS

    hung = FAST_FETCH_WORKERS * 3
    release = threading.Event()
    fetch = InFlight(release=release)
    poller = make_poller(make_config([f"http://127.0.0.1:1/{index}/metrics" for index in range(hung)]), clock,
                         fetch=fetch)
    cycle = threading.Thread(target=poller.poll_once)
    cycle.start()
    try:
        for _ in range(hung):  # every hung fetch in flight at once, though only a few workers started
            assert fetch.entered.acquire(timeout=10)
    finally:
        release.set()
        cycle.join(timeout=10)
    assert fetch.most == hung <= MAX_FETCH_WORKERS


def test_a_poll_too_slow_for_its_interval_adds_workers(clock: ManualClock, make_poller: MakePoller) -> None:
    """Targets 50 ms away (none slow on its own): 80 of them by the starting workers would take
    80 x 0.05 / FAST_FETCH_WORKERS = 1 s, past a quarter of a 1 s interval; the poll adds workers."""
    from exporter.serve.poller import FAST_FETCH_WORKERS

    fetch = InFlight(hold_seconds=0.05)
    config = make_config([f"http://127.0.0.1:1/{index}/metrics" for index in range(80)], poll_interval="1s")
    poller = make_poller(config, clock, fetch=fetch)
    assert len(poller.poll_once().readings) == 80
    assert fetch.most > FAST_FETCH_WORKERS
