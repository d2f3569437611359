"""This host by its numbers, measured when it is used: the docs/operations.md one-liners.

A CPU's memory bandwidth and matmul rate are not on a datasheet, and the hosts these run on differ:
the one this was first written on printed 27GB/s and 9.14e+10, a later one 49GB/s and 2.34e+11. A
figure written down once is stale on the next host, and a peak set too low pins the online fit at it
(benchmarks/results/real_vllm_online.md at commit 54bfaa1, the run on the faster host). So
`make demo-vllm`, the real-engine tests and the online benchmark run the same two commands a user is
told to run, before their server starts (a server decoding beside them would take its share of the
cores and the memory bus).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from exporter.errors import InputError
from exporter.units import parse_bandwidth_bytes_per_second, parse_flops_per_second

# The best of ten timed copies of a 1 GiB array on every core, bytes read plus bytes written (STREAM's
# "copy" convention); printed as the config reads it.
BANDWIDTH_COMMAND = (
    "import numpy as n,os,time;from concurrent.futures import ThreadPoolExecutor as P;k=os.cpu_count();"
    "a=n.ones(2**27);b=n.empty_like(a);A,B=n.array_split(a,k),n.array_split(b,k);p=P(k);t=[];"
    "[(s:=time.perf_counter(),list(p.map(n.copyto,B,A)),t.append(time.perf_counter()-s)) for _ in range(10)];"
    "print(f'{2*a.nbytes/min(t)/1e9:.0f}GB/s')")
# The best of five float32 matmuls of 4,096 x 4,096 (2 m^3 FLOPs) by numpy's BLAS on every core.
FLOPS_COMMAND = (
    "import numpy as n,time;m=4096;a=n.ones((m,m),n.float32);a@a;t=[];"
    "[(s:=time.perf_counter(),a@a,t.append(time.perf_counter()-s)) for _ in range(5)];print(f'{2*m**3/min(t):.3g}')")
MEASURE_TIMEOUT_SECONDS = 120.0  # each takes seconds on two cores; a minute or more means something is wrong
HOST_NAME = "cpu-host"
# What vLLM's CPU backend may use for weights and KV cache here, not the host's total: the 34M model's
# weights and VLLM_CPU_KVCACHE_SPACE=1 (GiB) fit many times over. The daemon reads the KV cache's
# capacity from the server's page; the planner alone sizes from this.
HOST_MEMORY = "8GiB"


class HostMeasureError(RuntimeError):
    """A one-liner failed, hung, or printed something that is not a figure."""


def measure_host_device(python: Path) -> dict[str, str]:
    """This host as a `gpu` mapping ({name, memory, peak_bandwidth, peak_flops}), its peaks measured now
    with `python` (one that has numpy: the vLLM CPU venv's does)."""
    bandwidth = _figure(python, BANDWIDTH_COMMAND, "peak bandwidth", parse_bandwidth_bytes_per_second)
    flops = _figure(python, FLOPS_COMMAND, "peak FLOP/s", parse_flops_per_second)
    return device_with_peaks(bandwidth, flops)


def device_with_peaks(peak_bandwidth: str, peak_flops: str) -> dict[str, str]:
    """This host as a `gpu` mapping with these peaks (as the config reads them)."""
    return {"name": HOST_NAME, "memory": HOST_MEMORY, "peak_bandwidth": peak_bandwidth, "peak_flops": peak_flops}


def _figure(python: Path, command: str, what: str, parse: Callable[[str, str], float]) -> str:
    """The command's output, checked to read as the figure the config will read it as."""
    printed = _run(python, command, what)
    try:
        parse(printed, f"measured {what}")
    except InputError as error:
        raise HostMeasureError(f"measuring this host's {what}: {error}") from error
    return printed


def _run(python: Path, command: str, what: str) -> str:
    try:
        done = subprocess.run([str(python), "-c", command], capture_output=True, text=True,
                              timeout=MEASURE_TIMEOUT_SECONDS, check=False)
    except subprocess.TimeoutExpired as error:
        raise HostMeasureError(f"measuring this host's {what} took over {MEASURE_TIMEOUT_SECONDS:g} s") from error
    except OSError as error:
        raise HostMeasureError(f"measuring this host's {what}: cannot run {python}: {error}") from error
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["no error output"]
        raise HostMeasureError(f"measuring this host's {what}: {python} exited {done.returncode}: {last[0]}")
    return done.stdout.strip()
