"""What the admission path costs per decision, and what it does for the chats of `agents-join`.

Cost, three layers, each an admit followed by its release (the release timed apart):
  1. the book alone (`AdmissionBook.admit`), with many targets and many open admissions;
  2. the HTTP handler (`AdmissionApi.admission`: bearer check, JSON parse, validation, decision);
  3. a gateway's whole round trip: `AdmissionClient.admit` over loopback HTTP to a running daemon.
Effect: `agents-join` in simulated time (exporter.admission.integrations.simulated_gateway), shared vs
pools vs one pool, per-stream decode speeds of the chats before and while the agents run.

    .venv/bin/python benchmarks/admission.py [--decisions 20000] [--http-decisions 2000]

Writes benchmarks/results/admission.md and admission.json. Timings are wall-clock on the machine
that ran it (stated in the results); nothing here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from exporter.admission import wiring as admission_module
from exporter.admission.api import AdmissionApi
from exporter.admission.book import AdmissionBook, AdmissionRequest, DeploymentPolicy
from exporter.admission.client import AdmissionClient
from exporter.admission.integrations.simulated_gateway import (
    MODES,
    format_run,
    run_agents_join,
    scenario_groups,
)
from exporter.serve import daemon as daemon_module
from exporter.serve.config import config_from_mapping
from exporter.simulator import (
    ServerSpec,
    load_scenario,
    start_server,
)

RESULTS = ROOT / "benchmarks" / "results"
TARGETS = 16
OPEN_ADMISSIONS = 2000
BUDGET_TOKENS = 10_000_000.0  # large: every admit is admitted, the open set stays the same size
TOKEN = "benchmark-token"


@dataclass(frozen=True)
class Timing:
    layer: str
    decisions: int
    targets: int
    open_admissions: int
    mean_microseconds: float
    p50_microseconds: float
    p99_microseconds: float
    max_microseconds: float


def timed(layer: str, decisions: int, targets: int, open_admissions: int, decide: Callable[[], object],
          release: Callable[[object], None]) -> Timing:
    samples: list[float] = []
    for _ in range(decisions):
        started = time.perf_counter()
        outcome = decide()
        samples.append((time.perf_counter() - started) * 1e6)
        release(outcome)
    ordered = sorted(samples)
    return Timing(layer, decisions, targets, open_admissions, statistics.fmean(samples),
                  ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], ordered[-1])


def loaded_book() -> AdmissionBook:
    book = AdmissionBook([DeploymentPolicy("chat", 50.0)])
    for index in range(TARGETS):
        book.reconcile("chat", f"10.0.0.{index}:8000", BUDGET_TOKENS, 50_000.0)
    for _ in range(OPEN_ADMISSIONS):
        book.admit(AdmissionRequest(1500, 500, deployment="chat"))
    return book


def bench_book(decisions: int) -> Timing:
    book = loaded_book()
    request = AdmissionRequest(1500, 500, deployment="chat")
    return timed("book: AdmissionBook.admit", decisions, TARGETS, OPEN_ADMISSIONS,
                 lambda: book.admit(request), lambda d: book.release(d.admission.id))  # type: ignore[attr-defined]


def bench_handler(decisions: int) -> Timing:
    api = AdmissionApi(loaded_book(), TOKEN)
    headers = {"authorization": f"Bearer {TOKEN}"}
    body = json.dumps({"deployment": "chat", "prompt_tokens": 1500, "max_output_tokens": 500}).encode()
    return timed("handler: AdmissionApi.admission (auth + JSON + decision)", decisions, TARGETS, OPEN_ADMISSIONS,
                 lambda: api.admission(headers, body),
                 lambda r: api.book.release(r.body["id"]))  # type: ignore[attr-defined]


def bench_http(decisions: int) -> Timing:
    """A daemon on 127.0.0.1 polling an idle simulated server; the client admits and releases."""
    with tempfile.TemporaryDirectory() as scratch:
        token_file = Path(scratch) / "token"
        token_file.write_text(TOKEN)
        simulated = start_server("127.0.0.1", 0, None, 1.0, ServerSpec())
        config = config_from_mapping({
            "listen": "127.0.0.1:0",
            "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                             "targets": {"static": [f"{simulated.url}/metrics"]}}],
            "admission": {"enabled": True, "token_file": str(token_file)},
        })
        daemon = daemon_module.build_daemon(config)
        try:
            admission_module.install(daemon)
            daemon.server.start()
            daemon.poller.poll_once()
            with AdmissionClient(f"http://127.0.0.1:{daemon.server.port}", TOKEN, timeout_seconds=2.0) as client:
                for _ in range(50):  # warm the connection pool
                    client.release(client.admit(1500, 500, deployment="chat").id or "")
                return timed("HTTP: AdmissionClient.admit round trip on 127.0.0.1", decisions, 1, 0,
                             lambda: client.admit(1500, 500, deployment="chat"),
                             lambda r: client.release(r.id))  # type: ignore[attr-defined]
        finally:
            daemon.server.stop()
            daemon.poller.stop()
            daemon.fetcher.close()
            simulated.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--http-decisions", type=int, default=2_000)
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    timings = [bench_book(args.decisions), bench_handler(args.decisions), bench_http(args.http_decisions)]
    runs = {mode: run_agents_join(mode) for mode in MODES}
    machine = (f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs, "
               f"{platform.machine()}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "admission.json").write_text(json.dumps({
        "machine": machine, "timings": [asdict(t) for t in timings],
        "agents_join": {mode: {**asdict(run), "decisions": {f"{d}/{k}": v for (d, k), v in run.decisions.items()}}
                        for mode, run in runs.items()},
    }, indent=2) + "\n")
    (RESULTS / "admission.md").write_text(render(machine, timings, runs))
    print((RESULTS / "admission.md").read_text())
    return 0


def workload() -> str:
    chats, agents = scenario_groups(load_scenario("agents-join"))
    return (f"`agents-join` on Qwen3-8B / H100 SXM: {chats.users} chat users "
            f"(~{chats.prompt_tokens.mean:,}-token prompts, ~{chats.output_tokens.mean:,}-token answers); "
                f"{agents.count} agent sessions of ~{agents.prompt_tokens.mean:,} prompt tokens "
                f"join at {agents.at_seconds:g} s.")


def render(machine: str, timings: list[Timing], runs: dict) -> str:
    lines = [
        "# Admission: cost per decision and effect on `agents-join`",
        "",
        f"Measured by `.venv/bin/python benchmarks/admission.py` on {machine}.",
        "",
        "## Cost per decision (admit; its release is not counted)",
        "",
        "| layer | decisions | targets | open admissions | mean µs | p50 µs | p99 µs | max µs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {t.layer} | {t.decisions:,} | {t.targets} | {t.open_admissions:,} | {t.mean_microseconds:,.1f} | "
              f"{t.p50_microseconds:,.1f} | {t.p99_microseconds:,.1f} | {t.max_microseconds:,.1f} |" for t in timings]
    lines += [
        "",
        "The budget is 1 ms per decision: the book and the handler are the daemon's share; the HTTP row is what "
        "a gateway waits for, loopback network and the client included.",
        "",
        "## `agents-join` through a gateway, in simulated time",
        "",
        f"{workload()} Median per-stream decode speed of the chats that streamed wholly before the agents joined "
        "and while they ran (from 30 s after they joined to the end of the run); the daemon's poll pipeline reads "
        "the simulated servers every 15 s and feeds the admission book. Modes: `shared` = no admission, one "
        "server; `pools` = admission with a chat pool (50 tok/s) and a long-context pool (20 tok/s budget), "
        "split at 32,000 tokens; `one-pool` = admission on the chat server alone.",
        "",
        "| mode | chats before | chats with the agents | chat streams measured | agents | agents ran on | decisions |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for mode, run in runs.items():
        decisions = (", ".join(f"{d} {k} {v}" for (d, k), v in sorted(run.decisions.items()) if v)
                     or "none (no admission)")
        where = ", ".join(sorted(set(run.agent_targets))) or "not sent (waiting)"
        lines.append(f"| {mode} | {run.chat_tokens_per_second_before:.1f} tok/s | "
                         f"{run.chat_tokens_per_second_during:.1f} tok/s | {run.chat_requests_during} | "
                         f"{run.agent_tokens_per_second_during:.1f} tok/s | {where} | "
                     f"{decisions} |")
    lines += ["", *[f"- {format_run(run)}" for run in runs.values()], ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
