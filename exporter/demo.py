"""`stepbudget demo`: simulated servers + calibration + the real daemon + a live terminal view.

What a newcomer runs first (`make demo`), with nothing but Python:
  1. an idle simulated server at real-time speed, calibrated against as a user would
     (`calibrate --url`'s library function: one stream alone at a short and a long context);
  2. two simulated vLLM pools at `--speed` (a steady-chat pool, and an agents-join pool where two
     ~100,000-token agent sessions join at t=120 s simulated and leave at t=420 s);
  3. the real daemon (`stepbudget serve`) as a child process, with a generated config file holding
     the calibrated bandwidth and overhead as the seed of its online calibration, polling both pools;
  4. a view of the daemon's own /metrics, refreshed every poll: tokens in flight against the token
     budget, predicted and measured step time, per-user tokens/s, and the daemon's own pending and
     firing alerts (its `GET /api/v1/alerts`, the conditions of rules/stepbudget.alerts.yaml).
`--duration S` ends it after S seconds with a summary; otherwise Ctrl-C ends it (or SIGTERM, or
SIGHUP when its terminal closes). Everything it started is stopped on the way out; if the demo is
killed outright, the daemon gets SIGTERM from the kernel (Linux PR_SET_PDEATHSIG), and the
simulated servers, threads of the demo, go with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from exporter.capacity import calibrate
from exporter.capacity.deployment import build_setup, load_architecture
from exporter.errors import InputError
from exporter.simulator import (
    AGENTS_JOIN_SECONDS,
    AGENTS_LEAVE_SECONDS,
    ServerHandle,
    ServerSpec,
    load_scenario,
    start_server,
)
from exporter.units import parse_duration_seconds

DEFAULT_DAEMON_PORT = 9421
DEFAULT_SPEED = 4.0  # agents join 30 s of wall time after the pools start
HTTP_TIMEOUT_SECONDS = 2.0
DAEMON_START_TIMEOUT_SECONDS = 20.0
MODEL, GPU = "qwen3-8b", "h100-sxm"
POOLS: tuple[tuple[str, str], ...] = (("chat-pool", "steady-chat"), ("agents-pool", "agents-join"))


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", metavar="SECONDS", help="stop after this long (e.g. 90 or 2m) with a summary; "
                                                              "default: run until Ctrl-C")
    parser.add_argument("--speed", type=float, default=DEFAULT_SPEED,
                        help=f"simulated seconds per wall second for the pools (default {DEFAULT_SPEED:g}: agents "
                             f"join after {AGENTS_JOIN_SECONDS / DEFAULT_SPEED:.0f} s and leave after "
                             f"{AGENTS_LEAVE_SECONDS / DEFAULT_SPEED:.0f} s)")
    parser.add_argument("--port", type=int, default=DEFAULT_DAEMON_PORT,
                        help="port of the daemon's /metrics "
                             f"(default {DEFAULT_DAEMON_PORT}; the next free one if busy)")
    parser.add_argument("--poll-interval", default="2s", help="the daemon's poll interval, wall time (default 2s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the simulated workloads")


@dataclass
class Pool:
    deployment: str
    scenario: str
    handle: ServerHandle


@dataclass
class TargetView:
    """One target's exported series at one refresh."""

    deployment: str
    target: str
    values: dict[str, float]

    def get(self, name: str) -> float | None:
        return self.values.get(name)


@dataclass
class Tally:
    """What the summary reports per target."""

    polls: int = 0
    alert_polls: dict[str, int] = field(default_factory=dict)  # polls in which each alert was active
    max_predicted_step_seconds: float = 0.0
    max_measured_step_seconds: float = 0.0
    max_tokens_in_flight: float = 0.0
    step_budget_seconds: float | None = None
    token_budget_tokens: float | None = None


# --- starting things ------------------------------------------------------------------------------


def free_port_from(port: int, host: str = "127.0.0.1", tries: int = 50) -> int:
    """`port` if nothing listens there, else the next free one."""
    for candidate in range(port, min(port + tries, 65536)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, candidate))
            except OSError:
                continue
            return candidate
    raise InputError(f"--port {port}: no free port in {port}-{port + tries - 1}")


