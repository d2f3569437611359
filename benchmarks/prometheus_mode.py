"""`targets.prometheus` at fleet sizes one machine can hold: a real Prometheus holding N engines'
series (backfilled with `promtool tsdb create-blocks-from openmetrics`), the daemon reading them.

Per N: two scrapes 15 s apart of every engine's full vLLM page (benchmarks/fleet.py's PageBook:
the simulator's renderer, ~230 samples, `_created` series left out), labelled as a Kubernetes
scrape labels them (job, instance, namespace, pod), plus each engine's `up`, written as OpenMetrics
and backfilled into a fresh TSDB; Prometheus 2.42 (127.0.0.1, no scrape jobs, lookback 1h so the
backfilled samples answer instant queries) serves them. The daemon's own Poller with one
PrometheusSource polls `cycles` times. Measured per cycle: wall time, the daemon's CPU (this
process, all threads), Prometheus's CPU (utime+stime from /proc), the answer's bytes; then peak RSS
of both processes, and whether every engine came back up with the page's tokens in flight.

    .venv/bin/python benchmarks/prometheus_mode.py [--engines 1000,5000,10000] [--cycles 3]

Writes benchmarks/results/prometheus_mode.json and prints the table benchmarks/results/prometheus_mode.md quotes.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.scale import free_port, machine, process_cpu_seconds

RESULTS = REPO / "benchmarks" / "results"
SCRAPE_SECONDS = 15.0


@dataclass
class Row:
    engines: int
    series_per_engine: int
    backfill_seconds: float
    prometheus_ready_seconds: float
    cycles: int
    poll_wall_seconds: float  # median over the cycles
    daemon_cpu_seconds: float  # median per cycle
    daemon_cpu_ms_per_engine: float
    prometheus_cpu_seconds: float  # median per cycle: the query's cost on the query path
    answer_bytes: int
    answered_series: int
    engines_up: int
    tokens_in_flight_agree: bool
    daemon_peak_rss_mib: float
    prometheus_rss_mib: float


def openmetrics(engines: int, start: float) -> tuple[str, int]:
    """Two scrapes of `engines` pages as OpenMetrics text (scrape 0 of all, then scrape 1), and the
    series per engine. Labels go after the page's own, as a scrape appends them."""
    from benchmarks.fleet import PageBook

    book = PageBook()
    lines: list[str] = []
    series = 0
    for scrape in (0, 1):
        at = start + scrape * SCRAPE_SECONDS
        samples = [line for line in book.page(scrape).decode().splitlines()
                   if line and not line.startswith("#") and "_created" not in line.split(" ", 1)[0].split("{", 1)[0]]
        series = len(samples) + 1
        for engine in range(engines):
            target = (f'instance="10.{engine // 62500}.{engine // 250 % 250}.{engine % 250}:8000",job="vllm",'
                      f'namespace="llm",pod="vllm-{engine}"')
            lines.append(f"up{{{target}}} 1 {at:.3f}")
            for sample in samples:
                name_labels, value = sample.rsplit(" ", 1)
                if "{" in name_labels:
                    lines.append(f"{name_labels[:-1]},{target}}} {value} {at:.3f}")
                else:
                    lines.append(f"{name_labels}{{{target}}} {value} {at:.3f}")
    lines.append("# EOF")
    return "\n".join(lines) + "\n", series


def backfill(promtool: str, text: str, data: Path) -> float:
    started = time.monotonic()
    source = data.parent / "backfill.om"
    source.write_text(text)
    subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(source), str(data)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    source.unlink()
    return time.monotonic() - started


def start_prometheus(binary: str, directory: Path, port: int) -> subprocess.Popen[bytes]:
    (directory / "prometheus.yml").write_text("global: {scrape_interval: 15s}\nscrape_configs: []\n")
    return subprocess.Popen(
        [binary, f"--config.file={directory / 'prometheus.yml'}", f"--storage.tsdb.path={directory / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--query.lookback-delta=1h", "--storage.tsdb.retention.time=30d"],
        stdout=subprocess.DEVNULL, stderr=(directory / "prometheus.log").open("w"))


def wait_ready(base: str, timeout: float = 600.0) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if requests.get(f"{base}/-/ready", timeout=2).status_code == 200:
                return time.monotonic() - started
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError("prometheus not ready")


