"""Online calibration: the daemon fits the step's terms from the windows it measures.

Each poll window of an engine is one observation: tokens in flight, running requests, prompt tokens
per step and the measured mean step. Per deployment, the windows of the last `history` except the
most recent `holdout` are fitted (bandwidth, per-step overhead, per-request cost and, where windows
are compute-bound, the compute rate), so that a sudden change shows as prediction error (and
StepBudgetPredictionDrift) for `holdout` before the fit absorbs it.

The fit (`fit_windows`) is pure: robust (Huber weights on relative residuals, windows past six robust
standard deviations left out: restarts, preemption storms), pulled toward the seed by a ridge of 0.1% of
what the windows say about each term beyond the others (a numerical guard, not a prior), and bounded to
physically sane values (`model.FitBounds`; bandwidth and compute at least 5% of peak). It replaces the seed only with
`min_windows` windows whose tokens in flight spread enough, and fits each term only where the windows
identify it (`identify_terms`): tokens in flight that merely follow running requests (a steady context per
request) cannot tell the KV bytes from the per-request cost, so the bandwidth stays at its seed; a steady
running count keeps the per-request cost at its seed; windows that never say how prefill split into
steps, or never reach the compute roof, keep the compute rate. What is held, and why, is exported
(`Fit.held`). Each window's bytes are counted with its
engine's own KV dtype and block size (`window_setup`), as its reading predicts. `OnlineCalibrator` is
the wiring: it collects the windows from the poller's readings into each deployment's `WindowHistory`
(thinned by time, so a fleet's fit spans the history as one engine's does), refits (deployments at
staggered phases), swaps the setup the deployment predicts with (`SetupInUse`) and logs every refit
that moves a parameter by more than 5%.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import itertools
import json
import math
import statistics
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import structlog

from exporter.capacity import model
from exporter.capacity.deployment import fit_bounds
from exporter.errors import InputError
from exporter.serve.reading import page_setup

if TYPE_CHECKING:
    from exporter.capacity.deployment import ResolvedSetup
    from exporter.serve.config import Deployment
    from exporter.serve.poller import PollResult
    from exporter.serve.reading import Reading

log = structlog.get_logger("stepbudget.online_calibration")

ONLINE_SOURCE = "online"
DEFAULT_HISTORY_SECONDS = 6 * 3600.0
DEFAULT_HOLDOUT_SECONDS = 1800.0
DEFAULT_MIN_WINDOWS = 30
# Tokens in flight must spread this much ((90th - 10th percentile) / median) for the windows to tell
# the fixed costs from the bytes: a single load level fits any split between them.
MIN_TOKENS_SPREAD_RATIO = 0.05
# A term is fitted only where its own column spreads this much beyond what the other free terms'
# columns explain ((90th - 10th percentile of the residual) / median of the column): below it the
# split between them is set by noise and by where the model and the server differ, not by the server.
# On the simulator (2% noise, truth 0.8 x peak), a context-per-request spread giving 0.24 fitted the
# bandwidth 15-19% high; 0.44 and over within 4%.
MIN_OWN_SPREAD_RATIO = 0.4
# Prefill mixes are kept (and exported, and read back from Prometheus after a restart) in at most this
# many parts: vLLM's iteration-tokens buckets rarely hold more than a decode part, a chunk part and
# one or two in between, and merging the nearest parts keeps the prefill tokens.
MIX_PARTS = 4
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
MIN_RATE_SHARE_OF_PEAK = 0.05  # fitted bandwidth and compute: at least this share of the datasheet peak
_HUBER_K = 1.345
_OUTLIER_SIGMAS = 6.0
_MIN_SCALE = 0.01  # relative residual scale floor: 1% noise
_RIDGE = 1e-3  # pull toward the seed, relative to the data's own curvature in each direction
_COMPUTE_FACTORS = (0.5, 0.7, 1.0, 1.4, 2.0)  # compute rates tried, times the seed's
_COMPUTE_MIN_GAIN = 0.9  # a compute rate other than the seed's must cut the robust loss by 10%
_IRLS_ROUNDS = 8
_AT_BOUND_RATIO = 1e-6  # a fitted bandwidth this close to the peak is the bound's, not the windows'


@dataclass(frozen=True)
class Settings:
    """`online_calibration` of one deployment (defaults merged with its own)."""

    enabled: bool = True
    history_seconds: float = DEFAULT_HISTORY_SECONDS
    holdout_seconds: float = DEFAULT_HOLDOUT_SECONDS
    min_windows: int = DEFAULT_MIN_WINDOWS
    prometheus_url: str | None = None


@dataclass(frozen=True)
class FitWindow:
    """One poll window of one engine: what it held and how long its steps took on average."""

    end_seconds: float
    tokens_in_flight: float
    running: float
    prefill_tokens_per_step: float
    measured_step_seconds: float
    # The window's steps by prefill tokens ((tokens, share) pairs), where the page has the histogram:
    # a few steps with big chunks cost more than the same tokens spread evenly (compute-bound GEMMs).
    prefill_mix: tuple[tuple[float, float], ...] | None = None
    # The KV cache dtype and block size the engine's page reported (None: the config's). The window's
    # bytes are counted with them, as its reading predicted with them (reading.page_setup): fitted with
    # the config's, a page's fp8 cache would read as half the bandwidth's worth of KV bytes too many.
    kv_cache_dtype: str | None = None
    block_size_tokens: int | None = None
    # The mean context the window's prefill tokens attended to (Window.prefill_mean_context_tokens): a
    # chunk after thousands of its prompt's tokens takes longer than the same chunk at its prompt's start.
    prefill_mean_context_tokens: float | None = None
    # The KV bytes per token the engine allocated, where its page says (a float32 server behind a bfloat16
    # config.json): counted as the reading counted them.
    kv_bytes_per_token: float | None = None

    @property
    def usable(self) -> bool:
        numbers = (self.end_seconds, self.tokens_in_flight, self.running, self.prefill_tokens_per_step,
                   self.measured_step_seconds)
        return (all(math.isfinite(value) for value in numbers) and self.running >= 1
                and self.tokens_in_flight >= 0 and self.prefill_tokens_per_step >= 0
                and 0 < self.measured_step_seconds < 60)


@dataclass(frozen=True)
class Parameters:
    bandwidth_bytes_per_second: float
    step_overhead_seconds: float
    per_request_seconds: float
    compute_flops_per_second: float

    @classmethod
    def of(cls, setup: model.ServingSetup) -> Parameters:
        return cls(setup.effective_bandwidth_bytes_per_second, setup.step_overhead_seconds,
                   setup.per_request_seconds, setup.effective_compute_flops_per_second)

    def applied_to(self, setup: model.ServingSetup) -> model.ServingSetup:
        return replace(setup, effective_bandwidth_bytes_per_second=self.bandwidth_bytes_per_second,
                       step_overhead_seconds=self.step_overhead_seconds,
                       per_request_seconds=self.per_request_seconds,
                       effective_compute_flops_per_second=self.compute_flops_per_second)

    def as_dict(self) -> dict[str, float]:
        return {"bandwidth_bytes_per_second": self.bandwidth_bytes_per_second,
                "step_overhead_seconds": self.step_overhead_seconds,
                "per_request_seconds": self.per_request_seconds,
                "compute_flops_per_second": self.compute_flops_per_second}


# Why a term stays at its seed (the `reason` label of stepbudget_online_fit_held_info).
HELD_REASONS = {
    "tokens_follow_running_requests": "tokens in flight only follow running requests (a steady context per "
                                      "request): the KV bytes cannot be told from the per-request cost",
    "tokens_steady": "tokens in flight barely change (at a steady running count): the KV bytes cannot be told "
                     "from the per-step overhead",
    "bandwidth_at_peak": "the windows' best fit put the bandwidth at the device's peak, which no server reaches: "
                         "the KV bytes moved the step too little, or the model reads them wrong, to measure it",
    "running_requests_steady": "running requests barely change: the per-request cost cannot be told from the "
                               "per-step overhead",
    "no_prefill_mix": "fewer than half the windows say how their prefill split into steps (vLLM's "
                      "iteration_tokens_total): spread evenly, a few big chunks read as a slow GPU",
    "no_compute_bound_steps": "no window holds a step past the compute roof: the compute rate changes no prediction",
}
BANDWIDTH, OVERHEAD, PER_REQUEST, COMPUTE = ("bandwidth_bytes_per_second", "step_overhead_seconds",
                                             "per_request_seconds", "compute_flops_per_second")


@dataclass(frozen=True)
class Held:
    """A term the windows do not identify, kept at its seed: `reason` is a HELD_REASONS code, `detail`
    the numbers behind it."""

    parameter: str  # a Parameters field
    reason: str
    detail: str = ""


@dataclass(frozen=True)
class Fit:
    """A fit's outcome. `parameters` is None when the seed stays (`reason` says why); otherwise the
    terms in `held` are the seed's (the windows do not identify them) and the others are fitted."""

    parameters: Parameters | None
    windows: int  # windows offered (inside history, outside the holdout)
    windows_used: int  # after leaving out the outliers
    residual_ratio: float | None  # median |relative residual| of the windows used
    reason: str = ""
    held: tuple[Held, ...] = ()


