"""The pieces of the end-to-end stack: managed processes, recording HTTP servers, config files,
Prometheus API reads, and the comparisons the tests make.

Everything listens on 127.0.0.1. Every process is started in its own session (process group) and
stopped by group, so a server that forks (or a CLI that starts threads) leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from exporter.serve.alert_rules import AlertSettings, tune_rules_document
from tests.support.tools import require_tool

HTTP_TIMEOUT_SECONDS = 5.0
STOP_GRACE_SECONDS = 5.0
SCRAPE_LABELS = ("instance", "job")  # added by Prometheus to every scraped series

T = TypeVar("T")
SeriesKey = tuple[str, frozenset[tuple[str, str]]]  # (metric name, label set)


# --- waiting on real processes ---------------------------------------------------------------------


class Deadline:
    """One wall-clock budget for the whole stack, so no wait can push the test past it."""

    def __init__(self, seconds: float) -> None:
        self.end_monotonic = time.monotonic() + seconds

    def left_seconds(self) -> float:
        return self.end_monotonic - time.monotonic()


def wait_for(condition: Callable[[], T | None], *, timeout_seconds: float, what: str,
             state: Callable[[], object] = lambda: "", deadline: Deadline | None = None,
             interval_seconds: float = 0.2) -> T:
    """Poll `condition` until it returns something truthy, else fail saying what and the last state.

    For real servers only (start-up, a scrape, an alert on its way); never to assert speed.
    """
    limit = timeout_seconds if deadline is None else max(0.0, min(timeout_seconds, deadline.left_seconds()))
    end = time.monotonic() + limit
    last_error = ""
    while True:
        try:
            value = condition()
        except (requests.RequestException, OSError, ValueError, KeyError) as error:
            value, last_error = None, f"{type(error).__name__}: {error}"
        if value:
            return value
        if time.monotonic() >= end:
            raise AssertionError(f"timed out after {limit:.0f}s waiting for {what}; last state: {state()!s:.3000}"
                                 + (f"; last error: {last_error}" if last_error else ""))
        time.sleep(interval_seconds)


# --- processes ----------------------------------------------------------------------------------------


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, characters: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-characters:]
        except OSError:
            return ""

    def check_running(self) -> None:
        if self.popen.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.popen.returncode}; log {self.log_path}:\n"
                                 f"{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL after the grace period."""
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                _signal_group(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=STOP_GRACE_SECONDS)
        _signal_group(self.popen.pid, signal.SIGKILL)  # anything the leader left in its group


def _signal_group(pid: int, signum: signal.Signals) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def start_process(name: str, argv: Sequence[str], log_dir: Path) -> ManagedProcess:
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    return ManagedProcess(name, popen, log_path)


def alertmanager_binary() -> str:
    """Alertmanager as upstream names it, or as Debian's package does."""
    return shutil.which("alertmanager") or require_tool("prometheus-alertmanager")


def start_alertmanager_and_prometheus(work: Path, *, alertmanager: tuple[str, Path, str],
                                      prometheus: tuple[str, Path, str]) -> list[ManagedProcess]:
    """Both real servers, each (binary, config file, listen address), their data under `work`."""
    alertmanager_binary, am_config, am_address = alertmanager
    prometheus_binary, prom_config, prom_address = prometheus
    started = [start_process("alertmanager", [
        alertmanager_binary, f"--config.file={am_config}", f"--storage.path={work / 'am-data'}",
        f"--web.listen-address={am_address}", "--cluster.listen-address="], work)]
    try:
        started.append(start_process("prometheus", [
            prometheus_binary, f"--config.file={prom_config}", f"--storage.tsdb.path={work / 'prom-data'}",
            f"--web.listen-address={prom_address}"], work))
    except BaseException:
        started[0].stop()
        raise
    return started


# --- recording HTTP servers -----------------------------------------------------------------------------


@dataclass
class Post:
    path: str
    body: Any  # the decoded JSON
    status: int  # what this server answered (upstream's answer when forwarding)
    received_monotonic: float
    received_unix: float


