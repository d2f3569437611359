"""What happened between two polls of one engine: measured step time and prefill per step.

Why deltas: the server's ITL histogram and token counters are cumulative since it started, so the
step time *now* is the change between two readings, the way PromQL's `rate()` and
`histogram_quantile()` read them. A counter that goes backwards means the server restarted: that
window has no deltas at all (never negative or absurd numbers), and the next one starts afresh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from exporter.serve.engines.vllm_prefill import PromptTokens, prefill_mean_context_tokens
from exporter.serve.process_identity import other_process
from exporter.serve.snapshot import Histogram, Snapshot, counter_delta

_SUM_WOBBLE = 1e-9
# A median interpolated inside a bucket wider than this share of its value is not a measurement.
MEDIAN_RESOLUTION_RATIO = 0.1
_COUNTERS = ("prompt_tokens_total", "prompt_tokens_computed_total", "prompt_tokens_cached_total",
             "generation_tokens_total", "preemptions_total", "engine_steps_total", "server_read_bytes_total",
             "admission_rejections_total", "spec_decode_draft_tokens_total",
             "spec_decode_accepted_tokens_total", "prompt_tokens_admitted_total",
             "prompt_tokens_admitted_cached_total", "prompt_tokens_local_cache_hit_total",
             "finished_prompt_tokens_total", "finished_generation_tokens_total", "finished_requests_total",
             "prompt_tokens_transferred_total", "prompt_tokens_admitted_external_total")


@dataclass(frozen=True)
class Window:
    """Deltas between two snapshots of one engine; None where they cannot be known."""

    measured_step_mean_seconds: float | None  # delta(ITL sum) / delta(ITL count)
    # histogram_quantile(0.5) over the bucket deltas: PromQL's number, a linear interpolation inside
    # the bucket the median falls in, which is only as good as that bucket is narrow (see
    # measured_step_median_point_seconds; the reading exports that and the bounds, not this).
    measured_step_median_seconds: float | None
    prefill_tokens_per_step: float | None  # delta(computed prompt tokens) / delta(engine steps)
    tokens_generated: float | None  # delta(ITL count): observations in the window
    counter_reset: bool  # some counter went backwards (server restart): no deltas this window
    notes: tuple[str, ...]
    # The window's mix of steps: (prefill tokens in the step, share of the steps), shares summing to
    # 1, from the iteration-tokens bucket deltas; None where the page has no such histogram.
    prefill_mix: tuple[tuple[float, float], ...] | None = None
    # The server's own estimate of bytes read per step over the window (delta of vLLM's
    # estimated_read_bytes_per_gpu_total / delta of engine steps); None where the page lacks it or
    # the server does not estimate (its counter stands still while steps run).
    server_read_bytes_per_step: float | None = None
    # Requests the server's front end refused at its queue limits in the window.
    admission_rejections: float | None = None
    # The window's first snapshot: what the reading predicts the window's start with, so that our
    # bytes per step are set beside the server's over the same steps.
    start: Snapshot | None = None
    # The ITL bucket the median falls in: (lower, upper] edges; upper None for the +Inf bucket.
    measured_step_median_lower_seconds: float | None = None
    measured_step_median_upper_seconds: float | None = None
    # Speculative decoding: tokens each running request gets per engine step (accepted drafts + 1),
    # None where the page shows none (one token a step); and draft tokens the step verifies (vLLM),
    # which the step computes as extra query tokens beside the one per request.
    tokens_per_step: float | None = None
    draft_tokens_per_step: float | None = None
    # The mean context a prompt token computed in the window attended to (its position in its prompt,
    # engines/vllm_prefill.py's `prefill_mean_context_tokens`): what a chunk's attention grows with. None
    # where the page cannot say.
    prefill_mean_context_tokens: float | None = None
    # Prompt tokens the engine computed in the window (engines/vllm_prefill.py's `PromptTokens.computed`), and
    # the mean time to first token of the requests whose prefill ended in it: a prefill server's budget
    # (reading.prefill_budget).
    prompt_tokens_computed: float | None = None
    time_to_first_token_mean_seconds: float | None = None
    # Tokens the window's streams got after their first (`_decode_tokens`): what the per-user speed
    # objective counts.
    decode_tokens: float | None = None

    @property
    def measured_step_median_point_seconds(self) -> float | None:
        """The median as one number, only where its bucket is narrow enough to be one.

        A histogram says how many observations fell in each bucket, not where: with vLLM's default
        ITL edges (10, 25, 50 ms ...) steps of 11 and 24 ms both interpolate to 17.5 ms, which at an
        18 ms budget reads "under budget" for both. Inside a bucket wider than MEDIAN_RESOLUTION_RATIO of
        the value the interpolation is an artefact, and only the bounds are said.
        """
        median, lower, upper = (self.measured_step_median_seconds, self.measured_step_median_lower_seconds,
                                self.measured_step_median_upper_seconds)
        if median is None or lower is None or upper is None or upper - lower > MEDIAN_RESOLUTION_RATIO * median:
            return None
        return median


@dataclass(frozen=True)
class QuantileBucket:
    """A quantile as PromQL interpolates it, and the bucket it lies in: (lower, upper]."""

    value: float
    lower: float
    upper: float  # math.inf for the +Inf bucket (value is then the last finite edge)


def histogram_quantile(quantile: float, buckets: tuple[tuple[float, float], ...]) -> float | None:
    """PromQL's classic `histogram_quantile` (prometheus/promql/quantile.go `bucketQuantile`).

    Finds the bucket the rank falls in and interpolates linearly inside it; the first bucket's lower
    bound is 0 (or its upper bound if that is <= 0); a rank in the +Inf bucket returns the upper
    bound of the last finite bucket. None where PromQL returns NaN (no observations, no +Inf bucket,
    fewer than two buckets).
    """
    found = quantile_bucket(quantile, buckets)
    return None if found is None else found.value


def quantile_bucket(quantile: float, buckets: tuple[tuple[float, float], ...]) -> QuantileBucket | None:
    """`histogram_quantile` with the bucket it interpolated in, which is the quantile's resolution."""
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
        return QuantileBucket(ordered[-2][0], ordered[-2][0], math.inf)
    upper = ordered[index][0]
    if index == 0 and upper <= 0:
        return QuantileBucket(upper, upper, upper)
    lower, below = (ordered[index - 1][0], counts[index - 1]) if index > 0 else (0.0, 0.0)
    return QuantileBucket(lower + (upper - lower) * (rank - below) / (counts[index] - below), lower, upper)


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
            now < before for (_, before), (_, now) in zip(before_h.buckets, now_h.buckets, strict=True)
        ):
            backwards.append("inter_token_latency buckets")
    return backwards


