"""The fetch path alone: the project's hand-written HTTP/1.1 client against pycurl's multi interface,
both fetching the same N pages from the same loopback server, cycle after cycle.

Why: the daemon fetches every target's /metrics with its own client (HttpFetcher over lean_http.py
for `http://`). A hand-written client has to earn its place against a well-kept alternative; libcurl's
multi interface (one thread, non-blocking sockets, connection reuse) is the obvious one. This measures
both on the fetch alone, so nothing else the daemon does (reading pages, rendering) blurs the figure.

Setup per target count N: one benchmarks/path_fleet.py process (the server benchmarks/scale.py points
the daemon at) serves N targets on one 127.0.0.1 port, `/t/0/metrics` ..., each the same ~19 KB vLLM
page. Each fetcher then runs in a fresh process of its own (so its peak RSS is its own), which
imports both clients (so the import cost is the same for both), and fetches all N pages per cycle:
  - project: HttpFetcher as the daemon builds it (timeout and size cap as shipped), driven the way
    the poll loop drives it at loopback speed: FAST_FETCH_WORKERS threads taking URLs off one queue;
  - curl: a minimal CurlMulti fetcher written here: CURL_CONCURRENCY easy handles reused transfer
    after transfer, so at most that many in flight (the multi handle's connection cache keeps their
    connections alive across cycles, as the project's pool keeps its sockets), a connect and an
    overall timeout, the same size cap and request headers, the body decoded to text as the
    project's fetcher returns it.
A fetch counts as an error unless it answered 200 with a non-empty body. The first cycle opens the
connections and is reported apart; the figures are the medians of the cycles after it. Each count
runs `--rounds` rounds, the two fetchers taking turns, so a shared machine's load falls on both alike.

Measured per cycle, in the fetcher's process: wall seconds, CPU seconds (time.process_time: every
thread), errors; and the process's peak RSS (VmHWM) after the cycles, beside its RSS before the
first one.

    .venv/bin/python benchmarks/fetch_path.py [--targets 1000,5000] [--cycles 6] [--rounds 3]   # about a minute

Needs pycurl (`.venv/bin/pip install pycurl`; not a dependency of the package): without it, it says
so and exits 0 without writing anything. Writes benchmarks/results/fetch_path.json (every cycle, the
medians and the verdict the figures give).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"
OUTPUT = RESULTS / "fetch_path.json"
CURL_CONCURRENCY = 32  # transfers in flight: the poll loop's MAX_FETCH_WORKERS
FETCHERS = ("project", "curl")


def have_pycurl() -> bool:
    try:
        importlib.import_module("pycurl")
    except ImportError:
        return False
    return True


def rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


# --- the two fetchers, each: one cycle over every URL -> (pages fetched, errors, characters read) ---------


class ProjectCycle:
    """HttpFetcher, FAST_FETCH_WORKERS threads taking URLs off one queue (poller._poll_targets at a pace
    that never calls for more workers)."""

    def __init__(self, timeout_seconds: float, max_response_bytes: int) -> None:
        from exporter.serve.config import Tls
        from exporter.serve.fetch import HttpFetcher
        from exporter.serve.poller import FAST_FETCH_WORKERS

        self.module = HttpFetcher.__module__
        self.fetcher = HttpFetcher(timeout_seconds, max_response_bytes)
        self.workers = FAST_FETCH_WORKERS
        self.tls = Tls()

    def __call__(self, urls: list[str]) -> tuple[int, int, int]:
        queue = collections.deque(urls)
        counts = [0, 0, 0]  # ok, errors, characters
        lock = threading.Lock()

        def work() -> None:
            ok = errors = size = 0
            while True:
                try:
                    url = queue.popleft()
                except IndexError:
                    break
                try:
                    text = self.fetcher(url, bearer_token=None, tls=self.tls)
                except Exception:
                    errors += 1
                    continue
                if text:
                    ok += 1
                    size += len(text)
                else:
                    errors += 1
            with lock:
                counts[0] += ok
                counts[1] += errors
                counts[2] += size

        threads = [threading.Thread(target=work) for _ in range(self.workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return counts[0], counts[1], counts[2]

    def close(self) -> None:
        self.fetcher.close()


class _Transfer:
    """One transfer's body, refused past the size cap (libcurl fails the transfer when write returns 0)."""

    __slots__ = ("cap", "chunks", "size")

    def __init__(self, cap: int) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.cap = cap

    def write(self, chunk: bytes) -> int:
        self.size += len(chunk)
        if self.size > self.cap:
            return 0
        self.chunks.append(chunk)
        return len(chunk)


