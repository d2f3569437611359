"""Load shapes drawn from a seed for a real engine, and a player that runs one through the load generator.

Why: a predictor is judged on loads it was never tuned on. A shape is drawn from a seed, so a
run can be repeated exactly (the same seed, the same shape, field for field) and a new seed gives a load
no one chose. Each shape is one of a few kinds (`shape_kinds()`): synchronized or staggered closed-loop
lanes, chats that long sessions join with nothing in between, open-loop Poisson arrivals of fixed or
long-tailed lengths, bursts, shared system prompts, unique long prompts beside short chats, a mix.

Every draw fits the server it is sized for (`ShapeLimits`; the suite's tiny Llama on vLLM 0.32.0's CPU
backend by default): each request's prompt + output within max_model_len; at any moment at most
max_num_seqs streams; and the KV cache the requests can hold at their worst (every lane at its longest
request at once, every open-loop process at its own cap, a shared prefix's whole blocks once) within the
cache. Open-loop processes are held to their caps by the player (an arrival that would pass its
process's streams or KV budget waits, first come first served, counted in `PlayStats.held`); their rates
keep half the caps by Little's law at a typical step, so the caps bite only on a slow server and a
Poisson process stays one; their prompts offer at most half the prefill rate the sizes assume. Closed-loop
lanes run as the load generator's own `Phase`s (a shared prefix warmed first).

What repeats exactly: the shape (every process, size and time, every open-loop arrival's time and
lengths), with the same Python (`random`'s streams). Within lanes, each request's spread is the load
generator's draw, from `load_seed` but in the order its threads ask, as before.

Standard library only, like the load generator: it runs beside the daemon in any venv.
"""

from __future__ import annotations

import itertools
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from exporter.real_vllm.loadgen import LoadGenerator, Phase

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

Distribution = Literal["fixed", "lognormal", "pareto"]
Pattern = Literal["poisson", "bursts"]


@dataclass(frozen=True)
class ShapeLimits:
    """What the server holds and how fast it goes, as the draws assume: sizes are fitted to these."""

    cache_tokens: int
    max_model_len: int
    max_num_seqs: int = 32
    block_tokens: int = 128  # vLLM's CPU backend
    # The slowest decode step (2 busy CPU cores: steps of ~20-150 ms): the longest output is one that
    # ends within a share of the shape at this step.
    slow_step_seconds: float = 0.15
    # The step open-loop rates are sized at (Little's law, half the process's caps): at the slowest step
    # its streams come near its cap, which the player holds (an arrival waits), at the fastest a quarter.
    typical_step_seconds: float = 0.08
    # The prompt tokens a second the rates assume the server computes beside its decodes (a 5,000-token
    # prompt took 20-36 s beside 16 chats: real_vllm_online.md): open-loop prompts offer at most half.
    prefill_tokens_per_second: float = 200.0
    # The share of the cache the draws fill at most: the rest for the blocks a step allocates ahead.
    kv_fill_ratio: float = 0.9

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.max_model_len < 8 * self.block_tokens:
            raise ValueError(f"max_model_len {self.max_model_len} must hold at least 8 blocks of {self.block_tokens}")
        if self.cache_tokens < 32 * self.block_tokens:
            raise ValueError(f"a cache of {self.cache_tokens} tokens is too small to draw shapes for (32 blocks)")
        if self.max_num_seqs < 8:
            raise ValueError(f"max_num_seqs {self.max_num_seqs}: shapes need at least 8 streams")
        if not (0 < self.typical_step_seconds <= self.slow_step_seconds and self.prefill_tokens_per_second > 0
                and 0 < self.kv_fill_ratio <= 1):
            raise ValueError("steps, prefill_tokens_per_second and kv_fill_ratio must be positive (typical <= slow)")

    @property
    def cache_blocks(self) -> int:
        return self.cache_tokens // self.block_tokens

    def blocks(self, tokens: int) -> int:
        """The KV blocks `tokens` of one request's context take (its last block partly filled)."""
        return -(-tokens // self.block_tokens)


@dataclass(frozen=True)
class Lengths:
    """A length distribution, clipped to [min_tokens, max_tokens]: fixed, log-normal or Pareto (long tails)."""

    distribution: Distribution
    tokens: int  # fixed: every length; lognormal: the median; pareto: the minimum x_m
    min_tokens: int
    max_tokens: int
    sigma: float = 0.0  # lognormal: the standard deviation of the length's logarithm
    alpha: float = 0.0  # pareto: the tail index, P(length > x) = (x_m / x) ** alpha

    def __post_init__(self) -> None:
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"lengths clipped to [{self.min_tokens}, {self.max_tokens}]: empty or below 1")
        needs = {"lognormal": self.sigma, "pareto": self.alpha}.get(self.distribution, 1.0)
        if needs <= 0:
            raise ValueError(f"{self.distribution} lengths need a positive sigma or alpha")

    def unclipped(self, rng: random.Random) -> float:
        """One draw before clipping (the statistics the distribution claims are this draw's)."""
        if self.distribution == "lognormal":
            return rng.lognormvariate(math.log(self.tokens), self.sigma)
        if self.distribution == "pareto":
            return self.tokens * rng.paretovariate(self.alpha)
        return float(self.tokens)

    def draw(self, rng: random.Random, limit_tokens: int | None = None) -> int:
        """One length, clipped to the distribution's bounds and to `limit_tokens` (what else fits)."""
        tokens = min(max(round(self.unclipped(rng)), self.min_tokens), self.max_tokens)
        return max(1, tokens if limit_tokens is None else min(tokens, limit_tokens))

    def describe(self) -> str:
        if self.distribution == "lognormal":
            return f"lognormal med {self.tokens} sigma {self.sigma:.2f} <= {self.max_tokens}"
        if self.distribution == "pareto":
            return f"pareto {self.tokens}+ alpha {self.alpha:.2f} <= {self.max_tokens}"
        return f"{self.tokens}"