class RecordingServer:
    """A stdlib HTTP server on 127.0.0.1 that records every POST body (JSON).

    With `upstream`, it also forwards each POST to upstream + path and answers with upstream's
    status: a transparent tap on the line between an alert sender and Alertmanager, so the test
    sees exactly what each sender posted.
    """

    def __init__(self, upstream: str | None = None) -> None:
        self.upstream = upstream
        self.posts: list[Post] = []
        self._lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                # Forward first: once a post is recorded, Alertmanager has answered it.
                status, answer = recorder._forward(self.path, body, self.headers.get("Content-Type", ""))
                recorder._record(self.path, body, status)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="e2e-recorder", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def _record(self, path: str, body: bytes, status: int) -> None:
        try:
            decoded = json.loads(body)
        except ValueError:
            decoded = body.decode(errors="replace")
        with self._lock:
            self.posts.append(Post(path, decoded, status, time.monotonic(), time.time()))

    def _forward(self, path: str, body: bytes, content_type: str) -> tuple[int, bytes]:
        if self.upstream is None:
            return 200, b"{}"
        try:
            response = requests.post(self.upstream + path, data=body, timeout=HTTP_TIMEOUT_SECONDS,
                                     headers={"Content-Type": content_type or "application/json"})
        except requests.RequestException as error:
            return 502, json.dumps({"error": str(error)}).encode()
        return response.status_code, response.content

    def recorded(self) -> list[Post]:
        with self._lock:
            return list(self.posts)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def posted_alerts(posts: Sequence[Post], alertname: str) -> list[dict[str, Any]]:
    """Every alert (Alertmanager API v2 body: a list of alerts) posted with this name, in order."""
    return [alert for post in posts if isinstance(post.body, list) for alert in post.body
            if alert.get("labels", {}).get("alertname") == alertname]


def webhook_alerts(posts: Sequence[Post], alertname: str, status: str) -> list[dict[str, Any]]:
    """Alerts of this name and status ("firing" | "resolved") in Alertmanager's webhook payloads."""
    return [alert for post in posts if isinstance(post.body, dict) for alert in post.body.get("alerts", [])
            if alert["labels"].get("alertname") == alertname and alert["status"] == status]


# --- config files -------------------------------------------------------------------------------------


def copy_rules_with_for(original: Path, destination: Path, for_by_alert: Mapping[str, str]) -> Path:
    """A copy of a rule file where the named alerts get a new `for` as a site's `alerting.rules` sets it (the
    daemon's loop, given the same, says the new `for` in the description too: so does the copy)."""
    settings = {name: AlertSettings(for_text=duration) for name, duration in for_by_alert.items()}
    document = tune_rules_document(yaml.safe_load(original.read_text()), settings, str(original))
    destination.write_text(yaml.safe_dump(document, sort_keys=False, width=1000))
    return destination


def differences_besides_for(original: Any, copy: Any, where: str = "") -> list[str]:
    """Paths where two loaded YAML documents differ, ignoring the values of `for` keys."""
    if isinstance(original, dict) and isinstance(copy, dict):
        differences = [f"{where}.{key}: only in one" for key in set(original) ^ set(copy)]
        for key in sorted(set(original) & set(copy), key=str):
            if key != "for":
                differences += differences_besides_for(original[key], copy[key], f"{where}.{key}")
        return differences
    if isinstance(original, list) and isinstance(copy, list):
        if len(original) != len(copy):
            return [f"{where}: {len(original)} items vs {len(copy)}"]
        return [difference for i, (a, b) in enumerate(zip(original, copy, strict=True))
                for difference in differences_besides_for(a, b, f"{where}[{i}]")]
    return [] if original == copy else [f"{where}: {original!r} vs {copy!r}"]


def prometheus_config(*, scrape_address: str, alertmanager_address: str, rule_files: Sequence[Path],
                      interval: str, external_labels: Mapping[str, str],
                      alert_relabel_configs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval,
                   "external_labels": dict(external_labels)},
        "rule_files": [str(path) for path in rule_files],
        "alerting": {"alert_relabel_configs": list(alert_relabel_configs),
                     "alertmanagers": [{"static_configs": [{"targets": [alertmanager_address]}]}]},
        "scrape_configs": [{"job_name": "stepbudget", "static_configs": [{"targets": [scrape_address]}]}],
    }