@dataclass(frozen=True)
class Bounds:
    """Sane ranges, from the GPU's datasheet peaks and model.FitBounds."""

    min_bandwidth: float
    max_bandwidth: float
    max_overhead: float
    max_per_request: float
    min_compute: float
    max_compute: float

    @classmethod
    def of(cls, peak_bandwidth: float, peak_compute: float,
           fit_bounds: model.FitBounds = model.DEFAULT_FIT_BOUNDS) -> Bounds:
        return cls(MIN_RATE_SHARE_OF_PEAK * peak_bandwidth, peak_bandwidth, fit_bounds.max_step_overhead_seconds,
                   fit_bounds.max_per_request_seconds, MIN_RATE_SHARE_OF_PEAK * peak_compute, peak_compute)

    @classmethod
    def of_setup(cls, resolved: ResolvedSetup) -> Bounds:
        """The bounds of a deployment's setup: its GPU's peaks and the limits `calibrate` fits within
        (capacity.deployment.fit_bounds), so the online fit and a calibration file agree on what is sane."""
        limits = fit_bounds(resolved)
        return cls.of(limits.max_bandwidth_bytes_per_second, limits.max_compute_flops_per_second, limits)


@dataclass(frozen=True)
class _Phase:
    """What the model says one kind of step in a window did, independent of the fitted rates."""

    share: float
    weight_bytes: float
    kv_bytes: float
    gemm_flops: float
    attention_flops: float