@dataclass(frozen=True)
class LanesProcess:
    """`lanes` closed-loop clients that start together at `start_seconds` and send requests back to back
    until `stop_seconds` (their last ones run to their end): the load generator's `Phase`."""

    name: str
    role: str  # what the lanes stand for, for labels: "chats", "sessions", "lanes", "system-1"
    lanes: int
    prompt_tokens: int  # the whole prompt's centre, a shared prefix included
    max_tokens: int
    start_seconds: float
    stop_seconds: float
    spread_ratio: float = 0.0  # each request's own prompt ids within +-this share (Phase.spread_ratio)
    output_spread_ratio: float = 0.0
    shared_prefix_tokens: int = 0  # a system prompt every lane's requests begin with (warmed before start)

    def phase(self) -> Phase:
        return Phase(self.name, self.lanes, self.prompt_tokens, self.max_tokens, spread_ratio=self.spread_ratio,
                     shared_prefix_tokens=self.shared_prefix_tokens, output_spread_ratio=self.output_spread_ratio)

    @property
    def longest_prompt_tokens(self) -> int:
        """The longest prompt the load generator's spread can draw (round(x (1 + s)) <= ceil)."""
        own = self.prompt_tokens - self.shared_prefix_tokens
        return self.shared_prefix_tokens + math.ceil(own * (1 + self.spread_ratio))

    @property
    def longest_output_tokens(self) -> int:
        return math.ceil(self.max_tokens * (1 + self.output_spread_ratio))

    @property
    def longest_context_tokens(self) -> int:
        return self.longest_prompt_tokens + self.longest_output_tokens

    @property
    def streams(self) -> int:
        """Streams at most at once: the lanes, and the one warming a shared prefix before them."""
        return self.lanes + (1 if self.shared_prefix_tokens else 0)

    def kv_blocks(self, limits: ShapeLimits) -> int:
        """The KV blocks the lanes hold at their worst: each lane its longest context, the shared prefix's
        whole blocks once (the block where it ends holds a request's own ids too), plus the warming
        request's own block."""
        shared = self.shared_prefix_tokens // limits.block_tokens
        own = limits.blocks(self.longest_context_tokens) - shared
        return shared + self.lanes * own + (1 if self.shared_prefix_tokens else 0)

    def describe(self, duration_seconds: float) -> str:
        spread = f"+-{self.spread_ratio:.0%}" if self.spread_ratio else ""
        out_spread = f"+-{self.output_spread_ratio:.0%}" if self.output_spread_ratio else ""
        prefix = f" ({self.shared_prefix_tokens} shared)" if self.shared_prefix_tokens else ""
        return (f"{self.lanes} {self.role} p {self.prompt_tokens}{spread}{prefix} o {self.max_tokens}{out_spread}"
                f"{_span(self.start_seconds, self.stop_seconds, duration_seconds)}")


