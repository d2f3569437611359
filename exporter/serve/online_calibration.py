"""Online calibration: the daemon fits the step's terms from the windows it measures.

Each poll window of an engine is one observation: tokens in flight, running requests, prompt tokens
per step and the measured mean step. Per deployment, the windows of the last `history` except the
most recent `holdout` are fitted (bandwidth, per-step overhead, per-request cost and, where windows
are compute-bound, the compute rate), so that a sudden change shows as prediction error (and
StepBudgetPredictionDrift) for `holdout` before the fit absorbs it.

This module is the calibrator's state and threads; the fit itself is pure (exporter.serve.online_fit,
its vocabulary exporter.serve.online_fit_types).
`OnlineCalibrator` collects the windows from the poller's readings into each deployment's
`WindowHistory` (thinned by time, so a fleet's fit spans the history as one engine's does), refits
(deployments at staggered phases), publishes the setup the deployment predicts with
(`exporter.serve.setups_in_use`) and logs every refit that moves a parameter by more than 5%.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import structlog

from exporter.serve.online_fit import fit_windows
from exporter.serve.online_fit_types import Bounds, Fit, FitWindow, Held, Parameters, fit_mix, setup_key
from exporter.serve.online_settings import Settings
from exporter.serve.setups_in_use import InUse, SetupsInUse

if TYPE_CHECKING:
    from exporter.serve.config import Deployment
    from exporter.serve.poller import PollResult
    from exporter.serve.reading import Reading


log = structlog.get_logger("stepbudget.online_calibration")

ONLINE_SOURCE = "online"
LOG_CHANGE_RATIO = 0.05  # a refit that moves a parameter by more than this is logged
# A fleet adds one window per engine per poll: 1,000 engines over 6 h at 15 s would be 1.4 million
# windows. The history is cut into HISTORY_SLICES slices of time, and each keeps at most
# WINDOWS_PER_SLICE windows (a uniform sample of the engines and moments in it): the fit spans the
# whole history and weighs every part of it alike, whatever the engine count. One engine at 15 s
# polls (4 windows per 1-minute slice of 6 h) keeps all of its windows.
HISTORY_SLICES = 360
WINDOWS_PER_SLICE = 8
MAX_WINDOWS_PER_DEPLOYMENT = (HISTORY_SLICES + 1) * WINDOWS_PER_SLICE  # a partly expired slice at the old end
# A refit costs O(windows): at most once this often (or a quarter of the holdout, if shorter). The
# holdout (30 min by default) already delays what a refit learns; five minutes more costs nothing.
REFIT_INTERVAL_SECONDS = 300.0


def windows_from_readings(readings: Iterable[Reading], now_seconds: float) -> dict[str, list[tuple[tuple[str, ...],
                                                                                                 FitWindow]]]:
    """Each up reading with a measured window, by deployment, keyed by engine identity."""
    found: dict[str, list[tuple[tuple[str, ...], FitWindow]]] = {}
    # A server-wide reading's engines come with their share of its measured step (server_wide_reading);
    # a down server's kept reading keeps them too, as they were: not a new window.
    for reading in (engine for whole in readings
                    for engine in ((whole, *whole.ranks) if whole.target_up else (whole,))):
        if not reading.target_up or reading.measured_step_seconds is None or reading.tokens_in_flight is None \
                or reading.requests_running is None:
            continue  # down, no window yet, or a server-wide series (no tokens of its own)
        # The load at the window's end, as a window read back from Prometheus has it (online_seed):
        # one fit from live and seeded windows alike. Huber weights take care of the windows where the
        # load jumped; the mean of both ends (the prediction error's) narrows the load's spread, which
        # the fit needs to tell the terms apart.
        window = FitWindow(reading.last_success_timestamp_seconds or now_seconds, reading.tokens_in_flight,
                           reading.requests_running, reading.prefill_tokens_per_step or 0.0,
                           reading.measured_step_seconds, fit_mix(reading.prefill_mix), reading.kv_cache_dtype,
                           reading.block_size_tokens, reading.prefill_mean_context_tokens,
                           reading.kv_cache_bytes_per_token)
        if window.usable:
            found.setdefault(reading.deployment, []).append((reading.identity, window))
    return found


def _end_seconds(window: FitWindow) -> float:
    return window.end_seconds


def _sample_rank(identity: tuple[str, ...], end_seconds: float) -> int:
    """A stable pseudo-random rank of one window: a slice keeps its lowest-ranked windows, a sample
    that favours no engine and no moment, whatever order the windows arrive in (and across restarts)."""
    digest = hashlib.blake2b(f"{identity!r}@{end_seconds!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class WindowHistory:
    """One deployment's windows, thinned by time: at most `per_slice` in each slice of
    `history_seconds / slices`, so the kept windows always span the history, however many engines
    feed it (halving the older half at a cap instead let a large fleet's history shrink to minutes)."""

    def __init__(self, history_seconds: float, slices: int = HISTORY_SLICES,
                 per_slice: int = WINDOWS_PER_SLICE) -> None:
        self.slice_seconds = history_seconds / slices
        self.slices = slices
        self.per_slice = per_slice
        self._newest: int | None = None  # the newest slice index seen
        # Per slice index, a heap of (-rank, arrival, window): its root is the highest-ranked kept.
        self._slices: dict[int, list[tuple[int, int, FitWindow]]] = {}
        self._arrivals = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, identity: tuple[str, ...], window: FitWindow) -> None:
        index = math.floor(window.end_seconds / self.slice_seconds)
        if self._newest is None or index > self._newest:
            # A new slice: the ones a whole history older leave now, not at the next refit, so the
            # history never holds more than MAX_WINDOWS_PER_DEPLOYMENT windows.
            self._newest = index
            self._drop_before(index - self.slices)
        elif index < self._newest - self.slices:
            return  # older than the history: never fitted
        kept = self._slices.setdefault(index, [])
        entry = (-_sample_rank(identity, window.end_seconds), next(self._arrivals), window)
        if len(kept) < self.per_slice:
            heapq.heappush(kept, entry)
            self._size += 1
        elif entry[0] > kept[0][0]:  # ranks below the slice's highest: takes its place
            heapq.heapreplace(kept, entry)

    def between(self, oldest_seconds: float, newest_seconds: float) -> list[FitWindow]:
        """The windows that ended in [oldest, newest], in time order; slices wholly older are dropped."""
        self._drop_before(math.floor(oldest_seconds / self.slice_seconds))
        windows = [window for kept in self._slices.values() for _, _, window in kept
                   if oldest_seconds <= window.end_seconds <= newest_seconds]
        windows.sort(key=_end_seconds)
        return windows

    def _drop_before(self, first: int) -> None:
        for index in [index for index in self._slices if index < first]:
            self._size -= len(self._slices.pop(index))