def process_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class FreshSource:
    """A new PrometheusSource per poll: the backfilled series never get a newer scrape, and a
    source that has read a scrape skips it (rightly); each cycle must do the whole read."""

    def __init__(self, deployment: Any, stale_after_seconds: float) -> None:
        self.deployment = deployment
        self.stale_after_seconds = stale_after_seconds
        self.answer_bytes = 0
        self.answered_series = 0

    def read(self) -> Any:
        from exporter.serve.prometheus_source import PrometheusSource

        source = PrometheusSource(self.deployment, timeout_seconds=120.0, stale_after_seconds=self.stale_after_seconds)
        try:
            return source.read()
        finally:
            source.close()


def answer_size(base: str, query: str) -> tuple[int, int]:
    response = requests.post(f"{base}/api/v1/query", data={"query": query}, timeout=300)
    return len(response.content), len(response.json()["data"]["result"])


def measure(engines: int, cycles: int, prometheus: str, promtool: str) -> Row:
    from benchmarks.fleet import PageBook
    from exporter.serve.config import config_from_mapping
    from exporter.serve.discovery import Discovery
    from exporter.serve.engines import read_page, wanted_names
    from exporter.serve.poller import Poller
    from exporter.serve.prometheus_source import series_query

    directory = Path(tempfile.mkdtemp(prefix="stepbudget-prommode-"))
    process = None
    try:
        text, per_engine = openmetrics(engines, time.time() - 900)
        backfill_seconds = backfill(promtool, text, directory / "data")
        del text
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        process = start_prometheus(prometheus, directory, port)
        ready = wait_ready(base)
        config = config_from_mapping({
            "poll_interval": "15s", "timeout": "120s", "stale_after": "2h",
            "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "engine": "vllm",
                             "targets": {"prometheus": {"url": base, "selector": 'job="vllm"',
                                                        "max_response_bytes": "4GiB"}}}]})
        (deployment,) = config.deployments
        poller = Poller(config, Discovery(config.deployments, timeout_seconds=5.0), fetch=lambda *a, **k: "",
                        sources=[FreshSource(deployment, config.stale_after_seconds)])
        walls, cpus, prom_cpus = [], [], []
        for _ in range(cycles):
            cpu0, wall0, prom0 = time.process_time(), time.monotonic(), process_cpu_seconds(process.pid)
            poller.poll_once()
            walls.append(time.monotonic() - wall0)
            cpus.append(time.process_time() - cpu0)
            prom_cpus.append(process_cpu_seconds(process.pid) - prom0)
        readings = poller.readings()
        expected = read_page(PageBook().page(1).decode(), "vllm").snapshots[0]
        expected_tokens = expected.kv_cache_usage_ratio * expected.kv_cache_capacity_tokens
        up = [r for r in readings if r.target_up]
        agree = len(up) == engines and all(abs(r.tokens_in_flight - expected_tokens) < 1e-6 * expected_tokens
                                           for r in up)
        answer_bytes, answered = answer_size(base, series_query(wanted_names("vllm"), 'job="vllm"'))
        prom_rss = process_rss_mib(process.pid)
        poller.stop()
        return Row(engines, per_engine, round(backfill_seconds, 1), round(ready, 1), cycles,
                   round(_median(walls), 3), round(_median(cpus), 3), round(_median(cpus) / engines * 1000, 3),
                   round(_median(prom_cpus), 3), answer_bytes, answered, len(up), agree,
                   round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), round(prom_rss, 1))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
        shutil.rmtree(directory, ignore_errors=True)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def table(rows: list[Row]) -> str:
    lines = ["| engines | series/engine | answer MB (series) | poll wall s | daemon CPU s (ms/engine) | "
             "Prometheus CPU s / query | engines up, tokens agree | daemon peak RSS MiB | Prometheus RSS MiB | "
             "backfill s |",
             "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.engines:,} | {r.series_per_engine} | {r.answer_bytes / 1e6:.1f} ({r.answered_series:,}) | "
                     f"{r.poll_wall_seconds} | {r.daemon_cpu_seconds} ({r.daemon_cpu_ms_per_engine}) | "
                     f"{r.prometheus_cpu_seconds} | {r.engines_up:,}, {'yes' if r.tokens_in_flight_agree else 'NO'} | "
                     f"{r.daemon_peak_rss_mib} | {r.prometheus_rss_mib} | {r.backfill_seconds} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="1000,5000,10000")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if not prometheus or not promtool:
        print("needs prometheus and promtool on PATH (make tools)", file=sys.stderr)
        return 2
    import logging

    import structlog

    # One engine_detected line per engine would time the terminal, not the daemon.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    rows = []
    for engines in [int(n) for n in args.engines.split(",")]:
        rows.append(measure(engines, args.cycles, prometheus, promtool))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        document = {"machine": machine(), "rows": [asdict(row) for row in rows]}
        (RESULTS / "prometheus_mode.json").write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
