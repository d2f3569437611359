"""The daemon's own process (`stepbudget serve`) against 100 and 1,000 simulated targets: RSS and CPU.

What the chart's default `resources` come from. For each target count: a fleet process
(benchmarks/fleet.py, realistic vLLM pages on loopback) and a real `stepbudget serve` with a
config listing every target, polling every 15 s as in production. After one warm-up poll, the
daemon's CPU time (utime + stime from /proc/PID/stat) is read over `--cycles` polls, and its
RSS (VmRSS now, VmHWM the peak) at the end; /metrics is fetched once a cycle as Prometheus would.

    .venv/bin/python benchmarks/resources.py [--targets 100,1000] [--cycles 3]

Writes benchmarks/results/resources.json and prints the table benchmarks/results/resources.md quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.fleet import address_of
from benchmarks.scale import free_port, process_cpu_seconds, start_fleet, stop

RESULTS = REPO / "benchmarks" / "results"
INTERVAL_SECONDS = 15.0


def _status_kib(pid: int, key: str) -> int:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    line = next(text for text in lines if text.startswith(key + ":"))
    return int(line.split()[1])


def measure(count: int, cycles: int) -> dict:
    fleet, fleet_port = start_fleet(count)
    port = free_port()
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "config.yaml"
        config.write_text(yaml.safe_dump({
            "listen": f"127.0.0.1:{port}", "poll_interval": f"{INTERVAL_SECONDS:g}s", "log_format": "json",
            "deployments": [{"name": "bench", "model": "qwen3-8b", "gpu": "h100-sxm",
                             "targets": {"static": [f"http://{address_of(i)}:{fleet_port}/metrics"
                                                    for i in range(count)]}}]}))
        cli = Path(sys.executable).parent / "stepbudget"
        daemon = subprocess.Popen([str(cli), "serve", "--config", str(config)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}/metrics"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if 'stepbudget_target_up{' in requests.get(url, timeout=5).text:
                        break
                except requests.RequestException:
                    pass
                time.sleep(0.5)
            time.sleep(INTERVAL_SECONDS)  # the warm-up poll is done: connections open, pages parsed once
            start_cpu, start = process_cpu_seconds(daemon.pid), time.monotonic()
            metrics_bytes = 0
            for _ in range(cycles):
                metrics_bytes = len(requests.get(url, timeout=30).content)
                time.sleep(INTERVAL_SECONDS)
            cpu, wall = process_cpu_seconds(daemon.pid) - start_cpu, time.monotonic() - start
            up = requests.get(url, timeout=30).text.count("stepbudget_target_up{")
            return {
                "targets": count, "targets_up_series": up, "cycles": cycles,
                "cpu_seconds": round(cpu, 2), "wall_seconds": round(wall, 1),
                "cpu_cores_mean": round(cpu / wall, 4),
                "cpu_seconds_per_poll": round(cpu / cycles, 3),
                "rss_mib": round(_status_kib(daemon.pid, "VmRSS") / 1024, 1),
                "peak_rss_mib": round(_status_kib(daemon.pid, "VmHWM") / 1024, 1),
                "metrics_bytes": metrics_bytes,
            }
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
            stop(fleet)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default="100,1000")
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args(argv)
    rows = [measure(int(n), args.cycles) for n in args.targets.split(",")]
    result = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
              "poll_interval_seconds": INTERVAL_SECONDS, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "resources.json").write_text(json.dumps(result, indent=2) + "\n")
    print("| targets | CPU s / poll | mean CPU (cores) | RSS MiB | peak RSS MiB | /metrics bytes |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['targets']} | {r['cpu_seconds_per_poll']} | {r['cpu_cores_mean']} | {r['rss_mib']} | "
              f"{r['peak_rss_mib']} | {r['metrics_bytes']:,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