class DeploymentCalibration:
    """One deployment's windows and fit. `refit_phase_ratio` (0-1) offsets its refits by that share of
    the refit interval, so that a daemon's deployments do not all refit on the same poll."""

    def __init__(self, deployment: Deployment, settings: Settings, bounds: Bounds,
                 refit_phase_ratio: float = 0.0) -> None:
        self.deployment = deployment
        self.settings = settings
        self.bounds = bounds
        self.seed = deployment.resolved.setup
        self.seed_source = deployment.resolved.bandwidth_source
        self.refit_phase_ratio = refit_phase_ratio
        self.windows = WindowHistory(settings.history_seconds)
        # Each engine's last window end, to skip a window published again: only the engines of the last
        # poll (`keep_engines`), so pods that come and go never pile up here.
        self._seen: dict[tuple[str, ...], float] = {}
        self._since_refit = 0
        self._last_refit_seconds: float | None = None
        self.fit: Fit | None = None
        self._compute_candidate: float | None = None  # a compute rate the last refit chose and did not take
        self.in_use = Parameters.of(self.seed)
        self.source = self.seed_source
        self.held: tuple[Held, ...] = ()
        self.setup_key = setup_key(deployment.resolved)

    def add(self, identity: tuple[str, ...], window: FitWindow) -> None:
        if self._seen.get(identity) == window.end_seconds:
            return  # the same window published again (no newer scrape)
        self._seen[identity] = window.end_seconds
        self.windows.add(identity, window)
        self._since_refit += 1

    def keep_engines(self, identities: set[tuple[str, ...]]) -> None:
        """Forget the last window end of every engine but these (the last poll's): an engine absent
        from a poll comes back with a window that ends later, never the same one again."""
        for identity in [identity for identity in self._seen if identity not in identities]:
            del self._seen[identity]

    @property
    def engines_seen(self) -> int:
        return len(self._seen)

    def windows_for_fit(self, now_seconds: float) -> list[FitWindow]:
        return self.windows.between(now_seconds - self.settings.history_seconds,
                                    now_seconds - self.settings.holdout_seconds)

    @property
    def refit_interval_seconds(self) -> float:
        return min(REFIT_INTERVAL_SECONDS, self.settings.holdout_seconds / 4)

    def due(self, now_seconds: float) -> bool:
        """Refit after a third of min_windows new windows (at least one), and not more often than
        REFIT_INTERVAL_SECONDS: a refit per poll would cost O(windows) each time for no better answer."""
        if self._since_refit < max(1, self.settings.min_windows // 3):
            return False
        last = self._last_refit_seconds
        return last is None or now_seconds - last >= self.refit_interval_seconds

    def refit(self, now_seconds: float) -> Fit:
        self._since_refit = 0
        # The first refit (a young history: cheap) sets the phase every later one keeps.
        first = self._last_refit_seconds is None
        self._last_refit_seconds = now_seconds - (self.refit_phase_ratio * self.refit_interval_seconds
                                                  if first else 0.0)
        windows = self.windows_for_fit(now_seconds)
        fit = fit_windows(self.seed, windows, self.bounds, min_windows=self.settings.min_windows,
                          seed_bandwidth_measured=self.seed_source != "default")
        fit = self._compute_rate_twice(fit, windows)
        self.fit = fit
        if fit.parameters is None:
            return fit
        old, new = self.in_use, fit.parameters
        moved = {name: (before, after) for (name, before), after in
                 zip(old.as_dict().items(), new.as_dict().values(), strict=True)
                 if abs(after - before) > LOG_CHANGE_RATIO * max(abs(before), 1e-12)}
        if moved or self.source != ONLINE_SOURCE:
            log.info("online_calibration_refit", deployment=self.deployment.name, windows=fit.windows_used,
                     residual_ratio=round(fit.residual_ratio or 0.0, 4),
                     **{f"{name}_old": before for name, (before, _) in moved.items()},
                     **{f"{name}_new": after for name, (_, after) in moved.items()})
        if [(h.parameter, h.reason) for h in fit.held] != [(h.parameter, h.reason) for h in self.held]:
            log.info("online_calibration_held", deployment=self.deployment.name,
                     held={h.parameter: f"{h.reason}: {h.detail}" for h in fit.held},
                     fitted=[name for name in new.as_dict() if all(h.parameter != name for h in fit.held)])
        self.in_use, self.source, self.held = new, ONLINE_SOURCE, fit.held
        return fit

    def _compute_rate_twice(self, fit: Fit, windows: Sequence[FitWindow]) -> Fit:
        """`fit`, or where it moves the compute rate from the online fit's in use and the refit before did
        not choose the same: the same windows fitted at the rate in use (the first fit replaces the seed's
        whole). The rate comes from a coarse grid
        (_COMPUTE_FACTORS), and on a flat loss noise can tip one refit to a neighbour the next refit leaves
        (a simulated steady load: 1.0x -> 1.4x -> 1.0x the seed's in 100 s); a server whose rate moved
        chooses the new one twice, a refit interval later."""
        chosen = fit.parameters.compute_flops_per_second if fit.parameters is not None else None
        in_use = self.in_use.compute_flops_per_second
        if (chosen is None or self.source != ONLINE_SOURCE or math.isclose(chosen, in_use, rel_tol=1e-9)
                or chosen == self._compute_candidate):
            self._compute_candidate = None
            return fit
        self._compute_candidate = chosen
        log.info("online_calibration_compute_pending", deployment=self.deployment.name,
                 compute_flops_per_second_in_use=in_use, compute_flops_per_second_chosen=chosen)
        return fit_windows(self.seed, windows, self.bounds, min_windows=self.settings.min_windows,
                           compute_flops_per_second=in_use, seed_bandwidth_measured=self.seed_source != "default")

    def published(self) -> InUse:
        """What the deployment predicts with after the last refit (the seed's before any)."""
        fit = self.fit
        return InUse(self.in_use.applied_to(self.seed), self.source,
                     fit.windows_used if fit is not None and fit.parameters is not None else 0,
                     fit.residual_ratio if fit is not None and fit.parameters is not None else None,
                     self.held, self.seed_source)


class OnlineCalibrator:
    """Every enabled deployment's online fit, fed by the poller's readings (a poll listener). Each refit
    is published into `setups_in_use`, which the poller and the collector read (hand them the same one)."""

    def __init__(self, deployments: Sequence[Deployment], setups_in_use: SetupsInUse | None = None) -> None:
        self._lock = threading.Lock()
        self.setups_in_use = SetupsInUse() if setups_in_use is None else setups_in_use
        self.deployments: dict[str, DeploymentCalibration] = {}
        enabled = [(deployment, settings) for deployment in deployments
                   if (settings := deployment.online_calibration) is not None and settings.enabled]
        for index, (deployment, settings) in enumerate(enabled):
            calibration = DeploymentCalibration(deployment, settings, Bounds.of_setup(deployment.resolved),
                                                index / len(enabled))
            self._publish(calibration)
            self.deployments[deployment.name] = calibration

    def _publish(self, calibration: DeploymentCalibration) -> None:
        self.setups_in_use.set(calibration.deployment.name, calibration.published())

    def seed_windows(self, deployment: str, windows: Iterable[tuple[tuple[str, ...], FitWindow]],
                     now_seconds: float) -> None:
        """Windows from before this process started (Prometheus): the fit picks up where it was."""
        with self._lock:
            calibration = self.deployments.get(deployment)
            if calibration is None:
                return
            for identity, window in windows:
                calibration.add(identity, window)
            calibration.refit(now_seconds)
            self._publish(calibration)

    def observe(self, readings: Iterable[Reading], now_seconds: float) -> None:
        with self._lock:
            found = windows_from_readings(readings, now_seconds)
            for name, calibration in self.deployments.items():
                windows = found.get(name, [])
                for identity, window in windows:
                    calibration.add(identity, window)
                calibration.keep_engines({identity for identity, _ in windows})
            for calibration in self.deployments.values():
                if calibration.due(now_seconds):
                    calibration.refit(now_seconds)
                    self._publish(calibration)

    def on_poll(self, result: PollResult) -> None:
        """A Poller listener: the poll's readings, at the poll's end."""
        self.observe(result.readings, result.finished_at_seconds)

    def sizes(self) -> tuple[int, int]:
        """(windows kept, engines remembered) over every deployment: at most MAX_WINDOWS_PER_DEPLOYMENT
        windows per deployment, and the engines of the last poll."""
        with self._lock:
            return (sum(len(c.windows) for c in self.deployments.values()),
                    sum(c.engines_seen for c in self.deployments.values()))
