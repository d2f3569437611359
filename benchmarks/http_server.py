"""What the guarded HTTP server (uvicorn + exporter/serve/guarded_http.py) costs on /metrics, against the
http.server one it replaced (exporter/serve/server.py as committed at `--before-ref`, default HEAD).

The page is cached (a registry with a generation, as the daemon's), so what is measured is serving it:
per request, the server process's CPU (time.process_time of this process, which runs only the server;
the client is a separate process) and the latency the client sees. Pages of 100 and 1,000 targets'
worth of series (30 families x 4 labels a target: ~0.3 and ~3 MB, as benchmarks/results/resources.md
measured the daemon's), plain and gzip, on one keep-alive connection, and /-/healthy for the fixed
per-request cost. Each server is measured in turn on the same machine, `--rounds` times, the best
round kept (other engineers' work shares the 2 cores).

    .venv/bin/python benchmarks/http_server.py [--rounds 3]

Writes benchmarks/results/http_server.json and prints the table benchmarks/results/http_server.md quotes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.serve import server as server_now
from exporter.serve.collector import PageRegistry

RESULTS = REPO / "benchmarks" / "results"
FAMILIES = 30
CASES = (  # (name, path, targets, accept-encoding, requests)
    ("healthy", "/-/healthy", 100, "identity", 3000),
    ("metrics 100 targets", "/metrics", 100, "identity", 400),
    ("metrics 100 targets gzip", "/metrics", 100, "gzip", 400),
    ("metrics 1,000 targets", "/metrics", 1000, "identity", 100),
    ("metrics 1,000 targets gzip", "/metrics", 1000, "gzip", 100),
)


class FleetPage(Collector):
    """FAMILIES gauges per target, labelled as the daemon labels them; one generation: rendered once."""

    def __init__(self, targets: int) -> None:
        self.targets = targets

    def describe(self) -> Iterable[Metric]:
        return []

    def generation(self) -> int:
        return self.targets

    def collect(self) -> Iterator[Metric]:
        for number in range(FAMILIES):
            family = GaugeMetricFamily(f"stepbudget_bench_value_{number}", "a benchmark series",
                                       labels=["deployment", "target", "model_name", "engine"])
            for index in range(self.targets):
                family.add_metric(["chat", f"10.0.{index // 250}.{index % 250}:8000", "Qwen/Qwen3-8B", "0"],
                                  index * 1.5 + number)
            yield family


def server_before(ref: str) -> ModuleType:
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:exporter/serve/server.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "server_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("server_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


CLIENT = r"""
import http.client, json, sys, time
port, path, encoding, count = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
seconds, size = [], 0
for _ in range(5):  # warm-up: the first render and the connection
    connection.request("GET", path, headers={"Accept-Encoding": encoding}); connection.getresponse().read()
print("go", flush=True); sys.stdin.readline()
for _ in range(count):
    started = time.perf_counter()
    connection.request("GET", path, headers={"Accept-Encoding": encoding})
    answer = connection.getresponse(); size = len(answer.read())
    seconds.append(time.perf_counter() - started)
connection.close()
print(json.dumps({"seconds": seconds, "bytes": size}), flush=True)
"""


def measure(module: ModuleType, path: str, targets: int, encoding: str, count: int) -> dict[str, Any]:
    registry = PageRegistry()
    registry.register(FleetPage(targets))
    server = module.StepBudgetServer("127.0.0.1", 0, registry, ready=lambda: True)
    server.start()
    try:
        client = subprocess.Popen([sys.executable, "-c", CLIENT, str(server.port), path, encoding, str(count)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert client.stdout is not None and client.stdin is not None
            assert client.stdout.readline().strip() == "go"
            cpu = time.process_time()
            client.stdin.write("\n")
            client.stdin.flush()
            result = json.loads(client.stdout.readline())
            cpu = time.process_time() - cpu
        finally:
            if client.poll() is None:
                client.kill()
            client.wait(timeout=10)
    finally:
        server.stop()
    seconds = sorted(result["seconds"])
    return {"requests": count, "bytes": result["bytes"], "server_cpu_ms_per_request": 1000 * cpu / count,
            "p50_ms": 1000 * statistics.median(seconds), "p99_ms": 1000 * seconds[int(0.99 * (len(seconds) - 1))],
            "mean_ms": 1000 * statistics.fmean(seconds)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before-ref", default="HEAD")
    args = parser.parse_args(argv)
    servers = {"http.server (before)": server_before(args.before_ref), "uvicorn, guarded (now)": server_now}
    rows: list[dict[str, Any]] = []
    for name, path, targets, encoding, count in CASES:
        for label, module in servers.items():
            rounds = [measure(module, path, targets, encoding, count) for _ in range(args.rounds)]
            best = min(rounds, key=lambda r: r["server_cpu_ms_per_request"])
            row = {"case": name, "server": label, **best,
                   "p50_ms_best": min(r["p50_ms"] for r in rounds)}
            rows.append(row)
            print(f"{name:28} {label:24} {row['bytes']:>9,} B  cpu {row['server_cpu_ms_per_request']:7.3f} ms  "
                  f"p50 {row['p50_ms_best']:7.3f} ms  p99 {row['p99_ms']:7.3f} ms", flush=True)
    (RESULTS / "http_server.json").write_text(json.dumps({
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "before_ref": args.before_ref, "rounds": args.rounds, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
