"""The offline fit: measured steps (inter-token latency at known bytes read) into the model's terms.

One job: least squares over `CalibrationPoint`s, fitting the effective bandwidth and, where the points
allow, the per-step overhead, the per-request cost and a compute rate, each held to physically sane
bounds (`FitBounds`), with a verdict on whether the model explains the points at all (`Calibration`).

Why apart from the model (exporter/capacity/model.py): the model predicts a step from an architecture
and a serving setup; the fit only sees numbers per point and never an architecture, so it is read,
tested and changed without the step math (`model.calibration_point` turns a measured gap into a point).
Pure functions over dataclasses, like the model: no I/O, no clocks, no logging.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from exporter.errors import InputError

AGREEMENT_TOLERANCE = 0.15


@dataclass(frozen=True)
class CalibrationPoint:
    """One measured step: its inter-token latency, tokens in flight, the bytes a step read at it,
    and (for batches) the running requests, the weight part of the bytes and the GEMM FLOPs."""

    itl_seconds: float
    tokens_in_flight: float
    read_bytes: float
    running_requests: float = 1.0
    weight_read_bytes: float = 0.0
    gemm_flops: float = 0.0

    @property
    def bandwidth_bytes_per_second(self) -> float:
        """The point's own bandwidth, taking the whole gap as memory time (no overhead)."""
        return self.read_bytes / self.itl_seconds


def residual_ratios(points: Sequence[CalibrationPoint], fitted_seconds: Sequence[float]) -> tuple[float, ...]:
    """(fitted - measured) / measured, point by point."""
    return tuple((fit - p.itl_seconds) / p.itl_seconds for p, fit in zip(points, fitted_seconds, strict=True))


AGREEMENT_ON_BANDWIDTHS, AGREEMENT_ON_FIT_RESIDUALS = "bandwidths", "fit_residuals"
AGREEMENT_ON_WINDOW_RESIDUALS = "window_residuals_p90"  # online fits: many windows, a few may be outliers


@dataclass(frozen=True)
class Calibration:
    effective_bandwidth_bytes_per_second: float
    step_overhead_seconds: float
    points: tuple[CalibrationPoint, ...]
    fitted_seconds: tuple[float, ...]
    spread_ratio: float
    tolerance: float = AGREEMENT_TOLERANCE
    overhead_fitted: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    per_request_seconds: float = 0.0
    per_request_fitted: bool = False
    effective_compute_flops_per_second: float | None = None  # None: not fitted
    # What spread_ratio measures: BANDWIDTHS (one batch size), FIT_RESIDUALS (several batch sizes: the
    # largest miss) or WINDOW_RESIDUALS (an online fit: the 90th percentile miss over its windows).
    agreement_basis: str = AGREEMENT_ON_BANDWIDTHS

    @property
    def agrees(self) -> bool:
        """The model fits this server: the points' own bandwidths agree within tolerance (one batch
        size), or the fitted terms reproduce every point within it (several batch sizes)."""
        return self.spread_ratio <= self.tolerance

    @property
    def residual_ratios(self) -> tuple[float, ...]:
        return residual_ratios(self.points, self.fitted_seconds)

    @property
    def residual_rms_seconds(self) -> float:
        """Root mean square of the fit's residuals: how far the fitted terms are from the points."""
        squares = [(fit - p.itl_seconds) ** 2 for p, fit in zip(self.points, self.fitted_seconds, strict=True)]
        return math.sqrt(sum(squares) / len(squares))


@dataclass(frozen=True)
class FitBounds:
    """Physically sane ranges for fitted terms; a fit that leaves them is not trusted.

    Per-request costs measured on published tables are 50-130 us (sampling, per-sequence input
    preparation, a TP all-reduce growing with the batch); per-step overheads (scheduling, launches)
    are a few ms. Bandwidth and compute cannot exceed the GPU's datasheet peaks (inf: unknown)."""

    max_bandwidth_bytes_per_second: float = math.inf
    max_compute_flops_per_second: float = math.inf
    max_step_overhead_seconds: float = 0.05
    max_per_request_seconds: float = 300e-6

    def __post_init__(self) -> None:
        for name, value in (("max_bandwidth_bytes_per_second", self.max_bandwidth_bytes_per_second),
                            ("max_compute_flops_per_second", self.max_compute_flops_per_second),
                            ("max_step_overhead_seconds", self.max_step_overhead_seconds),
                            ("max_per_request_seconds", self.max_per_request_seconds)):
            if not value > 0:
                raise InputError(f"{name} must be greater than zero, got {value!r}")

    def upper(self, term: str) -> float:
        return self.max_step_overhead_seconds if term == _OVERHEAD else self.max_per_request_seconds


