"""How long `stepbudget plan` takes to answer, cold (a fresh process, as a user runs it).

The plan path must answer in under 0.5 s: no heavy imports (matplotlib only with --plot).
Writes benchmarks/results/plan_latency.md and .json.

    .venv/bin/python benchmarks/plan_latency.py [--runs 15]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
LIMIT_SECONDS = 0.5

CASES: dict[str, list[str]] = {
    "defaults (qwen3-8b, h100-sxm)": [],
    "loads + contexts, --json": ["--load", "40x2000", "--load", "2x100000",
                                 "--context", "2000", "--context", "8000", "--json"],
    "MoE, numeric budget": ["--model", "qwen3-30b-a3b", "--load", "40x2000", "--json"],
    "sliding window, numeric budget": ["--model", "gemma-3-27b", "--gpu", "h200", "--context", "4000"],
    "HF config.json": ["--model", str(REPO / "tests" / "data" / "hf_configs" / "DeepSeek-V3" / "config.json"),
                       "--tp", "8", "--gpu", "h200", "--json"],
}


@dataclass
class CaseResult:
    case: str
    runs: int
    median_seconds: float
    max_seconds: float
    under_limit: bool


def time_once(flags: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "exporter.cli", "plan", *flags], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL, timeout=30)
    return time.perf_counter() - started


def measure(runs: int) -> list[CaseResult]:
    results = []
    for case, flags in CASES.items():
        time_once(flags)  # warm the file cache and bytecode
        samples = [time_once(flags) for _ in range(runs)]
        results.append(CaseResult(case, runs, statistics.median(samples), max(samples),
                                  max(samples) < LIMIT_SECONDS))
    return results


def write(results: list[CaseResult]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.system()} {platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} CPUs"
    (RESULTS / "plan_latency.json").write_text(json.dumps(
        {"limit_seconds": LIMIT_SECONDS, "machine": machine, "results": [asdict(r) for r in results]}, indent=2) + "\n")
    lines = [
        "# `stepbudget plan` latency (fresh process each run)",
        "",
        f"Command: `.venv/bin/python benchmarks/plan_latency.py`. Machine: {machine}.",
        f"Limit: every run under {LIMIT_SECONDS} s.",
        "",
        "| case | runs | median s | max s | under limit |",
        "|---|---:|---:|---:|---|",
    ]
    lines += [f"| {r.case} | {r.runs} | {r.median_seconds:.3f} | {r.max_seconds:.3f} | "
              f"{'yes' if r.under_limit else 'NO'} |" for r in results]
    (RESULTS / "plan_latency.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    results = measure(parser.parse_args().runs)
    write(results)
    return 0 if all(r.under_limit for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
