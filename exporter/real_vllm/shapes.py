"""Load shapes for a real engine: what a shape is (its processes, their sizes and times) and the server it fits.

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

Drawing a shape from a seed is exporter/real_vllm/shape_draws.py; playing one through the load generator,
exporter/real_vllm/shape_player.py. This module is what both agree on.

Standard library only, like the load generator: it runs beside the daemon in any venv.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Literal

from exporter.real_vllm.loadgen import Phase

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
    # prompt took 20-36 s beside 16 chats: benchmarks/results/real_vllm_online.md at commit 54bfaa1): open-loop
    # prompts offer at most half.
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
