"""Memory soaks, in simulated time: the daemon's resident set stays flat (within 10% after warm-up).

`admissions`: the admission API over real HTTP on 127.0.0.1 (the daemon's StepBudgetServer, its
admission routes, an AdmissionBook on a simulated clock): 100 admissions per simulated second for 30
simulated minutes (180,000), each asking for a whole 131,072-token context (prompt 1, output 131,071),
so each lease is 120 + 4 x 131,071 / 20 = 26,334 s at 20 tok/s: longer than the whole run. Each is
released a simulated 1 to 60 s after it was admitted. Run once with this tree's book and once with the
book as committed before (`git show HEAD:exporter/admission/book.py`, unless `--before-ref` names
another), where a release left the lease in the heap until it ran out.

`fleet`: the daemon's poll pipeline (Poller, HttpFetcher, collector and /metrics page, alert loop,
online calibration, admission book, state sizes) against 1,000 targets (benchmarks/fleet.py on
loopback) flapping for 30 simulated minutes: 120 polls at 15 s, back to back. Every other poll a
target's state changes: a quarter of the fleet answers 500 for a poll, and 100 targets leave discovery
while 100 new ones (new addresses) join, so pods come and go as in a rollout.

RSS is read from /proc/self/statm after a full collection, at every simulated minute (admissions) or
poll (fleet); the first 10% of the run is warm-up.

    .venv/bin/python benchmarks/soak.py [--only admissions|fleet] [--minutes 30]

Writes benchmarks/results/soak.json and the table in benchmarks/results/soak.md.
"""

from __future__ import annotations

import argparse
import gc
import http.client
import importlib.util
import json
import logging
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.fleet import Fleet, address_of
from exporter.admission import book as book_module
from exporter.admission.api import AdmissionApi
from exporter.admission.metrics import AdmissionCollector
from exporter.admission.wiring import serve_api
from exporter.logs import configure_logging
from exporter.serve.alerting import AlertLoop
from exporter.serve.collector import make_registry
from exporter.serve.config import Config, config_from_mapping
from exporter.serve.daemon import watch_state
from exporter.serve.discovery import Target
from exporter.serve.fetch import HttpFetcher
from exporter.serve.online_calibration import OnlineCalibrator
from exporter.serve.poller import Poller
from exporter.serve.server import StepBudgetServer

RESULTS = REPO / "benchmarks" / "results"
TOKEN = "soak-token"
CONTEXT_TOKENS = 131_072
TARGET_TPS = 20.0
RATE_PER_SECOND = 100
POLL_SECONDS = 15.0
FLEET_TARGETS = 1000
FLEET_SPARES = 200  # addresses beyond the 1,000 that join as others leave
CHURN_PER_POLL = 100
FLAT_RATIO = 0.10
WARM_UP_SHARE = 0.10
WINDOWS = 10


