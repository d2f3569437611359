"""Keep the online fit across restarts without new state: read the daemon's own exported series back
from Prometheus (`/api/v1/query_range` over `history`) and turn them into fit windows.

A window is rebuilt with what the live fit had: tokens in flight, running requests, prefill per step,
the measured step, the window's prefill mix (stepbudget_prefill_mix_tokens / _share_ratio), the mean context
its prefill tokens attended to (stepbudget_prefill_mean_context_tokens) and the
KV dtype and block size its engine ran with (stepbudget_window_setup_info). Only the windows whose
`setup` is the deployment's now are kept: after a change of GPU, tensor parallelism or quantization
the old setup's windows say nothing about the new one's terms, and a window of no known setup (a
daemon before this export) cannot be told apart, so it is left out too.

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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import structlog

from exporter.capacity.deployment import ResolvedSetup
from exporter.capacity.fit import Calibration
from exporter.errors import InputError
from exporter.serve.collector import MIX_SHARE_METRIC, MIX_TOKENS_METRIC, WINDOW_SETUP_METRIC
from exporter.serve.online_fit import calibration_from_fit, fit_windows
from exporter.serve.online_fit_types import Bounds, FitWindow, fit_mix, setup_key
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
    "context": "stepbudget_prefill_mean_context_tokens",
    "step": "stepbudget_measured_step_seconds",
    "mix_tokens": MIX_TOKENS_METRIC,
    "mix_share": MIX_SHARE_METRIC,
    "setup": WINDOW_SETUP_METRIC + "_info",
}
_IDENTITY_LABELS = ("target", "model_name", "engine")
# Labels that belong to one family's sample, not to the engine and daemon it came from.
_OWN_LABELS = frozenset({"__name__", "part", "setup", "kv_cache_dtype", "block_size"})
_MIX_SHARE_TOLERANCE = 0.01

Identity = tuple[str, ...]
SeriesKey = tuple[tuple[str, str], ...]  # every label but _OWN_LABELS: one engine as one daemon exported it


@dataclass(frozen=True)
class History:
    """The windows read back, and those left out for their setup."""

    windows: list[tuple[Identity, FitWindow]]
    other_setup: int = 0  # windows of another setup (`setup` label not this deployment's)
    unknown_setup: int = 0  # windows with no stepbudget_window_setup_info (or two at once)


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


def windows_from_prometheus(url: str, deployment: str, start: float, end: float, *, setup: str,
                            step_seconds: float = DEFAULT_STEP_SECONDS,
                            timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> History:
    """The deployment's windows of setup `setup` (setup_key) between `start` and
    `end`, one per engine and sample time where the tokens in flight, running requests and measured
    step all have a value (prefill: 0 when absent; the mix where its parts are all there).

    The series are joined on every label but the families' own (instance and job included): two
    daemons exporting one engine (a rolling restart) are two sources, never mixed. A range query
    repeats a sample at every step until the next one arrives: a window equal to the engine's
    previous one is that repeat, and left out. Each window carries the load at its end, as the
    daemon's own windows do (a query step coarser than the polls skips windows: the sample before
    need not be this window's start)."""
    if not end > start:
        return History([])
    step = max(step_seconds, (end - start) / MAX_POINTS_PER_SERIES)
    values: dict[str, dict[tuple[SeriesKey, float], float]] = {}
    parts: dict[str, dict[tuple[SeriesKey, float], dict[int, float]]] = {"mix_tokens": {}, "mix_share": {}}
    setups: dict[tuple[SeriesKey, float], list[dict[str, str]]] = {}
    identities: dict[SeriesKey, Identity] = {}
    for name, metric in SERIES.items():
        query = f'{metric}{{deployment="{_escape(deployment)}"}}'
        values[name] = {}
        for labels, samples in query_range(url, query, start, end, step, timeout_seconds):
            key = tuple(sorted((label, value) for label, value in labels.items() if label not in _OWN_LABELS))
            identities.setdefault(key, tuple(labels.get(label, "") for label in _IDENTITY_LABELS))
            for moment, value in samples:
                if name in parts:
                    part = _part(labels.get("part"))
                    if part is not None:
                        parts[name].setdefault((key, moment), {})[part] = value
                elif name == "setup":
                    setups.setdefault((key, moment), []).append(labels)
                else:
                    values[name][(key, moment)] = value
    history = History([])
    last: dict[SeriesKey, tuple[float, float, float]] = {}
    for key, moment in sorted(values["step"], key=lambda k: (k[1], k[0])):
        tokens, running = values["tokens"].get((key, moment)), values["running"].get((key, moment))
        if tokens is None or running is None:
            continue
        measured = values["step"][(key, moment)]
        if last.get(key) == (tokens, running, measured):
            continue
        last[key] = (tokens, running, measured)
        window = FitWindow(moment, tokens, running, values["prefill"].get((key, moment), 0.0), measured)
        if not window.usable:
            continue
        found = setups.get((key, moment), [])
        if len(found) != 1:
            history = replace(history, unknown_setup=history.unknown_setup + 1)
            continue
        if found[0].get("setup") != setup:
            history = replace(history, other_setup=history.other_setup + 1)
            continue
        block = found[0].get("block_size", "")
        window = replace(window, prefill_mix=mix_from_parts(parts["mix_tokens"].get((key, moment)),
                                                            parts["mix_share"].get((key, moment))),
                         prefill_mean_context_tokens=values["context"].get((key, moment)),
                         kv_cache_dtype=found[0].get("kv_cache_dtype") or None,
                         block_size_tokens=int(block) if block.isdigit() and int(block) > 0 else None)
        history.windows.append((identities[key], window))
    return history


