"""The load generator's ground truth about one stream (exporter/real_vllm/loadgen.py), from arrivals
written out by hand: what the real-engine tests compare the daemon with must itself be right."""

from __future__ import annotations

import pytest

from exporter.real_vllm.loadgen import STALL_EVENTS, TOGETHER_SECONDS, Stream


def _stream(arrivals: list[tuple[float, int]], sent_at_seconds: float = 0.0,
            finished_at_seconds: float | None = None) -> Stream:
    return Stream(prompt_tokens=100, max_tokens=arrivals[-1][1] if arrivals else 1, sent_at_seconds=sent_at_seconds,
                  arrivals=arrivals, finished_at_seconds=finished_at_seconds)


def test_events_a_step_apart_are_no_stall() -> None:
    step = 0.017
    stream = _stream([(1.0 + i * step, i + 1) for i in range(50)])
    assert stream.delivery_stalls() == []


def test_a_burst_after_a_silence_is_a_stall_from_the_last_arrival_before_it() -> None:
    # 10 tokens a step apart, then nothing for 10 s, then 118 events within a millisecond (what a CI run
    # showed): one stall, from the 10th token's arrival to the burst's first event.
    step = 0.017
    arrivals = [(1.0 + i * step, i + 1) for i in range(10)]
    last_before = arrivals[-1][0]
    burst_at = last_before + 10.0
    arrivals += [(burst_at + i * 0.000005, 11 + i) for i in range(118)]
    assert _stream(arrivals).delivery_stalls() == [(last_before, burst_at)]


def test_two_events_together_are_not_a_stall_but_three_are() -> None:
    # A step's output and the request's end can reach the client together; a third event cannot be the
    # same step's (the server merges what one step made for one request into one event).
    assert STALL_EVENTS == 3
    half = TOGETHER_SECONDS / 2
    two = _stream([(1.0, 1), (1.5, 2), (1.5 + half, 3)])
    three = _stream([(1.0, 1), (1.5, 2), (1.5 + half / 2, 3), (1.5 + half, 4)])
    assert two.delivery_stalls() == []
    assert three.delivery_stalls() == [(1.0, 1.5)]


def test_a_stall_before_the_first_token_starts_when_the_request_was_sent() -> None:
    stream = _stream([(4.0, 1), (4.0005, 2), (4.001, 3), (4.02, 4)], sent_at_seconds=0.5)
    assert stream.delivery_stalls() == [(0.5, 4.0)]


def test_a_chunk_of_several_tokens_is_one_event_and_counts_its_tokens() -> None:
    # A front end behind the engine merges steps into one event of k tokens: no stall, k tokens, each
    # the chunk's gap over k.
    stream = _stream([(1.0, 1), (1.02, 2), (1.14, 6), (1.16, 7)], finished_at_seconds=1.2)
    assert stream.delivery_stalls() == []
    gaps = stream.token_gaps_in(1.0, 1.2)  # the first token (a prefill's) is not a gap
    assert gaps == pytest.approx([0.02, 0.12 / 4, 0.12 / 4, 0.12 / 4, 0.12 / 4, 0.02])
    assert sum(gaps) == pytest.approx(1.16 - 1.0)
    assert stream.token_gaps_in(1.0, 1.1) == pytest.approx([0.02])  # (start, end]: the chunk at 1.14 is out
    assert stream.tokens_held_at(1.15) == 100 + 6
    assert stream.tokens_held_at(1.2) == 0  # finished: its blocks are freed