def _progress(context_tokens: int, received: int, wanted: int) -> None:
    """One line per stream: rewritten in place on a terminal, printed once when done otherwise."""
    done = received >= wanted
    if sys.stdout.isatty():
        print(f"\r   one stream alone, context {context_tokens:>6,} tokens: {received:>3}/{wanted} tokens streamed",
              end="\n" if done else "", flush=True)
    elif done:
        print(f"   one stream alone, context {context_tokens:>6,} tokens: {wanted} tokens streamed", flush=True)


def _number(value: object) -> float:
    """A number of `stepbudget calibrate --json` output (a JSON object of plain values)."""
    if not isinstance(value, int | float | str):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    return float(value)


def calibrate_against(url: str, model_name: str) -> dict[str, object]:
    """`calibrate --url` as a user runs it; returns its --json document."""
    resolved = build_setup(load_architecture(MODEL), GPU)
    calibration = calibrate.calibrate_live(url, resolved.setup, model_name=model_name, progress=_progress)
    return calibrate.calibration_to_json(resolved, calibration)


def daemon_config(listen: str, poll_interval: str, calibration_path: Path, pools: list[Pool]) -> dict[str, object]:
    return {
        "listen": listen,
        "poll_interval": poll_interval,
        "timeout": "2s",
        "log_format": "json",
        "deployments": [{
            "name": pool.deployment, "model": MODEL, "gpu": GPU, "calibration": str(calibration_path),
            "targets": {"static": [f"{pool.handle.url}/metrics"]},
        } for pool in pools],
        # Wall-time durations: the simulators run faster than real time, so the fit converges in a minute.
        # The drift alert's `for` is scaled down with them: a holdout must outlast it (and two polls).
        "defaults": {"online_calibration": {
            **DEMO_ONLINE_CALIBRATION,
            "holdout": f"{max(20.0, DEMO_DRIFT_FOR_SECONDS + 2 * parse_duration_seconds(poll_interval, 'poll')):g}s"}},
        "alerting": {"drift_for": f"{DEMO_DRIFT_FOR_SECONDS:g}s"},
    }


DEMO_ONLINE_CALIBRATION = {"history": "10m", "holdout": "20s", "min_windows": 15}
DEMO_DRIFT_FOR_SECONDS = 10.0
PARAMETER_SERIES = ("step_overhead_seconds", "per_request_seconds", "effective_compute_flops_per_second",
                    "online_fit_windows", "online_fit_residual_ratio")


# The exported parameters' names as the view says them (stepbudget_online_fit_held_info's `parameter`).
PARAMETER_WORDS = {"effective_bandwidth_bytes_per_second": "bandwidth", "step_overhead_seconds": "overhead",
                   "per_request_seconds": "per request", "effective_compute_flops_per_second": "compute"}


@dataclass
class ParametersView:
    """One deployment's step parameters in use, where they came from, and the terms the online fit held
    at the seed (exported parameter name -> reason)."""

    source: str = ""
    values: dict[str, float] = field(default_factory=dict)
    held: dict[str, str] = field(default_factory=dict)


def parameter_views(samples: Iterable[Sample]) -> dict[str, ParametersView]:
    """Each deployment's parameters in use (bandwidth, overhead, per-request cost, compute), their source
    (online where the fit set any of them) and the terms it held."""
    found: dict[str, ParametersView] = {}
    for sample in samples:
        name = sample.name.removeprefix("stepbudget_")
        deployment = sample.labels.get("deployment")
        if deployment is None:
            continue
        if name == "online_fit_held_info":
            found.setdefault(deployment, ParametersView()).held[sample.labels.get("parameter", "")] = \
                sample.labels.get("reason", "")
            continue
        if name not in (*PARAMETER_SERIES, "effective_bandwidth_bytes_per_second"):
            continue
        view = found.setdefault(deployment, ParametersView())
        view.values[name] = sample.value
        if view.source != "online":  # a held term carries its seed's source, the fitted ones "online"
            view.source = sample.labels.get("source", view.source)
    return found


