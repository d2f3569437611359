"""How far this host's own speed moves from minute to minute, with nothing of ours running.

Why: the online-calibration benchmark (benchmarks/real_vllm_online.py) predicts its evaluated phase from a
fit made a holdout (60 s) earlier, and its bar is a median error within 5% there. Its drift tables
show the same load stepping 5-20% apart a minute later. This asks whether the host moves that much on its
own: on the core vLLM 0.32.0's CPU backend binds its model to (core 0 here: vllm/utils/ompmultiprocessing.py
l. 137-141 takes one logical CPU per physical core, and l. 293-296 reserves the last of them for the
engine core and the API server, so the 2-core VM runs the model on core 0, as the server's log says),
one thread copies a 256 MiB array (bytes read plus
written, STREAM's "copy" convention: a decode step on this host is this memory traffic) and multiplies
768 x 768 float32 matrices (a prefill chunk's GEMMs), the median of five of each every few seconds.

    .venv/bin/python benchmarks/host_drift.py [--seconds 180]

Writes benchmarks/results/host_drift.json (every sample) and prints the table for host_drift.md: the
means over each 30 s, against the run's median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one thread, as vLLM's model runs on one core here
import numpy

RESULTS = Path(__file__).resolve().parent / "results"
MODEL_CORE = 0
COPY_ELEMENTS = 2 ** 25  # float64: 256 MiB, far past any cache
MATRIX = 768
REPEATS = 5
PAUSE_SECONDS = 4.0
SPAN_SECONDS = 30.0  # half the online benchmark's holdout


@dataclass(frozen=True)
class Sample:
    at_seconds: float
    copy_bytes_per_second: float
    matmul_flops_per_second: float


def _median_seconds(work: Callable[[], object], repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def sample(source: numpy.ndarray, target: numpy.ndarray, matrix: numpy.ndarray, began: float) -> Sample:
    copy_seconds = _median_seconds(lambda: numpy.copyto(target, source))
    matmul_seconds = _median_seconds(lambda: matrix @ matrix)
    return Sample(time.monotonic() - began, 2 * source.nbytes / copy_seconds, 2 * MATRIX ** 3 / matmul_seconds)


def run(seconds: float) -> list[Sample]:
    os.sched_setaffinity(0, {MODEL_CORE})
    source = numpy.ones(COPY_ELEMENTS)
    target = numpy.empty_like(source)
    matrix = numpy.ones((MATRIX, MATRIX), numpy.float32)
    matrix @ matrix  # BLAS's first call sets up its threads
    began = time.monotonic()
    samples = []
    while time.monotonic() - began < seconds:
        samples.append(sample(source, target, matrix, began))
        time.sleep(PAUSE_SECONDS)
    return samples


def table(samples: list[Sample]) -> str:
    copy_median = statistics.median(s.copy_bytes_per_second for s in samples)
    matmul_median = statistics.median(s.matmul_flops_per_second for s in samples)
    lines = ["| span | samples | copy, mean | against the run's median | matmul, mean | against the run's median |",
             "|---|---:|---:|---:|---:|---:|"]
    spans = int(max(s.at_seconds for s in samples) // SPAN_SECONDS) + 1
    copy_means, matmul_means = [], []
    for span in range(spans):
        mine = [s for s in samples if span * SPAN_SECONDS <= s.at_seconds < (span + 1) * SPAN_SECONDS]
        if not mine:
            continue
        copy_mean = statistics.fmean(s.copy_bytes_per_second for s in mine)
        matmul_mean = statistics.fmean(s.matmul_flops_per_second for s in mine)
        copy_means.append(copy_mean)
        matmul_means.append(matmul_mean)
        lines.append(f"| {span * SPAN_SECONDS:.0f}-{(span + 1) * SPAN_SECONDS:.0f} s | {len(mine)} "
                     f"| {copy_mean / 1e9:.2f} GB/s | {copy_mean / copy_median - 1:+.1%} "
                     f"| {matmul_mean / 1e9:.1f} GFLOP/s | {matmul_mean / matmul_median - 1:+.1%} |")
    lines.append("")
    lines.append(f"Samples: copy {min(s.copy_bytes_per_second for s in samples) / 1e9:.1f}-"
                 f"{max(s.copy_bytes_per_second for s in samples) / 1e9:.1f} GB/s (median {copy_median / 1e9:.2f}), "
                 f"matmul {min(s.matmul_flops_per_second for s in samples) / 1e9:.0f}-"
                 f"{max(s.matmul_flops_per_second for s in samples) / 1e9:.0f} GFLOP/s "
                 f"(median {matmul_median / 1e9:.1f}). The {SPAN_SECONDS:.0f} s means span "
                 f"{(max(copy_means) - min(copy_means)) / copy_median:.1%} of the median copy rate and "
                 f"{(max(matmul_means) - min(matmul_means)) / matmul_median:.1%} of the median matmul rate.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--output", type=Path, default=RESULTS / "host_drift.json")
    args = parser.parse_args()
    samples = run(args.seconds)
    args.output.write_text(json.dumps([asdict(s) for s in samples], indent=1) + "\n")
    print(table(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