@dataclass(frozen=True)
class _Columns:
    seconds: float
    running: float
    phases: tuple[_Phase, ...]


def window_setup(seed: model.ServingSetup, window: FitWindow) -> model.ServingSetup:
    """The setup the window's engine ran with: the seed's rates, the engine's own KV dtype and block
    size. The same function the reading predicts with, so the fit and the prediction count one setup."""
    return page_setup(seed, window.kv_cache_dtype, window.block_size_tokens, window.kv_bytes_per_token)


def _columns(seed: model.ServingSetup, window: FitWindow) -> _Columns:
    groups = model.groups_from_total(window.tokens_in_flight, window.running)
    mix = window.prefill_mix or ((window.prefill_tokens_per_step, 1.0),)
    total = sum(share for _, share in mix) or 1.0
    setup = window_setup(seed, window)
    compute = setup.effective_compute_flops_per_second
    phases, running = [], 0.0
    for tokens, share in mix:
        step = model.predict_step(setup, groups, tokens, prefill_mean_context_tokens=window.prefill_mean_context_tokens)
        running = step.decode_tokens
        phases.append(_Phase(share / total, step.weight_read_bytes, step.kv_read_bytes,
                             step.gemm_compute_seconds * compute, step.attention_compute_seconds * compute))
    return _Columns(window.measured_step_seconds, running, tuple(phases))


def _predict(column: _Columns, inverse_bandwidth: float, overhead: float, per_request: float,
             inverse_compute: float) -> float:
    return overhead + per_request * column.running + sum(
        phase.share * (max(phase.weight_bytes * inverse_bandwidth, phase.gemm_flops * inverse_compute)
                       + max(phase.kv_bytes * inverse_bandwidth, phase.attention_flops * inverse_compute))
        for phase in column.phases)


def fit_mix(mix: Sequence[tuple[float, float]] | None, parts: int = MIX_PARTS
            ) -> tuple[tuple[float, float], ...] | None:
    """A window's prefill mix as the fit keeps it: (tokens, share) parts in token order, shares summing
    to 1, at most `parts` of them. Past that the two neighbours whose merge moves the fewest
    share-weighted tokens (Ward's criterion) become one part at their mean, so the window's prefill
    tokens are kept and a decode part is never averaged with a chunk part while closer parts remain."""
    points = sorted((float(tokens), float(share)) for tokens, share in mix or ()
                    if math.isfinite(tokens) and tokens >= 0 and math.isfinite(share) and share > 0)
    total = sum(share for _, share in points)
    if not points or not total > 0:
        return None
    merged: list[tuple[float, float]] = []
    for tokens, share in points:  # parts of equal tokens (buckets under the decode tokens all read 0) are one
        if merged and merged[-1][0] == tokens:
            merged[-1] = (tokens, merged[-1][1] + share / total)
        else:
            merged.append((tokens, share / total))
    while len(merged) > max(1, parts):
        def cost(i: int) -> float:
            (a, wa), (b, wb) = merged[i], merged[i + 1]
            return wa * wb / (wa + wb) * (b - a) ** 2
        i = min(range(len(merged) - 1), key=cost)
        (a, wa), (b, wb) = merged[i], merged[i + 1]
        merged[i:i + 2] = [((a * wa + b * wb) / (wa + wb), wa + wb)]
    return tuple(merged)


