"""Keep the online fit across restarts without new state: read the daemon's own exported series back
from Prometheus (`/api/v1/query_range` over `history`) and turn them into fit windows.

Every call has a timeout and a failing Prometheus never stops start-up: seeding runs on its own thread
and a failure is one warning; the fit then starts from the live windows alone.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING

import structlog

from exporter.capacity.deployment import ResolvedSetup
from exporter.capacity.model import Calibration
from exporter.errors import InputError
from exporter.serve import online_calibration
from exporter.serve.online_calibration import FitWindow
from exporter.units import parse_duration_seconds

if TYPE_CHECKING:
    from exporter.serve.online_calibration import OnlineCalibrator

log = structlog.get_logger("stepbudget.online_seed")

DEFAULT_TIMEOUT_SECONDS = 10.0
MAX_POINTS_PER_SERIES = 10_000  # Prometheus refuses more than 11,000 points per series
DEFAULT_STEP_SECONDS = 15.0
# The per-target series a window is made of (the daemon's own export).
SERIES = {
    "tokens": "stepbudget_tokens_in_flight",
    "running": "stepbudget_requests_running",
    "prefill": "stepbudget_prefill_tokens_per_step",
    "step": "stepbudget_measured_step_seconds",
}
_IDENTITY_LABELS = ("target", "model_name", "engine")

Identity = tuple[str, ...]


class PrometheusError(Exception):
    """Prometheus could not be reached or answered something unusable."""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


Samples = list[tuple[float, float]]


def query_range(url: str, query: str, start: float, end: float, step: float,
                timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> list[tuple[dict[str, str], Samples]]:
    """One range query: each series' labels and (time, value) samples."""
    params = urllib.parse.urlencode({"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"})
    address = f"{url.rstrip('/')}/api/v1/query_range?{params}"
    try:
        with urllib.request.urlopen(address, timeout=timeout_seconds) as response:
            document = json.loads(response.read())
    except (OSError, ValueError, urllib.error.URLError) as error:
        raise PrometheusError(f"GET {url}/api/v1/query_range: {error}") from None
    if not isinstance(document, dict) or document.get("status") != "success":
        raise PrometheusError(f"GET {url}/api/v1/query_range: {str(document)[:200]}")
    found = []
    for series in document.get("data", {}).get("result", []) or []:
        samples = []
        for pair in series.get("values", []) or []:
            try:
                moment, value = float(pair[0]), float(pair[1])
            except (TypeError, ValueError, IndexError):
                continue
            if math.isfinite(value):
                samples.append((moment, value))
        found.append((dict(series.get("metric", {})), samples))
    return found


def windows_from_prometheus(url: str, deployment: str, start: float, end: float, *,
                            step_seconds: float = DEFAULT_STEP_SECONDS,
                            timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> list[tuple[Identity, FitWindow]]:
    """The deployment's windows between `start` and `end`, one per engine and sample time where the
    tokens in flight, running requests and measured step all have a value (prefill: 0 when absent).

    A range query repeats a sample at every step until the next one arrives: a window equal to the
    engine's previous one is that repeat, and left out."""
    if not end > start:
        return []
    step = max(step_seconds, (end - start) / MAX_POINTS_PER_SERIES)
    values: dict[str, dict[tuple[Identity, float], float]] = {}
    for name, metric in SERIES.items():
        query = f'{metric}{{deployment="{_escape(deployment)}"}}'
        values[name] = {}
        for labels, samples in query_range(url, query, start, end, step, timeout_seconds):
            identity = tuple(labels.get(label, "") for label in _IDENTITY_LABELS)
            for moment, value in samples:
                values[name][(identity, moment)] = value
    windows: list[tuple[Identity, FitWindow]] = []
    last: dict[Identity, tuple[float, float, float]] = {}
    for key in sorted(values["step"], key=lambda k: (k[1], k[0])):
        identity, moment = key
        tokens, running = values["tokens"].get(key), values["running"].get(key)
        if tokens is None or running is None:
            continue
        measured = values["step"][key]
        if last.get(identity) == (tokens, running, measured):
            continue
        last[identity] = (tokens, running, measured)
        window = FitWindow(moment, tokens, running, values["prefill"].get(key, 0.0), measured)
        if window.usable:
            windows.append((identity, window))
    return windows


def seed_deployment(calibrator: OnlineCalibrator, name: str, *, now_seconds: float | None = None,
                    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> int:
    """Seed one deployment's fit from Prometheus; the number of windows read (0 on any failure, logged)."""
    calibration = calibrator.deployments.get(name)
    if calibration is None or not calibration.settings.prometheus_url:
        return 0
    now = time.time() if now_seconds is None else now_seconds
    url = calibration.settings.prometheus_url
    try:
        windows = windows_from_prometheus(url, name, now - calibration.settings.history_seconds, now,
                                          timeout_seconds=timeout_seconds)
        calibrator.seed_windows(name, windows, now)
    except Exception as error:
        log.warning("online_calibration_seed_failed", deployment=name, prometheus_url=url, reason=str(error)[:300])
        return 0
    fit = calibration.fit
    log.info("online_calibration_seeded", deployment=name, prometheus_url=url, windows=len(windows),
             fit=fit.reason if fit is not None and fit.parameters is None else calibration.source)
    return len(windows)


def start_seeding(calibrator: OnlineCalibrator) -> list[threading.Thread]:
    """One daemon thread per deployment with a `prometheus_url`: start-up never waits on Prometheus."""
    threads = []
    for name, calibration in calibrator.deployments.items():
        if calibration.settings.prometheus_url:
            thread = threading.Thread(target=seed_deployment, args=(calibrator, name), daemon=True,
                                      name=f"stepbudget-seed-{name}")
            thread.start()
            threads.append(thread)
    return threads


def calibration_from_history(args: argparse.Namespace, resolved: ResolvedSetup) -> Calibration:
    """`stepbudget calibrate --prometheus URL --deployment NAME [--since 24h]`: the online fit over
    the daemon's own series, `--since` back, as a calibration (OSError: Prometheus unreachable)."""
    if not args.deployment:
        raise InputError("--prometheus needs --deployment NAME (the deployment label of the daemon's series)")
    since = parse_duration_seconds(args.since, "--since")
    now = time.time()
    try:
        pairs = windows_from_prometheus(args.prometheus, args.deployment, now - since, now)
    except PrometheusError as error:
        raise OSError(str(error)) from None
    windows = [window for _, window in pairs]
    bounds = online_calibration.Bounds.of_setup(resolved)
    fit = online_calibration.fit_windows(resolved.setup, windows, bounds, min_windows=1)
    where = f"of deployment {args.deployment!r} in {args.prometheus} over the last {args.since}"
    return online_calibration.calibration_from_fit(resolved.setup, windows, fit, where)