@dataclass(frozen=True)
class Arrival:
    """One open-loop request: when it is due (seconds from the shape's start) and its exact lengths."""

    at_seconds: float
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class OpenLoopProcess:
    """Requests arriving on their own clock, whatever the server does: Poisson at `rate_per_second` within
    each of `on_periods` (one period from start to stop for plain Poisson; on/off periods for bursts).
    The arrivals are drawn with the shape; the player holds one back while the process has `max_in_flight`
    streams or `kv_budget_tokens` of contexts out (first come, first served)."""

    name: str
    role: str
    pattern: Pattern
    rate_per_second: float  # while on
    start_seconds: float
    stop_seconds: float
    on_periods: tuple[tuple[float, float], ...]
    prompt: Lengths
    output: Lengths
    max_in_flight: int
    kv_budget_tokens: int  # whole blocks: what the process's requests may hold of the cache at once
    arrivals: tuple[Arrival, ...]

    @property
    def streams(self) -> int:
        return self.max_in_flight

    def kv_blocks(self, limits: ShapeLimits) -> int:
        return self.kv_budget_tokens // limits.block_tokens

    def describe(self, duration_seconds: float) -> str:
        on = ""
        if self.pattern == "bursts":
            on_seconds = sum(end - start for start, end in self.on_periods)
            on = f" in {len(self.on_periods)} bursts ({on_seconds:.0f} s on)"
        return (f"{self.role} {self.rate_per_second:.3g}/s{on} p {self.prompt.describe()} o {self.output.describe()}"
                f", <= {self.max_in_flight} out{_span(self.start_seconds, self.stop_seconds, duration_seconds)}"
                f" ({len(self.arrivals)} requests)")


def _span(start_seconds: float, stop_seconds: float, duration_seconds: float) -> str:
    """" from-to s", or nothing for a process that runs the whole shape."""
    if start_seconds == 0.0 and stop_seconds == duration_seconds:
        return ""
    return f" {start_seconds:.0f}-{stop_seconds:.0f} s"


@dataclass(frozen=True)
class Segment:
    """A stretch of the shape over which the same processes run (and a burst is on or off throughout)."""

    label: str
    start_seconds: float
    end_seconds: float