def alertmanager_config(*, webhook_url: str, group_wait: str, group_interval: str, repeat_interval: str,
                        resolve_timeout: str) -> dict[str, Any]:
    # group_by ['...']: every distinct label set is its own group, so one notification = one alert.
    return {
        "global": {"resolve_timeout": resolve_timeout},
        "route": {"receiver": "webhook", "group_by": ["..."], "group_wait": group_wait,
                  "group_interval": group_interval, "repeat_interval": repeat_interval},
        "receivers": [{"name": "webhook", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}],
    }


def write_yaml(path: Path, document: Any) -> Path:
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


# --- reading the exporter and Prometheus ---------------------------------------------------------------


def labels_key(name: str, labels: Mapping[str, str]) -> SeriesKey:
    return name, frozenset((k, v) for k, v in labels.items() if k not in SCRAPE_LABELS and k != "__name__")


def parse_exposition(text: str) -> dict[SeriesKey, float]:
    """Every sample of a text exposition page, by (name, labels)."""
    return {labels_key(sample.name, sample.labels): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def get_text(url: str) -> str:
    response = requests.get(url, timeout=HTTP_TIMEOUT_SECONDS)
    response.raise_for_status()
    return response.text


@dataclass
class PrometheusApi:
    url: str

    def query(self, expr: str, at_seconds: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr} if at_seconds is None else {"query": expr, "time": f"{at_seconds:.3f}"}
        response = requests.get(f"{self.url}/api/v1/query", params=params, timeout=HTTP_TIMEOUT_SECONDS)
        payload = response.json()
        if payload.get("status") != "success":
            raise AssertionError(f"Prometheus refused {expr!r}: {payload}")
        return payload["data"]["result"]

    def samples(self, expr: str, at_seconds: float | None = None) -> dict[SeriesKey, float]:
        """An instant vector as {(name, labels without instance/job): value}."""
        return {labels_key(item["metric"].get("__name__", ""), item["metric"]): float(item["value"][1])
                for item in self.query(expr, at_seconds)}

    def label_values(self, label: str, match: str) -> list[str]:
        """What Grafana's `label_values(match, label)` asks Prometheus for."""
        response = requests.get(f"{self.url}/api/v1/label/{label}/values", params={"match[]": match},
                                timeout=HTTP_TIMEOUT_SECONDS)
        return sorted(response.json()["data"])

    def rules(self) -> list[dict[str, Any]]:
        response = requests.get(f"{self.url}/api/v1/rules", timeout=HTTP_TIMEOUT_SECONDS)
        return [rule for group in response.json()["data"]["groups"] for rule in group["rules"]]

    def alerts(self) -> list[dict[str, Any]]:
        response = requests.get(f"{self.url}/api/v1/alerts", timeout=HTTP_TIMEOUT_SECONDS)
        return response.json()["data"]["alerts"]


def alertmanager_alerts(url: str) -> list[dict[str, Any]]:
    """Alertmanager's current alerts (API v2; resolved ones are not listed)."""
    response = requests.get(f"{url}/api/v2/alerts", timeout=HTTP_TIMEOUT_SECONDS)
    response.raise_for_status()
    return response.json()


@dataclass
class DaemonHistory:
    """Samples the daemon's /metrics often enough to keep every poll it published.

    Keyed by each target's `stepbudget_target_last_success_timestamp_seconds`: the poll that made a
    value. Prometheus's latest sample of a target then has one daemon page to be compared with,
    whatever the phases of the poll loop and the scrape.
    """

    metrics_url: str
    interval_seconds: float = 0.1
    by_poll: dict[tuple[str, float], dict[SeriesKey, float]] = field(default_factory=dict)
    constant: dict[SeriesKey, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    def __enter__(self) -> DaemonHistory:
        self._thread = threading.Thread(target=self._run, name="e2e-daemon-history", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HTTP_TIMEOUT_SECONDS + 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            try:
                page = parse_exposition(get_text(self.metrics_url))
            except (requests.RequestException, ValueError):
                continue
            self._add(page)

    def _add(self, page: dict[SeriesKey, float]) -> None:
        polls = {dict(labels)["target"]: value for (name, labels), value in page.items()
                 if name == "stepbudget_target_last_success_timestamp_seconds"}
        with self._lock:
            for key, value in page.items():
                target = dict(key[1]).get("target")
                if target is None:
                    self.constant[key] = value
                elif target in polls:
                    self.by_poll.setdefault((target, polls[target]), {})[key] = value

    def page_at(self, polls: Mapping[str, float]) -> dict[SeriesKey, float] | None:
        """The daemon's series for the given poll of every target, or None if one was not seen."""
        with self._lock:
            if any((target, poll) not in self.by_poll for target, poll in polls.items()):
                return None
            page = dict(self.constant)
            for target, poll in polls.items():
                page.update(self.by_poll[(target, poll)])
            return page


def poll_times(page: Mapping[SeriesKey, float]) -> dict[str, float]:
    return {dict(labels)["target"]: value for (name, labels), value in page.items()
            if name == "stepbudget_target_last_success_timestamp_seconds"}


def compare_pages(expected: Mapping[SeriesKey, float], actual: Mapping[SeriesKey, float]) -> list[str]:
    """Human-readable differences: series on one side only, and values that are not equal."""
    problems = [f"only in the daemon: {describe(key)}" for key in sorted(set(expected) - set(actual), key=str)]
    problems += [f"only in Prometheus: {describe(key)}" for key in sorted(set(actual) - set(expected), key=str)]
    problems += [f"{describe(key)}: daemon {expected[key]!r}, Prometheus {actual[key]!r}"
                 for key in sorted(set(expected) & set(actual), key=str) if not _same(expected[key], actual[key])]
    return problems


def _same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)


def describe(key: SeriesKey) -> str:
    name, labels = key
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels)) + "}"


