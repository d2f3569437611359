"""Load shapes drawn from a seed (exporter/real_vllm/shapes.py, shape_draws.py, shape_player.py), without an
engine: a seed gives one shape and a new seed another, every kind is drawn, every draw fits the suite's real
server, the arrival processes have the statistics they claim (computed here by hand), and the player sends
what a shape says, within its caps, to a stand-in server on 127.0.0.1.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import time
from collections.abc import Iterator

import pytest

from exporter.real_vllm.loadgen import LoadGenerator, Phase
from exporter.real_vllm.shape_draws import SPEC_REPEAT_IDS, draw_shape, shape_kinds
from exporter.real_vllm.shape_player import ShapePlayer, make_load, play
from exporter.real_vllm.shapes import Arrival, LanesProcess, Lengths, LoadShape, OpenLoopProcess, ShapeLimits
from tests.support.completions import StandInCompletions

BLOCK = 128
MAX_MODEL_LEN = 4096
MAX_NUM_SEQS = 32
CACHES = (16_384, 32_768)  # the suite's servers' KV caches
DURATION = 180.0
KINDS = ("sync-lanes", "staggered-lanes", "chats+join", "poisson-fixed", "poisson-longtail", "bursts",
         "shared-prefix", "unique-long-prompts", "mixed")


def _draw(seed: int, kind: str | None = None, *, cache_tokens: int = 16_384, duration: float = DURATION) -> LoadShape:
    return draw_shape(seed, duration_seconds=duration, cache_tokens=cache_tokens, max_model_len=MAX_MODEL_LEN,
                      kind=kind)


# --- one seed, one shape ------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_shape_and_other_seeds_others() -> None:
    for kind in (None, *KINDS):
        assert _draw(7, kind) == _draw(7, kind)
        assert _draw(7, kind).describe() == _draw(7, kind).describe()
    shapes = [_draw(seed) for seed in range(60)]
    assert len({shape.describe() for shape in shapes}) == 60
    for kind in KINDS:
        assert len({_draw(seed, kind).describe() for seed in range(20)}) == 20, kind


def test_a_forced_kind_is_the_draw_the_seed_gives_that_kind() -> None:
    for seed in range(40):
        shape = _draw(seed)
        assert _draw(seed, shape.kind) == shape


def test_every_kind_is_drawable_and_a_free_draw_reaches_them_all() -> None:
    assert shape_kinds() == KINDS
    assert len(KINDS) >= 8
    for kind in KINDS:
        shape = _draw(1, kind)
        assert shape.kind == kind
        assert shape.lanes or any(p.arrivals for p in shape.open_loops)
        assert shape.describe().startswith(f"{kind} (seed 1")
    drawn = [_draw(seed).kind for seed in range(300)]
    assert set(drawn) == set(KINDS)
    # Each about one ninth of the draws.
    assert all(300 / len(KINDS) / 2 < drawn.count(kind) < 300 / len(KINDS) * 2 for kind in KINDS)
    with pytest.raises(ValueError, match="unknown kind"):
        _draw(1, "chats")


def test_speculative_decoding_is_wanted_by_some_shapes_with_prompts_it_can_draft_from() -> None:
    shapes = [_draw(seed) for seed in range(200)]
    wanted = [shape for shape in shapes if shape.speculative_decoding]
    assert 0.1 * len(shapes) < len(wanted) < 0.4 * len(shapes)
    assert all(shape.repeat_ids == (SPEC_REPEAT_IDS if shape.speculative_decoding else 0) for shape in shapes)
    assert all("spec decode" in shape.describe() for shape in wanted)


# --- every draw fits the server -------------------------------------------------------------------------


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def _lanes_context(lanes: LanesProcess) -> int:
    """The longest context the load generator can send for these lanes: its spread is round(x (1 + u)) for
    u within +-s, at most ceil(x (1 + s)), on the prompt's own ids past the shared prefix."""
    own = lanes.prompt_tokens - lanes.shared_prefix_tokens
    return (lanes.shared_prefix_tokens + math.ceil(own * (1 + lanes.spread_ratio))
            + math.ceil(lanes.max_tokens * (1 + lanes.output_spread_ratio)))