@dataclass(frozen=True)
class LoadShape:
    """One drawn load: its kind, what runs when, and whether it wants the server to speculate."""

    seed: int
    kind: str
    duration_seconds: float
    limits: ShapeLimits
    lanes: tuple[LanesProcess, ...]
    open_loops: tuple[OpenLoopProcess, ...]
    # A server setting, so the benchmark decides: whether the shape wants ngram speculative decoding, and
    # the prompts' repeated-id unit that gives it drafts (`LoadGenerator(repeat_ids=...)`; 0: all random).
    speculative_decoding: bool
    repeat_ids: int

    @property
    def load_seed(self) -> int:
        """The seed for the load generator's own draws (token ids, lanes' spread)."""
        return self.seed * 7919 + 1

    def peak_streams(self) -> int:
        """Streams at most at once, every process counted at its most (whenever it runs)."""
        return sum(p.streams for p in self.lanes) + sum(p.streams for p in self.open_loops)

    def peak_kv_blocks(self) -> int:
        """KV blocks at most at once, every process counted at its worst (whenever it runs)."""
        return (sum(p.kv_blocks(self.limits) for p in self.lanes)
                + sum(p.kv_blocks(self.limits) for p in self.open_loops))

    def violations(self) -> list[str]:
        """The limits this shape breaks (none for a drawn one)."""
        limits, found = self.limits, []
        if self.peak_streams() > limits.max_num_seqs:
            found.append(f"{self.peak_streams()} streams > max_num_seqs {limits.max_num_seqs}")
        if self.peak_kv_blocks() > limits.cache_blocks:
            found.append(f"{self.peak_kv_blocks()} KV blocks > the cache's {limits.cache_blocks}")
        for lanes in self.lanes:
            if lanes.longest_context_tokens > limits.max_model_len:
                found.append(f"{lanes.name}: a context of {lanes.longest_context_tokens} > max_model_len")
            if not 0 <= lanes.start_seconds < lanes.stop_seconds <= self.duration_seconds:
                found.append(f"{lanes.name}: runs {lanes.start_seconds}-{lanes.stop_seconds} s outside the shape")
        for process in self.open_loops:
            budget_blocks = process.kv_blocks(limits)
            for arrival in process.arrivals:
                context = arrival.prompt_tokens + arrival.max_tokens
                if context > limits.max_model_len or limits.blocks(context) > budget_blocks:
                    found.append(f"{process.name}: a request of {context} tokens fits neither model nor budget")
                if not any(start <= arrival.at_seconds < end for start, end in process.on_periods):
                    found.append(f"{process.name}: an arrival at {arrival.at_seconds} s outside its periods")
            if not 0 <= process.start_seconds < process.stop_seconds <= self.duration_seconds:
                found.append(f"{process.name}: runs outside the shape")
        return found

    def segments(self) -> tuple[Segment, ...]:
        """The shape cut where any process starts or stops, or a burst turns on or off."""
        edges = {0.0, self.duration_seconds}
        for lanes in self.lanes:
            edges |= {lanes.start_seconds, lanes.stop_seconds}
        for process in self.open_loops:
            edges |= {process.start_seconds, process.stop_seconds}
            if process.pattern == "bursts":
                edges |= {edge for period in process.on_periods for edge in period}
        points = sorted(edge for edge in edges if 0.0 <= edge <= self.duration_seconds)
        segments: list[Segment] = []
        for start, end in itertools.pairwise(points):
            label = self._label(start)
            if segments and segments[-1].label == label:
                segments[-1] = Segment(label, segments[-1].start_seconds, end)
            else:
                segments.append(Segment(label, start, end))
        return tuple(segments)

    def label_at(self, elapsed_seconds: float) -> str:
        """What runs `elapsed_seconds` into the shape ("after" past its end)."""
        if elapsed_seconds >= self.duration_seconds:
            return "after"
        return self._label(max(0.0, elapsed_seconds))

    def _label(self, at_seconds: float) -> str:
        lanes_by_role: dict[str, int] = {}
        for lanes in self.lanes:
            if lanes.start_seconds <= at_seconds < lanes.stop_seconds:
                lanes_by_role[lanes.role] = lanes_by_role.get(lanes.role, 0) + lanes.lanes
        parts = [f"{count} {role}" for role, count in lanes_by_role.items()]
        for process in self.open_loops:
            if process.start_seconds <= at_seconds < process.stop_seconds:
                on = any(start <= at_seconds < end for start, end in process.on_periods)
                state = "on" if on else "off"
                parts.append(process.role if process.pattern == "poisson" else f"{process.role} {state}")
        return " + ".join(parts) or "idle"

    def describe(self) -> str:
        """One line for the benchmark's table."""
        spec = ", spec decode" if self.speculative_decoding else ""
        by_role: dict[str, list[LanesProcess]] = {}
        for lanes in self.lanes:
            by_role.setdefault(lanes.role, []).append(lanes)
        parts: list[str] = []
        for role, group in by_role.items():
            if len(group) <= 3:
                parts.extend(lanes.describe(self.duration_seconds) for lanes in group)
                continue
            # Many single lanes (staggered): their ranges, not each.
            prompts, outputs = [p.prompt_tokens for p in group], [p.max_tokens for p in group]
            starts = [p.start_seconds for p in group]
            parts.append(f"{sum(p.lanes for p in group)} {role} starting {min(starts):.0f}-{max(starts):.0f} s "
                         f"({sum(1 for p in group if p.stop_seconds < self.duration_seconds)} leaving early), "
                         f"p {min(prompts)}-{max(prompts)} o {min(outputs)}-{max(outputs)}")
        parts += [process.describe(self.duration_seconds) for process in self.open_loops]
        return f"{self.kind} (seed {self.seed}, {self.duration_seconds:.0f} s{spec}): " + "; ".join(parts)