def _part(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def mix_from_parts(tokens: dict[int, float] | None, shares: dict[int, float] | None
                   ) -> tuple[tuple[float, float], ...] | None:
    """A window's prefill mix from its parts' two gauges (by part number): None unless every part has
    both and the shares sum to 1 (a part missing or torn between scrapes is no mix; the window is
    fitted at its mean)."""
    if not tokens or not shares or tokens.keys() != shares.keys():
        return None
    if abs(sum(shares.values()) - 1.0) > _MIX_SHARE_TOLERANCE:
        return None
    return fit_mix([(tokens[part], shares[part]) for part in sorted(tokens)])


def seed_deployment(calibrator: OnlineCalibrator, name: str, *, now_seconds: float | None = None,
                    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> int:
    """Seed one deployment's fit from Prometheus; the number of windows read (0 on any failure, logged)."""
    calibration = calibrator.deployments.get(name)
    if calibration is None or not calibration.settings.prometheus_url:
        return 0
    now = time.time() if now_seconds is None else now_seconds
    url = calibration.settings.prometheus_url
    try:
        history = windows_from_prometheus(url, name, now - calibration.settings.history_seconds, now,
                                          setup=calibration.setup_key, timeout_seconds=timeout_seconds)
        calibrator.seed_windows(name, history.windows, now)
    except Exception as error:
        log.warning("online_calibration_seed_failed", deployment=name, prometheus_url=url, reason=str(error)[:300])
        return 0
    fit = calibration.fit
    log.info("online_calibration_seeded", deployment=name, prometheus_url=url, windows=len(history.windows),
             setup=calibration.setup_key, other_setup_windows=history.other_setup,
             unknown_setup_windows=history.unknown_setup,
             fit=fit.reason if fit is not None and fit.parameters is None else calibration.source)
    return len(history.windows)


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
        history = windows_from_prometheus(args.prometheus, args.deployment, now - since, now,
                                          setup=setup_key(resolved))
    except PrometheusError as error:
        raise OSError(str(error)) from None
    windows = [window for _, window in history.windows]
    if not windows and (history.other_setup or history.unknown_setup):
        raise InputError(f"no window of this setup in {args.prometheus} for deployment {args.deployment!r} over "
                         f"the last {args.since}: {history.other_setup} of another setup (model, GPU, tensor "
                         f"parallelism or weight dtype), {history.unknown_setup} of no known setup")
    bounds = Bounds.of_setup(resolved)
    fit = fit_windows(resolved.setup, windows, bounds, min_windows=1,
                                         seed_bandwidth_measured=resolved.bandwidth_source != "default")
    where = f"of deployment {args.deployment!r} in {args.prometheus} over the last {args.since}"
    return calibration_from_fit(resolved.setup, windows, fit, where)
