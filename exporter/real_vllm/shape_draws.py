"""Drawing a load shape from a seed: each kind's draw, its sizes fitted to the server the shape is for.

One job: a seed (and a server's `ShapeLimits`) into a `LoadShape` (exporter/real_vllm/shapes.py says what
one is and what it must fit). Why apart: the draws are the long, tuned part (sizes, rates kept under the
caps by Little's law, bursts, shared prefixes); the shapes they give and the player that runs them do not
change when a draw does.

Standard library only, like the load generator: it runs beside the daemon in any venv.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from exporter.real_vllm.shapes import (
    Arrival,
    LanesProcess,
    Lengths,
    LoadShape,
    OpenLoopProcess,
    Pattern,
    ShapeLimits,
)

SPEC_REPEAT_IDS = 16  # a prompt of 16 random ids repeated: what ngram speculation drafts from (spec tests)
OUTPUT_MIN_TOKENS = 4  # an open-loop request's shortest answer unless its kind asks for prefill-only ones
# The longest request, in seconds at the slowest step, as a share of the shape: a request outliving its
# shape by much would hold the drain (and the benchmark) long after the shape ended.
REQUEST_SHARE_OF_DURATION = 0.4
LONGEST_OUTPUT_TOKENS = 1536
PREFILL_SHARE = 0.5  # of the prefill rate the sizes assume, what an open-loop process's prompts may offer
RATE_SAMPLE_REQUESTS = 400  # requests drawn to estimate a process's mean time in the server
STEADY_IN_FLIGHT_SHARE = 0.5  # a Poisson process's mean streams and KV, as a share of its caps
BURST_IN_FLIGHT_SHARE = 0.8  # a burst's, during its on periods (it means to press on the caps)


@dataclass
class _Budget:
    """What is left of the server for the processes still to draw."""

    blocks: int
    streams: int

    def take(self, blocks: int, streams: int) -> None:
        assert blocks <= self.blocks and streams <= self.streams, (blocks, self.blocks, streams, self.streams)
        self.blocks -= blocks
        self.streams -= streams


@dataclass
class _Draw:
    """One shape's draw under way: its random stream, what is left, and its output cap."""

    rng: random.Random
    limits: ShapeLimits
    duration_seconds: float
    budget: _Budget
    lanes: list[LanesProcess] = field(default_factory=list)
    open_loops: list[OpenLoopProcess] = field(default_factory=list)

    @property
    def output_cap_tokens(self) -> int:
        """The longest output a request may ask for: it ends within a share of the shape at the slowest step."""
        by_time = int(REQUEST_SHARE_OF_DURATION * self.duration_seconds / self.limits.slow_step_seconds)
        return max(16, min(LONGEST_OUTPUT_TOKENS, by_time, self.limits.max_model_len // 2))

    def log_uniform(self, low: float, high: float) -> int:
        low = min(low, high)
        return round(math.exp(self.rng.uniform(math.log(low), math.log(high))))

    def add_lanes(self, name: str, role: str, lanes: int, prompt_tokens: int, max_tokens: int, *,
                  start_seconds: float, stop_seconds: float, spread_ratio: float = 0.0,
                  output_spread_ratio: float = 0.0, shared_prefix_tokens: int = 0, blocks: int | None = None,
                  streams: int | None = None, min_lanes: int = 1) -> LanesProcess:
        """Lanes sized to fit `blocks` and `streams` (by default what is left): first fewer lanes, down to
        `min_lanes`, then shorter requests, then fewer lanes again."""
        limits = self.limits
        blocks = self.budget.blocks if blocks is None else min(blocks, self.budget.blocks)
        streams = self.budget.streams if streams is None else min(streams, self.budget.streams)
        warm = 1 if shared_prefix_tokens else 0
        lanes = max(1, min(lanes, streams - warm))
        max_tokens = max(1, min(max_tokens, math.floor(self.output_cap_tokens / (1 + output_spread_ratio))))
        while True:
            process = LanesProcess(name, role, lanes, prompt_tokens, max_tokens, start_seconds, stop_seconds,
                                   spread_ratio, output_spread_ratio, shared_prefix_tokens)
            over = process.longest_context_tokens - limits.max_model_len
            if over > 0:  # the output gives way first, then the prompt's own ids
                max_tokens = max(1, math.floor((process.longest_output_tokens - over) / (1 + output_spread_ratio)))
                if math.ceil(max_tokens * (1 + output_spread_ratio)) + process.longest_prompt_tokens > \
                        limits.max_model_len:
                    prompt_tokens = max(shared_prefix_tokens + 1, (prompt_tokens + shared_prefix_tokens) // 2)
                continue
            if process.kv_blocks(limits) <= blocks:
                self.budget.take(process.kv_blocks(limits), process.streams)
                self.lanes.append(process)
                return process
            own = prompt_tokens - shared_prefix_tokens
            if lanes > min_lanes:
                lanes -= 1
            elif max_tokens > 32 and (max_tokens >= own or own <= 32):  # the longer of the two gives way
                max_tokens //= 2
            elif own > 32:
                prompt_tokens = shared_prefix_tokens + own // 2
            elif shared_prefix_tokens > limits.block_tokens:
                shared_prefix_tokens //= 2
                prompt_tokens = shared_prefix_tokens + own
            elif lanes > 1:
                lanes -= 1
            elif max_tokens > 1 or own > 1:
                max_tokens, prompt_tokens = max(1, max_tokens // 2), shared_prefix_tokens + max(1, own // 2)
            else:
                raise AssertionError(f"no lane of {name} fits {blocks} blocks")  # ShapeLimits' minimum rules it out

    def chats(self, name: str, lanes: int, *, start_seconds: float, stop_seconds: float, blocks: int,
              streams: int | None = None) -> LanesProcess:
        """Short chats: a short prompt, a few hundred tokens back, lengths spread +-50% (the benchmark's); at
        least half the lanes asked for stay, their requests shortened instead."""
        prompt = self.log_uniform(64, 384)
        output = self.log_uniform(128, min(600, self.output_cap_tokens))
        return self.add_lanes(name, "chats", lanes, prompt, output, start_seconds=start_seconds,
                              stop_seconds=stop_seconds, spread_ratio=0.5, output_spread_ratio=0.5, blocks=blocks,
                              streams=streams, min_lanes=max(1, lanes // 2))

    def randint(self, low: int, high: int) -> int:
        """An integer in [low, high], or `high` where that is below `low` (a small server)."""
        return self.rng.randint(min(low, high), high)

    def long_tail(self, median_low: int, median_high: int, min_tokens: int, max_tokens: int) -> Lengths:
        """Log-normal or Pareto lengths, clipped."""
        if self.rng.random() < 0.5:
            median = self.log_uniform(median_low, median_high)
            return Lengths("lognormal", median, min_tokens, max_tokens, sigma=self.rng.uniform(0.6, 1.3))
        minimum = self.log_uniform(max(min_tokens, median_low // 3), max(min_tokens, median_high // 3))
        return Lengths("pareto", minimum, min_tokens, max_tokens, alpha=self.rng.uniform(1.1, 2.2))

    def add_open_loop(self, name: str, role: str, pattern: Pattern, prompt: Lengths, output: Lengths, *,
                      start_seconds: float, stop_seconds: float, max_in_flight: int,
                      blocks: int | None = None) -> OpenLoopProcess:
        """An open-loop process whose rate keeps its mean streams and KV under its caps (Little's law at the
        typical step) and its prompt tokens a second, on average over on and off, under a share of the
        prefill rate; Poisson within its on periods."""
        limits, rng = self.limits, self.rng
        blocks = self.budget.blocks if blocks is None else min(blocks, self.budget.blocks)
        max_in_flight = max(1, min(max_in_flight, self.budget.streams))
        context_cap = min(limits.max_model_len, blocks * limits.block_tokens)
        share = STEADY_IN_FLIGHT_SHARE if pattern == "poisson" else BURST_IN_FLIGHT_SHARE
        sample = random.Random(rng.getrandbits(64))
        seconds = block_seconds = prompt_total = 0.0
        for _ in range(RATE_SAMPLE_REQUESTS):
            prompt_tokens, max_tokens = _lengths(sample, prompt, output, context_cap)
            in_server = prompt_tokens / limits.prefill_tokens_per_second + max_tokens * limits.typical_step_seconds
            seconds += in_server
            block_seconds += in_server * limits.blocks(prompt_tokens + max_tokens)
            prompt_total += prompt_tokens
        if pattern == "poisson":
            periods: tuple[tuple[float, float], ...] = ((start_seconds, stop_seconds),)
        else:
            periods = _on_periods(rng, start_seconds, stop_seconds)
        on_share = sum(end - start for start, end in periods) / (stop_seconds - start_seconds)
        prefill_rate = PREFILL_SHARE * limits.prefill_tokens_per_second / on_share  # bursts: over on and off
        rate_cap = min(share * max_in_flight * RATE_SAMPLE_REQUESTS / seconds,
                       share * blocks * RATE_SAMPLE_REQUESTS / block_seconds,
                       prefill_rate * RATE_SAMPLE_REQUESTS / prompt_total)
        rate = rate_cap * rng.uniform(0.5, 1.0)
        arrivals: list[Arrival] = []
        for period_start, period_end in periods:
            at = period_start
            while True:
                at += rng.expovariate(rate)
                if at >= period_end:
                    break
                prompt_tokens, max_tokens = _lengths(rng, prompt, output, context_cap)
                arrivals.append(Arrival(at, prompt_tokens, max_tokens))
        process = OpenLoopProcess(name, role, pattern, rate, start_seconds, stop_seconds, periods, prompt, output,
                                  max_in_flight, blocks * limits.block_tokens, tuple(arrivals))
        self.budget.take(blocks, max_in_flight)
        self.open_loops.append(process)
        return process


def _lengths(rng: random.Random, prompt: Lengths, output: Lengths, context_cap_tokens: int) -> tuple[int, int]:
    """A request's prompt and output, the two within `context_cap_tokens` (the prompt leaves the output
    room for its shortest)."""
    prompt_tokens = prompt.draw(rng, context_cap_tokens - output.min_tokens)
    return prompt_tokens, output.draw(rng, context_cap_tokens - prompt_tokens)


def _on_periods(rng: random.Random, start_seconds: float, stop_seconds: float) -> tuple[tuple[float, float], ...]:
    """Bursts: on for 4-20 s, off for 8-40 s, from an off period's end at start, until stop."""
    periods: list[tuple[float, float]] = []
    at = start_seconds + rng.uniform(0.0, 10.0)
    while at < stop_seconds:
        end = min(stop_seconds, at + rng.uniform(4.0, 20.0))
        periods.append((at, end))
        at = end + rng.uniform(8.0, 40.0)
    return tuple(periods) or ((start_seconds, min(stop_seconds, start_seconds + 4.0)),)


def _sync_lanes(draw: _Draw) -> None:
    """One group of lanes that start together, or two, the second replacing the first all at once; fixed
    lengths or a spread, any prompt from 32 to 2,048 tokens."""
    duration, rng = draw.duration_seconds, draw.rng
    groups = rng.choice([1, 1, 2])
    switch = round(rng.uniform(0.35, 0.65) * duration, 1) if groups == 2 else duration
    spans = [(0.0, switch), (switch, duration)][:groups]
    for index, (start, stop) in enumerate(spans):
        spread = 0.0 if rng.random() < 0.5 else round(rng.uniform(0.1, 0.5), 2)
        lanes = draw.randint(2, min(24, draw.limits.max_num_seqs // groups))
        prompt = min(draw.log_uniform(32, 2048), draw.limits.max_model_len // 2)
        output = draw.log_uniform(32, draw.output_cap_tokens)
        draw.add_lanes(f"lanes-{index + 1}", "lanes", lanes, prompt, output, start_seconds=start, stop_seconds=stop,
                       spread_ratio=spread, output_spread_ratio=spread, blocks=draw.budget.blocks // (groups - index),
                       streams=draw.budget.streams // (groups - index), min_lanes=2)


def _staggered_lanes(draw: _Draw) -> None:
    """Lanes that come one by one over the first half, some leaving before the end: no two in step."""
    duration, rng = draw.duration_seconds, draw.rng
    count = draw.randint(4, min(20, draw.limits.max_num_seqs))
    for index in range(count):
        start = 0.0 if index == 0 else round(rng.uniform(0.0, 0.5) * duration, 1)
        stop = round(rng.uniform(0.6, 1.0) * duration, 1) if rng.random() < 0.4 else duration
        prompt = min(draw.log_uniform(32, 1536), draw.limits.max_model_len // 2)
        output = draw.log_uniform(32, draw.output_cap_tokens)
        draw.add_lanes(f"lane-{index + 1}", "lanes", 1, prompt, output, start_seconds=start, stop_seconds=stop,
                       spread_ratio=0.5, output_spread_ratio=0.5, blocks=draw.budget.blocks // (count - index),
                       streams=1)


def _chats_join(draw: _Draw) -> None:
    """Chats from the start; long sessions (1-3, usually 2) join together part-way, nothing in between,
    and stay: README's story, where the daemon's decode prediction ran 30-45% low."""
    duration, rng, limits = draw.duration_seconds, draw.rng, draw.limits
    join = round(rng.uniform(0.35, 0.6) * duration, 1)
    sessions = rng.choice([1, 2, 2, 2, 3])
    draw.chats("chats", rng.randint(6, 20), start_seconds=0.0, stop_seconds=duration,
               blocks=int(draw.budget.blocks * rng.uniform(0.3, 0.5)), streams=draw.budget.streams - sessions)
    output = draw.log_uniform(128, draw.output_cap_tokens)
    spread = rng.choice([0.0, 0.0, 0.05])
    per_session_tokens = draw.budget.blocks // sessions * limits.block_tokens
    context = min(limits.max_model_len, per_session_tokens, rng.randint(1500, 3800) + output)
    output = min(output, context // 4)
    prompt = max(1, math.floor((context - math.ceil(output * (1 + spread))) / (1 + spread)) - 1)
    draw.add_lanes("sessions", "sessions", sessions, prompt, output, start_seconds=join, stop_seconds=duration,
                   spread_ratio=spread, output_spread_ratio=spread)


def _prompt_cap(draw: _Draw) -> int:
    """The longest prompt a long tail may reach: under 4,000 tokens and max_model_len less an answer."""
    return min(4000, draw.limits.max_model_len - OUTPUT_MIN_TOKENS)


def _fixed(tokens: int) -> Lengths:
    return Lengths("fixed", tokens, tokens, tokens)


def _poisson_fixed(draw: _Draw) -> None:
    """Open-loop Poisson arrivals of one prompt length and one output length, for the whole shape."""
    prompt_tokens = min(draw.log_uniform(32, 2048), draw.limits.max_model_len // 2)
    output_tokens = draw.log_uniform(16, draw.output_cap_tokens)
    draw.add_open_loop("poisson", "poisson", "poisson", _fixed(prompt_tokens), _fixed(output_tokens),
                       start_seconds=0.0, stop_seconds=draw.duration_seconds,
                       max_in_flight=draw.randint(8, min(24, draw.budget.streams)))


def _poisson_longtail(draw: _Draw) -> None:
    """Open-loop Poisson arrivals whose prompts and outputs have long tails (log-normal or Pareto)."""
    prompt = draw.long_tail(96, 768, 16, _prompt_cap(draw))
    output = draw.long_tail(32, min(256, draw.output_cap_tokens), OUTPUT_MIN_TOKENS, draw.output_cap_tokens)
    draw.add_open_loop("poisson", "poisson", "poisson", prompt, output, start_seconds=0.0,
                       stop_seconds=draw.duration_seconds, max_in_flight=draw.randint(8, min(24, draw.budget.streams)))


def _bursts(draw: _Draw) -> None:
    """Poisson bursts (on 4-20 s, off 8-40 s) of fixed or long-tailed requests, over a few chats or none."""
    duration, rng = draw.duration_seconds, draw.rng
    if rng.random() < 0.5:
        draw.chats("chats", rng.randint(2, 8), start_seconds=0.0, stop_seconds=duration,
                   blocks=int(draw.budget.blocks * 0.3), streams=draw.budget.streams // 3)
    if rng.random() < 0.5:
        prompt = _fixed(min(draw.log_uniform(32, 1024), draw.limits.max_model_len // 2))
        output = _fixed(draw.log_uniform(16, min(400, draw.output_cap_tokens)))
    else:
        prompt = draw.long_tail(64, 512, 16, _prompt_cap(draw))
        output = draw.long_tail(32, min(256, draw.output_cap_tokens), OUTPUT_MIN_TOKENS, draw.output_cap_tokens)
    draw.add_open_loop("bursts", "bursts", "bursts", prompt, output, start_seconds=0.0, stop_seconds=duration,
                       max_in_flight=draw.randint(8, min(24, draw.budget.streams)))


def _shared_prefix_groups(draw: _Draw, groups: int, *, blocks: int, streams: int,
                          first_start_seconds: float = 0.0) -> None:
    """`groups` groups of lanes within `blocks` and `streams`, each sharing its own system prompt of
    256-2,048 tokens; the first starts at `first_start_seconds`, each other then or part-way."""
    duration, rng, limits = draw.duration_seconds, draw.rng, draw.limits
    for index in range(groups):
        start = first_start_seconds
        if index and rng.random() < 0.5:
            start = round(rng.uniform(0.2, 0.6) * duration, 1)
        prefix = draw.log_uniform(256, min(2048, limits.max_model_len // 2))
        own = draw.log_uniform(32, 384)
        output = draw.log_uniform(32, min(400, draw.output_cap_tokens))
        left = groups - index
        process = draw.add_lanes(f"system-{index + 1}", f"system-{index + 1}", rng.randint(3, 12), prefix + own,
                                 output, start_seconds=start, stop_seconds=duration, spread_ratio=0.5,
                                 output_spread_ratio=0.5, shared_prefix_tokens=prefix, blocks=blocks // left,
                                 streams=streams // left, min_lanes=3)
        blocks -= process.kv_blocks(limits)
        streams -= process.streams


def _shared_prefix(draw: _Draw) -> None:
    """One to three groups of lanes, each group's requests beginning with the same system prompt."""
    _shared_prefix_groups(draw, draw.rng.choice([1, 2, 3]), blocks=draw.budget.blocks, streams=draw.budget.streams)


def _unique_long_prompts(draw: _Draw) -> None:
    """Short chats throughout; from a point in the first third, Poisson arrivals of unique long prompts
    (1,000-3,800 tokens, no shared prefix) with short answers: where the daemon read 42% low."""
    duration, rng, limits = draw.duration_seconds, draw.rng, draw.limits
    draw.chats("chats", rng.randint(4, 16), start_seconds=0.0, stop_seconds=duration,
               blocks=int(draw.budget.blocks * rng.uniform(0.3, 0.5)), streams=draw.budget.streams - 4)
    output_tokens = rng.choice([1, 16, 32, 64])
    longest = min(3800, limits.max_model_len - output_tokens, draw.budget.blocks * limits.block_tokens - output_tokens)
    shortest = min(1000, longest)
    prompt = Lengths("lognormal", min(longest, rng.randint(1500, 2500)), shortest, longest, sigma=0.3)
    draw.add_open_loop("long-prompts", "long prompts", "poisson", prompt, _fixed(output_tokens),
                       start_seconds=round(rng.uniform(0.15, 0.35) * duration, 1), stop_seconds=duration,
                       max_in_flight=min(4, draw.budget.streams))


def _mixed(draw: _Draw) -> None:
    """Chats, a group sharing a system prompt and long-tailed Poisson arrivals, each with a share of the
    server, the last two starting part-way."""
    duration, rng = draw.duration_seconds, draw.rng
    draw.chats("chats", rng.randint(4, 12), start_seconds=0.0, stop_seconds=duration,
               blocks=int(draw.budget.blocks * 0.3), streams=draw.budget.streams // 3)
    _shared_prefix_groups(draw, 1, blocks=draw.budget.blocks // 2, streams=draw.budget.streams // 2,
                          first_start_seconds=round(rng.uniform(0.0, 0.4) * duration, 1))
    prompt = draw.long_tail(96, 768, 16, _prompt_cap(draw))
    output = draw.long_tail(32, min(256, draw.output_cap_tokens), OUTPUT_MIN_TOKENS, draw.output_cap_tokens)
    draw.add_open_loop("poisson", "poisson", "poisson", prompt, output,
                       start_seconds=round(rng.uniform(0.0, 0.4) * duration, 1), stop_seconds=duration,
                       max_in_flight=draw.randint(4, min(10, draw.budget.streams)))


_KINDS: dict[str, Callable[[_Draw], None]] = {
    "sync-lanes": _sync_lanes,
    "staggered-lanes": _staggered_lanes,
    "chats+join": _chats_join,
    "poisson-fixed": _poisson_fixed,
    "poisson-longtail": _poisson_longtail,
    "bursts": _bursts,
    "shared-prefix": _shared_prefix,
    "unique-long-prompts": _unique_long_prompts,
    "mixed": _mixed,
}
SPECULATIVE_SHARE = 0.25  # of the shapes, those that want ngram speculative decoding


def shape_kinds() -> tuple[str, ...]:
    """Every kind `draw_shape` draws from, in a fixed order."""
    return tuple(_KINDS)


def draw_shape(seed: int, *, duration_seconds: float, cache_tokens: int, max_model_len: int,
               max_num_seqs: int = 32, block_tokens: int = 128, kind: str | None = None,
               limits: ShapeLimits | None = None) -> LoadShape:
    """The shape `seed` gives: its kind (unless `kind` forces one: the rest is then the same draw as the seed
    would give that kind), every size and time, every open-loop arrival. `limits` overrides the server the
    sizes fit (cache_tokens, max_model_len, max_num_seqs and block_tokens then come from it)."""
    if limits is None:
        limits = ShapeLimits(cache_tokens, max_model_len, max_num_seqs, block_tokens)
    if duration_seconds < 30.0:
        raise ValueError(f"a shape of {duration_seconds} s is too short to hold its phases (at least 30 s)")
    if kind is not None and kind not in _KINDS:
        raise ValueError(f"unknown kind {kind!r}: one of {', '.join(_KINDS)}")
    rng = random.Random(seed)
    drawn_kind = rng.choice(shape_kinds())  # drawn even when forced, so the rest of the stream is the same
    chosen = kind or drawn_kind
    speculative = rng.random() < SPECULATIVE_SHARE
    budget = _Budget(int(limits.cache_blocks * limits.kv_fill_ratio), limits.max_num_seqs)
    draw = _Draw(random.Random(rng.getrandbits(64)), limits, float(duration_seconds), budget)
    _KINDS[chosen](draw)
    shape = LoadShape(seed, chosen, float(duration_seconds), limits, tuple(draw.lanes), tuple(draw.open_loops),
                      speculative, SPEC_REPEAT_IDS if speculative else 0)
    broken = shape.violations()
    if broken:  # the draws fit by construction: this is a bug in them, never the caller's
        raise RuntimeError(f"seed {seed} drew a {chosen} shape that breaks its limits: {broken}")
    return shape
