"""The real-engine pipeline's checks, run again on a run recorded from it (no engine needed): a CI run
of tests/real_vllm/test_real_vllm_pipeline.py on 2 cores, 2026-12-02, which failed the tokens-in-flight bound at
one poll. The run is `dump_run`'s run.json from that CI machine, gzipped, unchanged
(tests/data/real-vllm-runs/README.md).

What happened there: one chat stream's delivery stalled for 5.7 s (its 242nd to 397th tokens reached the
client together), while the engine went on decoding it; at a poll inside the stall it had crossed into
a fourth block the client could not know of. The bound now lets a stalled stream hold every token it
will ever hold.

The daemon then read tokens in flight from the KV cache's used blocks; that figure is checked here as KV
used (`recorded_run` files it so), and the context the daemon now reads from the request counters is
checked on the live run.
"""

from __future__ import annotations

import pytest

from exporter.real_vllm.loadgen import Stream
from tests.support.client_truth import (
    RecordedPoll,
    check_an_exact_poll_in_each,
    check_kv_used,
    check_running_and_waiting,
    kv_used_bounds,
    recorded_run,
    stalled_about,
    unsettled,
)
from tests.support.tools import DATA

RUN = DATA / "real-vllm-runs" / "ci-2026-12-02-stalled-stream.json.gz"
# The recorded script's (tests/real_vllm/test_real_vllm_pipeline.py).
STORY_PHASES = ("chat4", "chat16", "chat16+long")
SIXTEEN_CHATS = ("chat16", "chat16+long")
Recorded = tuple[list[RecordedPoll], list[Stream]]


@pytest.fixture(scope="module")
def recorded() -> Recorded:
    return recorded_run(RUN)


def test_the_recorded_run_holds_the_clients_bounds_at_every_poll(recorded: Recorded) -> None:
    polls, streams = recorded
    assert len(polls) == 45 and len({poll.phase for poll in polls}) == 6
    exact_phases = check_kv_used(polls, streams, STORY_PHASES)
    check_an_exact_poll_in_each(exact_phases, ("chat4",), SIXTEEN_CHATS)
    check_running_and_waiting(polls, streams)


def test_a_stream_stalled_about_the_poll_may_hold_every_token_it_will_hold(recorded: Recorded) -> None:
    polls, streams = recorded
    poll = polls[3]  # the poll CI failed on
    t = poll.at_seconds
    assert poll.phase == "chat4"
    # The page: 10 of the 127 usable blocks used, 4 requests running; the daemon takes (128 - 1) / 2 of
    # each request's last block as empty.
    assert poll.reading.kv_cache_usage_ratio == pytest.approx(10 / 127)
    assert poll.reading.requests_running == 4
    kv_used = poll.reading.kv_cache_used_tokens
    assert kv_used is not None
    assert kv_used == pytest.approx(10 * 128 - 4 * 63.5)  # 1,026
    near = [s for s in streams if s.running_at(t - 0.3) or s.running_at(t + 0.3)]
    (stalled,) = [s for s in near if stalled_about(s, t)]
    # 83 prompt tokens and 241 delivered before the stall: ceil(324 / 128) = 3 blocks as the client saw
    # it; all 397 it was to make: ceil(480 / 128) = 4.
    assert (stalled.prompt_tokens, stalled.generated_by(t), stalled.max_tokens) == (83, 241, 397)
    (gap_start, gap_end), = stalled.delivery_stalls()
    assert gap_end - gap_start > 5.0 and stalled.generated_by(gap_end + 0.01) == 397
    # The other three are settled at 2, 2 and 1-2 blocks (the third crossed 128 tokens about then).
    others = [s for s in near if s is not stalled]
    assert len(others) == 3 and not any(unsettled(s, t) for s in others)
    low, high = kv_used_bounds(streams, t)
    assert high == pytest.approx((2 + 2 + 2 + 4) * 128 - 3 * 63.5)  # 1,089.5: the page's 1,026 within
    assert low == pytest.approx((2 + 2 + 1 + 0) * 128 - 4 * 63.5)
    # Held to what it had delivered, the stalled stream would put the bound at 961.5, 6.3% under the page.
    assert (2 + 2 + 2 + 3) * 128 - 3 * 63.5 < kv_used / 1.02