class SimulatedClock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def resident_bytes() -> int:
    gc.collect()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def flatness(samples_mib: list[float]) -> dict[str, Any]:
    """Whether the resident set stayed flat after warm-up. The samples after the first 10% are cut into
    WINDOWS equal windows and each window's highest is compared with the first window's: like against
    like, whatever phase a single sample falls on (the fleet's RSS swings ~8% between the polls where a
    quarter of it is down and the others). Flat: no window's highest over the first's by more than 10%.
    Also given: the strict figure, the highest sample against the first sample after warm-up."""
    after = samples_mib[max(1, int(len(samples_mib) * WARM_UP_SHARE)):]
    size = max(1, len(after) // WINDOWS)
    peaks = [max(after[start:start + size]) for start in range(0, len(after) - size + 1, size)]
    growth = (max(peaks) - peaks[0]) / peaks[0]
    return {"rss_after_warm_up_mib": after[0], "rss_max_mib": max(after), "rss_end_mib": after[-1],
            "window_peaks_mib": [round(peak, 2) for peak in peaks], "growth_ratio": round(growth, 4),
            "strict_growth_ratio": round((max(after) - after[0]) / after[0], 4), "flat": growth <= FLAT_RATIO}


def book_before(ref: str) -> ModuleType:
    """The admission book as committed at `ref` (the lease heap that kept released admissions)."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:exporter/admission/book.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "book_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("book_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# --- admissions over HTTP ----------------------------------------------------------------------------


def soak_admissions(module: ModuleType, minutes: float, seed: int = 7) -> dict[str, Any]:
    clock = SimulatedClock(1_000_000.0)
    book = module.AdmissionBook([module.DeploymentPolicy("chat", TARGET_TPS)], clock=clock)
    book.sync([module.TargetMeasurement("chat", f"10.0.0.{i}:8000", 1e15, 0.0) for i in range(8)], [])
    api = AdmissionApi(book, TOKEN)
    server = StepBudgetServer("127.0.0.1", 0, make_registry(tuple, ()), ready=lambda: True)
    serve_api(server, api)
    if hasattr(book, "open_admissions"):  # the book before had no size to export
        server.registry.register(AdmissionCollector(book))
    server.start()
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    admit_body = json.dumps({"deployment": "chat", "prompt_tokens": 1,
                             "max_output_tokens": CONTEXT_TOKENS - 1}).encode()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    rss: list[int] = []
    leases: list[int] = []
    open_now: list[int] = []
    total = int(minutes * 60 * RATE_PER_SECOND)
    wall = time.monotonic()

    def post(path: str, body: bytes) -> dict[str, Any]:
        connection.request("POST", path, body=body, headers=headers)
        answer = connection.getresponse()
        document: dict[str, Any] = json.loads(answer.read())
        return document

    try:
        release_at: list[tuple[float, str]] = []  # (when, id), sorted once a simulated second
        for tick in range(total):
            clock.now = 1_000_000.0 + tick / RATE_PER_SECOND
            answer = post("/v1/admission", admit_body)
            if answer["decision"] != "admitted":
                raise RuntimeError(f"refused at tick {tick}: {answer}")
            release_at.append((clock.now + rng.uniform(1.0, 60.0), answer["id"]))
            if tick % RATE_PER_SECOND == 0:  # once a simulated second: release what is due
                release_at.sort()
                while release_at and release_at[0][0] <= clock.now:
                    _, admission_id = release_at.pop(0)
                    if not post("/v1/release", json.dumps({"id": admission_id}).encode())["released"]:
                        raise RuntimeError(f"release of {admission_id} failed")
            if tick % (60 * RATE_PER_SECOND) == 0:  # once a simulated minute
                rss.append(resident_bytes())
                leases.append(len(book._leases))  # the heap itself, whichever book this is
                open_now.append(len(book._by_id))
        rss.append(resident_bytes())
        leases.append(len(book._leases))
        open_now.append(len(book._by_id))
        page = post_free_get(connection, "/metrics")
    finally:
        connection.close()
        server.stop()
    return {"admissions": total, "simulated_minutes": minutes, "wall_seconds": time.monotonic() - wall,
            "lease_seconds": 120.0 + 4.0 * (CONTEXT_TOKENS - 1) / TARGET_TPS,
            "rss_mib": [round(b / 2**20, 2) for b in rss], "lease_heap_entries": leases,
            "open_admissions": open_now, "metrics_page_has_open_gauge": b"stepbudget_admission_open_admissions" in page,
            **flatness([b / 2**20 for b in rss])}


def post_free_get(connection: http.client.HTTPConnection, path: str) -> bytes:
    connection.request("GET", path)
    return connection.getresponse().read()


# --- 1,000 targets flapping --------------------------------------------------------------------------


class ChurningDiscovery:
    """The fleet's addresses, CHURN_PER_POLL of them swapped for spares every other poll."""

    def __init__(self, config: Config, port: int) -> None:
        self._deployment = config.deployments[0].name
        self._port = port
        self.poll = 0

    def discover(self) -> list[Target]:
        shift = (self.poll // 2) * CHURN_PER_POLL
        indexes = [(i + shift) % (FLEET_TARGETS + FLEET_SPARES) for i in range(FLEET_TARGETS)]
        return [Target(self._deployment, f"http://{address_of(i)}:{self._port}/metrics",
                       f"{address_of(i)}:{self._port}") for i in indexes]


def soak_fleet(minutes: float) -> dict[str, Any]:
    polls = int(minutes * 60 / POLL_SECONDS)
    state = {"poll": 0}

    def behaviour(index: int, request: int) -> str:
        # A quarter of the fleet answers 500 for a poll, every other poll: up, down, up ...
        return "500" if (state["poll"] // 2) % 2 == 1 and index % 4 == 0 else "ok"

    fleet = Fleet(FLEET_TARGETS + FLEET_SPARES, behaviour)
    for number in range(polls + 4):
        fleet.book.page(number)  # every page the soak will serve, rendered before measuring
    with tempfile.TemporaryDirectory() as scratch:
        token_file = Path(scratch) / "token"
        token_file.write_text(TOKEN)
        config = config_from_mapping({
            "listen": "127.0.0.1:0", "timeout": "5s", "deployments": [{
                "name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                "targets": {"static": [f"http://{address_of(0)}:{fleet.port}/metrics"]}}],
        })
    clock = SimulatedClock(1_800_000_000.0)
    discovery = ChurningDiscovery(config, fleet.port)
    fetcher = HttpFetcher(config.timeout_seconds, config.max_response_bytes)
    calibrator = OnlineCalibrator(config.deployments)  # as serve wires it: its setups reach the poller and page
    poller = Poller(config, discovery, fetcher, clock=clock,  # type: ignore[arg-type]
                    setups_in_use=calibrator.setups_in_use)
    registry = make_registry(poller.readings, config.deployments, poller.deployment_targets,
                             setups_in_use=calibrator.setups_in_use)
    server = StepBudgetServer("127.0.0.1", 0, registry, ready=lambda: poller.ready)
    alert_loop = AlertLoop(config.alerting, poll_interval_seconds=POLL_SECONDS, clock=clock, post=lambda *a: None)
    book = book_module.AdmissionBook([book_module.DeploymentPolicy("chat", 50.0)], clock=clock)
    poller.add_listener(calibrator.on_poll)
    poller.add_listener(alert_loop.on_poll)
    poller.add_listener(lambda result: book.sync(*book_module.measurements_from_readings(result.readings)))
    registry.register(AdmissionCollector(book))
    sizes = watch_state(poller, fetcher, alert_loop, calibrator, server)
    poller.add_listener(sizes.on_poll)
    poller.add_listener(lambda result: server.metrics_page.refresh())
    server.start()
    rss: list[int] = []
    sampled: list[dict[str, int]] = []
    up: list[int] = []
    page_bytes = 0
    wall = time.monotonic()
    try:
        for poll in range(polls):
            state["poll"] = discovery.poll = poll
            clock.now += POLL_SECONDS
            result = poller.poll_once()
            up.append(sum(1 for reading in result.readings if reading.target_up))
            for _ in range(200):  # admissions between polls, most released, the rest left to their leases
                decision = book.admit(book_module.AdmissionRequest(2000, 500, deployment="chat"))
                if decision.admission is not None and random.random() < 0.9:
                    book.release(decision.admission.id)
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            try:
                connection.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
                page_bytes = len(connection.getresponse().read())
            finally:
                connection.close()
            rss.append(resident_bytes())
            sampled.append({**sizes.sizes(), "admission_open": book.sizes().open_admissions,
                            "admission_leases": book.sizes().leases, "admission_targets": book.sizes().targets})
            print(f"poll {poll + 1}/{polls}: up {up[-1]}, rss {rss[-1] / 2**20:.1f} MiB, {sampled[-1]}", flush=True)
    finally:
        server.stop()
        poller.stop()
        fetcher.close()
        fleet.close()
    return {"targets": FLEET_TARGETS, "polls": polls, "simulated_minutes": minutes,
            "wall_seconds": time.monotonic() - wall, "targets_up_per_poll": up,
            "rss_mib": [round(b / 2**20, 2) for b in rss], "structures_at_end": sampled[-1],
            "structures_max": {name: max(s[name] for s in sampled) for name in sampled[-1]},
            "metrics_gzip_bytes": page_bytes, **flatness([b / 2**20 for b in rss])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("admissions", "before", "fleet"),
                        help="one soak: admissions (this book), before (the book at --before-ref), fleet")
    parser.add_argument("--minutes", type=float, default=30.0, help="simulated minutes (default 30)")
    parser.add_argument("--summarize", action="store_true",
                        help="recompute the flatness figures from the samples in soak.json, run nothing")
    parser.add_argument("--before-ref", default="HEAD", help="git ref of the book to compare with (default HEAD)")
    args = parser.parse_args(argv)
    configure_logging("console", level=logging.ERROR)  # the per-target lines (down, up) are not the point here
    out = RESULTS / "soak.json"
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if args.summarize:
        for name in ("admissions_after", "admissions_before", "fleet"):
            if name in results:
                results[name].update(flatness(results[name]["rss_mib"]))
        out.write_text(json.dumps(results, indent=1) + "\n")
        return 0
    results["machine"] = {"python": platform.python_version(), "cpus": __import__("os").cpu_count(),
                          "platform": platform.platform()}
    if args.only in (None, "admissions"):
        results["admissions_after"] = soak_admissions(book_module, args.minutes)
        print("admissions, this book:", {k: v for k, v in results["admissions_after"].items()
                                         if not isinstance(v, list)}, flush=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
    if args.only in (None, "before"):
        results["admissions_before"] = soak_admissions(book_before(args.before_ref), args.minutes)
        results["admissions_before"]["ref"] = args.before_ref
        print("admissions, the book before:", {k: v for k, v in results["admissions_before"].items()
                                               if not isinstance(v, list)}, flush=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
    if args.only in (None, "fleet"):
        results["fleet"] = soak_fleet(args.minutes)
        print("fleet:", {k: v for k, v in results["fleet"].items() if not isinstance(v, list)}, flush=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