def setup_key(resolved: ResolvedSetup) -> str:
    """What a window's step time depends on besides its own load: the model's architecture, the device
    (name, memory, peaks), the tensor parallelism and the weights' bytes per parameter. Windows of
    another setup (a new GPU, TP or quantization) say nothing about this one's terms. Not in it: the
    rates (what the fit finds), the KV dtype and block size (each window carries its engine's own)."""
    setup = resolved.setup
    architecture = {name: value for name, value in dataclasses.asdict(setup.architecture).items() if name != "source"}
    gpu = resolved.gpu
    identity = {"architecture": architecture, "gpu": gpu.name, "gpu_memory_bytes": setup.gpu_memory_bytes,
                "peak_bandwidth": gpu.peak_bandwidth_bytes_per_second,
                "peak_flops": sorted(gpu.peak_flops_per_second.items()), "tensor_parallel": setup.tensor_parallel,
                "weight_bytes_per_param": setup.weight_bytes_per_param}
    text = json.dumps(identity, sort_keys=True, default=repr)
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def tokens_spread_ratio(windows: Sequence[FitWindow]) -> float:
    """(90th - 10th percentile) / median of the windows' tokens in flight."""
    tokens = sorted(window.tokens_in_flight for window in windows)
    if len(tokens) < 2:
        return 0.0
    deciles = statistics.quantiles(tokens, n=10, method="inclusive")
    median = statistics.median(tokens)
    return (deciles[-1] - deciles[0]) / median if median > 0 else 0.0


def fit_windows(seed: model.ServingSetup, windows: Sequence[FitWindow], bounds: Bounds, *,
                min_windows: int = DEFAULT_MIN_WINDOWS,
                min_spread: float = MIN_TOKENS_SPREAD_RATIO) -> Fit:
    """The step's terms that best explain `windows`, robustly, or the seed's with the reason why; the
    terms the windows do not identify (`identify_terms`) stay at the seed's, and `Fit.held` says why."""
    usable = [window for window in windows if window.usable]
    if len(usable) < min_windows:
        return Fit(None, len(usable), 0, None, f"{len(usable)} windows, fewer than {min_windows}")
    spread = tokens_spread_ratio(usable)
    if spread < min_spread:
        return Fit(None, len(usable), 0, None,
                   f"tokens in flight spread {spread:.0%}, less than {min_spread:.0%}: one load level cannot "
                   "tell fixed costs from bytes")
    columns = [_columns(seed, window) for window in usable]
    start = Parameters.of(seed)
    seed_compute = min(max(start.compute_flops_per_second, bounds.min_compute), bounds.max_compute)
    # A compute rate only from windows that say how their prefill split into steps: spread evenly over
    # every step, a few big chunks would read as a slow GPU.
    mixed = sum(1 for window in usable if window.prefill_mix) * 2 >= len(usable)
    factors = _COMPUTE_FACTORS if mixed else (1.0,)
    held = identify_terms(columns)
    if not mixed:
        held.append(Held(COMPUTE, "no_prefill_mix",
                         f"{sum(1 for window in usable if window.prefill_mix)} of {len(usable)} windows have a mix"))
    elif not _reaches_compute_roof(columns, bounds, min(seed_compute * min(factors), bounds.max_compute)):
        held.append(Held(COMPUTE, "no_compute_bound_steps", "not even at the peak bandwidth and half the seed's "
                                                              "compute rate"))
        factors = (1.0,)
    best = _best_fit(columns, start, seed_compute, factors, bounds, held)
    if best is not None and BANDWIDTH not in {h.parameter for h in held} \
            and best[1].bandwidth_bytes_per_second >= bounds.max_bandwidth * (1 - _AT_BOUND_RATIO):
        # No server reads memory at its device's peak: a fit pinned there is the windows asking for a
        # flatter KV slope than the hardware allows, which is the model or the noise, not the server.
        # On a real vLLM (make demo-vllm, 2026-12-04: a 34M model's 136 MB of weights, 4 chats at
        # 770-1,538 tokens in flight) 13 windows fitted 42 GB/s (the host's peak) and 13.4 ms of
        # overhead: 30 ms predicted where two 6,000-token sessions then stepped 73-81 ms, and the
        # calibrated seed's 7.81 GB/s predicted 72 ms.
        held.append(Held(BANDWIDTH, "bandwidth_at_peak", f"the windows' best fit read "
                                                         f"{best[1].bandwidth_bytes_per_second / 1e9:.3g} GB/s, "
                                                         "the device's peak"))
        best = _best_fit(columns, start, seed_compute, factors, bounds, held)
    if best is None:
        return Fit(None, len(usable), 0, None, "the windows do not determine the step's terms")
    _, parameters, used, residual = best
    return Fit(parameters, len(usable), used, residual, held=tuple(held))


