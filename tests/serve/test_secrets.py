"""No credential the config gives ever shows: not in a log line, not in a label of /metrics, not in an
alert posted to Alertmanager, on any failure path.

The daemon's own pieces run for real (HttpFetcher, Poller, PrometheusSource, the collector, AlertLoop
posting through its default poster) against servers on 127.0.0.1 started and stopped here, with the
poll clock simulated: a target that refuses, one that never answers (timeout), one that answers 401,
one that returns garbage, one that answers a real vLLM page; a Prometheus query API that answers 401,
then an error, then is gone; an Alertmanager that answers 500, and one that is not there. Every
secret is planted where the daemon could leak it: a basic-auth password (file for the targets,
environment for Prometheus and Alertmanager), a token in every target URL's query, and userinfo in
a target URL, the query API's URL and an Alertmanager URL. The config refuses userinfo (test below);
here the userinfo URLs are put in after the config check, to show that redaction holds even for a URL
that got past it.
Logs are read from structlog's capture, which drops every processor: what is asserted is what the
sources log, without the renderer's backstop (tested on its own at the end).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import structlog
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from exporter.logs import configure_logging
from exporter.redaction import redact
from exporter.serve.alerting import AlertLoop
from exporter.serve.collector import make_registry
from exporter.serve.config import ConfigError, config_from_mapping
from exporter.serve.discovery import Discovery
from exporter.serve.fetch import HttpFetcher
from exporter.serve.poller import Poller
from exporter.serve.prometheus_source import PrometheusSource
from tests.support.clocks import ManualClock, SteppingClock
from tests.support.prometheus_api import QueryApi
from tests.support.servers import HandlerServer, PageServer, free_port, send_text
from tests.support.tools import DATA

PAGE = (DATA / "vllm-0.32.0-cpu" / "vllm-0.32.0-cpu_REAL_16streams_t1.prom").read_text()

TARGET_PASSWORD = "pw-target-9c41e7"  # basic_auth.password_file of the page deployment
QUERY_TOKEN = "tok-query-5e8a1c"  # ?token= of every static target URL
USERINFO_PASSWORD = "pw-userinfo-b20f6a"  # user:password@ of one static URL
PROMETHEUS_PASSWORD = "pw-prom-77b1d3"  # basic_auth.password_env of the query API
ALERTMANAGER_PASSWORD = "pw-am-1d2c90"  # alerting.auth.basic_auth.password_env
ALERTMANAGER_USERINFO = "pw-am-userinfo-4411ee"  # user:password@ of one Alertmanager URL
PROMETHEUS_USERINFO = "pw-prom-userinfo-0a9f"  # user:password@ of the query API's URL
PLANTED = (TARGET_PASSWORD, QUERY_TOKEN, USERINFO_PASSWORD, PROMETHEUS_PASSWORD, ALERTMANAGER_PASSWORD,
           ALERTMANAGER_USERINFO, PROMETHEUS_USERINFO)


def basic(username: str, password: str) -> str:
    return base64.b64encode(f"{username}:{password}".encode()).decode()


# The header values too: a line that logged a request's headers would leak the password encoded.
ENCODED = (basic("scraper", TARGET_PASSWORD), basic("reader", PROMETHEUS_PASSWORD),
           basic("reader", PROMETHEUS_USERINFO),
           basic("alerts", ALERTMANAGER_PASSWORD), basic("scraper", USERINFO_PASSWORD))


class Alertmanager:
    """A stand-in Alertmanager on 127.0.0.1: records every POST (path, Authorization, body), answers 500."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # http.server naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                outer.posts.append((self.path, self.headers.get("Authorization", ""), body))
                send_text(self, "the cluster is unhappy", 500)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = HandlerServer(Handler)

    @property
    def url(self) -> str:
        return self._server.base_url

    def close(self) -> None:
        self._server.close()


@pytest.fixture
def servers() -> Iterator[dict[str, PageServer]]:
    release = threading.Event()
    made = {name: PageServer() for name in ("silent", "unauthorized", "garbage", "good")}
    made["silent"].respond = lambda handler: release.wait(10)  # never answers: the fetch times out
    # A 401 whose body echoes the request (its token), and garbage that does too: neither body may surface.
    made["unauthorized"].respond = lambda handler: send_text(handler, f"who are you? {handler.path}", 401)
    made["garbage"].respond = lambda handler: send_text(handler, b"\x00\x01\x02" + handler.path.encode() * 40)
    made["good"].serve_text(PAGE)
    yield made
    release.set()
    for server in made.values():
        server.close()


@pytest.fixture
def query_api() -> Iterator[QueryApi]:
    api = QueryApi()
    yield api
    api.close()


@pytest.fixture
def alertmanager() -> Iterator[Alertmanager]:
    am = Alertmanager()
    yield am
    am.close()


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


def with_token(url: str) -> str:
    return f"{url}?token={QUERY_TOKEN}"