DEFAULT_FIT_BOUNDS = FitBounds()


# Terms a calibration can fit besides the bandwidth, by the point column that carries each.
_OVERHEAD, _PER_REQUEST = "overhead", "per_request"
# Compute rates tried when the points allow a compute fit (FLOP/s): 1 TFLOP/s to 10 PFLOP/s.
_COMPUTE_GRID_FLOPS = tuple(10 ** (12 + step / 20) for step in range(81))
# A compute rate is kept only where it cuts the squared residuals by this share: it must earn its place.
_COMPUTE_MIN_IMPROVEMENT = 0.5


def calibrate(points: Iterable[CalibrationPoint], tolerance: float = AGREEMENT_TOLERANCE,
              bounds: FitBounds = DEFAULT_FIT_BOUNDS) -> Calibration:
    """Fit the step's terms to measured points, least squares.

    itl = overhead + per_request * running + read_bytes / bandwidth (+ the GEMM FLOPs beyond the
    weight read, at a fitted compute rate, where the points allow it). Bandwidth is always fitted;
    a per-request cost where the running requests differ; an overhead where the bytes differ and a
    point is left over; compute where points are left over after those and it halves the residuals.
    A term fitted negative, or past its bound in `bounds` (the points cannot separate it reliably:
    a per-request cost of milliseconds is a bad point, not sampling), is dropped with a note and the
    rest refitted; a bandwidth past the GPU's peak drops the last extra term, and failing that is
    held at the peak; compute rates are searched up to the peak only.

    The agreement verdict, at one batch size, compares the points' own bandwidths (no overhead): a
    spread over `tolerance` means bytes read alone do not explain the gaps (prefix caching, quantized
    cache, MoE routing, or large fixed overheads). At several batch sizes the points' own bandwidths
    differ by the per-request cost even when the model fits exactly (1 request at 7.2 ms and 16 at
    9.5 ms on Qwen3-8B spread 16% with a 90 us cost that reproduces both), so the verdict is the
    fit's largest miss instead; a per-request cost past its bound is dropped first, so a bad point
    still shows as a miss rather than being absorbed.
    """
    points = tuple(points)
    _validate_points(points)
    bandwidths = [point.bandwidth_bytes_per_second for point in points]
    spread = max(bandwidths) / min(bandwidths) - 1.0
    notes: list[str] = []
    terms = _identifiable_terms(points)
    memory_notes: list[str] = []
    coefficients = _fit_non_negative(points, terms, memory_notes, 0.0, bounds)
    # A compute rate needs a point to spare beyond the terms it joins: with none it fits any two points exactly.
    inverse_compute = _fit_compute(points, terms, coefficients, bounds) if len(points) > len(terms) + 2 else 0.0
    if inverse_compute:  # compute-bound points distort a memory-only fit: refit every term with it
        coefficients = _fit_non_negative(points, terms, notes, inverse_compute, bounds)
    else:
        notes += memory_notes
    fitted_seconds = tuple(_fitted_seconds(p, coefficients, inverse_compute) for p in points)
    basis = AGREEMENT_ON_BANDWIDTHS
    if len({p.running_requests for p in points}) >= 2:
        basis = AGREEMENT_ON_FIT_RESIDUALS
        spread = max(abs(ratio) for ratio in residual_ratios(points, fitted_seconds))
    return Calibration(
        effective_bandwidth_bytes_per_second=1.0 / coefficients["inverse_bandwidth"],
        step_overhead_seconds=coefficients.get(_OVERHEAD, 0.0),
        points=points,
        fitted_seconds=fitted_seconds,
        spread_ratio=spread,
        tolerance=tolerance,
        overhead_fitted=_OVERHEAD in coefficients,
        notes=tuple(notes),
        per_request_seconds=coefficients.get(_PER_REQUEST, 0.0),
        per_request_fitted=_PER_REQUEST in coefficients,
        effective_compute_flops_per_second=1.0 / inverse_compute if inverse_compute else None,
        agreement_basis=basis,
    )


def _validate_points(points: tuple[CalibrationPoint, ...]) -> None:
    if not points:
        raise InputError("calibration needs at least one point")
    for point in points:
        if not point.itl_seconds > 0 or not point.read_bytes > 0 or point.tokens_in_flight < 0 \
                or not point.running_requests >= 1:
            raise InputError(
                f"calibration point {point.itl_seconds}@{point.tokens_in_flight}: inter-token latency "
                "must be greater than zero, tokens in flight not negative and running requests at least 1"
            )