def si_rate(value: float, unit: str) -> str:
    """`2.00 TB/s` for a GPU, `12.30 GB/s` for a CPU host: one scale would print a CPU's as 0.01 TB/s."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def parameters_line(view: ParametersView | None) -> str:
    if view is None or not view.values:
        return "  parameters        -"
    values = view.values
    fit = (f", fitted from {values.get('online_fit_windows', 0):.0f} windows (median residual "
           f"{values.get('online_fit_residual_ratio', 0):.1%})" if view.source == "online" else
           " (the seed: the online fit has too few windows yet)")
    return (f"  parameters        source {view.source}{fit}: bandwidth "
            f"{si_rate(values.get('effective_bandwidth_bytes_per_second', 0), 'B/s')}, overhead "
            f"{values.get('step_overhead_seconds', 0) * 1e3:.2f} ms, per request "
            f"{values.get('per_request_seconds', 0) * 1e6:.0f} us, compute "
            f"{si_rate(values.get('effective_compute_flops_per_second', 0), 'FLOP/s')}"
            + "".join(f"\n                    {PARAMETER_WORDS.get(parameter, parameter)} held at the seed: {reason}"
                      for parameter, reason in view.held.items()))


# Run as `python -c _DIE_WITH_PARENT PARENT_PID PROGRAM ARGS...`: on Linux, ask the kernel for SIGTERM
# when the parent dies (prctl PR_SET_PDEATHSIG = 1, kept across execv), exit at once if the parent
# is already gone, then exec PROGRAM. A wrapper rather than Popen's preexec_fn, which is unsafe
# while the demo runs threads (the simulated servers).
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(sys.argv[1]):
        sys.exit(0)
os.execv(sys.argv[2], sys.argv[2:])
"""