def _check_bounds(shape: LoadShape, cache_tokens: int, max_model_len: int, max_num_seqs: int) -> None:
    duration = shape.duration_seconds
    streams = blocks = 0
    for lanes in shape.lanes:
        context = _lanes_context(lanes)
        assert context <= max_model_len, (shape.describe(), lanes)
        assert lanes.prompt_tokens - lanes.shared_prefix_tokens >= 1 and lanes.max_tokens >= 1 and lanes.lanes >= 1
        assert 0 <= lanes.start_seconds < lanes.stop_seconds <= duration
        shared = lanes.shared_prefix_tokens // BLOCK
        warm = 1 if lanes.shared_prefix_tokens else 0  # the request that warms the prefix: prefix + 1 id
        streams += lanes.lanes + warm
        blocks += shared + lanes.lanes * (_blocks(context) - shared) + warm
        lanes.phase()  # the load generator takes it
    for process in shape.open_loops:
        assert 0 <= process.start_seconds < process.stop_seconds <= duration
        assert process.kv_budget_tokens % BLOCK == 0
        streams += process.max_in_flight
        blocks += process.kv_budget_tokens // BLOCK
        for arrival in process.arrivals:
            context = arrival.prompt_tokens + arrival.max_tokens
            assert arrival.prompt_tokens >= 1 and arrival.max_tokens >= 1
            assert context <= max_model_len and context <= process.kv_budget_tokens
            assert arrival.prompt_tokens <= 4000
            assert process.start_seconds <= arrival.at_seconds < process.stop_seconds
        times = [arrival.at_seconds for arrival in process.arrivals]
        assert times == sorted(times)
    assert streams <= max_num_seqs, shape.describe()
    assert blocks <= cache_tokens // BLOCK, shape.describe()
    assert streams == shape.peak_streams() and blocks == shape.peak_kv_blocks()
    assert shape.violations() == []


def test_every_draw_fits_the_suites_server_over_500_seeds() -> None:
    for seed in range(500):
        for cache_tokens in CACHES:
            shape = _draw(seed, cache_tokens=cache_tokens, duration=(120.0, 300.0)[seed % 2])
            _check_bounds(shape, cache_tokens, MAX_MODEL_LEN, MAX_NUM_SEQS)
            # The longest request ends within 40% of the shape at the slowest step (0.15 s).
            longest_output = max([math.ceil(p.max_tokens * (1 + p.output_spread_ratio)) for p in shape.lanes]
                                 + [a.max_tokens for p in shape.open_loops for a in p.arrivals])
            assert longest_output * 0.15 <= 0.4 * shape.duration_seconds


def test_every_kind_fits_a_small_server_too() -> None:
    limits = ShapeLimits(cache_tokens=4096, max_model_len=1024, max_num_seqs=8)
    for kind in KINDS:
        for seed in range(60):
            shape = draw_shape(seed, duration_seconds=60.0, cache_tokens=0, max_model_len=0, kind=kind, limits=limits)
            _check_bounds(shape, 4096, 1024, 8)


def test_limits_too_small_to_draw_for_are_refused() -> None:
    with pytest.raises(ValueError, match="too short"):
        _draw(1, duration=10.0)
    with pytest.raises(ValueError, match="too small"):
        ShapeLimits(cache_tokens=1024, max_model_len=1024)
    with pytest.raises(ValueError, match="max_num_seqs"):
        ShapeLimits(cache_tokens=16_384, max_model_len=4096, max_num_seqs=4)


def test_open_loop_rates_stay_within_what_the_server_drains() -> None:
    # Little's law, by hand, at the step the rates assume (0.08 s) and 200 prompt tokens a second: over
    # its on time, the mean streams a process keeps out is under its cap, and over many shapes its prompts
    # ask for about half the prefill rate or less.
    prompt_per_second: list[float] = []
    for seed in range(300):
        shape = _draw(seed, ("poisson-fixed", "poisson-longtail", "bursts", "unique-long-prompts", "mixed")[seed % 5])
        for process in shape.open_loops:
            on_seconds = sum(end - start for start, end in process.on_periods)
            in_server = sum(a.prompt_tokens / 200.0 + a.max_tokens * 0.08 for a in process.arrivals)
            assert in_server / on_seconds <= process.max_in_flight, shape.describe()
            prompt_per_second.append(sum(a.prompt_tokens for a in process.arrivals)
                                     / (process.stop_seconds - process.start_seconds))
    assert statistics.mean(prompt_per_second) <= 0.5 * 200.0