# --- drawing ------------------------------------------------------------------------------------------


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


# --- playing ------------------------------------------------------------------------------------------


def make_load(shape: LoadShape, base_url: str, model: str, *, vocab_size: int,
              clock: Callable[[], float] = time.time) -> LoadGenerator:
    """A fresh load generator for one shape: its seed, and repeated-id prompts where it wants speculation
    (one generator a shape: phases are named per shape, and a name's shared prefix is drawn once)."""
    return LoadGenerator(base_url, model, vocab_size=vocab_size, seed=shape.load_seed, clock=clock,
                         repeat_ids=shape.repeat_ids)


@dataclass
class PlayStats:
    """What the player did beside what the shape says: the open-loop requests sent, those held back by their
    process's caps (and for how long in all), and those still held when the shape ended (dropped)."""

    sent: int = 0
    held: int = 0
    held_seconds: float = 0.0
    dropped: int = 0
    # When each lanes process actually started (seconds into the shape: a shared prefix is warmed first).
    lanes_started_seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class _OpenLoopState:
    """One open-loop process's streams and KV blocks out, and its arrivals waiting for room (each with the
    second it was queued)."""

    process: OpenLoopProcess
    in_flight: int = 0
    blocks_out: int = 0
    waiting: deque[tuple[Arrival, float]] = field(default_factory=deque)


