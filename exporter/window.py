"""What happened between two polls of one engine: measured step time and prefill per step.

Why deltas: the server's ITL histogram and token counters are cumulative since it started, so the
step time *now* is the change between two readings, the way PromQL's `rate()` and
`histogram_quantile()` read them. A counter that goes backwards means the server restarted: that
window has no deltas at all (never negative or absurd numbers), and the next one starts afresh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exporter.snapshot import Histogram, Snapshot

_SUM_WOBBLE = 1e-9
_COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "preemptions_total", "engine_steps_total")


@dataclass(frozen=True)
class Window:
    """Deltas between two snapshots of one engine; None where they cannot be known."""

    measured_step_mean_seconds: float | None  # delta(ITL sum) / delta(ITL count)
    measured_step_median_seconds: float | None  # histogram_quantile(0.5) over the bucket deltas
    prefill_tokens_per_step: float | None  # delta(prompt tokens) / delta(engine steps)
    tokens_generated: float | None  # delta(ITL count): observations in the window
    counter_reset: bool  # some counter went backwards (server restart): no deltas this window
    notes: tuple[str, ...]


def histogram_quantile(quantile: float, buckets: tuple[tuple[float, float], ...]) -> float | None:
    """PromQL's classic `histogram_quantile` (prometheus/promql/quantile.go `bucketQuantile`).

    Finds the bucket the rank falls in and interpolates linearly inside it; the first bucket's lower
    bound is 0 (or its upper bound if that is <= 0); a rank in the +Inf bucket returns the upper
    bound of the last finite bucket. None where PromQL returns NaN (no observations, no +Inf bucket,
    fewer than two buckets).
    """
    ordered = sorted(buckets)
    if len(ordered) < 2 or ordered[-1][0] != math.inf:
        return None
    counts: list[float] = []
    for _, count in ordered:  # PromQL's ensureMonotonic: cumulative counts never go down
        counts.append(max(count, counts[-1]) if counts else count)
    observations = counts[-1]
    if observations <= 0:
        return None
    rank = quantile * observations
    index = next((i for i, count in enumerate(counts[:-1]) if count >= rank), len(counts) - 1)
    if index == len(counts) - 1:
        return ordered[-2][0]
    upper = ordered[index][0]
    if index == 0 and upper <= 0:
        return upper
    lower, below = (ordered[index - 1][0], counts[index - 1]) if index > 0 else (0.0, 0.0)
    return lower + (upper - lower) * (rank - below) / (counts[index] - below)


def _went_backwards(previous: Snapshot, current: Snapshot) -> list[str]:
    backwards = []
    for name in _COUNTERS:
        before, now = getattr(previous, name), getattr(current, name)
        if before is not None and now is not None and now < before:
            backwards.append(name)
    before_h, now_h = previous.inter_token_latency, current.inter_token_latency
    if before_h is not None and now_h is not None:
        # A float sum re-added across processes (multiprocess mode) may wobble in its last bits.
        if now_h.count < before_h.count or now_h.sum < before_h.sum - _SUM_WOBBLE * max(1.0, abs(before_h.sum)):
            backwards.append("inter_token_latency")
        elif _same_edges(before_h, now_h) and any(
            now < before for (_, before), (_, now) in zip(before_h.buckets, now_h.buckets)
        ):
            backwards.append("inter_token_latency buckets")
    return backwards


def _same_edges(a: Histogram, b: Histogram) -> bool:
    return [le for le, _ in a.buckets] == [le for le, _ in b.buckets]


def _empty(reset: bool, *notes: str) -> Window:
    return Window(None, None, None, None, reset, tuple(notes))


def _step_times(previous: Histogram, current: Histogram, notes: list[str]) -> tuple[float | None, float | None, float]:
    """(mean, median, observations) of the ITL observations made between the two readings."""
    observations = current.count - previous.count
    if observations <= 0:
        notes.append("no new tokens in the window (idle)")
        return None, None, observations
    mean = max(0.0, current.sum - previous.sum) / observations
    if not _same_edges(previous, current):
        notes.append("ITL bucket edges changed between polls: no median this window")
        return mean, None, observations
    deltas = tuple((le, now - before) for (le, now), (_, before) in zip(current.buckets, previous.buckets))
    return mean, histogram_quantile(0.5, deltas), observations


def _prefill_per_step(previous: Snapshot, current: Snapshot, notes: list[str]) -> float | None:
    names = ("prompt_tokens_total", "engine_steps_total")
    values = [(getattr(previous, n), getattr(current, n)) for n in names]
    if any(before is None or now is None for before, now in values):
        notes.append("no prompt-token or engine-step counter: prefill per step unknown (decode only)")
        return None
    (prompt_before, prompt_now), (steps_before, steps_now) = values
    steps = steps_now - steps_before
    if steps <= 0:
        return None
    return (prompt_now - prompt_before) / steps


def compute_window(previous: Snapshot | None, current: Snapshot) -> Window:
    """Deltas between two polls of one engine (same target, model_name and engine)."""
    if previous is None:
        return _empty(False, "first poll: no window yet")
    if (previous.kind, previous.model_name, previous.engine) != (current.kind, current.model_name, current.engine):
        return _empty(False, "snapshots are of different engines: no window")
    backwards = _went_backwards(previous, current)
    if backwards:
        return _empty(True, f"counter reset (server restart?): {', '.join(backwards)} went backwards")
    notes: list[str] = []
    mean = median = tokens = None
    before_h, now_h = previous.inter_token_latency, current.inter_token_latency
    if before_h is None or now_h is None:
        notes.append("no ITL histogram in one of the two polls: no measured step")
    else:
        mean, median, tokens = _step_times(before_h, now_h, notes)
    return Window(
        measured_step_mean_seconds=mean,
        measured_step_median_seconds=median,
        prefill_tokens_per_step=_prefill_per_step(previous, current, notes),
        tokens_generated=tokens,
        counter_reset=False,
        notes=tuple(notes),
    )