# --- the statistics each process claims -------------------------------------------------------------------


def _poisson_processes(kind: str, seeds: range) -> list[OpenLoopProcess]:
    return [p for seed in seeds for p in _draw(seed, kind, duration=600.0).open_loops]


@pytest.mark.parametrize("kind", ["poisson-fixed", "poisson-longtail"])
def test_poisson_arrivals_come_at_their_rate_with_poisson_counts_and_exponential_gaps(kind: str) -> None:
    processes = _poisson_processes(kind, range(300))
    expected = [p.rate_per_second * (p.stop_seconds - p.start_seconds) for p in processes]
    counts = [len(p.arrivals) for p in processes]
    # The mean inter-arrival time (the process's seconds per arrival, over every draw) is 1 / rate.
    assert sum(counts) > 10_000
    assert sum(counts) / sum(expected) == pytest.approx(1.0, rel=0.03)
    # Counts as a Poisson process's: their variance is their mean (a regular or clumped one's is not).
    dispersion = sum((n - mu) ** 2 for n, mu in zip(counts, expected, strict=True)) / sum(expected)
    assert dispersion == pytest.approx(1.0, abs=0.15)
    # Gaps between arrivals, in units of each process's mean gap, exponential: mean 1, one in e longer
    # than the mean (over processes with many arrivals, where the window's end cuts few gaps short).
    gaps = [(b.at_seconds - a.at_seconds) * p.rate_per_second for p in processes if len(p.arrivals) > 50
            for a, b in zip(p.arrivals, p.arrivals[1:], strict=False)]
    assert len(gaps) > 5_000
    assert statistics.mean(gaps) == pytest.approx(1.0, rel=0.04)
    assert sum(1 for gap in gaps if gap > 1.0) / len(gaps) == pytest.approx(math.exp(-1), abs=0.02)
    assert statistics.pstdev(gaps) == pytest.approx(1.0, rel=0.08)


def test_bursts_arrive_only_while_on_at_their_rate_with_off_periods_between() -> None:
    processes = _poisson_processes("bursts", range(300))
    on_expected = 0.0
    for process in processes:
        assert process.pattern == "bursts"
        periods = process.on_periods
        for start, end in periods:
            assert 0 < end - start <= 20.0
        for (_, end), (start, _) in itertools.pairwise(periods):
            assert 8.0 <= start - end <= 40.0  # off between bursts
        assert all(start + 4.0 <= end or end == process.stop_seconds for start, end in periods)
        assert all(any(s <= a.at_seconds < e for s, e in periods) for a in process.arrivals)
        on_expected += process.rate_per_second * sum(end - start for start, end in periods)
        # Bursty: the rate while on is the whole process's over its on share of the time.
        on_share = sum(end - start for start, end in periods) / (process.stop_seconds - process.start_seconds)
        assert on_share < 0.75
    assert sum(len(p.arrivals) for p in processes) / on_expected == pytest.approx(1.0, rel=0.04)


