"""The capacity model: bytes read per decode step, step time, token budget.

Pure functions over dataclasses; no I/O, no clocks, no logging. Sizes are bytes, times seconds,
rates per second. Everything is *per GPU* of one model replica: with tensor parallelism each GPU
holds 1/tp of the weights and of the KV heads, reads them from its own memory at its own bandwidth,
and all GPUs of the replica step together, so the per-GPU step time is the replica's step time.

Physics (see docs/model.md and DESIGN §1):
  * A decode step produces one token for every running request. It reads the weights once for the
    whole batch (memory-bound) plus every running request's KV cache.
  * A step runs its GEMMs and its attention as separate kernels, so the phases add up; they do not
    overlap into one global max(memory, compute):
      step        = overhead + per_request * running + t_gemm + t_attention
      t_gemm      = max(weight bytes read / bandwidth, 2 * GEMM params * tokens in the step / compute)
      t_attention = max(KV bytes read / bandwidth, attention FLOPs / compute)
    Attention FLOPs matter only for prefill chunks, which attend to their whole context.

What a model is and the bytes it holds per token are exporter/capacity/architecture.py; the KV cache's
size and block layout, exporter/capacity/kv_cache.py; the offline fit of the terms here to measured
steps, exporter/capacity/fit.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from exporter.capacity.architecture import (
    Architecture,
    kv_bytes_for_context,
    kv_bytes_per_token,
    weight_read_bytes,
)
from exporter.capacity.fit import (
    CalibrationPoint,
)
from exporter.capacity.kv_cache import (
    DEFAULT_BLOCK_SIZE_TOKENS,
)
from exporter.errors import InputError

DEFAULT_HEADROOM = 0.9
DEFAULT_BANDWIDTH_EFFICIENCY = 0.6
DEFAULT_COMPUTE_EFFICIENCY = 0.5
_BUDGET_SEARCH_CEILING_TOKENS = 1e10


@dataclass(frozen=True)
class ServingSetup:
    """One model replica on `tensor_parallel` GPUs, with the effective rates it achieves per GPU."""

    architecture: Architecture
    gpu_memory_bytes: float
    effective_bandwidth_bytes_per_second: float
    effective_compute_flops_per_second: float
    tensor_parallel: int = 1
    weight_bytes_per_param: float = 2.0
    kv_bytes_per_element: float = 2.0
    step_overhead_seconds: float = 0.0
    # Sampling and per-sequence bookkeeping, paid once per running request per step (0 unless fitted).
    per_request_seconds: float = 0.0
    gpu_memory_utilization: float = 0.9
    reserved_memory_bytes: float = 0.0
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS

    def __post_init__(self) -> None:
        positive = {
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "effective_bandwidth_bytes_per_second": self.effective_bandwidth_bytes_per_second,
            "effective_compute_flops_per_second": self.effective_compute_flops_per_second,
            "tensor_parallel": self.tensor_parallel,
            "weight_bytes_per_param": self.weight_bytes_per_param,
            "kv_bytes_per_element": self.kv_bytes_per_element,
            "block_size_tokens": self.block_size_tokens,
        }
        for name, value in positive.items():
            if not value > 0:
                raise InputError(f"{name} must be greater than zero, got {value!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InputError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name, value in (("step_overhead_seconds", self.step_overhead_seconds),
                            ("per_request_seconds", self.per_request_seconds),
                            ("reserved_memory_bytes", self.reserved_memory_bytes)):
            if not (math.isfinite(value) and value >= 0):
                raise InputError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class RequestGroup:
    """`count` running requests, each holding `context_tokens` tokens (prompt + generated so far)."""

    count: int
    context_tokens: float

    def __post_init__(self) -> None:
        if self.count < 0 or self.context_tokens < 0:
            raise InputError(f"a load needs a non-negative count and context, got {self.count}x{self.context_tokens}")

    @property
    def tokens(self) -> float:
        return self.count * self.context_tokens


@dataclass(frozen=True)
class StepPrediction:
    """The model's view of one decode step, phase by phase.

    Each phase takes the longer of its memory time and its compute time; phases run one after
    the other, so the step is their sum plus the fixed and per-request costs.
    """

    tokens_in_flight: float
    decode_tokens: float
    prefill_tokens: float
    weight_read_bytes: float
    kv_read_bytes: float
    weight_memory_seconds: float
    kv_memory_seconds: float
    gemm_compute_seconds: float
    attention_compute_seconds: float
    overhead_seconds: float
    per_request_seconds: float = 0.0  # per-request cost times running requests

    @property
    def read_bytes(self) -> float:
        return self.weight_read_bytes + self.kv_read_bytes

    @property
    def tokens_in_step(self) -> float:
        return self.decode_tokens + self.prefill_tokens

    @property
    def memory_seconds(self) -> float:
        """All bytes read at the effective bandwidth (what a purely memory-bound step would take)."""
        return self.weight_memory_seconds + self.kv_memory_seconds

    @property
    def compute_seconds(self) -> float:
        """All FLOPs at the effective compute (what a purely compute-bound step would take)."""
        return self.gemm_compute_seconds + self.attention_compute_seconds

    @property
    def gemm_seconds(self) -> float:
        return max(self.weight_memory_seconds, self.gemm_compute_seconds)

    @property
    def attention_seconds(self) -> float:
        return max(self.kv_memory_seconds, self.attention_compute_seconds)

    @property
    def step_seconds(self) -> float:
        return self.overhead_seconds + self.per_request_seconds + self.gemm_seconds + self.attention_seconds

    @property
    def user_tokens_per_second(self) -> float:
        """Every decoding request gets one token per step."""
        return 1.0 / self.step_seconds


# --- FLOPs ---------------------------------------------------------------------------------------


def gemm_flops(arch: Architecture, tokens_in_step: float, tensor_parallel: int = 1) -> float:
    """2 FLOPs per weight per token through every matrix; an embedding lookup multiplies nothing."""
    return 2.0 * (arch.active_params - arch.input_embedding_params) / tensor_parallel * tokens_in_step


def attention_flops(arch: Architecture, attended_tokens: float, tensor_parallel: int = 1) -> float:
    """QK^T and softmax·V: 2 + 2 FLOPs per query head dimension per attended token per layer.

    `attended_tokens` is summed over the query tokens (a decode token attends to its context; a
    prefill chunk of n tokens after P tokens attends to n·(P + n/2) in all, causally)."""
    heads = arch.attention_heads / tensor_parallel
    return 4.0 * arch.layers * heads * arch.head_dim * attended_tokens


def _attended_tokens(arch: Architecture, context_tokens: float) -> float:
    """Tokens one query at this context attends to, averaged over layers (sliding layers stop at the window)."""
    windowed = min(context_tokens, arch.sliding_window or context_tokens)
    return (arch.full_attention_layers * context_tokens + arch.sliding_window_layers * windowed) / arch.layers


def prefill_attended_tokens(arch: Architecture, chunk_tokens: float, context_before_tokens: float) -> float:
    """Sum over a chunk's tokens of what each attends to: the context before it plus the chunk so far."""
    if chunk_tokens <= 0:
        return 0.0
    mean_context = context_before_tokens + chunk_tokens / 2.0
    return chunk_tokens * _attended_tokens(arch, mean_context)