class CurlCycle:
    """A minimal CurlMulti fetcher: `concurrency` easy handles, reused transfer after transfer (the
    multi handle's connection cache keeps their connections alive across cycles), connect and overall
    timeouts, the project's request headers, the body capped and decoded to text."""

    def __init__(self, timeout_seconds: float, max_response_bytes: int, concurrency: int = CURL_CONCURRENCY) -> None:
        pycurl: Any = importlib.import_module("pycurl")  # no type information: Any at this boundary
        self.pycurl = pycurl
        self.module = "pycurl " + str(pycurl.version)
        self.cap = max_response_bytes
        from exporter.serve.fetch import BASE_HEADERS

        headers = [f"{name}: {value}" for name, value in BASE_HEADERS.items()
                   if name.lower() != "accept-encoding"]  # libcurl sends it, and decodes the body, with ENCODING
        self.multi: Any = pycurl.CurlMulti()
        self.multi.setopt(pycurl.M_MAXCONNECTS, concurrency)  # the keep-alive cache: one per transfer in flight
        self.free: list[Any] = []
        for _ in range(concurrency):
            handle = pycurl.Curl()
            handle.setopt(pycurl.HTTPHEADER, headers)
            handle.setopt(pycurl.ENCODING, "gzip,deflate")
            handle.setopt(pycurl.CONNECTTIMEOUT_MS, int(timeout_seconds * 1000))
            handle.setopt(pycurl.TIMEOUT_MS, int(timeout_seconds * 1000))  # the whole transfer
            handle.setopt(pycurl.NOSIGNAL, 1)
            handle.setopt(pycurl.PROXY, "")  # targets are reached directly, as the project's fetcher does
            handle.setopt(pycurl.FOLLOWLOCATION, 1)
            handle.setopt(pycurl.MAXREDIRS, 5)
            self.free.append(handle)
        self.handles = list(self.free)

    def __call__(self, urls: list[str]) -> tuple[int, int, int]:
        pycurl, multi = self.pycurl, self.multi
        pending = collections.deque(urls)
        transfers: dict[int, _Transfer] = {}
        ok = errors = size = 0
        while pending or transfers:
            while pending and self.free:
                handle = self.free.pop()
                transfer = _Transfer(self.cap)
                handle.setopt(pycurl.URL, pending.popleft())
                handle.setopt(pycurl.WRITEFUNCTION, transfer.write)
                transfers[id(handle)] = transfer
                multi.add_handle(handle)
            while multi.perform()[0] == pycurl.E_CALL_MULTI_PERFORM:
                pass
            while True:
                queued, succeeded, failed = multi.info_read()
                for handle in succeeded:
                    transfer = transfers.pop(id(handle))
                    multi.remove_handle(handle)
                    self.free.append(handle)
                    text = b"".join(transfer.chunks).decode("utf-8", errors="replace")
                    if handle.getinfo(pycurl.RESPONSE_CODE) == 200 and text:
                        ok += 1
                        size += len(text)
                    else:
                        errors += 1
                for handle, _code, _message in failed:
                    transfers.pop(id(handle))
                    multi.remove_handle(handle)
                    self.free.append(handle)
                    errors += 1
                if not queued:
                    break
            if transfers:
                multi.select(1.0)
        return ok, errors, size

    def close(self) -> None:
        for handle in self.handles:
            handle.close()
        self.multi.close()


# --- a fetcher's own process ---------------------------------------------------------------------------