def test_long_tailed_lengths_have_the_median_and_tail_they_claim() -> None:
    rng = random.Random(5)
    lognormal = Lengths("lognormal", 300, 1, 10**9, sigma=1.1)
    draws = [lognormal.draw(rng) for _ in range(40_000)]
    assert statistics.median(draws) == pytest.approx(300, rel=0.03)
    # log-normal: log-lengths' standard deviation sigma
    assert statistics.pstdev(math.log(d) for d in draws) == pytest.approx(1.1, rel=0.03)
    pareto = Lengths("pareto", 100, 1, 10**9, alpha=1.5)
    draws = [pareto.draw(rng) for _ in range(40_000)]
    assert min(draws) >= 100
    # P(X > x) = (x_m / x) ** alpha: beyond 2 x_m, 2 ** -1.5 = 35.4%; beyond 10 x_m, 10 ** -1.5 = 3.2%
    assert sum(1 for d in draws if d > 200) / len(draws) == pytest.approx(2 ** -1.5, abs=0.01)
    assert sum(1 for d in draws if d > 1000) / len(draws) == pytest.approx(10 ** -1.5, abs=0.004)
    # Clipped to its bounds and to what else fits.
    clipped = Lengths("pareto", 100, 120, 400, alpha=1.0)
    draws = [clipped.draw(rng) for _ in range(5_000)]
    assert min(draws) == 120 and max(draws) == 400
    assert max(clipped.draw(rng, 250) for _ in range(1_000)) == 250
    assert {Lengths("fixed", 64, 64, 64).draw(rng) for _ in range(100)} == {64}
    with pytest.raises(ValueError):
        Lengths("lognormal", 100, 1, 200)  # no sigma


def test_open_loop_lengths_follow_their_distribution_inside_a_shape() -> None:
    # A log-normal prompt's arrivals, whatever the shape clipped: the median of the draws within the
    # clips is the claimed median, for processes whose clips leave it room.
    ratios: list[float] = []
    for seed in range(400):
        for process in _draw(seed, "poisson-longtail", duration=600.0).open_loops:
            if process.prompt.distribution == "lognormal" and len(process.arrivals) >= 20:
                ratios.append(statistics.median(a.prompt_tokens for a in process.arrivals) / process.prompt.tokens)
    assert len(ratios) > 50
    assert statistics.median(ratios) == pytest.approx(1.0, rel=0.06)


# --- the kinds' own promises ----------------------------------------------------------------------------


def test_chats_then_long_sessions_join_together_with_nothing_in_between() -> None:
    for seed in range(200):
        for cache_tokens in CACHES:
            shape = _draw(seed, "chats+join", cache_tokens=cache_tokens)
            assert not shape.open_loops
            chats, sessions = shape.lanes
            assert (chats.role, sessions.role) == ("chats", "sessions")
            join = sessions.start_seconds
            assert chats.start_seconds == 0.0 and chats.stop_seconds == sessions.stop_seconds == shape.duration_seconds
            assert 0.35 * DURATION <= join <= 0.6 * DURATION
            # The sessions are one group of lanes started at once: they join together.
            assert 1 <= sessions.lanes <= 3
            # Long contexts beside short chats.
            assert sessions.prompt_tokens >= 1000 > chats.longest_prompt_tokens
            # Two segments: the chats alone, then the chats with the sessions. No step between.
            segments = shape.segments()
            assert [(s.start_seconds, s.end_seconds) for s in segments] == [(0.0, join), (join, shape.duration_seconds)]
            assert segments[0].label == f"{chats.lanes} chats"
            assert segments[1].label == f"{chats.lanes} chats + {sessions.lanes} sessions"
            assert shape.label_at(join - 0.01) == segments[0].label
            assert shape.label_at(join) == segments[1].label
            assert shape.label_at(shape.duration_seconds) == "after"


def test_synchronized_lanes_start_together_and_a_second_group_replaces_the_first_at_once() -> None:
    seen_two = False
    for seed in range(100):
        shape = _draw(seed, "sync-lanes")
        assert not shape.open_loops and 1 <= len(shape.lanes) <= 2
        first = shape.lanes[0]
        assert first.start_seconds == 0.0 and first.lanes >= 2
        if len(shape.lanes) == 2:
            seen_two = True
            assert first.stop_seconds == shape.lanes[1].start_seconds
        assert shape.lanes[-1].stop_seconds == shape.duration_seconds
    assert seen_two


def test_staggered_lanes_start_apart() -> None:
    for seed in range(100):
        shape = _draw(seed, "staggered-lanes")
        assert all(lanes.lanes == 1 for lanes in shape.lanes) and len(shape.lanes) >= 4
        starts = [lanes.start_seconds for lanes in shape.lanes]
        assert starts[0] == 0.0 and len(set(starts)) > len(starts) // 2