def start_daemon(config_path: Path, log_path: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "exporter.cli", "serve", "--config", str(config_path)]
    with open(log_path, "wb") as log:
        # Its own session: Ctrl-C (and the SIGHUP of a closing terminal) reach only the demo,
        # which stops it in order; the kernel stops it if the demo dies without doing so.
        return subprocess.Popen([sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def launch_daemon(config_path: Path, log_path: Path, url: str, started: list[Callable[[], None]]
                  ) -> subprocess.Popen[bytes]:
    """Start the daemon, register its stop in `started`, and wait until it answers (RuntimeError if not)."""
    process = start_daemon(config_path, log_path)
    started.append(lambda: stop_daemon(process))
    wait_until_ready(url, process, log_path)
    return process


def wait_until_ready(url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + DAEMON_START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the daemon exited with code {process.returncode}:\n{_tail(log_path)}")
        try:
            if requests.get(url + "/-/ready", timeout=HTTP_TIMEOUT_SECONDS).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the daemon was not ready after {DAEMON_START_TIMEOUT_SECONDS:.0f} s:\n{_tail(log_path)}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop_daemon(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --- reading the daemon's output -------------------------------------------------------------------


def read_metrics(metrics_url: str) -> list[Sample]:
    """Every sample of the daemon's /metrics, fetched and parsed once per refresh: the target views
    and the parameters are both read from it, so they show the same poll."""
    text = requests.get(metrics_url, timeout=HTTP_TIMEOUT_SECONDS).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def target_views(samples: Iterable[Sample]) -> list[TargetView]:
    """The daemon's per-target series, grouped by (deployment, target)."""
    views: dict[tuple[str, str], TargetView] = {}
    for sample in samples:
        if not sample.name.startswith("stepbudget_") or "target" not in sample.labels:
            continue
        key = (sample.labels.get("deployment", ""), sample.labels["target"])
        view = views.setdefault(key, TargetView(key[0], key[1], {}))
        view.values[sample.name.removeprefix("stepbudget_")] = sample.value
    return sorted(views.values(), key=lambda v: v.deployment)


# (deployment, target) -> the alerts active there: (short name, state, seconds since it became active)
ActiveAlerts = dict[tuple[str, str], list[tuple[str, str, float]]]


def read_alerts(alerts_url: str, now_unix_seconds: float) -> ActiveAlerts:
    """The daemon's pending and firing alerts, from its own alert loop (`GET /api/v1/alerts`)."""
    alerts: ActiveAlerts = {}
    for alert in requests.get(alerts_url, timeout=HTTP_TIMEOUT_SECONDS).json()["data"]["alerts"]:
        labels = alert["labels"]
        active_at = datetime.fromisoformat(alert["activeAt"].replace("Z", "+00:00")).timestamp()
        name = labels["alertname"].removeprefix("StepBudget")
        key = (labels.get("deployment", ""), labels.get("target", ""))
        alerts.setdefault(key, []).append((name, alert["state"], max(0.0, now_unix_seconds - active_at)))
    return alerts


def _ms(seconds: float | None) -> str:
    return "    -   " if seconds is None else f"{seconds * 1e3:6.1f} ms"


def _median(view: TargetView) -> str:
    """The median as exported: a number only where its ITL bucket resolves it, else that bucket
    (vLLM's default buckets put every step from 10 to 25 ms at an interpolated 17.5 ms)."""
    point = view.get("measured_step_median_seconds")
    lower, upper = view.get("measured_step_median_lower_seconds"), view.get("measured_step_median_upper_seconds")
    if point is not None or lower is None:
        return _ms(point).strip()
    if upper is None:
        return f"> {lower * 1e3:.1f} ms"
    return f"{lower * 1e3:.1f}-{upper * 1e3:.1f} ms"


def _tokens(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def render_view(views: list[TargetView], alerts: ActiveAlerts, pools: dict[str, Pool], metrics_url: str,
                parameters: dict[str, ParametersView] | None = None) -> str:
    lines = [f"stepbudget demo — the daemon's view ({metrics_url}), refreshed every poll; Ctrl-C stops", ""]
    for view in views:
        pool = pools.get(view.deployment)
        simulated = "" if pool is None else (
            f"  [{pool.scenario}, t={pool.handle.simulator.now_seconds:,.0f} s simulated]")
        tokens, budget = view.get("tokens_in_flight"), view.get("token_budget_tokens")
        share = f" ({tokens / budget:.0%} of the budget)" if tokens is not None and budget else ""
        measured = view.get("measured_step_seconds")
        lines += [
            f"{view.deployment}  {view.target}{simulated}",
            f"  tokens in flight  {_tokens(tokens):>9} / token budget {_tokens(budget)}{share};"
            f" running {_tokens(view.get('requests_running'))}, waiting {_tokens(view.get('requests_waiting'))}",
            f"  step time         predicted {_ms(view.get('predicted_step_seconds'))}   measured "
            f"{_ms(measured)} (median {_median(view)})   budget "
            f"{_ms(view.get('step_budget_seconds')).strip()}",
            f"  per-user speed    predicted {view.get('predicted_user_tokens_per_second') or 0:6.1f} tok/s   measured "
            f"{(1 / measured) if measured else 0:6.1f} tok/s",
        ]
        if parameters is not None:
            lines.append(parameters_line(parameters.get(view.deployment)))
        active = alerts.get((view.deployment, view.target), [])
        shown = [f"{name} {state} for {seconds:.0f} s" for name, state, seconds in sorted(active)]
        lines.append("  alerts            " + (", ".join(shown) if shown else "none — within budget"))
        lines.append("")
    if not views:
        lines.append("(waiting for the daemon's first poll)")
    lines.append("Alerts from the daemon's own loop (the rules of rules/stepbudget.alerts.yaml): pending until "
                 "the condition has held for its `for` (5m for the page), then firing.")
    return "\n".join(lines)


def tally_views(views: list[TargetView], alerts: ActiveAlerts, tallies: dict[str, Tally]) -> None:
    for view in views:
        tally = tallies.setdefault(view.deployment, Tally())
        tally.polls += 1
        for name, _, _ in alerts.get((view.deployment, view.target), []):
            tally.alert_polls[name] = tally.alert_polls.get(name, 0) + 1
        tally.max_predicted_step_seconds = max(tally.max_predicted_step_seconds,
                                               view.get("predicted_step_seconds") or 0)
        tally.max_measured_step_seconds = max(tally.max_measured_step_seconds, view.get("measured_step_seconds") or 0)
        tally.max_tokens_in_flight = max(tally.max_tokens_in_flight, view.get("tokens_in_flight") or 0)
        tally.step_budget_seconds = view.get("step_budget_seconds") or tally.step_budget_seconds
        tally.token_budget_tokens = view.get("token_budget_tokens") or tally.token_budget_tokens


def summary(tallies: dict[str, Tally], pools: dict[str, Pool], wall_seconds: float) -> str:
    lines = [f"summary after {wall_seconds:.0f} s:"]
    for deployment, tally in tallies.items():
        pool = pools.get(deployment)
        simulated = "" if pool is None else f" ({pool.scenario}, {pool.handle.simulator.now_seconds:,.0f} s simulated)"
        over = tally.alert_polls.get("PredictedStepOverBudget", 0)
        verdict = (f"OVER BUDGET in {over} of {tally.polls} polls" if over
                   else f"within budget in all {tally.polls} polls")
        lines.append(f"  {deployment}{simulated}: {verdict}; predicted step up to "
                     f"{_ms(tally.max_predicted_step_seconds).strip()}, measured up to "
                     f"{_ms(tally.max_measured_step_seconds).strip()} "
                     f"(budget {_ms(tally.step_budget_seconds).strip()});"
                     f" tokens in flight up to {_tokens(tally.max_tokens_in_flight)}"
                     f" of a {_tokens(tally.token_budget_tokens)}"
                     f" token budget")
        others = {name: count for name, count in tally.alert_polls.items() if name != "PredictedStepOverBudget"}
        if others:
            lines.append("    also held: " + ", ".join(f"{name} ({count} polls)" for name, count in others.items()))
    return "\n".join(lines)


# --- the verb ---------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    duration = parse_duration_seconds(args.duration, "--duration") if args.duration is not None else None
    poll_seconds = parse_duration_seconds(args.poll_interval, "--poll-interval")
    if not args.speed > 0:
        raise InputError(f"--speed must be greater than 0, got {args.speed!r}")
    if not 1 <= args.port <= 65535:
        raise InputError(f"--port must be 1-65535, got {args.port}")
    return run_stopping_everything(
        "stepbudget-demo-", lambda workdir, started, stop: _run(args, duration, poll_seconds, workdir, started, stop))


Story = Callable[[Path, list[Callable[[], None]], threading.Event], int]


def run_stopping_everything(prefix: str, story: Story) -> int:
    """Runs `story(workdir, started, stop)` in a scratch folder: Ctrl-C, SIGTERM and SIGHUP (the
    terminal closed) set `stop`, so the view ends with its summary; then everything the story put in
    `started` is stopped, last first, and the folder removed, whatever happened."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    started: list[Callable[[], None]] = []
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda number, frame: stop.set())
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return story(workdir, started, stop)
    finally:
        for stop_one in reversed(started):
            stop_one()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(workdir, ignore_errors=True)


def _run(args: argparse.Namespace, duration: float | None, poll_seconds: float, workdir: Path,
         started: list[Callable[[], None]], stop: threading.Event) -> int:
    print("stepbudget demo: simulated vLLM servers, calibrated and watched by the stepbudget daemon", flush=True)
    print(f"1. calibrating against an idle simulated server ({MODEL} on {GPU}, real time), "
          "as `stepbudget calibrate --url` does:", flush=True)
    idle = start_server(scenario=load_scenario("idle"), speed=1.0, spec=ServerSpec(MODEL, GPU, seed=args.seed))
    started.append(idle.stop)
    document = calibrate_against(idle.url, idle.simulator.spec.model_name)
    idle.stop()
    started.remove(idle.stop)
    bandwidth = _number(document["effective_bandwidth_bytes_per_second"])
    efficiency = _number(document["bandwidth_efficiency"])
    overhead = _number(document["step_overhead_seconds"])
    print(f"   effective bandwidth {si_rate(bandwidth, 'B/s')} "
          f"({efficiency:.0%} of peak), per-step overhead "
          f"{overhead * 1e3:.2f} ms", flush=True)
    if stop.is_set():
        return 0
    calibration_path = workdir / "calibration.json"
    calibration_path.write_text(json.dumps(document, indent=2))

    print(f"2. starting two simulated vLLM pools at speed x{args.speed:g}:", flush=True)
    pools: list[Pool] = []
    for index, (deployment, scenario_name) in enumerate(POOLS):
        scenario = load_scenario(scenario_name)
        handle = start_server(scenario=scenario, speed=args.speed,
                              spec=ServerSpec(MODEL, GPU, seed=args.seed + index + 1))
        started.append(handle.stop)
        pools.append(Pool(deployment, scenario_name, handle))
        print(f"   {deployment}: {handle.url}/metrics  ({scenario.description})", flush=True)
        for at_seconds, what in scenario.timeline[1:]:
            print(f"      at {at_seconds / args.speed:.0f} s wall ({at_seconds:.0f} s simulated): {what}", flush=True)

    port = free_port_from(args.port)
    if port != args.port:
        print(f"   port {args.port} is busy; the daemon listens on {port} instead", flush=True)
    daemon_url = f"http://127.0.0.1:{port}"
    config_path = workdir / "stepbudget.yaml"
    config_path.write_text(yaml.safe_dump(daemon_config(f"127.0.0.1:{port}", args.poll_interval, calibration_path,
                                                        pools), sort_keys=False))
    log_path = workdir / "daemon.log"
    print(f"3. starting the daemon: stepbudget serve --config {config_path.name} (calibrated bandwidth and "
          f"overhead as the seed, refitted online from its own windows once it has "
          f"{DEMO_ONLINE_CALIBRATION['min_windows']}; poll every {poll_seconds:g} s)", flush=True)
    try:
        process = launch_daemon(config_path, log_path, daemon_url, started)
    except RuntimeError as error:
        print(f"stepbudget demo: error: {error}", file=sys.stderr)
        return 1
    metrics_url = f"{daemon_url}/metrics"
    print(f"   the daemon's metrics: {metrics_url}  (point Prometheus at it: "
          f"scrape_configs: [{{job_name: stepbudget, static_configs: [{{targets: ['127.0.0.1:{port}']}}]}}])",
          flush=True)
    by_name = {pool.deployment: pool for pool in pools}
    tallies, elapsed_seconds = watch(daemon_url, by_name, poll_seconds, duration, process, stop)
    print(summary(tallies, by_name, elapsed_seconds), flush=True)
    print(f"the daemon's metrics were at {metrics_url}", flush=True)
    return 0


def watch(daemon_url: str, pools: dict[str, Pool], poll_seconds: float, duration: float | None,
           process: subprocess.Popen[bytes], stop: threading.Event) -> tuple[dict[str, Tally], float]:
    """Refresh the view every poll until the duration ends, Ctrl-C or SIGTERM; (tallies, seconds)."""
    interactive = sys.stdout.isatty()
    metrics_url = f"{daemon_url}/metrics"
    tallies: dict[str, Tally] = {}
    began = time.monotonic()
    for _ in _ticks(poll_seconds, duration, stop):
        if process.poll() is not None:
            print(f"stepbudget demo: the daemon exited with code {process.returncode}", file=sys.stderr)
            break
        try:
            samples = read_metrics(metrics_url)
            alerts = read_alerts(f"{daemon_url}/api/v1/alerts", time.time())
        except requests.RequestException as error:
            print(f"stepbudget demo: cannot read the daemon at {daemon_url}: {error}", file=sys.stderr)
            continue
        views, parameters = target_views(samples), parameter_views(samples)
        order = list(pools)
        views.sort(key=lambda v: order.index(v.deployment) if v.deployment in order else len(order))
        text = render_view(views, alerts, pools, metrics_url, parameters)
        if any(v.get("predicted_step_seconds") is not None for v in views):
            tally_views(views, alerts, tallies)
        print(("\x1b[H\x1b[2J" if interactive else "\n") + text, flush=True)
    return tallies, time.monotonic() - began


def _ticks(poll_seconds: float, duration: float | None, stop: threading.Event) -> Iterator[float]:
    began = time.monotonic()
    next_tick = began + poll_seconds
    while not stop.is_set():
        end = None if duration is None else began + duration
        wake = next_tick if end is None else min(next_tick, end)
        if stop.wait(max(0.0, wake - time.monotonic())):
            return
        now = time.monotonic()
        if end is not None and now >= end:
            return
        yield now
        next_tick += poll_seconds