def _prefill_attended_at_mean(arch: Architecture, prefill_tokens: float, mean_context_tokens: float) -> float:
    """What `prefill_tokens` attend to in all where each attends to `mean_context_tokens` on average (a
    server's window, wherever in their prompts its tokens stood; sliding layers stop at the window)."""
    return prefill_tokens * _attended_tokens(arch, mean_context_tokens)


# --- step time -------------------------------------------------------------------------------


def predict_step(
    setup: ServingSetup, groups: Sequence[RequestGroup], prefill_tokens_per_step: float = 0.0,
    *, prefill_context_tokens: float | None = None, prefill_mean_context_tokens: float | None = None,
) -> StepPrediction:
    """Predict one decode step for the running requests in `groups` plus a prefill chunk of
    `prefill_tokens_per_step` tokens that follows `prefill_context_tokens` tokens of its own prompt,
    or prefill tokens that each attend to `prefill_mean_context_tokens` on average (a server's
    window: its prompt tokens, wherever in their prompts they stood, not one chunk).

    With neither (a server's page that cannot say where its prompt tokens stood) the prefill's attention
    FLOPs are left out rather than guessed: taking a window's prefill tokens as one causal chunk would
    count n²/2 pairs for what were many chunks."""
    if prefill_context_tokens is not None and prefill_mean_context_tokens is not None:
        raise InputError("give a prefill chunk's context or its tokens' mean context, not both")
    if prefill_tokens_per_step < 0 or (prefill_context_tokens or 0.0) < 0 or (prefill_mean_context_tokens or 0.0) < 0:
        raise InputError(f"prefill tokens per step and their context must not be negative, got "
                         f"{prefill_tokens_per_step!r} after {prefill_context_tokens or prefill_mean_context_tokens!r}")
    arch, tp = setup.architecture, setup.tensor_parallel
    decode_tokens = float(sum(group.count for group in groups))
    weights, weight_memory_seconds, gemm_compute_seconds = _gemm_phase(setup, decode_tokens + prefill_tokens_per_step)
    kv = sum(
        group.count * kv_bytes_for_context(arch, group.context_tokens, setup.kv_bytes_per_element, tp)
        for group in groups
    )
    attended = sum(group.count * _attended_tokens(arch, group.context_tokens) for group in groups)
    if prefill_context_tokens is not None:
        attended += prefill_attended_tokens(arch, prefill_tokens_per_step, prefill_context_tokens)
    elif prefill_mean_context_tokens is not None:
        attended += _prefill_attended_at_mean(arch, prefill_tokens_per_step, prefill_mean_context_tokens)
    return StepPrediction(
        tokens_in_flight=float(sum(group.tokens for group in groups)),
        decode_tokens=decode_tokens,
        prefill_tokens=float(prefill_tokens_per_step),
        weight_read_bytes=weights,
        kv_read_bytes=kv,
        weight_memory_seconds=weight_memory_seconds,
        kv_memory_seconds=kv / setup.effective_bandwidth_bytes_per_second,
        gemm_compute_seconds=gemm_compute_seconds,
        attention_compute_seconds=attention_flops(arch, attended, tp) / setup.effective_compute_flops_per_second,
        overhead_seconds=setup.step_overhead_seconds,
        per_request_seconds=setup.per_request_seconds * decode_tokens,
    )


