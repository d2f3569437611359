"""The online fit's math: windows in, a fit out (pure: no state, no threads, no logging).

The fit (`fit_windows`) is robust (Huber weights on relative residuals, windows past six robust
standard deviations left out: restarts, preemption storms), pulled toward the seed by a ridge of 0.1% of
what the windows say about each term beyond the others (a numerical guard, not a prior), and bounded to
physically sane values (`FitBounds`; bandwidth and compute at least 5% of peak). It replaces the seed only with
`min_windows` windows whose tokens in flight spread enough, and fits each term only where the windows
identify it (`identify_terms`): tokens in flight that merely follow running requests (a steady context per
request) cannot tell the KV bytes from the per-request cost, so the bandwidth stays at its seed; a steady
running count keeps the per-request cost at its seed; windows that never say how prefill split into
steps, or never reach the compute roof, keep the compute rate. What is held, and why, is exported
(`Fit.held`). Each window's bytes are counted with its engine's own KV dtype and block size
(`window_setup`), as its reading predicts.

Why a module of its own: pure, it is tested and benchmarked on windows alone, and the daemon's refits
(exporter.serve.online_calibration) and `calibrate --prometheus` (exporter.serve.online_seed) fit with
the same code.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from exporter.capacity import model
from exporter.capacity.fit import (
    AGREEMENT_ON_WINDOW_RESIDUALS,
    AGREEMENT_TOLERANCE,
    Calibration,
    CalibrationPoint,
    solve_linear,
)
from exporter.errors import InputError
from exporter.serve.online_fit_types import (
    BANDWIDTH,
    COMPUTE,
    OVERHEAD,
    PER_REQUEST,
    Bounds,
    Fit,
    FitWindow,
    Held,
    Parameters,
)
from exporter.serve.online_settings import DEFAULT_MIN_WINDOWS
from exporter.serve.reading import page_setup

# Tokens in flight must spread this much ((90th - 10th percentile) / median) for the windows to tell
# the fixed costs from the bytes: a single load level fits any split between them.
MIN_TOKENS_SPREAD_RATIO = 0.05
# A term is fitted only where its own column spreads this much beyond what the other free terms'
# columns explain ((90th - 10th percentile of the residual) / median of the column): below it the
# split between them is set by noise and by where the model and the server differ, not by the server.
# On the simulator (2% noise, truth 0.8 x peak), a context-per-request spread giving 0.24 fitted the
# bandwidth 15-19% high; 0.44 and over within 4%.
MIN_OWN_SPREAD_RATIO = 0.4
_HUBER_K = 1.345
_OUTLIER_SIGMAS = 6.0
_MIN_SCALE = 0.01  # relative residual scale floor: 1% noise
_RIDGE = 1e-3  # pull toward the seed, relative to the data's own curvature in each direction
_COMPUTE_FACTORS = (0.5, 0.7, 1.0, 1.4, 2.0)  # compute rates tried, times the seed's
_COMPUTE_MIN_GAIN = 0.9  # a compute rate other than the seed's must cut the robust loss by 10%
_IRLS_ROUNDS = 8
_AT_BOUND_RATIO = 1e-6  # a fitted bandwidth this close to the peak is the bound's, not the windows'


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
                min_spread: float = MIN_TOKENS_SPREAD_RATIO, compute_flops_per_second: float | None = None,
                seed_bandwidth_measured: bool = True) -> Fit:
    """The step's terms that best explain `windows`, robustly, or the seed's with the reason why; the
    terms the windows do not identify (`identify_terms`) stay at the seed's, and `Fit.held` says why.
    `compute_flops_per_second`, where given, is the only compute rate tried (where the windows identify one).

    Where the windows do not identify the bandwidth and the seed's was not measured (a datasheet share,
    `seed_bandwidth_measured` False), the overhead is held at the seed's instead and the bandwidth fitted
    (`_hold_overhead_for_a_guessed_bandwidth`)."""
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
    guessed = [] if seed_bandwidth_measured else _hold_overhead_for_a_guessed_bandwidth(held)
    if guessed:
        held = guessed
    if not mixed:
        held.append(Held(COMPUTE, "no_prefill_mix",
                         f"{sum(1 for window in usable if window.prefill_mix)} of {len(usable)} windows have a mix"))
    elif not _reaches_compute_roof(columns, bounds, min(seed_compute * min(factors), bounds.max_compute)):
        held.append(Held(COMPUTE, "no_compute_bound_steps", "not even at the peak bandwidth and half the seed's "
                                                              "compute rate"))
        factors = (1.0,)
    preferred = 1.0
    if compute_flops_per_second is not None and factors != (1.0,):
        preferred = compute_flops_per_second / seed_compute
        factors = (preferred,)
    best = _best_fit(columns, start, seed_compute, factors, bounds, held, preferred)
    at_peak = bounds.max_bandwidth * (1 - _AT_BOUND_RATIO)
    if guessed and best is not None and best[1].bandwidth_bytes_per_second >= at_peak:
        held = identify_terms(columns) + [h for h in held if h.parameter == COMPUTE]  # the seed's bandwidth after all
        best = _best_fit(columns, start, seed_compute, factors, bounds, held, preferred)
    if best is not None and BANDWIDTH not in {h.parameter for h in held} \
            and best[1].bandwidth_bytes_per_second >= at_peak:
        # No server reads memory at its device's peak: a fit pinned there is the windows asking for a
        # flatter KV slope than the hardware allows, which is the model or the noise, not the server.
        # On a real vLLM (make demo-vllm, 2026-12-04: a 34M model's 136 MB of weights, 4 chats at
        # 770-1,538 tokens in flight) 13 windows fitted 42 GB/s (the host's peak) and 13.4 ms of
        # overhead: 30 ms predicted where two 6,000-token sessions then stepped 73-81 ms, and the
        # calibrated seed's 7.81 GB/s predicted 72 ms.
        held.append(Held(BANDWIDTH, "bandwidth_at_peak", f"the windows' best fit read "
                                                         f"{best[1].bandwidth_bytes_per_second / 1e9:.3g} GB/s, "
                                                         "the device's peak"))
        best = _best_fit(columns, start, seed_compute, factors, bounds, held, preferred)
    if best is None:
        return Fit(None, len(usable), 0, None, "the windows do not determine the step's terms")
    _, parameters, used, residual = best
    return Fit(parameters, len(usable), used, residual, held=tuple(held))


def _hold_overhead_for_a_guessed_bandwidth(held: Sequence[Held]) -> list[Held]:
    """`held` with the overhead held in the bandwidth's place, where the bandwidth is held (else empty).

    Windows whose bytes do not vary apart from the fixed costs cannot split the step between them. Held at a
    guessed seed (a share of the datasheet peak), the bandwidth leaves the whole gap to the overhead, which
    then extrapolates as a fixed cost to every other load: on a real vLLM (CPU backend; its effective memory
    rate ~21% of the host's peak, the seed 60%) a fit over 6 long sessions put ~40 ms in the overhead and
    predicted 8 short chats at +92% (benchmarks/results/real_vllm_shapes.md). Held at the seed's, the overhead
    leaves the gap to the bytes, which extrapolate with the load (8.5% there); a measured seed bandwidth stays
    held, as the windows do not say better."""
    if not any(h.parameter == BANDWIDTH for h in held):
        return []
    reason = next(h for h in held if h.parameter == BANDWIDTH)
    return [h for h in held if h.parameter != BANDWIDTH] + [
        Held(OVERHEAD, "bandwidth_not_identified", f"{reason.detail}: the seed's bandwidth is a datasheet share, "
                                                   "so the bytes take the gap, not a fixed cost")]


def _best_fit(columns: Sequence[_Columns], start: Parameters, seed_compute: float, factors: Sequence[float],
              bounds: Bounds, held: Sequence[Held], preferred: float = 1.0
              ) -> tuple[float, Parameters, int, float] | None:
    """The robust fit at the compute rate (the seed's times one of `factors`) that explains the windows
    best, the terms in `held` at the seed's: (loss, parameters, windows used, median residual). A factor
    other than `preferred` must cut the robust loss by 10%."""
    held_linear = frozenset(_LINEAR.index(h.parameter) for h in held if h.parameter in _LINEAR)
    best: tuple[float, Parameters, int, float] | None = None
    for factor in factors:
        compute = min(max(seed_compute * factor, bounds.min_compute), bounds.max_compute)
        if factor != preferred and compute == min(max(seed_compute * preferred, bounds.min_compute),
                                                  bounds.max_compute):
            continue
        outcome = _robust_fit(columns, start, 1.0 / compute, bounds, held_linear)
        if outcome is None:
            continue
        loss, parameters, used, residual = outcome
        if factor != preferred:
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
        coefficients = solve_linear(gram, moments)
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
            solution = solve_linear(scaled, [moments[a] / scale[a] for a in range(len(free))])
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
            column = solve_linear([list(row) for row in normalized], unit)
        except InputError:
            own.append(_MIN_OWN_CURVATURE)
            continue
        inverse = column[a]
        own.append(min(1.0, max(_MIN_OWN_CURVATURE, 1.0 / inverse)) if inverse > 0 and math.isfinite(inverse)
                   else _MIN_OWN_CURVATURE)
    return own


def fitted_step_seconds(seed: model.ServingSetup, windows: Sequence[FitWindow], parameters: Parameters) -> list[float]:
    """What `parameters` predict for each window's mean step (the fit's own model)."""
    inverse_bandwidth = 1.0 / parameters.bandwidth_bytes_per_second
    inverse_compute = 1.0 / parameters.compute_flops_per_second
    return [_predict(_columns(seed, window), inverse_bandwidth, parameters.step_overhead_seconds,
                     parameters.per_request_seconds, inverse_compute) for window in windows]


def calibration_from_fit(seed: model.ServingSetup, windows: Sequence[FitWindow], fit: Fit, where: str,
                         tolerance: float = AGREEMENT_TOLERANCE) -> Calibration:
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
        points.append(CalibrationPoint(window.measured_step_seconds, window.tokens_in_flight, step.read_bytes,
                                             max(1.0, window.running), step.weight_read_bytes,
                                             step.gemm_compute_seconds * seed.effective_compute_flops_per_second))
    residuals = sorted(abs(f - w.measured_step_seconds) / w.measured_step_seconds
                       for f, w in zip(fitted, usable, strict=True))
    spread = statistics.quantiles(residuals, n=10, method="inclusive")[-1] if len(residuals) > 1 else residuals[0]
    return Calibration(
        effective_bandwidth_bytes_per_second=parameters.bandwidth_bytes_per_second,
        step_overhead_seconds=parameters.step_overhead_seconds, points=tuple(points), fitted_seconds=tuple(fitted),
        spread_ratio=spread, tolerance=tolerance, overhead_fitted=True,
        notes=(f"fitted online from {fit.windows} windows {where} ({fit.windows_used} after leaving out outliers; "
               f"median |residual| {fit.residual_ratio or 0.0:.1%}); spread_ratio is the 90th percentile of the "
               "windows' |relative residuals|, not the spread of lone streams' bandwidths",),
        per_request_seconds=parameters.per_request_seconds, per_request_fitted=True,
        effective_compute_flops_per_second=parameters.compute_flops_per_second,
        agreement_basis=AGREEMENT_ON_WINDOW_RESIDUALS,
    )