def _same_edges(a: Histogram, b: Histogram) -> bool:
    return [le for le, _ in a.buckets] == [le for le, _ in b.buckets]


def _empty(reset: bool, *notes: str) -> Window:
    return Window(None, None, None, None, reset, tuple(notes))


def _step_times(previous: Histogram, current: Histogram, notes: list[str]
                ) -> tuple[float | None, QuantileBucket | None, float]:
    """(mean, median and its bucket, observations) of the ITL observations made between the two readings."""
    observations = current.count - previous.count
    if observations <= 0:
        notes.append("no new tokens in the window (idle)")
        return None, None, observations
    mean = max(0.0, current.sum - previous.sum) / observations
    if not _same_edges(previous, current):
        notes.append("ITL bucket edges changed between polls: no median this window")
        return mean, None, observations
    return mean, quantile_bucket(0.5, _bucket_deltas(previous, current)), observations


def _bucket_deltas(previous: Histogram, current: Histogram) -> tuple[tuple[float, float], ...]:
    """Cumulative bucket counts observed between two readings of one histogram (same edges)."""
    return tuple((le, now - before) for (le, now), (_, before) in zip(current.buckets, previous.buckets, strict=True))


# More iteration-tokens observations than the ITL count allows by this factor: several API servers
# (N servers with requests spread over them observe about N per step).
_STEP_OVERCOUNT = 1.8
# The histogram's prefill share may differ from the computed-token counter by this much and still be
# the same tokens (requests finishing between the two counters' updates).
_MIX_AGREEMENT = 0.05