class ShapePlayer:
    """Plays a shape through a load generator: lanes as the generator's phases, each open-loop request in a
    thread of its own from its time on. `start()` returns at once; the schedule runs in a thread, on
    `clock` (seconds, monotonic); `started_at_seconds` is the load generator's clock at the start, so
    streams and polls can be placed in the shape (`LoadShape.label_at(t - started_at_seconds)`)."""

    def __init__(self, shape: LoadShape, load: LoadGenerator, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.shape = shape
        self.load = load
        self.stats = PlayStats()
        self.started_at_seconds: float | None = None
        self._clock = clock
        self._wall_clock = wall_clock
        self._condition = threading.Condition()
        self._halt = threading.Event()
        self._done = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stopped: set[str] = set()
        self._open = [_OpenLoopState(process) for process in shape.open_loops]
        self._started_monotonic: float | None = None

    def start(self) -> None:
        if self._started_monotonic is not None:
            raise RuntimeError("a player plays its shape once")
        self._started_monotonic = self._clock()
        self.started_at_seconds = self._wall_clock()
        self._spawn(self._schedule, "shape-schedule")

    def elapsed_seconds(self) -> float:
        """Seconds since the start (0 before it)."""
        return 0.0 if self._started_monotonic is None else self._clock() - self._started_monotonic

    def label_now(self) -> str:
        return self.shape.label_at(self.elapsed_seconds())

    def wait(self, timeout_seconds: float) -> bool:
        """Until the schedule has run to the shape's end (True) or the timeout passed (False)."""
        return self._done.wait(timeout_seconds)

    def stop(self) -> None:
        """No new request from now on: the schedule halts, lanes stop, arrivals waiting are dropped."""
        self._halt.set()
        self._finish()

    def join(self, timeout_seconds: float) -> bool:
        """Waits for every request sent to end (lanes and open loop); False if some still run."""
        deadline = self._clock() + timeout_seconds
        while True:
            with self._condition:
                alive = [thread for thread in self._threads if thread.is_alive()]
            if not alive or self._clock() >= deadline:
                break
            alive[0].join(max(0.0, deadline - self._clock()))
        return self.load.join(max(0.0, deadline - self._clock())) and not alive

    # --- the schedule ------------------------------------------------------------------------------

    def _events(self) -> list[tuple[float, int, Callable[[], None]]]:
        """(when, order at the same time, action): a lanes process stopping before one starting."""
        events: list[tuple[float, int, Callable[[], None]]] = []
        for lanes in self.shape.lanes:
            events.append((lanes.stop_seconds, 0, partial(self._stop_lanes, lanes)))
            events.append((lanes.start_seconds, 1, partial(self._start_lanes, lanes)))
        for state in self._open:
            events.extend((arrival.at_seconds, 2, partial(self._arrive, state, arrival))
                          for arrival in state.process.arrivals)
        return sorted(events, key=lambda event: (event[0], event[1]))

    def _schedule(self) -> None:
        assert self._started_monotonic is not None
        for at_seconds, _, action in self._events():
            if self._halt.wait(max(0.0, self._started_monotonic + at_seconds - self._clock())):
                return
            action()
        if not self._halt.wait(max(0.0, self._started_monotonic + self.shape.duration_seconds - self._clock())):
            self._finish()

    def _finish(self) -> None:
        with self._condition:
            for lanes in self.shape.lanes:
                self._stopped.add(lanes.name)
                self.load.stop(lanes.name)
            for state in self._open:
                self.stats.dropped += len(state.waiting)
                state.waiting.clear()
        self._done.set()

    def _start_lanes(self, lanes: LanesProcess) -> None:
        phase = lanes.phase()
        if not phase.shared_prefix_tokens:
            self._start_phase(lanes, phase)
            return

        def warm_then_start() -> None:  # warmed first, so every lane shares the prefix's blocks from its start
            self.load.warm_prefix(phase)
            self._start_phase(lanes, phase)

        self._spawn(warm_then_start, f"shape-warm-{lanes.name}")

    def _start_phase(self, lanes: LanesProcess, phase: Phase) -> None:
        with self._condition:
            if lanes.name in self._stopped or self._halt.is_set():
                return  # stopped while its prefix warmed: a phase started after its stop would run on
            self.load.start(phase)
            self.stats.lanes_started_seconds[lanes.name] = self.elapsed_seconds()

    def _stop_lanes(self, lanes: LanesProcess) -> None:
        with self._condition:
            self._stopped.add(lanes.name)
            self.load.stop(lanes.name)

    def _arrive(self, state: _OpenLoopState, arrival: Arrival) -> None:
        with self._condition:
            if self._done.is_set():  # stopped while the schedule reached it
                self.stats.dropped += 1
                return
            state.waiting.append((arrival, self.elapsed_seconds()))
            self._admit(state)
            if state.waiting and state.waiting[-1][0] is arrival:
                self.stats.held += 1  # no room at its time: it waits for a request of its process to end

    def _admit(self, state: _OpenLoopState) -> None:
        """Sends the waiting arrivals, oldest first, while the process has room (the condition held)."""
        limits, process = self.shape.limits, state.process
        while state.waiting and not self._halt.is_set():
            arrival, queued_seconds = state.waiting[0]
            blocks = limits.blocks(arrival.prompt_tokens + arrival.max_tokens)
            if state.in_flight >= process.max_in_flight or state.blocks_out + blocks > process.kv_blocks(limits):
                return
            state.waiting.popleft()
            self.stats.held_seconds += self.elapsed_seconds() - queued_seconds
            state.in_flight += 1
            state.blocks_out += blocks
            self.stats.sent += 1
            self._spawn(partial(self._send, state, arrival, blocks), f"shape-{process.name}")

    def _send(self, state: _OpenLoopState, arrival: Arrival, blocks: int) -> None:
        try:
            self.load.one(arrival.prompt_tokens, arrival.max_tokens)
        finally:
            with self._condition:
                state.in_flight -= 1
                state.blocks_out -= blocks
                self._admit(state)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        with self._condition:
            self._threads.append(thread)
        thread.start()


def play(shape: LoadShape, load: LoadGenerator, *, drain_timeout_seconds: float = 300.0) -> PlayStats:
    """Plays the whole shape, then waits for its last requests (up to `drain_timeout_seconds`)."""
    player = ShapePlayer(shape, load)
    player.start()
    try:
        player.wait(shape.duration_seconds + 60.0)
    finally:
        player.stop()
        player.join(drain_timeout_seconds)
    return player.stats