def prefill_tokens_per_second(setup: ServingSetup, prefill_tokens_per_step: float,
                              mean_context_tokens: float | None = None) -> float:
    """The prompt tokens a second a server that only prefills can compute, in steps of
    `prefill_tokens_per_step` prompt tokens attending to `mean_context_tokens` each (None: their attention
    left out): the step `predict_step` gives for such a step with no request decoding. A P/D prefill
    server's budget: beyond it, prompts queue and the time to first token grows without bound."""
    if prefill_tokens_per_step <= 0:
        raise InputError(f"prefill tokens per step must be greater than zero, got {prefill_tokens_per_step!r}")
    step = predict_step(setup, [], prefill_tokens_per_step, prefill_mean_context_tokens=mean_context_tokens)
    return prefill_tokens_per_step / step.step_seconds


def _gemm_phase(setup: ServingSetup, tokens_in_step: float) -> tuple[float, float, float]:
    """(weight bytes read, their memory seconds, GEMM compute seconds) of a step of `tokens_in_step` tokens:
    the one phase a step's prefill tokens change when their context is not known."""
    arch, tp = setup.architecture, setup.tensor_parallel
    weights = weight_read_bytes(arch, setup.weight_bytes_per_param, tokens_in_step, tp)
    return (weights, weights / setup.effective_bandwidth_bytes_per_second,
            gemm_flops(arch, tokens_in_step, tp) / setup.effective_compute_flops_per_second)


def predict_mean_step(
    setup: ServingSetup, groups: Sequence[RequestGroup], prefill_mix: Sequence[tuple[float, float]],
    prefill_mean_context_tokens: float | None = None,
) -> float:
    """Mean step time over steps whose prefill tokens follow `prefill_mix` ((tokens, share) pairs), each
    prefill token attending to `prefill_mean_context_tokens` on average (None: attention not counted).

    A step's GEMM phase is max(memory, compute): past the compute roof it grows with its tokens, so a
    few steps carrying big prefill chunks cost more than the same tokens spread evenly over every
    step; so does its attention phase, max(KV read, attention FLOPs), with a chunk's attention. The mean
    of the steps is the mean ITL a server shows, not the step at the mean prefill.
    """
    return mean_step_over_mix(setup, predict_step(setup, groups), prefill_mix, prefill_mean_context_tokens)