def _steps(previous: Snapshot, current: Snapshot, prompt: PromptTokens, notes: list[str]
           ) -> tuple[float | None, bool]:
    """Engine steps in the window, and whether each iteration-tokens observation is a whole step.

    With --api-server-count N > 1 every API server observes vllm:iteration_tokens_total for its own
    requests' outputs of a step (0.32.0 vllm/v1/engine/async_llm.py l. 850-853 and 899, loggers.py
    l. 1273: one observation per batch of outputs a front end receives, none for a step without
    outputs; outputs are split by client, vllm/v1/core/sched/scheduler.py l. 2263 and 2388-2391), so
    _count over-counts steps up to N times and each observation is a share; nothing on the page says
    N. One ITL observation per decoding request per step bounds the steps the other way
    (`_most_steps`).
    """
    steps = counter_delta(previous, current, "engine_steps_total")
    itl_before, itl_now = previous.inter_token_latency, current.inter_token_latency
    running = [r for r in (previous.requests_running, current.requests_running) if r]
    if steps is None or steps <= 0 or itl_before is None or itl_now is None or len(running) < 2:
        return steps, True
    observations = itl_now.count - itl_before.count
    most = _most_steps(previous, current, prompt.computed, observations, min(running))
    if observations > 0 and steps > _STEP_OVERCOUNT * most:
        steps_from_itl = observations / (sum(running) / len(running))
        notes.append(f"vllm:iteration_tokens_total counted {steps:.0f} steps where the ITL allows at most "
                     f"{most:.0f} (several API servers?): steps taken from ITL / running")
        return steps_from_itl, False
    return steps, True


def _most_steps(previous: Snapshot, current: Snapshot, computed: float | None, itl_observations: float,
                fewest_running: float) -> float:
    """The most engine steps one front end's counters allow in the window.

    Every running request is, in each step, either decoding (one ITL observation: 0.32.0
    vllm/v1/metrics/stats.py l. 548-552) or prefilling, which observes no ITL: a chunk that does
    not finish its prompt emits no output at all (scheduler.py l. 2200-2202 and 2289), and the
    chunk that finishes it emits the first token, counted in vllm:generation_tokens_total but
    observed as a TTFT (stats.py l. 516-523). So, with R the fewest running requests seen and S the
    steps, R x S - ITL is the request-steps spent prefilling, which are
      * the chunks that finish a prompt: one per first token, generation tokens - ITL observations
        (an upper bound where a step yields several tokens, as under speculative decoding), plus
      * the chunks that do not: each computes at least one prompt token (at most the computed prompt
        tokens), and at most one per step, since such a chunk is cut by the step's token budget,
        which then runs out (scheduler.py l. 659 and 708-712; 0.32.0's default
        long_prefill_token_threshold 0, vllm/config/scheduler.py l. 79).
    Reading R as decoding requests only (the ITL per running request) takes a request prefilling in
    chunks beside one decoding for two front ends, and halves the steps.
    """
    generated = counter_delta(previous, current, "generation_tokens_total")
    first_tokens = max(0.0, generated - itl_observations) if generated is not None else 0.0
    # The prompt tokens bound the prefilling request-steps too: none in a decode-only window.
    most = (itl_observations + first_tokens + (computed or 0.0)) / fewest_running
    if computed and fewest_running > 1:  # at most one chunk cut short per step
        most = min(most, (itl_observations + first_tokens) / (fewest_running - 1))
    return most


def _prefill_per_step(prompt: PromptTokens, steps: float | None, notes: list[str]) -> float | None:
    """Computed prompt tokens per engine step."""
    if steps is not None:
        notes.extend(prompt.notes)
    computed = prompt.computed if steps is not None else None
    if steps is None or computed is None:
        notes.append("no prompt-token or engine-step counter: prefill per step unknown (decode only)")
        return None
    if steps <= 0:
        return None
    return computed / steps