def _identifiable_terms(points: tuple[CalibrationPoint, ...]) -> list[str]:
    """Which terms the points can tell apart from the bandwidth: one column each, one point each.

    A per-request cost comes first where the batch sizes differ: it is what carries a fit from
    small batches to large ones. Points at one batch size (one stream) leave it inside the overhead."""
    terms: list[str] = []
    if len({p.running_requests for p in points}) >= 2:
        terms.append(_PER_REQUEST)
    if len({p.read_bytes for p in points}) >= 2 and len(points) > len(terms) + 1:
        terms.append(_OVERHEAD)
    return terms


def _column(point: CalibrationPoint, term: str) -> float:
    return 1.0 if term == _OVERHEAD else point.running_requests


def _design_rows(points: tuple[CalibrationPoint, ...], terms: list[str]) -> list[list[float]]:
    """One least-squares row per point: its bytes (for 1/bandwidth), then one column per extra term."""
    return [[p.read_bytes] + [_column(p, term) for term in terms] for p in points]


def _fit_non_negative(points: tuple[CalibrationPoint, ...], terms: list[str], notes: list[str],
                      inverse_compute: float, bounds: FitBounds = DEFAULT_FIT_BOUNDS) -> dict[str, float]:
    """Least squares over bandwidth and `terms`; a term fitted negative or past its bound is dropped
    (noted) and the rest refitted; a bandwidth past the peak drops the last term, or is held at the peak."""
    active = list(terms)
    while True:
        rows = _design_rows(points, active)
        try:
            solution = _least_squares(rows, [p.itl_seconds for p in points])
            for _ in range(4 if inverse_compute else 0):  # compute-bound points depend on the bandwidth
                targets = [p.itl_seconds - _compute_excess_seconds(p, inverse_compute, solution[0]) for p in points]
                solution = _least_squares(rows, targets)
        except InputError:
            if not active:
                raise
            notes.append(f"the points cannot tell a {active[-1].replace('_', '-')} cost from the others "
                         "(e.g. one context per request at every batch size); refitted without it")
            active.pop()
            continue
        if solution[0] <= 0:
            # A longer point stepped no slower than a shorter one: on a server whose speed moved between
            # the points (a CI run of tests/real_vllm/test_real_vllm_calibration.py: its 7,000-token stream
            # no slower than its 3,000-token one) the overhead takes the whole gap. Fitting the bandwidth
            # alone keeps the points, and the verdict then refuses them by their own bandwidths' spread.
            if not active:
                raise InputError(
                    "calibration points disagree: the inter-token latency does not grow with the bytes read, "
                    "so these points cannot come from one model on one server"
                )
            notes.append(f"the gaps did not grow with the bytes read, so the {active[-1].replace('_', '-')} cost "
                         "took them all; refitted without it")
            active.pop()
            continue
        negative = [(value, term) for value, term in zip(solution[1:], active, strict=True) if value < 0]
        if negative:
            dropped = min(negative)[1]
            notes.append(f"the fit gave a negative {dropped.replace('_', '-')} cost; refitted without it")
            active.remove(dropped)
            continue
        beyond = [(value / bounds.upper(term), term) for value, term in zip(solution[1:], active, strict=True)
                  if value > bounds.upper(term)]
        if beyond:
            ratio, dropped = max(beyond)
            notes.append(f"the fit gave a {dropped.replace('_', '-')} cost {ratio:.1f}x its bound of "
                         f"{_seconds_text(bounds.upper(dropped))}: the points cannot separate it reliably; "
                         "refitted without it")
            active.remove(dropped)
            continue
        if 1.0 / solution[0] > bounds.max_bandwidth_bytes_per_second:
            if active:
                notes.append(f"the fit gave a bandwidth of {1.0 / solution[0] / 1e12:.2f} TB/s, over the GPU's peak: "
                             f"the {active[-1].replace('_', '-')} cost took time the bytes need; refitted without it")
                active.pop()
                continue
            notes.append(f"the points read faster than the GPU's peak bandwidth; held at the peak "
                         f"{bounds.max_bandwidth_bytes_per_second / 1e12:.2f} TB/s")
            solution[0] = 1.0 / bounds.max_bandwidth_bytes_per_second
        return {"inverse_bandwidth": solution[0], **dict(zip(active, solution[1:], strict=True))}


def _seconds_text(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.0f} ms"