def test_no_planted_secret_leaves_the_daemon_on_any_failure_path(
        tmp_path: Path, servers: dict[str, PageServer], query_api: QueryApi, alertmanager: Alertmanager,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    password_file = tmp_path / "password"
    password_file.write_text(TARGET_PASSWORD + "\n")
    monkeypatch.setenv("PROM_PASSWORD", PROMETHEUS_PASSWORD)
    monkeypatch.setenv("AM_PASSWORD", ALERTMANAGER_PASSWORD)
    refused = f"http://127.0.0.1:{free_port()}/metrics"
    static = [with_token(refused), *(with_token(servers[name].url) for name in ("silent", "unauthorized", "garbage",
                                                                               "good"))]
    config = config_from_mapping({
        "poll_interval": "15s", "timeout": "1s", "stale_after": "60s",
        "deployments": [
            {"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": static},
             "auth": {"basic_auth": {"username": "scraper", "password_file": str(password_file)}}},
            {"name": "mimir", "model": "qwen3-8b", "gpu": "h100-sxm",
             "targets": {"prometheus": {"url": query_api.url, "selector": 'job="vllm"',
                                        "auth": {"basic_auth": {"username": "reader",
                                                                "password_env": "PROM_PASSWORD"}}}}},
        ],
        "alerting": {"alertmanager_urls": [alertmanager.url, f"http://127.0.0.1:{free_port()}"],
                     "auth": {"basic_auth": {"username": "alerts", "password_env": "AM_PASSWORD"}}},
    })
    # Past the config check (which refuses them: the next test): userinfo in a target and an Alertmanager URL.
    host = servers["good"].url.split("//", 1)[1]
    chat, mimir = config.deployments
    chat = replace(chat, static_urls=(*chat.static_urls, with_token(f"http://scraper:{USERINFO_PASSWORD}@{host}")))
    am_host = alertmanager.url.split("//", 1)[1]
    alerting = replace(config.alerting, alertmanager_urls=(*config.alerting.alertmanager_urls,
                                                           f"http://alerts:{ALERTMANAGER_USERINFO}@{am_host}"))
    assert mimir.prometheus is not None
    api_host = query_api.url.split("//", 1)[1]
    mimir = replace(mimir, prometheus=replace(mimir.prometheus, url=f"http://reader:{PROMETHEUS_USERINFO}@{api_host}"))
    config = replace(config, deployments=(chat, mimir), alerting=alerting)

    clock = ManualClock()
    fetcher = HttpFetcher(config.timeout_seconds, config.max_response_bytes)
    source = PrometheusSource(mimir, timeout_seconds=config.timeout_seconds,
                              stale_after_seconds=config.stale_after_seconds, clock=clock)
    poller = Poller(config, Discovery(config.deployments, timeout_seconds=1.0), fetcher, clock=clock,
                    monotonic=SteppingClock(0.125), sources=[source])
    alerts = AlertLoop(config.alerting, poll_interval_seconds=config.poll_interval_seconds,
                       generator_url="http://stepbudget:9421/", clock=clock)
    poller.add_listener(alerts.on_poll)
    target_down_for = next(rule.for_seconds for rule in alerts.rules if rule.name == "StepBudgetTargetDown")
    caplog.set_level(logging.DEBUG)  # urllib3's and requests' own lines too
    try:
        with capture_logs() as logs:
            query_api.answer = lambda form, headers: (401, b"unauthorized")
            poller.poll_once()
            clock.advance(target_down_for + 1)  # TargetDown fires at the next poll: posted to every Alertmanager
            query_api.answer = lambda form, headers: (
                422, b'{"status":"error","errorType":"execution","error":"query timed out in expression evaluation"}')
            poller.poll_once()
            clock.advance(61)
            query_api.close()  # Prometheus gone (and the source's kept-alive connection to it)
            source.close()
            poller.poll_once()
            page = generate_latest(make_registry(poller.readings, config.deployments, poller.deployment_targets))
    finally:
        poller.stop()
        fetcher.close()
        source.close()

    # Every failure path was taken, each with its reason.
    down = [(line["target"], line["reason"]) for line in logs if line["event"] == "target_down"]
    reasons = " | ".join(reason for _, reason in down)
    for expected in ("connection failed: Connection refused", "timed out after 1s", "HTTP 401",
                     "not Prometheus text", "prometheus HTTP 401: not a Prometheus API answer",
                     "query timed out in expression evaluation",
                     "prometheus unreachable: Connection refused"):
        assert expected in reasons, (expected, down)
    port = servers["good"].url.split(":")[2].split("/")[0]
    labels = {sample.split('target="', 1)[1].split('"', 1)[0]
              for sample in page.decode().splitlines() if sample.startswith("stepbudget_target_up{")}
    assert f"127.0.0.1:{port}?token=<redacted>" in labels and f"<redacted>@127.0.0.1:{port}?token=<redacted>" in labels
    assert f"<redacted>@{api_host}" in labels  # the query API, named after its address while it never answered
    posted = [json.loads(body) for path, _, body in alertmanager.posts]
    assert [path for path, _, _ in alertmanager.posts] == ["/api/v2/alerts"] * len(posted) and posted
    assert any(alert["labels"]["alertname"] == "StepBudgetTargetDown" for sent in posted for alert in sent)
    failed = [line for line in logs if line["event"] == "alertmanager_post_failed"]
    assert {line["url"] for line in failed} == {alertmanager.url, config.alerting.alertmanager_urls[1],
                                                f"http://<redacted>@{am_host}"}
    # The credentials were sent where they belong: basic auth to the pages and to Alertmanager.
    assert servers["unauthorized"].requests[0]["authorization"] == f"Basic {basic('scraper', TARGET_PASSWORD)}"
    assert alertmanager.posts[0][1] == f"Basic {basic('alerts', ALERTMANAGER_PASSWORD)}"

    # ... and nowhere else.
    shown = {
        "logs": json.dumps(logs, default=str),
        "stdlib logs": caplog.text,
        "/metrics": page.decode(),
        "Alertmanager posts": "\n".join(f"{path} {body}" for path, _, body in alertmanager.posts),
        "target states": repr([(state.target, state.last_error) for state in poller.target_states()]),
        "active alerts": json.dumps(alerts.active()),
    }
    for where, text in shown.items():
        for secret in (*PLANTED, *ENCODED):
            assert secret not in text, f"{secret!r} leaked into {where}"