def _server_read_bytes_per_step(previous: Snapshot, current: Snapshot, steps: float | None, notes: list[str]
                                ) -> float | None:
    """The server's own bytes read per step over the window.

    vLLM adds each step's estimate once, to one front end only (0.32.0 vllm/v1/core/sched/scheduler.py
    l. 2050-2052 and l. 2409-2418), so it is divided by the engine steps `_steps` gives. The family is
    on every 0.32.0 page, but counts only with --enable-mfu-metrics (scheduler.py l. 419-421, loggers.py
    l. 520): a counter that stands still while steps run is no estimate, not zero bytes.
    """
    read = counter_delta(previous, current, "server_read_bytes_total")
    if read is None or steps is None or steps <= 0:
        return None
    if read <= 0:
        notes.append("vllm:estimated_read_bytes_per_gpu_total stood still while the engine stepped "
                     "(--enable-mfu-metrics off?): no server estimate of bytes per step")
        return None
    return read / steps


def _prefill_mix(previous: Snapshot, current: Snapshot, counted: float | None, prefill_per_step: float | None,
                 tokens: list[tuple[float, float]] | None) -> tuple[tuple[float, float], ...] | None:
    """The window's steps as (prefill tokens, share), from vllm:iteration_tokens_total's buckets
    (`tokens`: `_counted_prefill_steps`).

    The histogram observes a prompt in the step that finishes it, as the counters count it: where a
    prompt was part-way at an end of the window, the buckets hold the prompt tokens the server counted,
    and the parts' prefill is scaled to the tokens the window computed (`PromptTokens.computed`). A
    window whose histogram holds no prompt token while its steps computed chunks has no mix (a lone
    chunk's step and its decode-only neighbours look alike in the buckets): it is predicted at its mean.
    """
    steps = counter_delta(previous, current, "engine_steps_total")
    if counted is None or prefill_per_step is None or not steps or steps <= 0:
        return None
    counted_per_step = counted / steps
    if counted_per_step <= 0 < prefill_per_step:
        return None
    if tokens is None:
        return None
    count = sum(n for _, n in tokens)
    placed = prefill_per_step / counted_per_step if counted_per_step > 0 else 1.0
    return tuple((value * placed, n / count) for value, n in tokens)


def _counted_prefill_steps(previous: Snapshot, current: Snapshot, counted: float | None, notes: list[str]
                           ) -> list[tuple[float, float]] | None:
    """(Counted prompt tokens in a step, steps) for each occupied bucket of vllm:iteration_tokens_total.

    Each observation is one step's computed prompt tokens plus its sampled tokens (0.23.0 on;
    0.33.0 vllm/v1/metrics/loggers.py l. 1273). Releases before 0.23.0 observe the full prompt,
    cache hits included (0.11.0 vllm/v1/metrics/stats.py l. 119-120): there the buckets disagree
    with the computed-token count and are not used. A step's sampled tokens are taken as the
    window's mean (generation tokens / steps); the rest of the step is prefill.
    """
    before_h, now_h = previous.iteration_tokens, current.iteration_tokens
    steps = counter_delta(previous, current, "engine_steps_total")
    generated = counter_delta(previous, current, "generation_tokens_total")
    if (before_h is None or now_h is None or not steps or steps <= 0 or generated is None or counted is None
            or not _same_edges(before_h, now_h)):
        return None
    counted_per_step = counted / steps
    decode_per_step = max(0.0, generated / steps)
    histogram_prefill = (now_h.sum - before_h.sum) / steps - decode_per_step
    if abs(histogram_prefill - counted_per_step) > _MIX_AGREEMENT * max(counted_per_step + decode_per_step, 1.0):
        notes.append("vllm:iteration_tokens_total disagrees with the computed prompt tokens (a release that "
                     "counts cache hits in it?): predicting at the mean prefill")
        return None
    total_tokens = (decode_per_step + counted_per_step) * steps
    tokens = step_tokens_in_buckets(_bucket_deltas(before_h, now_h), total_tokens, decode_per_step)
    if tokens is None:
        return None
    return [(max(0.0, value - decode_per_step), n) for value, n in tokens]