def run_worker(fetcher: str, port: int, count: int, cycles: int, pause_seconds: float) -> dict[str, Any]:
    """In a fresh process: both clients imported, one built, `cycles` cycles over the N URLs."""
    from benchmarks.scale import daemon_config
    from exporter.serve.config import config_from_mapping

    importlib.import_module("exporter.serve.fetch")  # both clients imported, whichever runs: the same baseline RSS
    importlib.import_module("pycurl")

    defaults = config_from_mapping(daemon_config([f"http://127.0.0.1:{port}/t/0/metrics"], 0, 15.0))
    cycle: ProjectCycle | CurlCycle
    if fetcher == "project":
        cycle = ProjectCycle(defaults.timeout_seconds, defaults.max_response_bytes)
    else:
        cycle = CurlCycle(defaults.timeout_seconds, defaults.max_response_bytes)
    urls = [f"http://127.0.0.1:{port}/t/{index}/metrics" for index in range(count)]
    rss_before = rss_mib("VmRSS")
    rows = []
    try:
        for _ in range(cycles):
            wall, cpu = time.monotonic(), time.process_time()
            ok, errors, size = cycle(urls)
            rows.append({"wall_seconds": round(time.monotonic() - wall, 4),
                         "cpu_seconds": round(time.process_time() - cpu, 4), "ok": ok, "errors": errors,
                         "characters": size})
            time.sleep(pause_seconds)
    finally:
        cycle.close()
    return {"fetcher": fetcher, "client": cycle.module, "targets": count, "timeout_seconds": defaults.timeout_seconds,
            "max_response_bytes": defaults.max_response_bytes, "rss_before_mib": rss_before,
            "peak_rss_mib": rss_mib("VmHWM"), "cycles": rows}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One fetcher at one count, over its rounds: medians of the cycles after each round's first."""
    steady = [row for run in runs for row in run["cycles"][1:]]
    first = [run["cycles"][0] for run in runs]
    wall = statistics.median(row["wall_seconds"] for row in steady)
    cpu = statistics.median(row["cpu_seconds"] for row in steady)
    every = [row for run in runs for row in run["cycles"]]
    return {"fetcher": runs[0]["fetcher"], "targets": runs[0]["targets"], "rounds": len(runs),
            "wall_seconds": round(wall, 3), "cpu_seconds": round(cpu, 3),
            "cpu_ms_per_page": round(cpu * 1000 / runs[0]["targets"], 4),
            "first_cycle_wall_seconds": round(statistics.median(row["wall_seconds"] for row in first), 3),
            "first_cycle_cpu_seconds": round(statistics.median(row["cpu_seconds"] for row in first), 3),
            "rss_before_mib": max(run["rss_before_mib"] for run in runs),
            "peak_rss_mib": max(run["peak_rss_mib"] for run in runs),
            "errors": sum(row["errors"] for row in every), "pages": sum(row["ok"] + row["errors"] for row in every),
            "characters": sum(row["characters"] for row in every)}


def verdict(rows: list[dict[str, Any]]) -> str:
    """Which fetcher is cheaper in CPU per cycle at each count, by how much, and what else differs."""
    parts = []
    for count in sorted({row["targets"] for row in rows}):
        by = {row["fetcher"]: row for row in rows if row["targets"] == count}
        project, curl = by["project"], by["curl"]
        cheaper, dearer = (project, curl) if project["cpu_seconds"] <= curl["cpu_seconds"] else (curl, project)
        times = dearer["cpu_seconds"] / cheaper["cpu_seconds"]
        saved = dearer["cpu_ms_per_page"] - cheaper["cpu_ms_per_page"]
        parts.append(f"{count:,} targets: {cheaper['fetcher']} is cheaper, {cheaper['cpu_seconds']} CPU s a cycle "
                     f"against {dearer['cpu_seconds']} ({times:.1f}x; {cheaper['cpu_ms_per_page']} against "
                     f"{dearer['cpu_ms_per_page']} ms a page, {saved:.3f} ms less); wall {project['wall_seconds']} s "
                     f"(project) against {curl['wall_seconds']} s (curl); peak RSS {project['peak_rss_mib']} against "
                     f"{curl['peak_rss_mib']} MiB; errors {project['errors']} and {curl['errors']} of "
                     f"{project['pages']:,} pages each")
    return "; ".join(parts) + "."