@pytest.mark.parametrize(("where", "document"), [
    ("deployments[0].targets.static[0]",
     {"targets": {"static": [f"http://scraper:{USERINFO_PASSWORD}@10.0.0.5:8000/metrics"]}}),
    ("deployments[0].targets.prometheus.url",
     {"targets": {"prometheus": {"url": f"https://reader:{USERINFO_PASSWORD}@mimir/prometheus",
                                 "selector": 'job="v"'}}}),
    ("alerting.alertmanager_urls[0]", {"alertmanager_urls": [f"http://alerts:{USERINFO_PASSWORD}@am:9093"]}),
])
def test_a_url_with_userinfo_is_refused_naming_the_key_and_never_the_password(where: str, document: dict) -> None:
    deployment = {"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                  "targets": {"static": ["http://10.0.0.5:8000/metrics"]}}
    top: dict[str, object] = {"deployments": [{**deployment, **document} if "targets" in document else deployment]}
    if "alertmanager_urls" in document:
        top["alerting"] = document
    with pytest.raises(ConfigError) as refused:
        config_from_mapping(top)
    message = str(refused.value)
    assert f"{where}:" in message and "basic_auth.password_file" in message and "basic_auth.password_env" in message
    assert USERINFO_PASSWORD not in message and "<redacted>@" in message


def test_the_log_renderer_redacts_every_line_tracebacks_included() -> None:
    """The backstop: a URL that reaches a log line some other way (a library's message, a traceback) is
    redacted by the renderer the daemon configures."""
    stream = io.StringIO()
    configure_logging("json", stream=stream)
    log = structlog.get_logger("stepbudget.test")
    url = f"http://scraper:{USERINFO_PASSWORD}@10.0.0.5:8000/metrics?token={QUERY_TOKEN}&x=1"
    log.warning("fetched", url=url, nested={"urls": [url]})
    try:
        raise RuntimeError(f"Max retries exceeded with url: /metrics?api_key={QUERY_TOKEN}")
    except RuntimeError:
        log.exception("crashed")
    logging.getLogger("urllib3.connectionpool").warning("GET %s", url)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 3
    assert lines[0]["url"] == "http://<redacted>@10.0.0.5:8000/metrics?token=<redacted>&x=1"
    assert lines[0]["nested"] == {"urls": [lines[0]["url"]]}
    assert "api_key=<redacted>" in lines[1]["exception"]
    assert lines[2]["event"] == f"GET {lines[0]['url']}"
    assert USERINFO_PASSWORD not in stream.getvalue() and QUERY_TOKEN not in stream.getvalue()


@pytest.mark.parametrize(("text", "shown"), [
    ("http://u:p@h:1/metrics?token=abc&x=1", "http://<redacted>@h:1/metrics?token=<redacted>&x=1"),
    ("https://tok3n@h/", "https://<redacted>@h/"),  # a bare token as the username is as secret
    ("u:p@10.0.0.5:8000/metrics", "<redacted>@10.0.0.5:8000/metrics"),  # a label: the netloc without a scheme
    ("Max retries exceeded with url: /api?api_key=zz (Caused by",
     "Max retries exceeded with url: /api?api_key=<redacted> (Caused by"),
    ("h/x?X-Amz-Signature=aa&X-Amz-Credential=bb&X-Amz-Date=1",
     "h/x?X-Amz-Signature=<redacted>&X-Amz-Credential=<redacted>&X-Amz-Date=1"),
    ("h/blob?sv=2022&sig=abc;se=2", "h/blob?sv=2022&sig=<redacted>;se=2"),  # an Azure SAS
    ("h/m?password=&pwd=x&client_secret=y&session_id=z",
     "h/m?password=&pwd=<redacted>&client_secret=<redacted>&session_id=<redacted>"),
    ("http://10.0.0.5:8000/metrics?format=text", "http://10.0.0.5:8000/metrics?format=text"),
    ("Qwen/Qwen3-8B@main and key=value without a query", "Qwen/Qwen3-8B@main and key=value without a query"),
])
def test_redact(text: str, shown: str) -> None:
    assert redact(text) == shown
