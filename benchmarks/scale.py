"""One daemon against a fleet of 100, 500 and 1,000 vLLM-like targets, beside a real Prometheus.

For each target count: a fleet process (benchmarks/fleet.py: realistic ~26 KB vLLM pages whose
counters advance, one asyncio thread, every target its own 127.0.x.y address) and, in this process,
the daemon's own poller, collector and HTTP server, polled every 15 s as `serve` would. Measured:
CPU seconds per poll cycle (this process's CPU time, all threads), wall time to poll every target,
time to serve `/metrics` (a real GET), peak RSS. A real Prometheus (Debian `prometheus`, 127.0.0.1,
temp storage, the same scrape interval) scrapes the same pages; its mean `scrape_duration_seconds`
and its own CPU per scrape sit beside the daemon's CPU per target, as ratios.

    .venv/bin/python benchmarks/scale.py [--targets 100,500,1000] [--cycles 4] [--profile NAME]

Writes benchmarks/results/scale.json (under --label) and prints the table that
benchmarks/results/scale.md quotes; --profile NAME writes results/profile_NAME.txt (cProfile of one
serial pass over every target) and results/profile_NAME_metrics.txt (one /metrics render) instead.
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import os
import platform
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"
INTERVAL_SECONDS = 15.0
CPU_TARGET_RATIO = 1.0  # issue 14: the daemon's CPU per target-poll at most Prometheus's per scrape of the same page
METRICS_LIMIT_SECONDS = 0.1  # issue 14: /metrics served within 0.1 s at 1,000 targets
METRICS_PROFILE = cProfile.Profile()


@dataclass
class Row:
    targets: int
    cycles: int
    cpu_seconds_per_cycle: float
    cpu_ms_per_target: float
    poll_wall_seconds: float
    metrics_serve_seconds: float
    metrics_render_cpu_ms_per_target: float  # inside the cycle: the page re-rendered once per poll
    metrics_cold_render_seconds: float  # one render + gzip from scratch (what each scrape cost before)
    metrics_bytes: int
    peak_rss_mib: float
    targets_up: int
    page_bytes: int
    prometheus_scrape_ms: float | None
    prometheus_cpu_ms_per_scrape: float | None
    ratio_to_scrape_duration: float | None
    ratio_to_prometheus_cpu: float | None


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


def start_fleet(count: int) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen([sys.executable, "-m", "benchmarks.fleet", "--count", str(count)], cwd=REPO,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline() if process.stdout else ""
    if not line.startswith("ready "):
        process.kill()
        raise RuntimeError(f"fleet did not start: {line!r}")
    return process, int(line.split()[1])


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


class Prometheus:
    """A real Prometheus scraping the fleet every INTERVAL_SECONDS, on 127.0.0.1, temp storage."""

    def __init__(self, urls: list[str], interval_seconds: float) -> None:
        self.dir = tempfile.mkdtemp(prefix="stepbudget-bench-prom-")
        self.port = free_port()
        hosts = [url.split("/")[2] for url in urls]
        config = {"global": {"scrape_interval": f"{interval_seconds:g}s",
                             "scrape_timeout": f"{min(10.0, interval_seconds):g}s"},
                  "scrape_configs": [{"job_name": "fleet", "static_configs": [{"targets": hosts}]}]}
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
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def measure(count: int, cycles: int, profile: cProfile.Profile | None, with_prometheus: bool,
            interval_seconds: float = INTERVAL_SECONDS) -> Row:
    from benchmarks.fleet import address_of
    from exporter.serve.collector import make_registry
    from exporter.serve.config import config_from_mapping
    from exporter.serve.discovery import Discovery
    from exporter.serve.exposition_writer import render_text
    from exporter.serve.poller import HttpFetcher, Poller
    from exporter.serve.server import GZIP_LEVEL, StepBudgetServer

    fleet, port = start_fleet(count)
    urls = [f"http://{address_of(i)}:{port}/metrics" for i in range(count)]
    page_bytes = len(requests.get(urls[0], timeout=5).content)
    prometheus = Prometheus(urls, interval_seconds) if with_prometheus and shutil.which("prometheus") else None
    config = config_from_mapping({"poll_interval": f"{interval_seconds:g}s", "timeout": "10s", "log_format": "json",
                                  "deployments": [{"name": "fleet", "model": "qwen3-8b", "gpu": "h100-sxm",
                                                   "targets": {"static": urls}}]})
    fetcher = HttpFetcher(config.timeout_seconds, config.max_response_bytes)
    poller = Poller(config, Discovery(config.deployments, timeout_seconds=5.0), fetcher)
    registry = make_registry(poller.readings, config.deployments)
    server = StepBudgetServer("127.0.0.1", 0, registry, ready=lambda: poller.ready, targets=lambda: [])
    render_cpu: list[float] = []

    def refresh(result: object) -> None:
        """As `serve` wires it (exporter/serve/daemon.py): the served formats re-rendered after each poll."""
        started = time.process_time()
        server.metrics_page.refresh()
        render_cpu.append(time.process_time() - started)

    poller.add_listener(refresh)
    server.start()
    cpu: list[float] = []
    wall: list[float] = []
    serve: list[float] = []
    size = up = 0
    prom_cpu_start = prometheus.cpu_seconds() if prometheus else 0.0
    measured_from = time.monotonic()
    try:
        for cycle in range(cycles + 1):  # the first cycle opens connections: warm-up, not counted
            started, cpu_started = time.monotonic(), time.process_time()
            result = poller.poll_once()
            if cycle > 0:
                wall.append(time.monotonic() - started)
                cpu.append(time.process_time() - cpu_started)
            up = sum(1 for reading in result.readings if reading.target_up)
            served = time.monotonic()
            body = requests.get(f"http://127.0.0.1:{server.port}/metrics", timeout=30).content
            if cycle > 0:
                serve.append(time.monotonic() - served)
            size = len(body)
            time.sleep(max(0.0, interval_seconds - (time.monotonic() - started)))
        cold = time.monotonic()
        gzip.compress(render_text(registry), compresslevel=GZIP_LEVEL)  # what the page renders
        cold_render = time.monotonic() - cold
        if profile is not None:
            # cProfile sees one thread: the same per-target work, serially, in this thread.
            targets = poller._discovery.discover()
            profile.enable()
            for target in targets:
                poller._poll_target(target, None)  # the fleet needs no bearer token
            profile.disable()
            METRICS_PROFILE.enable()
            render_text(registry)  # what GET /metrics renders (text format)
            METRICS_PROFILE.disable()
        prom_scrape = prom_cpu = None
        if prometheus:
            elapsed = time.monotonic() - measured_from
            scrapes = prometheus.query('sum(count_over_time(scrape_duration_seconds{job="fleet"}[10m]))') or 0
            mean = prometheus.query('avg(avg_over_time(scrape_duration_seconds{job="fleet"}[10m]))')
            prom_scrape = mean * 1000 if mean is not None else None
            prom_cpu = (prometheus.cpu_seconds() - prom_cpu_start) * 1000 / scrapes if scrapes else None
            print(f"  prometheus: {scrapes:.0f} scrapes over {elapsed:.0f}s", file=sys.stderr)
    finally:
        server.stop()
        poller.stop()
        fetcher.close()
        if prometheus:
            prometheus.close()
        stop(fleet)
    cpu_per_target_ms = statistics.median(cpu) * 1000 / count
    return Row(
        targets=count, cycles=cycles, cpu_seconds_per_cycle=round(statistics.median(cpu), 3),
        cpu_ms_per_target=round(cpu_per_target_ms, 3), poll_wall_seconds=round(statistics.median(wall), 3),
        metrics_serve_seconds=round(statistics.median(serve), 4),
        metrics_render_cpu_ms_per_target=round(statistics.median(render_cpu[1:]) * 1000 / count, 3),
        metrics_cold_render_seconds=round(cold_render, 4), metrics_bytes=size,
        peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), targets_up=up,
        page_bytes=page_bytes, prometheus_scrape_ms=round(prom_scrape, 3) if prom_scrape else None,
        prometheus_cpu_ms_per_scrape=round(prom_cpu, 3) if prom_cpu else None,
        ratio_to_scrape_duration=round(cpu_per_target_ms / prom_scrape, 2) if prom_scrape else None,
        ratio_to_prometheus_cpu=round(cpu_per_target_ms / prom_cpu, 2) if prom_cpu else None,
    )


def write_profile(profile: cProfile.Profile, name: str, header: str) -> Path:
    """Cumulative and own-time top lists, paths made relative so the file reads the same anywhere."""
    stream = io.StringIO()
    stats = pstats.Stats(profile, stream=stream)
    stats.sort_stats("cumulative").print_stats(35)
    stats.sort_stats("tottime").print_stats(25)
    path = RESULTS / f"profile_{name}.txt"
    text = stream.getvalue().replace(str(REPO) + "/", "").replace(sys.prefix + "/", "")
    path.write_text(header + "\n" + text)
    return path


def table(rows: list[Row]) -> str:
    lines = ["| targets | CPU s / cycle | CPU ms / target | of which /metrics render | poll wall s | "
             "/metrics s (bytes) | cold render + gzip s | peak RSS MiB | Prometheus scrape ms | "
             "Prometheus CPU ms / scrape | "
             "ratio (CPU / scrape) | ratio (CPU / Prom CPU) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.targets} ({r.targets_up} up) | {r.cpu_seconds_per_cycle} | {r.cpu_ms_per_target} | "
                     f"{r.metrics_render_cpu_ms_per_target} | {r.poll_wall_seconds} | "
                     f"{r.metrics_serve_seconds} ({r.metrics_bytes:,}) | {r.metrics_cold_render_seconds} | "
                     f"{r.peak_rss_mib} | "
                     f"{r.prometheus_scrape_ms} | {r.prometheus_cpu_ms_per_scrape} | {r.ratio_to_scrape_duration} | "
                     f"{r.ratio_to_prometheus_cpu} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default="100,500,1000", help="comma-separated target counts")
    parser.add_argument("--cycles", type=int, default=4,
                        help="measured poll cycles per target count (after one warm-up)")
    parser.add_argument("--profile", metavar="NAME", help="write results/profile_NAME.txt (cProfile of the polls)")
    parser.add_argument("--no-prometheus", action="store_true", help="skip the real Prometheus beside the daemon")
    parser.add_argument("--interval", type=float, default=INTERVAL_SECONDS, help="seconds between polls (and scrapes)")
    parser.add_argument("--label", default="after", help="name of this run in scale.json (before/after)")
    args = parser.parse_args(argv)
    counts = [int(part) for part in args.targets.split(",")]
    profile = cProfile.Profile() if args.profile else None
    rows = []
    for count in counts:
        print(f"{count} targets ...", file=sys.stderr)
        rows.append(measure(count, args.cycles, profile, not args.no_prometheus, args.interval))
        print(f"  {asdict(rows[-1])}", file=sys.stderr)
    info = machine()
    if profile is not None:
        header = (f"cProfile of one serial pass over every target after {args.cycles} poll cycles at "
                  f"{', '.join(map(str, counts))} targets ({args.label}); "
                  f"{info['cpu_model']}, {info['cores']} cores, Python {info['python']}")
        print(f"wrote {write_profile(profile, args.profile, header)}", file=sys.stderr)
        metrics_header = header.replace("one serial pass over every target", "rendering /metrics once")
        print(f"wrote {write_profile(METRICS_PROFILE, args.profile + '_metrics', metrics_header)}", file=sys.stderr)
        return 0  # a profiled run's timings are inflated by the profiler: not recorded as results
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "scale.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[args.label] = {"machine": info, "interval_seconds": args.interval, "rows": [asdict(r) for r in rows],
                        "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.write_text(json.dumps(runs, indent=2) + "\n")
    print(f"\n{args.label}: {info}\n" + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