# What the figures do and do not cover, written with every result.
NOTES = (
    "The fetch alone: a 19 KB page over keep-alive http on 127.0.0.1, the body decoded to text. Not measured: https "
    "(urllib3 in the project, OpenSSL in libcurl), slow or hostile targets, the watchdog's and the size cap's "
    "behaviour (the curl fetcher is minimal: a timeout and a cap, not the project's failure reasons).",
    "The project's fetcher runs as the poll loop runs it at loopback pace (FAST_FETCH_WORKERS threads under one "
    "interpreter lock); the curl fetcher is one thread in C between Python callbacks, CURL_CONCURRENCY in flight.",
    "Against the whole daemon (benchmarks/results/scale.md: ~0.75-0.9 ms of CPU per target-poll, the fetch ~5% of "
    "it), the CPU a page saves here is the share of a target-poll it is of that.",
    "pycurl is not a dependency of the package: a switch would add it (a C extension with its own libcurl) to the "
    "image and to the supported platforms.",
)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| targets | fetcher | wall s / cycle | CPU s / cycle | CPU ms / page | first cycle wall s (CPU s) | "
             "RSS before -> peak MiB | errors / pages |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['targets']:,} | {r['fetcher']} | {r['wall_seconds']} | {r['cpu_seconds']} | "
                     f"{r['cpu_ms_per_page']} | {r['first_cycle_wall_seconds']} ({r['first_cycle_cpu_seconds']}) | "
                     f"{r['rss_before_mib']} -> {r['peak_rss_mib']} | {r['errors']} / {r['pages']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default="1000,5000", help="comma-separated target counts")
    parser.add_argument("--cycles", type=int, default=6,
                        help="cycles per fetcher and count (the first opens connections)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds per count, the fetchers taking turns (a shared machine's load falls on both)")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between cycles")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="where the results go (default %(default)s)")
    parser.add_argument("--worker", choices=FETCHERS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not have_pycurl():
        print("fetch_path: skipped, pycurl is not installed (.venv/bin/pip install pycurl; the package does not "
              "depend on it)", file=sys.stderr)
        return 0
    counts = [int(part) for part in args.targets.split(",")]
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.port, counts[0], args.cycles, args.pause)))
        return 0

    from benchmarks.scale import machine, process_cpu_seconds, start_path_fleet, stop

    runs: list[dict[str, Any]] = []
    rows = []
    for count in counts:
        # A long interval: the page does not change while the fetchers read it, so both read the same bytes.
        fleet, port = start_path_fleet(count, 3600.0)
        try:
            for round_index in range(args.rounds):
                for fetcher in FETCHERS:
                    print(f"{count} targets, round {round_index + 1}/{args.rounds}, {fetcher} ...", file=sys.stderr)
                    fleet_cpu = process_cpu_seconds(fleet.pid)
                    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", fetcher,
                                          "--port", str(port), "--targets", str(count), "--cycles", str(args.cycles),
                                          "--pause", str(args.pause)], cwd=REPO, capture_output=True, text=True,
                                         check=True)
                    run = json.loads(out.stdout)
                    run["fleet_cpu_seconds"] = round(process_cpu_seconds(fleet.pid) - fleet_cpu, 2)
                    run["load_after"] = " ".join(f"{value:.2f}" for value in os.getloadavg())
                    runs.append(run)
        finally:
            stop(fleet)
        for fetcher in FETCHERS:
            rows.append(summarize([run for run in runs if run["targets"] == count and run["fetcher"] == fetcher]))
            print(f"  {rows[-1]}", file=sys.stderr)
    info = {**machine(), "libcurl": runs[-1]["client"], "project_fetcher_module": runs[0]["client"],
            "python": platform.python_version()}
    info.pop("prometheus", None)
    result = {"machine": info, "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "cycles": args.cycles, "rounds": args.rounds, "curl_concurrency": CURL_CONCURRENCY,
              "summary": rows, "verdict": verdict(rows), "notes": list(NOTES), "runs": runs}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows) + "\n\n" + result["verdict"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
