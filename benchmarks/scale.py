"""The daemon as a process (`stepbudget serve`, defaults as shipped) beside a real Prometheus, both
polling / scraping the same N vLLM targets, each measured the same way in the same run.

Setup per target count N: one loopback server (benchmarks/path_fleet.py, its own process) serves N
targets on distinct paths (`/t/0/metrics` ...), every one the same realistic ~19 KB vLLM V1 page whose
counters advance once per interval. Started together:
  - the daemon: `python -m exporter.cli serve --config FILE`, the config naming only the listen
    address, JSON logs (to a file) and one deployment with the N URLs: online calibration, the
    alert loop and every other default as shipped;
  - a real Prometheus (Debian `prometheus`, 127.0.0.1, temp storage) scraping the same N paths.
Every interval the benchmark GETs the daemon's `/metrics` as Prometheus 2.42 would scrape it (its
Accept header, so OpenMetrics, and gzip), so the page is rendered as in production.

Measured, after a warm-up of at least WARMUP_SECONDS, over a WINDOW_SECONDS window placed between
two of the daemon's polls (so it holds three whole polls at 15 s): each process's CPU time
(utime + stime from /proc/PID/stat, all threads), the requests each made to the fleet in the window
(the fleet counts them by User-Agent), hence **daemon CPU per target-poll** and **Prometheus CPU per
scrape**; the daemon's `/metrics` GETs in the window (wall time, client side); both processes' peak
RSS (VmHWM); the load average before and after.

    .venv/bin/python benchmarks/scale.py [--targets 1000] [--runs 3] [--label NAME]
    .venv/bin/python benchmarks/scale.py --breakdown [--targets 1000] [--label NAME]
    .venv/bin/python benchmarks/scale.py --profile NAME [--targets 1000]

`--breakdown`: the daemon built in this process exactly as `serve` builds it (build_daemon,
start_serving), each poll listener timed, over the same window: where the CPU goes (poll, render,
online calibration, alert loop, other). `--profile NAME`: a process run with py-spy sampling the
daemon through the window; prints where the process's samples fall, by stage and by function, and
leaves it as profile_NAME.txt in the temp folder, not in results/; it records nothing else. Results:
results/scale.json under `process` (each run under its label), `breakdown`; results/scale.md quotes
them.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"
PROFILES = Path(tempfile.gettempdir())  # a profile is read, quoted, and left out of results/
INTERVAL_SECONDS = 15.0
WARMUP_SECONDS = 35.0
WINDOW_SECONDS = 45.0
CPU_TARGET_RATIO = 1.0  # the bar: the daemon process's CPU per target-poll at most Prometheus's per scrape
METRICS_LIMIT_SECONDS = 0.1  # the bar: /metrics served within 0.1 s at 1,000 targets
# What Prometheus 2.42 sends when it scrapes (scrape/scrape.go's acceptHeader): OpenMetrics first.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
SCRAPE_OFFSET_SECONDS = 10.0  # the benchmark scrapes the daemon this long after each of its polls starts

def machine() -> dict[str, object]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu_model": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "prometheus": _prometheus_version()}


def _prometheus_version() -> str:
    binary = shutil.which("prometheus")
    if not binary:
        return "not installed"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    return (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else "unknown"


def start_fleet(count: int, module: str = "benchmarks.fleet", *flags: str) -> tuple[subprocess.Popen[str], int]:
    """A fleet process (`module` run with --count and `flags`) and the port it printed when ready."""
    process = subprocess.Popen([sys.executable, "-m", module, "--count", str(count), *flags], cwd=REPO,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline() if process.stdout else ""
    if not line.startswith("ready "):
        process.kill()
        raise RuntimeError(f"{module} did not start: {line!r}")
    return process, int(line.split()[1])


def terminate(process: subprocess.Popen[Any], timeout_seconds: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_seconds`."""
    process.terminate()
    try:
        process.wait(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def stop(process: subprocess.Popen[str]) -> None:
    if process.stdin:
        process.stdin.close()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (utime + stime from /proc), all its threads: what the
    benchmarks weigh the daemon and Prometheus by."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_path_fleet(count: int, interval_seconds: float) -> tuple[subprocess.Popen[str], int]:
    return start_fleet(count, "benchmarks.path_fleet", "--interval", f"{interval_seconds:g}")


def fleet_counts(port: int) -> dict[str, Any]:
    answer: dict[str, Any] = requests.get(f"http://127.0.0.1:{port}/_counts", timeout=10).json()
    return answer


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return math.nan


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


class Prometheus:
    """A real Prometheus scraping `host:port` at each of `paths` every interval, on 127.0.0.1, temp storage."""

    def __init__(self, address: str, paths: list[str], interval_seconds: float) -> None:
        self.dir = tempfile.mkdtemp(prefix="stepbudget-bench-prom-")
        self.port = free_port()
        # One target group per path: the path as __metrics_path__, and an instance label of its
        # own (all share one address, so the default instance label would collide).
        groups = [{"targets": [address], "labels": {"__metrics_path__": path, "instance": f"t{index}"}}
                  for index, path in enumerate(paths)]
        config = {"global": {"scrape_interval": f"{interval_seconds:g}s",
                             "scrape_timeout": f"{min(10.0, interval_seconds):g}s"},
                  "scrape_configs": [{"job_name": "fleet", "static_configs": groups}]}
        Path(self.dir, "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.process = subprocess.Popen(
            [shutil.which("prometheus") or "prometheus", f"--config.file={self.dir}/prometheus.yml",
             f"--storage.tsdb.path={self.dir}/data", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                stderr = self.process.stderr.read()[-1000:] if self.process.stderr else ""
                raise RuntimeError(f"prometheus exited: {stderr}")
            try:
                if requests.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.2)

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.process.pid)

    def query(self, expression: str) -> float | None:
        answer = requests.get(f"{self.url}/api/v1/query", params={"query": expression}, timeout=10).json()
        result = answer.get("data", {}).get("result", [])
        return float(result[0]["value"][1]) if result else None

    def close(self) -> None:
        terminate(self.process)
        shutil.rmtree(self.dir, ignore_errors=True)


def daemon_config(urls: list[str], listen_port: int, interval_seconds: float) -> dict[str, Any]:
    """What a user writes for N static targets; every other key (online calibration, alerting,
    timeouts, the poll interval at 15 s) left at its default."""
    config: dict[str, Any] = {"listen": f"127.0.0.1:{listen_port}", "log_format": "json",
                              "deployments": [{"name": "fleet", "model": "qwen3-8b", "gpu": "h100-sxm",
                                               "targets": {"static": urls}}]}
    if interval_seconds != INTERVAL_SECONDS:
        config["poll_interval"] = f"{interval_seconds:g}s"
    return config


@dataclass
class Scrape:
    at_seconds: float
    wall_seconds: float
    gzip_bytes: int
    targets_up: int


class DaemonScraper:
    """GETs the daemon's /metrics as Prometheus would, SCRAPE_OFFSET_SECONDS after each poll starts."""

    def __init__(self, port: int, first_poll: float, interval_seconds: float) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.first_poll, self.interval = first_poll, interval_seconds
        self.scrapes: list[Scrape] = []
        self.cpu_seconds = 0.0  # this thread's own CPU (subtracted in the in-process breakdown)
        self._stop = threading.Event()
        self._session = requests.Session()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        due = self.first_poll + SCRAPE_OFFSET_SECONDS
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            started_cpu = time.thread_time()
            started = time.monotonic()
            try:
                response = self._session.get(self.url, timeout=30, stream=True,
                                             headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"})
                raw = response.raw.read()
                wall = time.monotonic() - started
                up = sum(1 for line in gzip.decompress(raw).splitlines()
                         if line.startswith(b"stepbudget_target_up{") and line.endswith(b" 1.0"))
                self.scrapes.append(Scrape(started, wall, len(raw), up))
            except requests.RequestException:
                pass
            self.cpu_seconds += time.thread_time() - started_cpu
            due += self.interval

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=35)
        self._session.close()


def wait_until(moment: float) -> None:
    while (left := moment - time.monotonic()) > 0:
        time.sleep(min(left, 1.0))


def window_after(first_poll: float, started: float, interval_seconds: float, warmup_seconds: float) -> float:
    """The window's start: half an interval after a poll's start (between two polls), at least the
    warm-up after the processes started."""
    k = math.ceil((started + warmup_seconds - first_poll) / interval_seconds - 0.5)
    return first_poll + (k + 0.5) * interval_seconds


def first_request(port: int, client: str, timeout_seconds: float = 60.0) -> float:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        first = fleet_counts(port)["first_request"].get(client)
        if first is not None:
            return float(first)
        time.sleep(0.1)
    raise RuntimeError(f"no request from {client} within {timeout_seconds:g}s")


@dataclass
class ProcessRow:
    targets: int
    window_seconds: float
    daemon_cpu_seconds: float
    daemon_fetches: int
    daemon_cpu_ms_per_target_poll: float
    prometheus_cpu_seconds: float | None
    prometheus_scrapes: int | None
    prometheus_cpu_ms_per_scrape: float | None
    ratio: float | None
    metrics_seconds_max: float
    metrics_seconds_median: float
    metrics_gzip_bytes: int
    metrics_targets_up: int
    daemon_peak_rss_mib: float
    prometheus_peak_rss_mib: float | None
    fleet_cpu_seconds: float
    daemon_log_lines: int
    load_before: str
    load_after: str
    scrape_walls: list[float] = field(default_factory=list)


def measure_process(count: int, *, interval_seconds: float, warmup_seconds: float, window_seconds: float,
                    with_prometheus: bool, profile: str | None = None) -> ProcessRow:
    fleet, port = start_path_fleet(count, interval_seconds)
    paths = [f"/t/{index}/metrics" for index in range(count)]
    urls = [f"http://127.0.0.1:{port}{path}" for path in paths]
    scratch = Path(tempfile.mkdtemp(prefix="stepbudget-bench-daemon-"))
    listen = free_port()
    (scratch / "config.yaml").write_text(json.dumps(daemon_config(urls, listen, interval_seconds)))
    log_path = scratch / "daemon.log"
    prometheus = daemon = scraper = spy = None
    try:
        load_before = load_average()
        started = time.monotonic()
        if with_prometheus and shutil.which("prometheus"):
            prometheus = Prometheus(f"127.0.0.1:{port}", paths, interval_seconds)
        with log_path.open("w") as log_file:
            daemon = subprocess.Popen([sys.executable, "-m", "exporter.cli", "serve", "--config",
                                       str(scratch / "config.yaml")], cwd=REPO, stdout=log_file, stderr=log_file)
        first_poll = first_request(port, "stepbudget")
        scraper = DaemonScraper(listen, first_poll, interval_seconds)
        window_start = window_after(first_poll, started, interval_seconds, warmup_seconds)
        wait_until(window_start)
        counts_before = fleet_counts(port)["requests"]
        daemon_cpu = process_cpu_seconds(daemon.pid)
        prometheus_cpu = prometheus.cpu_seconds() if prometheus else 0.0
        fleet_cpu = process_cpu_seconds(fleet.pid)
        if profile:
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(daemon.pid),
                                    "--duration", f"{window_seconds:g}", "--rate", "100", "--nonblocking", "--gil",
                                    "--format", "raw", "--output", str(PROFILES / f"profile_{profile}.raw")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(window_start + window_seconds)
        counts_after = fleet_counts(port)["requests"]
        daemon_cpu = process_cpu_seconds(daemon.pid) - daemon_cpu
        prometheus_cpu = prometheus.cpu_seconds() - prometheus_cpu if prometheus else 0.0
        fleet_cpu = process_cpu_seconds(fleet.pid) - fleet_cpu
        daemon_rss = peak_rss_mib(daemon.pid)
        prometheus_rss = peak_rss_mib(prometheus.process.pid) if prometheus else None
        load_after = load_average()
        if spy is not None:
            spy.wait(timeout=60)
    finally:
        if scraper is not None:
            scraper.close()
        if daemon is not None:
            terminate(daemon, 20.0)
        if prometheus is not None:
            prometheus.close()
        stop(fleet)
    log_lines = len(log_path.read_text().splitlines())
    shutil.rmtree(scratch, ignore_errors=True)
    fetches = counts_after.get("stepbudget", 0) - counts_before.get("stepbudget", 0)
    scrapes = counts_after.get("Prometheus", 0) - counts_before.get("Prometheus", 0) if prometheus else None
    in_window = [s for s in scraper.scrapes if window_start <= s.at_seconds < window_start + window_seconds]
    walls = [s.wall_seconds for s in in_window]
    daemon_ms = daemon_cpu * 1000 / fetches
    prometheus_ms = prometheus_cpu * 1000 / scrapes if scrapes else None
    return ProcessRow(
        targets=count, window_seconds=window_seconds, daemon_cpu_seconds=round(daemon_cpu, 2), daemon_fetches=fetches,
        daemon_cpu_ms_per_target_poll=round(daemon_ms, 3),
        prometheus_cpu_seconds=round(prometheus_cpu, 2) if prometheus else None, prometheus_scrapes=scrapes,
        prometheus_cpu_ms_per_scrape=round(prometheus_ms, 3) if prometheus_ms else None,
        ratio=round(daemon_ms / prometheus_ms, 2) if prometheus_ms else None,
        metrics_seconds_max=round(max(walls), 4) if walls else math.nan,
        metrics_seconds_median=round(statistics.median(walls), 4) if walls else math.nan,
        metrics_gzip_bytes=in_window[-1].gzip_bytes if in_window else 0,
        metrics_targets_up=in_window[-1].targets_up if in_window else 0,
        daemon_peak_rss_mib=daemon_rss, prometheus_peak_rss_mib=prometheus_rss,
        fleet_cpu_seconds=round(fleet_cpu, 2), daemon_log_lines=log_lines,
        load_before=load_before, load_after=load_after, scrape_walls=[round(w, 4) for w in walls])


# --- the in-process breakdown ------------------------------------------------------------------------


@dataclass
class BreakdownRow:
    targets: int
    polls: int
    process_cpu_seconds: float  # the whole process over the window, less the benchmark's own scraper
    poll_seconds: float  # poll_once less its listeners: discovery, fetch, read, windows, readings, logs
    render_seconds: float  # the page re-rendered after each poll (MetricsPage.refresh)
    calibration_seconds: float  # OnlineCalibrator.on_poll
    alert_loop_seconds: float  # AlertLoop.on_poll
    other_seconds: float  # the rest: HTTP server, scheduler, watchdog, GC outside the timed parts
    cpu_ms_per_target_poll: float


class _Timed:
    """A callable wrapped to add its CPU time (the whole process's, as serve's threads all count)
    to `totals[part]` while `active()`."""

    def __init__(self, part: str, function: Callable[..., Any], totals: dict[str, float],
                 active: Callable[[], bool]) -> None:
        self.part, self.function, self.totals, self.active = part, function, totals, active
        self.__qualname__ = getattr(function, "__qualname__", part)

    def __call__(self, *args: Any) -> Any:
        counting = self.active()
        started = time.process_time()
        try:
            return self.function(*args)
        finally:
            if counting:
                self.totals[self.part] += time.process_time() - started


def measure_breakdown(count: int, *, interval_seconds: float, warmup_seconds: float,
                      window_seconds: float) -> BreakdownRow:
    from exporter.logs import configure_logging
    from exporter.serve.config import config_from_mapping
    from exporter.serve.daemon import build_daemon, start_serving

    fleet, port = start_path_fleet(count, interval_seconds)
    urls = [f"http://127.0.0.1:{port}/t/{index}/metrics" for index in range(count)]
    config = config_from_mapping(daemon_config(urls, free_port(), interval_seconds))
    totals: dict[str, float] = collections.defaultdict(float)
    window: list[float] = []
    counting = lambda: bool(window) and window[0] <= time.monotonic() < window[0] + window_seconds  # noqa: E731
    polls = 0
    with open(os.devnull, "w") as sink:
        configure_logging(config.log_format, stream=sink)
        started = time.monotonic()
        daemon = build_daemon(config)
        start_serving(daemon)
        parts = {"on_poll": "calibration", "<lambda>": "render"}
        listeners = daemon.poller._listeners
        for index, listener in enumerate(listeners):
            owner = type(getattr(listener, "__self__", None)).__name__
            part = "alert_loop" if owner == "AlertLoop" else parts.get(getattr(listener, "__name__", ""), "other")
            listeners[index] = _Timed(part, listener, totals, counting)
        poll_once = daemon.poller.poll_once

        def timed_poll() -> Any:
            nonlocal polls
            polls += counting()
            return poll_once()

        daemon.poller.poll_once = _Timed("poll_total", timed_poll, totals, counting)  # type: ignore[method-assign]
        daemon.poller.start()
        scraper = None
        try:
            first_poll = first_request(port, "stepbudget")
            scraper = DaemonScraper(daemon.server.port, first_poll, interval_seconds)
            window.append(window_after(first_poll, started, interval_seconds, warmup_seconds))
            wait_until(window[0])
            cpu, scraper_cpu = time.process_time(), scraper.cpu_seconds
            wait_until(window[0] + window_seconds)
            cpu = time.process_time() - cpu - (scraper.cpu_seconds - scraper_cpu)
        finally:
            if scraper is not None:
                scraper.close()
            daemon.poller.stop()
            daemon.server.stop()
            daemon.fetcher.close()
            stop(fleet)
    listened = totals["render"] + totals["calibration"] + totals["alert_loop"] + totals["other"]
    poll = totals["poll_total"] - listened
    return BreakdownRow(targets=count, polls=polls, process_cpu_seconds=round(cpu, 3), poll_seconds=round(poll, 3),
                        render_seconds=round(totals["render"], 3), calibration_seconds=round(totals["calibration"], 3),
                        alert_loop_seconds=round(totals["alert_loop"], 3),
                        other_seconds=round(cpu - totals["poll_total"] + totals["other"], 3),
                        cpu_ms_per_target_poll=round(cpu * 1000 / max(1, polls * count), 3))


# --- the profile --------------------------------------------------------------------------------------

STAGES = (  # (stage, a frame that puts a sample in it), first match wins, innermost listener first
    ("render", "refresh (exporter/serve/server.py"),
    ("render", "_metrics (exporter/serve/server.py"),
    ("online calibration", "(exporter/serve/online_calibration.py"),
    ("alert loop", "on_poll (exporter/serve/alerting.py"),
    ("poll: fetch", "_fetch (exporter/serve/fetch.py"),
    ("poll: read page", "read_page (exporter/serve/engines/__init__.py"),
    ("poll: window and reading", "_succeeded (exporter/serve/poller.py"),
    ("poll: rest", "poll_once (exporter/serve/poller.py"),
    ("HTTP server", "(http/server.py"),
    ("HTTP server", "(socketserver.py"),
)


def summarize_profile(raw: Path, header: str) -> str:
    """py-spy's collapsed stacks -> shares by stage, by own time and by inclusive time."""
    stages: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    prefixes = (str(REPO) + "/", sys.prefix + "/lib/python3.11/site-packages/", sys.base_prefix + "/lib/python3.11/")
    for line in raw.read_text().splitlines():
        stack, _, number = line.rpartition(" ")
        if not number.isdigit():
            continue
        samples = int(number)
        for prefix in prefixes:
            stack = stack.replace(prefix, "")
        frames = stack.split(";")
        total += samples
        stage = next((name for name, marker in STAGES if any(marker in frame for frame in frames)), "other")
        stages[stage] += samples
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    lines = [header, "", f"{total} samples (100 per second, of the thread holding the GIL)", "", "By stage:"]
    lines += [f"  {count / total:6.1%}  {name}" for name, count in stages.most_common()]
    lines += ["", "Own time (top 40):"]
    lines += [f"  {count / total:6.1%}  {frame}" for frame, count in own.most_common(40)]
    lines += ["", "Inclusive (top 40):"]
    lines += [f"  {count / total:6.1%}  {frame}" for frame, count in inclusive.most_common(40)]
    return "\n".join(lines) + "\n"


# --- output -------------------------------------------------------------------------------------------


def process_table(rows: list[ProcessRow]) -> str:
    lines = ["| targets | daemon CPU s (window) | daemon fetches | daemon CPU ms / target-poll | Prometheus CPU s | "
             "Prometheus scrapes | Prometheus CPU ms / scrape | ratio | /metrics s max (median) | "
             "daemon peak RSS MiB | Prometheus peak RSS MiB | up | load before -> after |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.targets:,} | {r.daemon_cpu_seconds} | {r.daemon_fetches:,} | "
                     f"**{r.daemon_cpu_ms_per_target_poll}** | {r.prometheus_cpu_seconds} | "
                     f"{r.prometheus_scrapes:,} | **{r.prometheus_cpu_ms_per_scrape}** | **{r.ratio}** | "
                     f"{r.metrics_seconds_max} ({r.metrics_seconds_median}) | {r.daemon_peak_rss_mib} | "
                     f"{r.prometheus_peak_rss_mib} | {r.metrics_targets_up:,} | {r.load_before} -> {r.load_after} |"
                     if r.prometheus_scrapes is not None else
                     f"| {r.targets:,} | {r.daemon_cpu_seconds} | {r.daemon_fetches:,} | "
                     f"{r.daemon_cpu_ms_per_target_poll} | - | - | - | - | {r.metrics_seconds_max} "
                     f"({r.metrics_seconds_median}) | {r.daemon_peak_rss_mib} | - | {r.metrics_targets_up:,} | "
                     f"{r.load_before} -> {r.load_after} |")
    return "\n".join(lines)


def breakdown_table(rows: list[BreakdownRow]) -> str:
    lines = ["| targets | polls | process CPU s | poll | render | online calibration | alert loop | other | "
             "CPU ms / target-poll |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        shares = [f"{seconds} s ({seconds / r.process_cpu_seconds:.0%})" for seconds in
                  (r.poll_seconds, r.render_seconds, r.calibration_seconds, r.alert_loop_seconds, r.other_seconds)]
        lines.append(f"| {r.targets:,} | {r.polls} | {r.process_cpu_seconds} | {' | '.join(shares)} | "
                     f"{r.cpu_ms_per_target_poll} |")
    return "\n".join(lines)


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "exporter"], cwd=REPO, capture_output=True,
                           text=True, check=False).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default="1000", help="comma-separated target counts")
    parser.add_argument("--runs", type=int, default=1, help="process runs per target count")
    parser.add_argument("--breakdown", action="store_true", help="the in-process breakdown instead of process runs")
    parser.add_argument("--profile", metavar="NAME",
                        help="py-spy the daemon process: profile_NAME.txt in the temp folder")
    parser.add_argument("--no-prometheus", action="store_true", help="no Prometheus beside the daemon")
    parser.add_argument("--interval", type=float, default=INTERVAL_SECONDS, help="seconds between polls (and scrapes)")
    parser.add_argument("--warmup", type=float, default=WARMUP_SECONDS, help="seconds before the window, at least")
    parser.add_argument("--window", type=float, default=WINDOW_SECONDS, help="seconds measured")
    parser.add_argument("--label", default="latest", help="name of this run in scale.json")
    args = parser.parse_args(argv)
    counts = [int(part) for part in args.targets.split(",")]
    timing = {"interval_seconds": args.interval, "warmup_seconds": args.warmup, "window_seconds": args.window}
    info = {**machine(), "commit": commit()}
    if args.breakdown:
        breakdown = []
        for count in counts:
            print(f"{count} targets (in-process breakdown) ...", file=sys.stderr)
            breakdown.append(measure_breakdown(count, **timing))
            print(f"  {asdict(breakdown[-1])}", file=sys.stderr)
        record("breakdown", args.label, {"machine": info, **timing, "rows": [asdict(r) for r in breakdown]})
        print(f"\n{args.label}: {info}\n" + breakdown_table(breakdown))
        return 0
    if args.profile:
        row = measure_process(counts[0], **timing, with_prometheus=not args.no_prometheus, profile=args.profile)
        raw = PROFILES / f"profile_{args.profile}.raw"
        header = (f"py-spy (--gil --nonblocking, 100 Hz: the thread holding the GIL) of the `stepbudget serve` "
                  f"process over the {args.window:g} s window at {counts[0]:,} targets, Prometheus beside it; "
                  f"commit {info['commit']}; "
                  f"{info['cpu_model']}, {info['cores']} cores, Python {info['python']}; daemon CPU in the window "
                  f"{row.daemon_cpu_seconds} s ({row.daemon_cpu_ms_per_target_poll} ms per target-poll, "
                  f"ratio {row.ratio}, inflated by the sampling)")
        path = PROFILES / f"profile_{args.profile}.txt"
        summary = summarize_profile(raw, header)
        path.write_text(summary)
        raw.unlink()
        print(summary + f"\n(also in {path})")
        return 0
    rows = []
    for count in counts:
        for run in range(args.runs):
            print(f"{count} targets, run {run + 1}/{args.runs} (load {load_average()}) ...", file=sys.stderr)
            rows.append(measure_process(count, **timing, with_prometheus=not args.no_prometheus))
            print(f"  {asdict(rows[-1])}", file=sys.stderr)
    record("process", args.label, {"machine": info, **timing, "rows": [asdict(r) for r in rows]})
    print(f"\n{args.label}: {info}\n" + process_table(rows))
    return 0


def record(kind: str, label: str, run: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "scale.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    run["recorded_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs.setdefault(kind, {})[label] = run
    path.write_text(json.dumps(runs, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