def test_shared_prefix_groups_share_a_system_prompt_held_once() -> None:
    for seed in range(100):
        shape = _draw(seed, "shared-prefix")
        assert 1 <= len(shape.lanes) <= 3 and not shape.open_loops
        for lanes in shape.lanes:
            assert lanes.shared_prefix_tokens >= BLOCK
            phase = lanes.phase()
            assert phase.shared_prefix_tokens == lanes.shared_prefix_tokens
            assert len({lanes.name for lanes in shape.lanes}) == len(shape.lanes)  # a prefix per group
    # Held once: 10 lanes of a 1,000-token prompt (896 shared: 7 whole blocks) and 100 out, 1,100 tokens or
    # 9 blocks each, take the 7 shared, 10 x (9 - 7) of their own and the warming request's block.
    lanes = LanesProcess("system-1", "system-1", 10, 1000, 100, 0.0, 60.0, shared_prefix_tokens=896)
    assert lanes.kv_blocks(ShapeLimits(16_384, 4096)) == 7 + 10 * 2 + 1 == 28


def test_unique_long_prompts_arrive_beside_short_chats() -> None:
    for seed in range(100):
        shape = _draw(seed, "unique-long-prompts")
        (chats,), (long_prompts,) = shape.lanes, shape.open_loops
        assert chats.role == "chats" and chats.start_seconds == 0.0
        assert long_prompts.start_seconds > 0.1 * DURATION
        assert all(a.prompt_tokens >= 1000 and a.max_tokens <= 64 for a in long_prompts.arrivals)


# --- the player, against a stand-in server -------------------------------------------------------------


@pytest.fixture
def completions() -> Iterator[StandInCompletions]:
    server = StandInCompletions(token_seconds=0.03)
    yield server
    server.close()


LIMITS = ShapeLimits(cache_tokens=16_384, max_model_len=MAX_MODEL_LEN)


def _open_loop(name: str, arrivals: list[Arrival], *, max_in_flight: int, kv_budget_tokens: int,
               stop_seconds: float) -> OpenLoopProcess:
    fixed = Lengths("fixed", 1, 1, 1)
    return OpenLoopProcess(name, name, "poisson", 1.0, 0.0, stop_seconds, ((0.0, stop_seconds),), fixed, fixed,
                           max_in_flight, kv_budget_tokens, tuple(arrivals))


@pytest.mark.slow  # 3 s
def test_the_player_sends_what_the_shape_says_within_each_processs_caps(completions: StandInCompletions) -> None:
    # Lanes of 2 from the start; 3 lanes sharing a 300-token system prompt from 0.2 s; 8 open-loop requests
    # due at once with room for 2 at a time (max_tokens 7, 0.21 s each); 4 more due at once whose 2 blocks
    # each leave room for one at a time in a 3-block budget (max_tokens 9). Requests are told apart by
    # their max_tokens. The shape lasts 3 s: time for every request held back to be sent.
    lanes = LanesProcess("chats", "chats", 2, 40, 3, 0.0, 1.0)
    system = LanesProcess("system-1", "system-1", 3, 320, 2, 0.2, 1.0, shared_prefix_tokens=300)
    capped = _open_loop("capped", [Arrival(0.1, 50 + i, 7) for i in range(8)], max_in_flight=2,
                        kv_budget_tokens=10 * BLOCK, stop_seconds=1.0)
    kv_capped = _open_loop("kv", [Arrival(0.3, 200 + i, 9) for i in range(4)], max_in_flight=4,
                           kv_budget_tokens=3 * BLOCK, stop_seconds=1.0)
    shape = LoadShape(1, "hand-made", 3.0, LIMITS, (lanes, system), (capped, kv_capped), False, 0)
    assert shape.violations() == []
    load = make_load(shape, completions.base_url, "tiny", vocab_size=4096)
    stats = play(shape, load, drain_timeout_seconds=30.0)
    assert not load.errors(), load.errors()
    requests = completions.requests()
    # Every open-loop request, its exact lengths, once; the first due first.
    assert sorted(len(p) for p, m in requests if m == 7) == [50 + i for i in range(8)]
    assert sorted(len(p) for p, m in requests if m == 9) == [200 + i for i in range(4)]
    assert stats.sent == 12 and stats.dropped == 0
    assert completions.most_open_by_max_tokens[7] <= 2
    assert completions.most_open_by_max_tokens[9] == 1
    assert stats.held >= 1 and stats.held_seconds > 0
    # The lanes ran: the chats' prompts of 40, and the system prompt warmed once (prefix + 1 id, one token
    # out) before any of its lanes' requests, every one of which begins with it.
    assert [len(p) for p, m in requests if m == 3] and all(len(p) == 40 for p, m in requests if m == 3)
    warm = [(index, p) for index, (p, m) in enumerate(requests) if m == 1]
    system_requests = [(index, p) for index, (p, m) in enumerate(requests) if m == 2]
    assert len(warm) == 1 and len(warm[0][1]) == 301 and system_requests
    assert all(index > warm[0][0] and p[:300] == warm[0][1][:300] for index, p in system_requests)
    assert set(stats.lanes_started_seconds) == {"chats", "system-1"}
    assert stats.lanes_started_seconds["system-1"] >= 0.2
    # The load generator kept every stream for the ground truth.
    assert len(load.streams) == len(requests)