def mean_step_over_mix(setup: ServingSetup, step: StepPrediction, prefill_mix: Sequence[tuple[float, float]],
                       prefill_mean_context_tokens: float | None = None) -> float:
    """predict_mean_step from a prediction already made for the same requests (`step`, with any
    prefill tokens): those change only its GEMM phase and its attention FLOPs, so the rest of the step
    is taken from it once (this runs on every reading, over every bucket of the window's mix)."""
    rest = step.overhead_seconds + step.per_request_seconds
    decode_attention = step.attention_compute_seconds - _prefill_attention_seconds(
        setup, step.prefill_tokens, prefill_mean_context_tokens)

    def mean_of(tokens: float) -> float:
        attention = decode_attention + _prefill_attention_seconds(setup, tokens, prefill_mean_context_tokens)
        return (rest + max(_gemm_phase(setup, step.decode_tokens + tokens)[1:])
                + max(step.kv_memory_seconds, attention))
    total_share = sum(share for _, share in prefill_mix)
    if not prefill_mix or total_share <= 0:
        return mean_of(0.0)
    return sum(mean_of(tokens) * share for tokens, share in prefill_mix) / total_share


def _prefill_attention_seconds(setup: ServingSetup, prefill_tokens: float, mean_context_tokens: float | None
                               ) -> float:
    """Attention compute seconds of prefill tokens that each attend to `mean_context_tokens` on average."""
    if mean_context_tokens is None or prefill_tokens <= 0:
        return 0.0
    arch = setup.architecture
    attended = _prefill_attended_at_mean(arch, prefill_tokens, mean_context_tokens)
    return attention_flops(arch, attended, setup.tensor_parallel) / setup.effective_compute_flops_per_second


def groups_from_total(tokens_in_flight: float, running_requests: float) -> list[RequestGroup]:
    """What a server's metrics allow: N running requests sharing T tokens, taken as N of T/N each.

    Exact for plain models (bytes are linear in tokens); for sliding-window models it assumes
    equal contexts, which overestimates the windowed saving when contexts are very unequal.
    """
    if tokens_in_flight < 0 or running_requests < 0:
        raise InputError("tokens in flight and running requests must not be negative")
    count = round(running_requests)
    if count == 0:
        return [RequestGroup(1, tokens_in_flight)] if tokens_in_flight > 0 else []
    return [RequestGroup(count, tokens_in_flight / count)]


def step_budget_seconds(target_tokens_per_second: float, headroom: float = DEFAULT_HEADROOM) -> float:
    """The longest step that still gives every user the target speed, keeping 1-headroom for prompts."""
    if not target_tokens_per_second > 0:
        raise InputError(f"target tokens per second must be greater than zero, got {target_tokens_per_second!r}")
    if not 0 < headroom <= 1:
        raise InputError(f"headroom must be in (0, 1], got {headroom!r}")
    return headroom / target_tokens_per_second


def token_budget_tokens(
    setup: ServingSetup, step_budget: float, context_tokens_per_request: float | None = None
) -> float:
    """The most tokens in flight whose predicted step fits `step_budget`; 0 if the model alone misses.

    Plain models with no per-request cost and no context given use the closed form
    ((budget - overhead) * bandwidth - weights read) / kv_bytes_per_token (memory-bound GEMMs). With a
    context per request (needed for sliding windows, MoE and a per-request cost, where the step is
    not linear in tokens alone) the budget is found numerically, with requests of that context, and
    every phase counts.
    """
    arch = setup.architecture
    if context_tokens_per_request is None:
        if not budget_has_closed_form(setup):
            raise InputError(
                f"model {arch.name!r} has sliding-window layers, experts or a per-request cost: its token "
                "budget depends on the context per request; give one"
            )
        usable_bytes = (step_budget - setup.step_overhead_seconds) * setup.effective_bandwidth_bytes_per_second
        spare = usable_bytes - weight_read_bytes(arch, setup.weight_bytes_per_param, 1.0, setup.tensor_parallel)
        per_token = kv_bytes_per_token(arch, setup.kv_bytes_per_element, setup.tensor_parallel)
        return max(0.0, spare / per_token)
    if not context_tokens_per_request > 0:
        raise InputError(f"context per request must be greater than zero, got {context_tokens_per_request!r}")
    if arch.is_linear:
        solved = _solve_linear_budget(setup, step_budget, context_tokens_per_request)
        if solved is not None:
            return solved
    return _solve_budget_numerically(setup, step_budget, context_tokens_per_request)


