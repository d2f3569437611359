"""The load generator's shared system prompts and prefill-only requests (exporter/real_vllm/loadgen.py),
without an engine: the prompts it sends, read by a stand-in server on 127.0.0.1, and the ground truth it
keeps, from streams written out by hand. What tests/real_vllm/test_real_vllm_shared_prefix.py compares the daemon
with must itself be right.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from exporter.real_vllm.loadgen import (
    FIRST_TOKEN_ID,
    LoadGenerator,
    Phase,
    Stream,
    contexts_held_at,
    prompt_tokens_first_returned_in,
    unique_blocks_held_at,
    unique_tokens_held_at,
)
from tests.support.completions import StandInCompletions, prompt_ids

BLOCK = 128  # vLLM's CPU backend's KV block (tests/support/real_vllm.py)
VOCAB = 8192


@pytest.fixture
def completions() -> Iterator[StandInCompletions]:
    server = StandInCompletions()
    yield server
    server.close()


def _run(load: LoadGenerator, phase: Phase, requests: int) -> None:
    """The phase's clients until at least `requests` requests have finished, then stopped and joined."""
    load.start(phase)
    deadline = time.monotonic() + 10.0
    while sum(1 for s in load.streams if s.finished_at_seconds is not None) < requests:
        assert time.monotonic() < deadline, load.streams
        time.sleep(0.01)
    load.stop(phase.name)
    assert load.join(10)
    assert not load.errors(), load.errors()


def test_every_prompt_begins_with_the_phases_prefix_and_goes_on_with_ids_of_its_own(
        completions: StandInCompletions) -> None:
    load = LoadGenerator(completions.base_url, "tiny", vocab_size=VOCAB, seed=3)
    phase = Phase("system", 4, 300, 2, spread_ratio=0.5, shared_prefix_tokens=200, output_spread_ratio=0.0)
    _run(load, phase, 12)
    prompts = completions.prompts()
    prefix = prompts[0][:200]
    assert len(prompts) >= 12
    assert all(prompt[:200] == prefix for prompt in prompts)
    assert all(FIRST_TOKEN_ID <= token < VOCAB for prompt in prompts for token in prompt)
    # The spread is the own part's: 100 +- 50 ids after the 200 shared, never the prefix's.
    assert all(250 <= len(prompt) <= 350 for prompt in prompts), sorted(len(p) for p in prompts)
    assert len({len(prompt) for prompt in prompts}) > 1
    # Their own ids differ from request to request (random draws from 8,189 ids: two own parts of 50 or
    # more alike only by a failure).
    owns = {tuple(prompt[200:]) for prompt in prompts}
    assert len(owns) == len(prompts)
    streams = load.streams
    assert sorted(s.prompt_tokens for s in streams) == sorted(len(p) for p in prompts)
    assert {(s.shared_prefix, s.shared_prefix_tokens) for s in streams} == {("system", 200)}
    # The outputs keep their own spread (none here).
    assert all(s.max_tokens == 2 and s.generated_by(s.finished_at_seconds or 0.0) == 2 for s in streams)


def test_a_phase_started_again_keeps_its_prefix_and_another_phase_draws_its_own(
        completions: StandInCompletions) -> None:
    load = LoadGenerator(completions.base_url, "tiny", vocab_size=VOCAB, seed=4)
    first = Phase("a", 1, 160, 1, shared_prefix_tokens=150)
    _run(load, first, 1)
    _run(load, first, 2)
    _run(load, Phase("b", 1, 160, 1, shared_prefix_tokens=150), 3)
    prompts = completions.prompts()
    a_prompts = [p for p, s in zip(prompts, load.streams, strict=True) if s.shared_prefix == "a"]
    b_prompts = [p for p, s in zip(prompts, load.streams, strict=True) if s.shared_prefix == "b"]
    assert len(a_prompts) >= 2 and b_prompts
    assert all(p[:150] == a_prompts[0][:150] for p in a_prompts)
    assert all(p[:150] == b_prompts[0][:150] for p in b_prompts)
    assert a_prompts[0][:150] != b_prompts[0][:150]


def test_warming_a_prefix_sends_it_alone_with_one_id_of_its_own_for_one_token(completions: StandInCompletions) -> None:
    load = LoadGenerator(completions.base_url, "tiny", vocab_size=VOCAB, seed=5)
    phase = Phase("system", 3, 600, 20, shared_prefix_tokens=512)
    warm = load.warm_prefix(phase)
    _run(load, phase, 3)
    (warm_body, *others) = completions.bodies
    warm_prompt = prompt_ids(warm_body)
    assert len(warm_prompt) == 513 and warm_body["max_tokens"] == 1
    assert all(prompt_ids(body)[:512] == warm_prompt[:512] for body in others)
    assert (warm.prompt_tokens, warm.max_tokens, warm.shared_prefix, warm.shared_prefix_tokens) == (
        513, 1, "system", 512)
    # Prefill-only: one token back, in one event.
    assert [total for _, total in warm.arrivals] == [1]
    assert warm.first_token_at_seconds == warm.arrivals[0][0]
    with pytest.raises(ValueError, match="no shared prefix"):
        load.warm_prefix(Phase("plain", 1, 100, 1))