def test_stopping_the_player_drops_what_waits_and_sends_nothing_more(completions: StandInCompletions) -> None:
    process = _open_loop("one-at-a-time", [Arrival(0.05, 30, 6) for _ in range(20)], max_in_flight=1,
                         kv_budget_tokens=4 * BLOCK, stop_seconds=5.0)
    shape = LoadShape(2, "hand-made", 5.0, LIMITS, (), (process,), False, 0)
    load = LoadGenerator(completions.base_url, "tiny", vocab_size=4096, seed=2)
    player = ShapePlayer(shape, load)
    player.start()
    deadline = time.monotonic() + 10.0
    while not completions.requests():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    player.stop()
    assert player.wait(5.0)
    assert player.join(10.0)
    sent = len(completions.requests())
    assert sent == player.stats.sent and player.stats.sent + player.stats.dropped <= 20
    assert player.stats.dropped >= 1
    with pytest.raises(RuntimeError, match="once"):
        player.start()


def test_a_player_places_times_in_the_shape() -> None:
    # Lanes due at 50 s of a 100-s shape, the player stopped long before: only its clock is read here.
    later = LanesProcess("chats", "chats", 2, 40, 3, 50.0, 100.0)
    shape = LoadShape(4, "hand-made", 100.0, LIMITS, (later,), (), False, 0)
    assert [(s.label, s.start_seconds, s.end_seconds) for s in shape.segments()] == [
        ("idle", 0.0, 50.0), ("2 chats", 50.0, 100.0)]
    load = LoadGenerator("http://127.0.0.1:9", "tiny", vocab_size=4096)
    clock = [1_000.0]
    player = ShapePlayer(shape, load, clock=lambda: clock[0], wall_clock=lambda: 5_000.0)
    assert player.elapsed_seconds() == 0.0
    player.start()
    try:
        assert player.started_at_seconds == 5_000.0
        assert player.label_now() == "idle"
        clock[0] += 60.0
        assert player.elapsed_seconds() == 60.0 and player.label_now() == "2 chats"
    finally:
        player.stop()
    assert player.join(5.0)
    assert load.streams == [] and player.stats.lanes_started_seconds == {}


def test_lanes_become_the_load_generators_phases() -> None:
    lanes = LanesProcess("system-2", "system-2", 4, 900, 50, 0.0, 10.0, spread_ratio=0.5, output_spread_ratio=0.25,
                         shared_prefix_tokens=700)
    assert lanes.phase() == Phase("system-2", 4, 900, 50, spread_ratio=0.5, shared_prefix_tokens=700,
                                  output_spread_ratio=0.25)
    assert lanes.longest_prompt_tokens == 700 + 300 and lanes.longest_output_tokens == math.ceil(62.5)