def _best_fit(columns: Sequence[_Columns], start: Parameters, seed_compute: float, factors: Sequence[float],
              bounds: Bounds, held: Sequence[Held]) -> tuple[float, Parameters, int, float] | None:
    """The robust fit at the compute rate (the seed's times one of `factors`) that explains the windows
    best, the terms in `held` at the seed's: (loss, parameters, windows used, median residual)."""
    held_linear = frozenset(_LINEAR.index(h.parameter) for h in held if h.parameter in _LINEAR)
    best: tuple[float, Parameters, int, float] | None = None
    for factor in factors:
        compute = min(max(seed_compute * factor, bounds.min_compute), bounds.max_compute)
        if factor != 1.0 and compute == seed_compute:
            continue
        outcome = _robust_fit(columns, start, 1.0 / compute, bounds, held_linear)
        if outcome is None:
            continue
        loss, parameters, used, residual = outcome
        if factor != 1.0:
            loss /= _COMPUTE_MIN_GAIN  # the seed's compute rate unless another clearly explains more
        if best is None or loss < best[0]:
            best = (loss, replace(parameters, compute_flops_per_second=compute), used, residual)
    return best


# The linear terms' order in the fit (theta): 1 / bandwidth, overhead, per-request cost.
_LINEAR = (BANDWIDTH, OVERHEAD, PER_REQUEST)


def identify_terms(columns: Sequence[_Columns], min_own_spread: float = MIN_OWN_SPREAD_RATIO) -> list[Held]:
    """The linear terms the windows cannot tell from the others, to keep at the seed.

    A term is told from the others only by the part of its column that theirs do not explain: the
    per-request cost by the running requests beyond a constant, the bandwidth by the KV bytes beyond
    a constant and the running requests. With the context per request steady, the KV bytes follow the
    running requests and any split between bandwidth and per-request cost fits alike (the seed's, or
    noise, decides it, and a long context is then predicted with a bandwidth no window measured); with
    a steady running count the per-request cost is the overhead's. The bandwidth is held before the
    per-request cost where both fail (the seed's bandwidth comes from a datasheet or `calibrate`; the
    per-request cost then takes what the running requests' spread identifies). The overhead is
    identified once these are."""
    weights = [1.0 / column.seconds ** 2 for column in columns]
    running = [column.running for column in columns]
    kv_bytes = [sum(phase.share * phase.kv_bytes for phase in column.phases) for column in columns]
    held: list[Held] = []
    running_spread = _own_spread(running, [], weights)
    if running_spread < min_own_spread:
        held.append(Held(PER_REQUEST, "running_requests_steady",
                         f"running requests spread {running_spread:.0%}, less than {min_own_spread:.0%}"))
        kv_spread = _own_spread(kv_bytes, [], weights)
        if kv_spread < min_own_spread:
            held.append(Held(BANDWIDTH, "tokens_steady",
                             f"KV bytes spread {kv_spread:.0%} at a steady running count, less than "
                             f"{min_own_spread:.0%}"))
        return held
    kv_spread = _own_spread(kv_bytes, [running], weights)
    if kv_spread < min_own_spread:
        held.append(Held(BANDWIDTH, "tokens_follow_running_requests",
                         f"KV bytes spread {kv_spread:.0%} beyond what running requests explain, less than "
                         f"{min_own_spread:.0%}"))
    return held