def _compute_excess_seconds(point: CalibrationPoint, inverse_compute: float, inverse_bandwidth: float | None) -> float:
    """What the GEMMs add beyond reading the weights when they are compute-bound (0 when not)."""
    if not inverse_compute or inverse_bandwidth is None:
        return 0.0
    return max(0.0, point.gemm_flops * inverse_compute - point.weight_read_bytes * inverse_bandwidth)


def _fitted_seconds(point: CalibrationPoint, coefficients: dict[str, float], inverse_compute: float) -> float:
    inverse_bandwidth = coefficients["inverse_bandwidth"]
    linear = point.read_bytes * inverse_bandwidth + sum(
        value * _column(point, term) for term, value in coefficients.items() if term != "inverse_bandwidth")
    return linear + _compute_excess_seconds(point, inverse_compute, inverse_bandwidth)


def _fit_compute(points: tuple[CalibrationPoint, ...], terms: list[str], memory_fit: dict[str, float],
                 bounds: FitBounds = DEFAULT_FIT_BOUNDS) -> float:
    """The inverse compute rate that best explains what the memory fit leaves, or 0 if none earns its place.

    A 1-D search: for each rate the memory terms are refitted to what the compute excess leaves."""
    if not all(p.gemm_flops > 0 and p.weight_read_bytes > 0 for p in points):
        return 0.0
    baseline = _squared_residuals(points, memory_fit, 0.0)
    best, best_residuals = 0.0, baseline * (1.0 - _COMPUTE_MIN_IMPROVEMENT)
    rows = _design_rows(points, terms)
    for flops in _COMPUTE_GRID_FLOPS:
        if flops > bounds.max_compute_flops_per_second:
            break
        inverse_compute = 1.0 / flops
        coefficients = {"inverse_bandwidth": memory_fit["inverse_bandwidth"]}
        for _ in range(3):  # which points are compute-bound depends on the bandwidth, and back
            excess = [_compute_excess_seconds(p, inverse_compute, coefficients["inverse_bandwidth"]) for p in points]
            try:
                solution = _least_squares(rows, [p.itl_seconds - e for p, e in zip(points, excess, strict=True)])
            except InputError:
                break
            if solution[0] <= 0 or 1.0 / solution[0] > bounds.max_bandwidth_bytes_per_second or any(
                    not 0 <= value <= bounds.upper(term) for value, term in zip(solution[1:], terms, strict=True)):
                break
            coefficients = {"inverse_bandwidth": solution[0], **dict(zip(terms, solution[1:], strict=True))}
        if len(coefficients) != len(terms) + 1:
            continue
        residuals = _squared_residuals(points, coefficients, inverse_compute)
        if residuals < best_residuals:
            best, best_residuals = inverse_compute, residuals
    return best


def _squared_residuals(points: tuple[CalibrationPoint, ...], coefficients: dict[str, float],
                       inverse_compute: float) -> float:
    return sum((_fitted_seconds(p, coefficients, inverse_compute) - p.itl_seconds) ** 2 for p in points)


def _least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """Least-squares coefficients by the normal equations, columns scaled to 1 for conditioning."""
    width = len(rows[0])
    scales = [max(abs(row[j]) for row in rows) or 1.0 for j in range(width)]
    scaled = [[row[j] / scales[j] for j in range(width)] for row in rows]
    gram = [[sum(r[i] * r[j] for r in scaled) for j in range(width)] for i in range(width)]
    moments = [sum(r[i] * t for r, t in zip(scaled, targets, strict=True)) for i in range(width)]
    return [value / scale for value, scale in zip(solve_linear(gram, moments), scales, strict=True)]


def solve_linear(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a singular system is an InputError."""
    size = len(vector)
    augmented = [[*row, value] for row, value in zip(matrix, vector, strict=True)]
    for column in range(size):
        pivot = max(range(column, size), key=lambda r: abs(augmented[r][column]))
        if abs(augmented[pivot][column]) < 1e-12:
            raise InputError("calibration points do not tell the fitted terms apart; measure more varied points")
        augmented[column], augmented[pivot] = augmented[pivot], augmented[column]
        for row in range(column + 1, size):
            factor = augmented[row][column] / augmented[column][column]
            augmented[row] = [a - factor * b for a, b in zip(augmented[row], augmented[column], strict=True)]
    solution = [0.0] * size
    for row in reversed(range(size)):
        known = sum(augmented[row][k] * solution[k] for k in range(row + 1, size))
        solution[row] = (augmented[row][size] - known) / augmented[row][row]
    return solution
