"""The vLLM request ledger (exporter/serve/open_context.py): the context of the open requests, from the
engine's own counters, with the requests its clients aborted taken out (they leave no finished record:
0.32.0 vllm/v1/engine/output_processor.py `abort_requests`). Every figure worked out by hand from the
counters fed."""

from __future__ import annotations

import pytest

from exporter.serve.open_context import OpenContext, open_context
from exporter.serve.snapshot import Histogram, Snapshot


def _page(*, running: float, waiting: float = 0.0, prompt: float, generated: float, first_tokens: float,
          finished: float = 0.0, finished_prompt: float = 0.0, finished_generated: float = 0.0,
          preemptions: float = 0.0) -> Snapshot:
    ttft = Histogram(((float("inf"), first_tokens),), first_tokens, 0.1 * first_tokens)
    return Snapshot(kind="vllm", model_name="m", engine="0", requests_running=running, requests_waiting=waiting,
                    prompt_tokens_total=prompt, generation_tokens_total=generated, time_to_first_token=ttft,
                    finished_requests_total=finished, finished_prompt_tokens_total=finished_prompt,
                    finished_generation_tokens_total=finished_generated, preemptions_total=preemptions)


def test_the_open_requests_hold_what_the_counters_took_in_less_what_finished() -> None:
    # 10 requests of 1,000 prompt tokens took their first token; 3 finished with 200 sampled each; the
    # other 7 sampled 50 each so far: 7 x 1,050 = 7,350 tokens of context open.
    ledger = open_context(_page(running=7, prompt=10_000, generated=3 * 200 + 7 * 50, first_tokens=10, finished=3,
                                finished_prompt=3_000, finished_generated=600), None)
    assert ledger is not None
    assert (ledger.context_tokens, ledger.requests, ledger.estimated) == (7_350, 7, False)


def test_requests_its_clients_aborted_are_taken_out_at_the_mean_of_the_open_ones() -> None:
    # Poll 1: 8 open requests of 1,100 tokens each (8,800). Poll 2: 2 of them were aborted (no finished
    # record), the other 6 sampled 100 more each and are all that runs: the counters still hold the 2.
    first = open_context(_page(running=8, prompt=8_000, generated=800, first_tokens=8), None)
    assert first is not None and first.context_tokens == 8_800
    second = open_context(_page(running=6, prompt=8_000, generated=800 + 600, first_tokens=8), first)
    assert second is not None
    # 8 opened, 6 can be open: 2 gone, each at poll 1's mean of 1,100 -> 9,400 - 2,200 = 7,200 = 6 x 1,200.
    assert (second.gone_requests, second.gone_tokens) == (2, 2_200)
    assert (second.context_tokens, second.requests, second.estimated) == (7_200, 6, True)
    # They stay taken out as the others go on: 6 x 100 more sampled.
    third = open_context(_page(running=6, prompt=8_000, generated=2_000, first_tokens=8), second)
    assert third is not None and third.context_tokens == 7_800


def test_an_idle_server_anchors_the_ledger_exactly() -> None:
    # The load above, later: the 6 finish with 300 sampled each and nothing runs. What the counters still hold
    # is exactly the aborted requests' context: 2 x 1,000 prompt + their 2 x 100 sampled.
    idle = open_context(_page(running=0, prompt=8_000, generated=2_000, first_tokens=8, finished=6,
                              finished_prompt=6_000, finished_generated=6 * 300), None)
    assert idle is not None
    assert (idle.gone_tokens, idle.gone_requests, idle.context_tokens, idle.estimated) == (2_200, 2, 0, False)
    # The next request of 500 + 10 sampled: read exactly, not as an estimate.
    busy = open_context(_page(running=1, prompt=8_500, generated=2_010, first_tokens=9, finished=6,
                              finished_prompt=6_000, finished_generated=1_800), idle)
    assert busy is not None and (busy.context_tokens, busy.estimated) == (510, False)


def test_a_preempted_request_waiting_is_not_taken_for_an_aborted_one() -> None:
    # 4 open requests of 2,000; one is preempted back to the waiting queue (preemptions 0 -> 1): 3 running,
    # 1 waiting, still open.
    before = open_context(_page(running=4, prompt=8_000, generated=0, first_tokens=4), None)
    after = open_context(_page(running=3, waiting=1, prompt=8_000, generated=30, first_tokens=4, preemptions=1),
                         before)
    assert after is not None and (after.context_tokens, after.gone_requests) == (8_030, 0)
    # Without a preemption a waiting request is a new one (no first token yet): the missing one is gone.
    fresh = open_context(_page(running=3, waiting=1, prompt=8_000, generated=30, first_tokens=4), before)
    assert fresh is not None and (fresh.gone_requests, fresh.gone_tokens) == (1, 2_000)


def test_a_server_first_seen_busy_with_aborts_behind_it_estimates_them_at_the_mean() -> None:
    # 12 requests opened, 2 finished, 6 running: 4 left without a record. The counters hold 20,000 tokens for
    # the 10; the 4 are taken at their mean, 2,000 each.
    ledger = open_context(_page(running=6, prompt=30_000, generated=1_000, first_tokens=12, finished=2,
                                finished_prompt=10_000, finished_generated=1_000), None)
    assert ledger is not None
    assert (ledger.context_tokens, ledger.estimated) == (pytest.approx(20_000 * 6 / 10), True)


def test_a_restart_starts_the_ledger_again() -> None:
    old = OpenContext(held_tokens=50_000, open_requests=30, gone_tokens=40_000, gone_requests=25,
                      estimated=True, first_tokens_total=900)
    restarted = open_context(_page(running=2, prompt=1_000, generated=20, first_tokens=2), old)
    assert restarted is not None and (restarted.context_tokens, restarted.gone_tokens) == (1_020, 0)


def test_a_page_without_the_request_counters_gives_no_ledger() -> None:
    snapshot = Snapshot(kind="vllm", model_name="m", engine="0", requests_running=3, requests_waiting=0,
                        prompt_tokens_total=100, generation_tokens_total=10)
    assert open_context(snapshot, None) is None