def _own_spread(column: Sequence[float], others: Sequence[Sequence[float]], weights: Sequence[float]) -> float:
    """(90th - 10th percentile) / median of what is left of `column` after a weighted least-squares fit
    on a constant and `others`: the column's own spread, the only part that can identify its term."""
    regressors = [[1.0] * len(column), *others]
    size = len(regressors)
    gram = [[sum(w * a * b for w, a, b in zip(weights, regressors[i], regressors[j], strict=True))
             for j in range(size)] for i in range(size)]
    moments = [sum(w * a * y for w, a, y in zip(weights, regressors[i], column, strict=True)) for i in range(size)]
    for i in range(size):
        gram[i][i] += 1e-12 * gram[i][i] + 1e-300  # a regressor constant too is no error: nothing of it to use
    try:
        coefficients = model.solve_linear(gram, moments)
    except InputError:
        return 0.0
    residuals = sorted(y - sum(c * regressors[i][k] for i, c in enumerate(coefficients))
                       for k, y in enumerate(column))
    median = statistics.median(column)
    if len(residuals) < 2 or not median > 0:
        return 0.0
    deciles = statistics.quantiles(residuals, n=10, method="inclusive")
    return (deciles[-1] - deciles[0]) / median


def _reaches_compute_roof(columns: Sequence[_Columns], bounds: Bounds, lowest_compute: float) -> bool:
    """Whether any window has a phase that is compute-bound at the peak bandwidth and `lowest_compute`:
    if none, no compute rate tried changes any prediction."""
    inverse_bandwidth, inverse_compute = 1.0 / bounds.max_bandwidth, 1.0 / lowest_compute
    return any(phase.gemm_flops * inverse_compute > phase.weight_bytes * inverse_bandwidth
               or phase.attention_flops * inverse_compute > phase.kv_bytes * inverse_bandwidth
               for column in columns for phase in column.phases)


def _robust_fit(columns: Sequence[_Columns], start: Parameters, inverse_compute: float, bounds: Bounds,
                held: frozenset[int] = frozenset()) -> tuple[float, Parameters, int, float] | None:
    """Iteratively reweighted least squares over (1/bandwidth, overhead, per-request) at one compute
    rate; the terms in `held` (indices into _LINEAR) stay at the seed's."""
    theta = [1.0 / min(max(start.bandwidth_bytes_per_second, bounds.min_bandwidth), bounds.max_bandwidth),
             min(start.step_overhead_seconds, bounds.max_overhead),
             min(start.per_request_seconds, bounds.max_per_request)]
    prior = list(theta)
    lower = [1.0 / bounds.max_bandwidth, 0.0, 0.0]
    upper = [1.0 / bounds.min_bandwidth, bounds.max_overhead, bounds.max_per_request]
    weights = [1.0] * len(columns)
    for _ in range(_IRLS_ROUNDS):
        rows, targets = [], []
        for column in columns:
            memory_bytes, fixed = 0.0, 0.0
            for phase in column.phases:  # each phase memory- or compute-bound at the current bandwidth
                gemm_compute = phase.gemm_flops * inverse_compute
                attention_compute = phase.attention_flops * inverse_compute
                if phase.weight_bytes * theta[0] >= gemm_compute:
                    memory_bytes += phase.share * phase.weight_bytes
                else:
                    fixed += phase.share * gemm_compute
                if phase.kv_bytes * theta[0] >= attention_compute:
                    memory_bytes += phase.share * phase.kv_bytes
                else:
                    fixed += phase.share * attention_compute
            rows.append((memory_bytes, 1.0, column.running))
            targets.append(column.seconds - fixed)
        solved = _bounded_ridge(rows, targets, [w / c.seconds ** 2 for w, c in zip(weights, columns, strict=True)],
                                prior, lower, upper, held)
        if solved is None:
            return None
        theta = solved
        residuals = [(_predict(c, theta[0], theta[1], theta[2], inverse_compute) - c.seconds) / c.seconds
                     for c in columns]
        scale = max(_MIN_SCALE, 1.4826 * statistics.median(abs(r) for r in residuals))
        weights = [0.0 if abs(r) > _OUTLIER_SIGMAS * scale else min(1.0, _HUBER_K * scale / abs(r)) if r else 1.0
                   for r in residuals]
    used = [abs(r) for r, w in zip(residuals, weights, strict=True) if w > 0]
    if not used:
        return None
    loss = sum(_huber(r / scale) for r in residuals) * scale ** 2 / len(residuals)
    parameters = Parameters(1.0 / theta[0], theta[1], theta[2], 1.0 / inverse_compute)
    return loss, parameters, len(used), statistics.median(used)


def _huber(x: float) -> float:
    if abs(x) > _OUTLIER_SIGMAS:
        return _HUBER_K * (_OUTLIER_SIGMAS - _HUBER_K / 2)
    return x * x / 2 if abs(x) <= _HUBER_K else _HUBER_K * (abs(x) - _HUBER_K / 2)