def test_a_prefill_only_phase_sends_max_tokens_one_and_each_request_streams_one_token(
        completions: StandInCompletions) -> None:
    load = LoadGenerator(completions.base_url, "tiny", vocab_size=VOCAB, seed=6)
    _run(load, Phase("prefill", 2, 1000, 1, spread_ratio=0.5), 6)
    assert {body["max_tokens"] for body in completions.bodies} == {1}
    assert all(s.max_tokens == 1 and [total for _, total in s.arrivals] == [1] for s in load.streams)
    # A prompt without a shared prefix is all its own: no two alike, none sharing even a first block.
    prompts = completions.prompts()
    assert len({tuple(p[:BLOCK]) for p in prompts}) == len(prompts)
    assert all(s.shared_prefix == "" and s.shared_tokens == 0 for s in load.streams)


def test_a_phase_whose_prefix_leaves_no_ids_of_its_own_is_refused() -> None:
    with pytest.raises(ValueError, match="shorter than"):
        Phase("bad", 1, 300, 10, shared_prefix_tokens=300)
    with pytest.raises(ValueError, match="at least 1"):
        Phase("bad", 1, 300, 0)


def _shared(prompt_tokens: int, prefix_tokens: int, sent: float, arrivals: list[tuple[float, int]],
            finished: float | None, prefix: str = "system") -> Stream:
    return Stream(prompt_tokens=prompt_tokens, max_tokens=arrivals[-1][1], sent_at_seconds=sent,
                  arrivals=arrivals, finished_at_seconds=finished, shared_prefix=prefix,
                  shared_prefix_tokens=prefix_tokens)


def test_contexts_count_each_request_whole_and_the_cache_holds_a_shared_prefix_once() -> None:
    # Three requests sharing a 3,000-token system prompt, one request of its own, worked by hand at t = 5:
    #   a: 3,200 prompt + 10 received -> 3,210    b: 3,100 + 4 -> 3,104    c: 3,300 + 0 (sent, no token yet) -> 3,300
    #   d: no prefix, 500 + 7 -> 507              e: shares the prefix but finished at t = 4: holds nothing
    a = _shared(3200, 3000, 0.0, [(1.0, 1), (4.0, 10), (6.0, 20)], 6.0)
    b = _shared(3100, 3000, 0.5, [(2.0, 1), (4.5, 4), (5.5, 9)], 7.0)
    c = _shared(3300, 3000, 4.9, [(6.0, 1)], 8.0)
    d = Stream(prompt_tokens=500, max_tokens=30, sent_at_seconds=1.0, arrivals=[(2.0, 1), (3.0, 7)],
               finished_at_seconds=9.0)
    e = _shared(3050, 3000, 0.0, [(1.0, 1), (3.9, 2)], 4.0)
    streams = [a, b, c, d, e]
    assert contexts_held_at(streams, 5.0) == 3210 + 3104 + 3300 + 507 == 10_121
    # The prefix once: 3,000 + (210 + 104 + 300) of the three sharing it + 507 of d's own.
    assert unique_tokens_held_at(streams, 5.0) == 3000 + 210 + 104 + 300 + 507 == 4121
    # Blocks of 128: the prefix fills 23 whole blocks (2,944 tokens), shared; each sharing request holds
    # ceil(context / 128) - 23 of its own (the 24th block holds 56 prefix ids and its own after them):
    # a: 26 - 23 = 3, b: 25 - 23 = 2, c: 26 - 23 = 3; d: ceil(507 / 128) = 4. 23 + 3 + 2 + 3 + 4 = 35.
    assert unique_blocks_held_at(streams, 5.0, BLOCK) == 35
    # Each counted whole instead, the blocks would be 26 + 25 + 26 + 4 = 81.
    assert sum(-(-s.tokens_held_at(5.0) // BLOCK) for s in streams) == 81
    # Nothing running, nothing held; a prefix whose requests all finished is no longer held.
    assert unique_blocks_held_at(streams, 100.0, BLOCK) == unique_tokens_held_at(streams, 100.0) == 0
    assert unique_tokens_held_at([e], 3.95) == 3052


def test_two_prefixes_are_each_held_once() -> None:
    # Two system prompts of 256 tokens (2 whole blocks each), two requests on each, at t = 1.
    streams = [_shared(300, 256, 0.0, [(0.5, 5)], None, prefix=name) for name in ("x", "x", "y", "y")]
    assert contexts_held_at(streams, 1.0) == 4 * 305
    assert unique_tokens_held_at(streams, 1.0) == 2 * 256 + 4 * 49
    assert unique_blocks_held_at(streams, 1.0, BLOCK) == 2 * 2 + 4 * (3 - 2)


def test_prompt_tokens_first_returned_in_a_window_are_those_of_the_first_tokens_inside_it() -> None:
    # Prefill-only requests of 1,000, 1,200 and 800 tokens whose one token came back at 1.0, 2.0 and 3.0;
    # one sent that never returned a token.
    streams = [Stream(prompt_tokens=tokens, max_tokens=1, sent_at_seconds=at - 0.5, arrivals=[(at, 1)],
                      finished_at_seconds=at) for tokens, at in ((1000, 1.0), (1200, 2.0), (800, 3.0))]
    streams.append(Stream(prompt_tokens=5000, max_tokens=1, sent_at_seconds=2.5))
    assert prompt_tokens_first_returned_in(streams, 1.0, 3.0) == 2000  # (start, end]: 2.0 and 3.0
    assert prompt_tokens_first_returned_in(streams, 0.0, 1.0) == 1000
    assert prompt_tokens_first_returned_in(streams, 3.0, 9.0) == 0