# --- dashboards --------------------------------------------------------------------------------------


def panels(dashboard: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every panel, including those inside collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panels(panel)


_REGEX_SPECIAL = re.compile(r"([\\^$.|?*+()\[\]{}])")


def grafana_regex(values: Sequence[str]) -> str:
    """How Grafana's Prometheus data source writes a multi-value variable into a `=~` matcher:
    regex-escaped inside a PromQL string (so `\\\\.`), and `(a|b)` when several."""
    escaped = [_REGEX_SPECIAL.sub(r"\\\\\1", value) for value in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<match>.*),\s*(?P<label>\w+)\s*\)\s*$")


def resolve_variables(dashboard: Mapping[str, Any], prometheus: PrometheusApi) -> dict[str, list[str] | str]:
    """Each query variable's values, asked of Prometheus in order (later ones use earlier ones). A variable
    whose label no series carries (`cluster` on a single Prometheus) is Grafana's All: its allValue, as is."""
    values: dict[str, list[str] | str] = {}
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"] if isinstance(variable["query"], str) else variable["query"]["query"]
        parsed = _LABEL_VALUES.match(substitute(query, values, {}))
        if parsed is None:
            raise AssertionError(f"variable {variable['name']}: not a label_values() query: {query!r}")
        found = prometheus.label_values(parsed["label"], parsed["match"])
        all_value = variable.get("allValue") if variable.get("includeAll") else None
        values[variable["name"]] = found if found or all_value is None else str(all_value)
    return values


def substitute(expr: str, variables: Mapping[str, Sequence[str] | str], intervals: Mapping[str, str]) -> str:
    """Grafana's substitution: interval macros first, then `$name` / `${name}` variables (a value list
    regex-escaped, an All value as it is)."""
    for macro, value in sorted(intervals.items(), key=lambda item: -len(item[0])):
        expr = expr.replace(macro, value)
    for name, chosen in sorted(variables.items(), key=lambda item: -len(item[0])):
        if chosen:
            text = chosen if isinstance(chosen, str) else grafana_regex(chosen)
            expr = expr.replace("${" + name + "}", text).replace("$" + name, text)
    return expr


def rate_interval(scrape_interval_seconds: float, interval_seconds: float) -> float:
    """Grafana's `$__rate_interval`: max($__interval + scrape interval, 4 x scrape interval)."""
    return max(interval_seconds + scrape_interval_seconds, 4 * scrape_interval_seconds)
