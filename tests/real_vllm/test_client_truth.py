"""The clients' bounds the real-engine tests hold the daemon's readings to (tests/support/client_truth.py),
on streams written out by hand: tokens in flight are each request's context to the token, KV used its
blocks."""

from __future__ import annotations

import pytest

from exporter.real_vllm.loadgen import Stream
from tests.support.client_truth import clients_mean_gap_ratio, context_bounds, kv_used_bounds
from tests.support.real_vllm import BLOCK_SIZE_TOKENS


def _steady(prompt_tokens: int, sent_seconds: float, per_second: int, until_seconds: float,
            max_tokens: int = 1000) -> Stream:
    """A stream that got its first token 0.1 s after it was sent and one token every 1/per_second after."""
    first = sent_seconds + 0.1
    count = int((until_seconds - first) * per_second) + 1
    arrivals = [(first + k / per_second, k + 1) for k in range(count)]
    return Stream(prompt_tokens, max_tokens, sent_seconds, arrivals)


def test_settled_streams_bound_the_context_to_their_prompts_and_the_tokens_that_reached_them() -> None:
    # Two streams sent at 0 s, 10 tokens a second from 0.1 s on. At 5 s +- 0.3 s each has 47 to 53 tokens
    # back (first token at 0.1 s, then one each 0.1 s: 1 + floor((t - 0.1) * 10)).
    streams = [_steady(100, 0.0, 10, 20.0), _steady(300, 0.0, 10, 20.0)]
    low, high = context_bounds(streams, 5.0)
    assert low == (100 + 47) + (300 + 47)
    assert high == (100 + 53) + (300 + 53)
    # Their blocks: 147-153 and 347-353 tokens sit in 2 and 3 blocks of 128 whichever the moment, less
    # half of each last block.
    empty = (BLOCK_SIZE_TOKENS - 1) / 2
    assert kv_used_bounds(streams, 5.0) == (5 * BLOCK_SIZE_TOKENS - 2 * empty, 5 * BLOCK_SIZE_TOKENS - 2 * empty)


def test_a_stream_still_in_its_prefill_may_count_nothing_or_what_reaches_it_soon_after() -> None:
    # Sent at 4.9 s, first token at 5.0 s: unsettled at a 5 s poll. 10 tokens a second: 3 back by 5.3 s.
    settled = _steady(100, 0.0, 10, 20.0)
    starting = _steady(500, 4.9, 10, 20.0)
    low, high = context_bounds([settled, starting], 5.0)
    assert low == pytest.approx(100 + 47)
    assert high == pytest.approx((100 + 53) + (500 + 4))  # 5.0, 5.1, 5.2, 5.3 s: 4 tokens by the late edge


def test_a_finished_stream_is_no_context_once_it_is_past_the_margin() -> None:
    done = _steady(100, 0.0, 10, 3.0, max_tokens=30)
    done.finished_at_seconds = 3.0
    assert context_bounds([done], 5.0) == (0.0, 0.0)
    # About its end, it may still be counted whole or already gone.
    low, high = context_bounds([done], 3.1)
    assert (low, high) == (0.0, 100 + 30)


def test_a_window_whose_tokens_reached_the_clients_late_evens_out_with_the_next() -> None:
    # The server steps 50 ms through two 2 s windows: 40 tokens each. The clients read 30 in the first (its
    # last 10 held in delivery: 30 gaps over its 2 s, 66.7 ms each) and 50 in the second (40 ms each). The
    # first window alone reads 0.05 / (2 / 30) - 1 = -25%; together 80 gaps over 4 s, 50 ms, as measured.
    late, caught_up = (0.050, [2.0 / 30] * 30), (0.050, [2.0 / 50] * 50)
    assert clients_mean_gap_ratio([late]) == pytest.approx(0.050 / (2.0 / 30) - 1)
    assert clients_mean_gap_ratio([late, caught_up]) == pytest.approx(0.0)
    # Measured 48 ms where the clients' 10 gaps were 63 ms, then 40 ms and 30 gaps of 40 ms: weighted by
    # the gaps, 0.048 * 10 + 0.040 * 30 = 1.68 s against 0.63 + 1.2 = 1.83 s.
    windows = [(0.048, [0.063] * 10), (0.040, [0.040] * 30)]
    assert clients_mean_gap_ratio(windows) == pytest.approx(1.68 / 1.83 - 1)