def step_tokens_in_buckets(cumulative: Sequence[tuple[float, float]], total_tokens: float, typical_tokens: float
                           ) -> list[tuple[float, float]] | None:
    """(tokens per step, steps) for each occupied bucket, consistent with the known total.

    A histogram says how many steps fell in each (lower, upper] bucket, not where inside it. Each
    bucket starts at its middle (the bucket holding the typical decode-only step, at that step;
    +Inf at its lower edge); the difference to the known total is then spread over the buckets in
    proportion to the room each has in that direction, never below the typical step and never past
    a finite edge (+Inf takes any excess). So a few large prefill steps keep their size instead of
    being averaged into every step, which matters because a step is compute-bound past a roof.
    """
    edges: list[tuple[float, float, float]] = []  # (lower, upper, steps)
    below_count = 0.0
    lower = 0.0
    for upper, count in sorted(cumulative):
        steps = count - below_count
        if steps < 0:
            return None
        if steps > 0:
            edges.append((lower, upper, steps))
        below_count, lower = max(below_count, count), upper
    if not edges:
        return None
    values = []
    for low, high, _ in edges:
        if low < typical_tokens <= high:
            values.append(typical_tokens)
        elif math.isinf(high):
            values.append(low)
        else:
            values.append((low + high) / 2.0)
    residual = total_tokens - sum(value * steps for value, (_, _, steps) in zip(values, edges, strict=True))
    if residual > 0:
        room = [(math.inf if math.isinf(high) else high - value) * steps
                for value, (_, high, steps) in zip(values, edges, strict=True)]
    else:
        room = [max(0.0, value - max(low, typical_tokens if value >= typical_tokens else low)) * steps
                for value, (low, _, steps) in zip(values, edges, strict=True)]
    unbounded = [i for i, r in enumerate(room) if math.isinf(r)]
    if unbounded:
        share = {i: 1.0 / len(unbounded) for i in unbounded}
    else:
        available = sum(room)
        share = {i: (r / available if available > 0 else 0.0) for i, r in enumerate(room)}
    adjusted = [value + residual * share.get(i, 0.0) / edges[i][2] for i, value in enumerate(values)]
    return [(value, steps) for value, (_, _, steps) in zip(adjusted, edges, strict=True)]


def tokens_per_step(current: Snapshot, accepted_tokens: float | None, itl_observations: float | None
                    ) -> float | None:
    """Tokens one running request gets per engine step under speculative decoding; None without it.

    `accepted_tokens` and `itl_observations` are a window's deltas (or the totals since the server
    started). vLLM: each decoding request-step is one ITL observation (0.32.0 vllm/v1/metrics/stats.py
    l. 548-552) carrying 1 + its accepted drafts (vllm/v1/core/sched/scheduler.py l. 2110-2118). A
    request-step whose proposer found nothing (ngram without a match) is no draft: num_drafts counts
    only the request-steps that carried drafts (vllm/v1/spec_decode/metrics.py l. 41-44), so vLLM's own
    "mean acceptance length" 1 + accepted / drafts overstates the tokens per step; 1 + accepted / ITL
    observations is what the streams get. SGLang: its accept length gauge is that figure already.
    """
    if current.kind == "sglang":
        length = current.spec_accept_length
        return length if length is not None and math.isfinite(length) and length > 1.0 else None
    if accepted_tokens is None or not itl_observations or itl_observations <= 0:
        return None
    return 1.0 + max(0.0, accepted_tokens) / itl_observations


def _draft_tokens_per_step(previous: Snapshot, current: Snapshot, steps: float | None) -> float | None:
    drafted = counter_delta(previous, current, "spec_decode_draft_tokens_total")
    if drafted is None or steps is None or steps <= 0:
        return None
    return max(0.0, drafted) / steps