def budget_has_closed_form(setup: ServingSetup) -> bool:
    """True when the step grows linearly with tokens in flight whatever their split into requests."""
    return setup.architecture.is_linear and setup.per_request_seconds == 0


def step_seconds_at(setup: ServingSetup, tokens_in_flight: float, context: float) -> float:
    """Predicted step with `tokens_in_flight` held by requests of `context` tokens each (the last
    one shorter); an empty batch is one request of 0 tokens, i.e. the weights alone."""
    return predict_step(setup, [RequestGroup(1, 0.0)] if tokens_in_flight <= 0 else
                        _groups_of_context(tokens_in_flight, context)).step_seconds


def _groups_of_context(tokens_in_flight: float, context: float) -> list[RequestGroup]:
    whole = int(tokens_in_flight // context)
    rest = tokens_in_flight - whole * context
    groups = [RequestGroup(whole, context)] if whole else []
    return groups + ([RequestGroup(1, rest)] if rest > 0 else [])


def _solve_linear_budget(setup: ServingSetup, step_budget: float, context: float) -> float | None:
    """The budget in closed form where every phase is affine in the running requests (dense, full
    attention); None where that does not hold and bisection must do (n past the embedding table).

    With requests of `context` tokens, n requests hold T in ((n-1)·context, n·context] tokens and the
    step is overhead + per_request·n + max(weights(n)/bandwidth, gemm(n)/compute) + s·T, with s the
    attention phase per token (its memory and compute both grow with T alone). So n requests fit
    iff the step at T = (n-1)·context is under the budget, a max of two affine functions of n;
    the largest such n comes from each line's root, and T from the budget left over in its interval.
    This runs on every reading with a fitted per-request cost: no search, a few predict_step calls.
    """
    def lines_at(requests: int) -> tuple[float, float, float]:
        """(memory-bound GEMM line, compute-bound GEMM line, step) at `requests` requests, the last empty."""
        step = predict_step(setup, [RequestGroup(requests - 1, context), RequestGroup(1, 0.0)])
        rest = step.step_seconds - step.gemm_seconds
        return rest + step.weight_memory_seconds, rest + step.gemm_compute_seconds, step.step_seconds

    memory_one, compute_one, first_step = lines_at(1)
    if not first_step < step_budget:
        return 0.0  # even the weights alone, with no context, miss
    memory_two, compute_two, _ = lines_at(2)
    largest = math.inf
    for at_one, at_two in ((memory_one, memory_two), (compute_one, compute_two)):
        slope = at_two - at_one
        if slope > 0:  # the line's root: n with at_one + slope·(n-1) = budget
            largest = min(largest, 1 + (step_budget - at_one) / slope)
    if largest * context > _BUDGET_SEARCH_CEILING_TOKENS:
        return _BUDGET_SEARCH_CEILING_TOKENS
    requests = max(1, math.ceil(largest) - 1)  # the most requests whose first token is strictly under
    arch = setup.architecture
    if arch.input_embedding_params and requests > arch.input_embedding_params / arch.hidden_size:
        return None  # past the table every row is read: the weight line bends, so search instead
    _, _, step = lines_at(requests)
    per_token = predict_step(setup, [RequestGroup(1, context)]).attention_seconds / context
    if not per_token > 0:
        return None
    return min(requests * context, (requests - 1) * context + (step_budget - step) / per_token)


def _solve_budget_numerically(setup: ServingSetup, step_budget: float, context: float) -> float:
    """The most tokens whose step fits, to half a token, for steps no formula inverts (MoE, sliding windows).

    The predicted step never decreases as tokens in flight grow, so a bracket [fits, misses] is kept
    throughout, first guessed from the straight line through 0 and one request. The step jumps where
    a request starts (its per-request cost, the experts its token touches) and is piecewise linear in
    between (kinks at windows and the compute roof). So the number of full requests is narrowed
    first, on the boundaries, where the step is smooth; then the last, partial request's tokens. Both
    by regula falsi, which lands in a few steps on such curves where bisection took ~30 per reading.
    """

    def excess(tokens: float) -> float:
        return step_seconds_at(setup, tokens, context) - step_budget

    at_zero, at_context = excess(0.0), excess(context)
    if at_zero > 0:
        return 0.0  # not even one request with no context yet
    low, below, high, above = 0.0, at_zero, context, at_context
    if at_context <= 0:
        slope = (at_context - at_zero) / context
        low, below = context, at_context
        high = max(2.0 * context, 1.05 * -at_zero / slope) if slope > 0 else 2.0 * context
        while (above := excess(high)) <= 0:
            low, below, high = high, above, 2.0 * high
            if high > _BUDGET_SEARCH_CEILING_TOKENS:
                return _BUDGET_SEARCH_CEILING_TOKENS
    # Full requests: k fit while excess(k * context) <= 0; low's whole requests fit, high's rounded up miss.
    fitting, missing = float(math.floor(low / context)), float(math.ceil(high / context))
    if missing - fitting > 1:
        fitting, fits, missing, misses = _narrow(lambda k: excess(k * context), fitting, missing,
                                                 excess(fitting * context), excess(missing * context), whole=True)
        if fitting * context > low:
            low, below = fitting * context, fits
        if missing * context < high:
            high, above = missing * context, misses
    if high - low > 0.5:  # the next request's first token may itself jump past the budget
        first = excess(low + 0.25)
        if first > 0:
            return low
        low, below = low + 0.25, first
    return _narrow(excess, low, high, below, above, whole=False)[0]


def _narrow(excess: Callable[[float], float], low: float, high: float, below: float, above: float, *,
            whole: bool) -> tuple[float, float, float, float]:
    """Shrink [low, high], excess(low) <= 0 < excess(high), to half a token (or to adjacent whole
    numbers): (low, its excess, high, its excess). Illinois regula falsi, bisecting when two steps
    fail to halve the bracket."""
    margin, done = (1.0, 1.0) if whole else (0.25, 0.5)
    replaced, stalls = 0, 0
    below_weight, above_weight = 1.0, 1.0  # Illinois scales the secant's end values, not the values returned
    while high - low > done:
        width = high - low
        if stalls >= 2:
            guess, stalls = (low + high) / 2, 0
        else:  # the secant's root
            scaled_below, scaled_above = below * below_weight, above * above_weight
            guess = low - scaled_below * width / (scaled_above - scaled_below)
        guess = float(round(guess)) if whole else guess
        guess = min(max(guess, low + margin), high - margin)  # strictly inside: the bracket always shrinks
        value = excess(guess)
        if value <= 0:
            low, below = guess, value
            above_weight = above_weight / 2 if replaced == -1 else above_weight  # Illinois: the stale end halves
            replaced = -1
        else:
            high, above = guess, value
            below_weight = below_weight / 2 if replaced == 1 else below_weight
            replaced = 1
        stalls = stalls + 1 if high - low > width / 2 else 0
    return low, below, high, above


# --- calibration -----------------------------------------------------------------------------


def calibration_point(setup: ServingSetup, itl_seconds: float, tokens_in_flight: float,
                      running_requests: float = 1.0) -> CalibrationPoint:
    """A measured gap with what the model says the step did: bytes read (weights and all), GEMM FLOPs.

    `tokens_in_flight` is shared by `running_requests` equal requests (one stream: its context)."""
    step = predict_step(setup, groups_from_total(tokens_in_flight, running_requests))
    return CalibrationPoint(itl_seconds, tokens_in_flight, step.read_bytes, max(1.0, running_requests),
                            step.weight_read_bytes, gemm_flops(setup.architecture, step.tokens_in_step,
                                                               setup.tensor_parallel))