def _bounded_ridge(rows: Sequence[tuple[float, float, float]], targets: Sequence[float], weights: Sequence[float],
                   prior: list[float], lower: list[float], upper: list[float], held: frozenset[int] = frozenset()
                   ) -> list[float] | None:
    """Weighted least squares pulled toward `prior` by a small ridge, each coefficient held inside its
    bounds: one that leaves them is fixed at the bound and the rest are solved again. The coefficients
    in `held` are the prior's (clamped to their bounds).

    The ridge in each direction is _RIDGE of the data's own curvature there: of what the windows say
    about that coefficient beyond what the others explain (1 / the diagonal of the inverse normal
    matrix), not of its raw sum of squares. A bandwidth column is mostly the weights' constant bytes,
    so a ridge on its raw sum pulled a bandwidth the windows did identify 10-20% toward the seed."""
    fixed: dict[int, float] = {j: min(max(prior[j], lower[j]), upper[j]) for j in held}
    for _ in range(4):
        free = [j for j in range(3) if j not in fixed]
        if not free:
            break
        gram = [[0.0] * len(free) for _ in free]
        moments = [0.0] * len(free)
        for row, target, weight in zip(rows, targets, weights, strict=True):
            if weight <= 0:
                continue
            rest = target - sum(row[j] * value for j, value in fixed.items())
            for a, j in enumerate(free):
                moments[a] += weight * row[j] * rest
                for b, k in enumerate(free):
                    gram[a][b] += weight * row[j] * row[k]
        scale = [math.sqrt(gram[a][a]) or 1.0 for a in range(len(free))]
        own = _own_curvature([[gram[a][b] / (scale[a] * scale[b]) for b in range(len(free))]
                              for a in range(len(free))])
        for a, j in enumerate(free):
            ridge = _RIDGE * own[a] * gram[a][a] if gram[a][a] > 0 else 1.0 / (prior[j] or 1.0) ** 2
            gram[a][a] += ridge
            moments[a] += ridge * prior[j]
        scaled = [[gram[a][b] / (scale[a] * scale[b]) for b in range(len(free))] for a in range(len(free))]
        try:
            solution = model.solve_linear(scaled, [moments[a] / scale[a] for a in range(len(free))])
        except InputError:  # singular: nothing to fit
            return None
        values = {j: solution[a] / scale[a] for a, j in enumerate(free)}
        if not all(math.isfinite(value) for value in values.values()):
            return None
        outside = {j: min(max(value, lower[j]), upper[j]) for j, value in values.items()
                   if not lower[j] <= value <= upper[j]}
        if not outside:
            return [fixed.get(j, values.get(j, 0.0)) for j in range(3)]
        fixed.update(outside)
    return [fixed.get(j, min(max(prior[j], lower[j]), upper[j])) for j in range(3)]


_MIN_OWN_CURVATURE = 1e-6  # a direction the windows all but leave open still gets a ridge, for the solve


def _own_curvature(normalized: list[list[float]]) -> list[float]:
    """For a normal matrix with unit diagonal, each coefficient's curvature beyond the others' (the
    share of its column the other columns leave unexplained: 1 / the inverse's diagonal), 0-1."""
    size = len(normalized)
    own = []
    for a in range(size):
        try:
            unit = [1.0 if b == a else 0.0 for b in range(size)]
            column = model.solve_linear([list(row) for row in normalized], unit)
        except InputError:
            own.append(_MIN_OWN_CURVATURE)
            continue
        inverse = column[a]
        own.append(min(1.0, max(_MIN_OWN_CURVATURE, 1.0 / inverse)) if inverse > 0 and math.isfinite(inverse)
                   else _MIN_OWN_CURVATURE)
    return own


# --- the wiring -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InUse:
    """What a deployment predicts with now: the setup, where its rates came from, and the online fit.
    A term in `held` is the seed's (source `seed_source`), the windows did not identify it."""

    setup: model.ServingSetup
    source: str
    fit_windows: int = 0
    fit_residual_ratio: float | None = None
    held: tuple[Held, ...] = ()
    seed_source: str = ""

    def source_of(self, parameter: str) -> str:
        """Where one term (a Parameters field) came from: the seed's source where the fit held it."""
        if self.seed_source and any(held.parameter == parameter for held in self.held):
            return self.seed_source
        return self.source


class SetupInUse:
    """The one mutable thing a Deployment carries: the setup it predicts with (the seed until the
    online fit replaces it). Swapped whole, so a reader sees an old or a new InUse, never a mix."""

    def __init__(self) -> None:
        self._current: InUse | None = None

    def get(self) -> InUse | None:
        return self._current

    def set(self, in_use: InUse | None) -> None:
        self._current = in_use


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
        fit = fit_windows(self.seed, self.windows_for_fit(now_seconds), self.bounds,
                          min_windows=self.settings.min_windows)
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

    def publish(self) -> None:
        fit = self.fit
        self.deployment.setup_in_use.set(InUse(
            self.in_use.applied_to(self.seed), self.source,
            fit.windows_used if fit is not None and fit.parameters is not None else 0,
            fit.residual_ratio if fit is not None and fit.parameters is not None else None,
            self.held, self.seed_source))