def compute_window(previous: Snapshot | None, current: Snapshot) -> Window:
    """Deltas between two polls of one engine (same target, model_name and engine)."""
    if previous is None:
        return _empty(False, "first poll: no window yet")
    if (previous.kind, previous.model_name, previous.engine) != (current.kind, current.model_name, current.engine):
        return _empty(False, "snapshots are of different engines: no window")
    restarted = other_process(previous, current)
    if restarted is not None:  # a new process: its counters do not continue the old one's, whichever is larger
        return _empty(True, f"server restarted (another process wrote the page: {restarted}): no window")
    backwards = _went_backwards(previous, current)
    if backwards:
        return _empty(True, f"counter reset (server restart?): {', '.join(backwards)} went backwards")
    notes: list[str] = []
    mean = tokens = None
    median: QuantileBucket | None = None
    before_h, now_h = previous.inter_token_latency, current.inter_token_latency
    if before_h is None or now_h is None:
        notes.append("no ITL histogram in one of the two polls: no measured step")
    else:
        mean, median, tokens = _step_times(before_h, now_h, notes)
    prompt = PromptTokens.of(previous, current)
    steps, whole_steps = _steps(previous, current, prompt, notes)
    prefill = _prefill_per_step(prompt, steps, notes)
    # The histogram's steps, read once for the mix and for what the counted prompts attend to.
    counted_steps = (_counted_prefill_steps(previous, current, prompt.counted, notes if whole_steps else [])
                     if prefill is not None else None)
    mix = _prefill_mix(previous, current, prompt.counted, prefill, counted_steps) if whole_steps else None
    server_bytes = _server_read_bytes_per_step(previous, current, steps, notes)
    accepted = counter_delta(previous, current, "spec_decode_accepted_tokens_total")
    per_step = tokens_per_step(current, accepted, tokens)
    if per_step is not None and current.kind == "sglang":
        # SGLang observes each token, at the step's interval / the step's tokens (module docstring of
        # exporter/serve/engines/sglang.py): the step is the ITL times the tokens per step.
        notes.append(f"speculative decoding: {per_step:.2f} tokens per step (sglang:spec_accept_length), "
                     "measured step = ITL x accept length")
        mean = mean * per_step if mean is not None else None
        if median is not None:
            median = QuantileBucket(median.value * per_step, median.lower * per_step, median.upper * per_step)
    return Window(
        measured_step_mean_seconds=mean,
        measured_step_median_seconds=median.value if median else None,
        prefill_tokens_per_step=prefill,
        tokens_generated=tokens,
        counter_reset=False,
        notes=tuple(notes),
        prefill_mix=mix,
        server_read_bytes_per_step=server_bytes,
        admission_rejections=counter_delta(previous, current, "admission_rejections_total"),
        start=previous,
        measured_step_median_lower_seconds=median.lower if median else None,
        measured_step_median_upper_seconds=median.upper if median and math.isfinite(median.upper) else None,
        tokens_per_step=per_step,
        draft_tokens_per_step=_draft_tokens_per_step(previous, current, steps),
        prefill_mean_context_tokens=(prefill_mean_context_tokens(previous, current, prompt, counted_steps)
                                     if prefill else None),
        prompt_tokens_computed=prompt.computed,
        time_to_first_token_mean_seconds=_mean_of(previous.time_to_first_token, current.time_to_first_token),
        decode_tokens=_decode_tokens(previous, current, tokens, per_step),
    )


def _decode_tokens(previous: Snapshot, current: Snapshot, itl_observations: float | None,
                   per_step: float | None) -> float | None:
    """Tokens the window's streams got after their first: the tokens generated less one a request whose prefill
    ended in the window (the time-to-first-token histogram observes each request once, as its prefill returns
    its first token; 0.32.0 vllm/v1/metrics/stats.py l. 514-523). Where a page lacks either: vLLM observes one
    inter-token gap per step a request takes, whatever that step gave it (l. 548-552), so its tokens are the
    observations times the tokens per step; SGLang observes each token (exporter/serve/engines/sglang.py).
    The first way is exact under speculative decoding, where the counted accepted drafts include some past a
    request's last token (a real vLLM with ngram drafts: 282 observations and 517 accepted, 796 tokens after
    4 streams' first)."""
    generated = counter_delta(previous, current, "generation_tokens_total")
    before, now = previous.time_to_first_token, current.time_to_first_token
    if generated is not None and before is not None and now is not None:
        return max(0.0, generated - (now.count - before.count))
    if itl_observations is None:
        return None
    return itl_observations if current.kind == "sglang" else itl_observations * (per_step or 1.0)


def mixed_processes_window(reason: str) -> Window:
    """No window: the target's pages come from more than one process (process_identity.ProcessWatch),
    and deltas between two processes' counters measure nothing. Not a counter reset."""
    return _empty(False, reason)


def _mean_of(previous: Histogram | None, current: Histogram | None) -> float | None:
    """The mean of the observations a histogram took between two readings; None where it took none."""
    if previous is None or current is None or current.count <= previous.count:
        return None
    return max(0.0, current.sum - previous.sum) / (current.count - previous.count)
