"""A stub Prometheus query API on 127.0.0.1 and the answers it gives, as a scrape labels them: what the
Prometheus-source tests (tests/serve/test_prometheus_source.py, test_prometheus_torn_scrape.py,
test_no_targets.py) share."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

from prometheus_client.parser import text_string_to_metric_families

from exporter.serve.config import Config, config_from_mapping
from exporter.serve.discovery import Discovery
from exporter.serve.engines import wanted_names
from exporter.serve.poller import Poller
from exporter.serve.prometheus_source import SAMPLE_TIME_SPREAD_LABEL, SCRAPE_TIME_LABEL, PrometheusSource
from tests.support.clocks import ManualClock
from tests.support.pages import VllmState

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


def scraped(page: str, instance: str, *, up: float = 1.0, at: float = SCRAPED_AT,
            extra: dict[str, str] | None = None, spread: float | None = None) -> list[dict[str, Any]]:
    """One target's part of an answer: its wanted samples, `up` and `timestamp(up)`, as a scrape labels
    them, and (given `spread`) how far apart its series' sample times are, as the query's spread series."""
    target = {"job": "vllm", "instance": instance, **(extra or {})}
    items = [{"metric": {"__name__": "up", **target}, "value": [at, f"{up:g}"]},
             {"metric": {**target, SCRAPE_TIME_LABEL: "1"}, "value": [at, f"{at:.3f}"]}]
    if spread is not None:
        # `stddev by (cluster, job, instance)` keeps those three (cluster where the scrape has one).
        kept = {key: target[key] for key in ("cluster", "job", "instance") if key in target}
        items.append({"metric": {**kept, SAMPLE_TIME_SPREAD_LABEL: "1"}, "value": [at, f"{spread:g}"]})
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