class OnlineCalibrator:
    """Every enabled deployment's online fit, fed by the poller's readings (a poll listener)."""

    def __init__(self, deployments: Sequence[Deployment]) -> None:
        self._lock = threading.Lock()
        self.deployments: dict[str, DeploymentCalibration] = {}
        enabled = [(deployment, settings) for deployment in deployments
                   if (settings := deployment.online_calibration) is not None and settings.enabled]
        for index, (deployment, settings) in enumerate(enabled):
            calibration = DeploymentCalibration(deployment, settings, Bounds.of_setup(deployment.resolved),
                                                index / len(enabled))
            calibration.publish()
            self.deployments[deployment.name] = calibration

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
            calibration.publish()

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
                    calibration.publish()

    def on_poll(self, result: PollResult) -> None:
        """A Poller listener: the poll's readings, at the poll's end."""
        self.observe(result.readings, result.finished_at_seconds)

    def sizes(self) -> tuple[int, int]:
        """(windows kept, engines remembered) over every deployment: at most MAX_WINDOWS_PER_DEPLOYMENT
        windows per deployment, and the engines of the last poll."""
        with self._lock:
            return (sum(len(c.windows) for c in self.deployments.values()),
                    sum(c.engines_seen for c in self.deployments.values()))


def fitted_step_seconds(seed: model.ServingSetup, windows: Sequence[FitWindow], parameters: Parameters) -> list[float]:
    """What `parameters` predict for each window's mean step (the fit's own model)."""
    inverse_bandwidth = 1.0 / parameters.bandwidth_bytes_per_second
    inverse_compute = 1.0 / parameters.compute_flops_per_second
    return [_predict(_columns(seed, window), inverse_bandwidth, parameters.step_overhead_seconds,
                     parameters.per_request_seconds, inverse_compute) for window in windows]


def calibration_from_fit(seed: model.ServingSetup, windows: Sequence[FitWindow], fit: Fit, where: str,
                         tolerance: float = model.AGREEMENT_TOLERANCE) -> model.Calibration:
    """The fit as `calibrate --json` writes it, so it serves as a deployment's calibration file.

    Windows are not lone streams, so their own bandwidths differ by design; the agreement check here
    is on the fit: `spread_ratio` is the 90th percentile of the windows' |relative residuals|."""
    if fit.parameters is None:
        raise InputError(f"no fit from {where}: {fit.reason}")
    usable = [window for window in windows if window.usable]
    parameters = fit.parameters
    fitted = fitted_step_seconds(seed, usable, parameters)
    points = []
    for window in usable:
        groups = model.groups_from_total(window.tokens_in_flight, window.running)
        step = model.predict_step(window_setup(seed, window), groups, window.prefill_tokens_per_step)
        points.append(model.CalibrationPoint(window.measured_step_seconds, window.tokens_in_flight, step.read_bytes,
                                             max(1.0, window.running), step.weight_read_bytes,
                                             step.gemm_compute_seconds * seed.effective_compute_flops_per_second))
    residuals = sorted(abs(f - w.measured_step_seconds) / w.measured_step_seconds
                       for f, w in zip(fitted, usable, strict=True))
    spread = statistics.quantiles(residuals, n=10, method="inclusive")[-1] if len(residuals) > 1 else residuals[0]
    return model.Calibration(
        effective_bandwidth_bytes_per_second=parameters.bandwidth_bytes_per_second,
        step_overhead_seconds=parameters.step_overhead_seconds, points=tuple(points), fitted_seconds=tuple(fitted),
        spread_ratio=spread, tolerance=tolerance, overhead_fitted=True,
        notes=(f"fitted online from {fit.windows} windows {where} ({fit.windows_used} after leaving out outliers; "
               f"median |residual| {fit.residual_ratio or 0.0:.1%}); spread_ratio is the 90th percentile of the "
               "windows' |relative residuals|, not the spread of lone streams' bandwidths",),
        per_request_seconds=parameters.per_request_seconds, per_request_fitted=True,
        effective_compute_flops_per_second=parameters.compute_flops_per_second,
        agreement_basis=model.AGREEMENT_ON_WINDOW_RESIDUALS,
    )
