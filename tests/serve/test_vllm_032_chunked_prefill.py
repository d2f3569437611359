"""A prompt longer than the step's token budget, on a real vLLM 0.32.0 (CPU backend).

Four pages a real server served 3 s apart while 16 chats ran and two agents each sent a 2,500-token
prompt (tests/data/vllm-0.32.0-cpu/README.md). The engine computes such a prompt in chunks, one a step,
and vLLM counts it (prompt_tokens_total and by source) only in the step that finishes it. On this CPU a
chunk's step lasts over 3 s, so a window can hold one chunk step and no counted prompt token at all.
Each window's computed prompt tokens are checked here against the scheduler's own arithmetic, worked
out from the counters on the pages: a step holds each decoding request's token and fills the rest of
its token budget with prompt chunks.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

import pytest

from exporter.serve.engines import read_page
from exporter.serve.snapshot import Snapshot
from exporter.serve.window import Window, compute_window
from tests.support.tools import DATA

PAGES = DATA / "vllm-0.32.0-cpu"
# vLLM's default max_num_batched_tokens for the OpenAI server on a CPU (0.32.0 vllm/engine/arg_utils.py
# l. 2975-2979: 2,048 x world size, here 1); the server was started without the flag.
BUDGET_TOKENS = 2048
AGENT_PROMPT_TOKENS = 2500  # the load's (README)
BLOCK_TOKENS = 128  # the CPU backend's block: what the KV cache's growth is counted in


def _texts() -> list[str]:
    return [(PAGES / f"vllm-0.32.0-cpu_REAL_chunked_prefill_t{i}.prom").read_text() for i in range(4)]


def _value(text: str, name: str, source: str | None = None) -> float:
    """One sample of the page, read with a pattern of its own (not the adapter under test)."""
    labels = r'\{engine="0",model_name="tiny"' + (f',source="{source}"' if source else "") + r"\}"
    match = re.search(rf"^{re.escape(name)}{labels} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def _delta(before: str, after: str, name: str, source: str | None = None) -> float:
    return _value(after, name, source) - _value(before, name, source)


@pytest.fixture(scope="module")
def windows() -> list[tuple[str, str, Window]]:
    texts = _texts()
    snapshots: list[Snapshot] = []
    for text in texts:
        (snapshot,) = read_page(text).snapshots
        snapshots.append(snapshot)
    return [(before, after, compute_window(a, b))
            for (before, after), (a, b) in zip(itertools.pairwise(texts), itertools.pairwise(snapshots), strict=True)]


def _computed_in(before: str, after: str, window: Window) -> float:
    """The window's computed prompt tokens as the daemon reads them: per step, times the steps."""
    assert window.prefill_tokens_per_step is not None
    return window.prefill_tokens_per_step * _delta(before, after, "vllm:iteration_tokens_total_count")


def _chunk_tokens(before: str, after: str) -> float:
    """What one step's prompt chunks hold: the budget less one token for each decoding request (one
    ITL observation each, 0.32.0 vllm/v1/metrics/stats.py l. 548-552)."""
    return BUDGET_TOKENS - _delta(before, after, "vllm:inter_token_latency_seconds_count")


def test_the_pages_hold_what_the_readme_says(windows: list[tuple[str, str, Window]]) -> None:
    steps = [_delta(before, after, "vllm:iteration_tokens_total_count") for before, after, _ in windows]
    counted = [_delta(before, after, "vllm:prompt_tokens_by_source_total", "local_compute")
               for before, after, _ in windows]
    admitted = [_delta(before, after, "vllm:prefix_cache_queries_total") for before, after, _ in windows]
    assert steps == [1, 1, 21]
    # The first agent's prompt admitted and not counted; counted and the second admitted; the second counted
    # (with one chat's prompt beside it, admitted and counted in the same window).
    assert admitted[:2] == [AGENT_PROMPT_TOKENS, AGENT_PROMPT_TOKENS]
    assert counted[:2] == [0, AGENT_PROMPT_TOKENS]
    assert counted[2] == admitted[2] + AGENT_PROMPT_TOKENS


def test_a_window_holding_one_chunk_and_no_counted_prompt_reads_the_chunk(
        windows: list[tuple[str, str, Window]]) -> None:
    before, after, window = windows[0]
    assert _delta(before, after, "vllm:prompt_tokens_total") == 0  # what the counters alone gave: 0 per step
    assert _computed_in(before, after, window) == pytest.approx(_chunk_tokens(before, after), abs=BLOCK_TOKENS)
    assert window.prefill_mix is None  # the histogram observed no prompt token in that step either


def test_a_prompt_counted_whole_is_read_as_the_part_of_it_the_window_computed(
        windows: list[tuple[str, str, Window]]) -> None:
    """The second window's one step finished the first prompt and began the second: one budget's worth,
    not the first prompt's 2,500. The third finished the second prompt: what the two chunks before did
    not compute, and the chat prompt."""
    first_chunk = _chunk_tokens(*windows[0][:2])
    before, after, window = windows[1]
    second_step = _chunk_tokens(before, after)
    assert _computed_in(before, after, window) == pytest.approx(second_step, abs=BLOCK_TOKENS)
    second_prompt_so_far = second_step - (AGENT_PROMPT_TOKENS - first_chunk)
    before, after, window = windows[2]
    chat_prompts = _delta(before, after, "vllm:prefix_cache_queries_total")
    assert _computed_in(before, after, window) == pytest.approx(
        AGENT_PROMPT_TOKENS - second_prompt_so_far + chat_prompts, abs=BLOCK_TOKENS)


def test_over_the_windows_every_computed_prompt_token_is_read_once(windows: list[tuple[str, str, Window]]) -> None:
    """Moved between windows, not made or lost: the three windows sum to what vLLM counted, less what was
    part-way at the first page (nothing) and plus what is part-way at the last (nothing), give or take
    the partly filled last blocks, which the KV cache's growth counts with the chunks (the requests that
    started and finished between the first page and the last: a block's worth or two)."""
    first, last = windows[0][0], windows[-1][1]
    part_way = [_value(text, "vllm:prefix_cache_queries_total") - _value(text, "vllm:prefix_cache_hits_total")
                - _value(text, "vllm:prompt_tokens_by_source_total", "local_compute") for text in (first, last)]
    assert part_way == [0, 0]
    total = sum(_computed_in(before, after, window) for before, after, window in windows)
    assert total == pytest.approx(_delta(first, last, "vllm:prompt_tokens_by_source_total", "local_compute"),
                                  abs=2 * BLOCK_TOKENS)



def _attended_in(before: str, after: str, window: Window) -> float:
    """What the window's computed prompt tokens attended to in all, as the daemon reads them."""
    assert window.prefill_mean_context_tokens is not None
    return window.prefill_mean_context_tokens * _computed_in(before, after, window)


def test_each_window_reads_where_in_its_prompts_the_tokens_it_computed_stood(
        windows: list[tuple[str, str, Window]]) -> None:
    """A prompt token attends to its prompt's tokens before it, so a chunk's attention grows with what its
    prompt held already: tokens k0+1 .. k1 of a prompt attend to (k1^2 - k0^2) / 2 in all. Each window's,
    by the scheduler's arithmetic. Where a prompt was part-way at a poll, the daemon knows how far it had
    got from the KV cache, less half a block for each of the 18-20 running requests' partly filled last
    blocks; each of those is anywhere in its block, about 165 tokens either way in all (128 x sqrt(20 / 12)),
    so the arithmetic is held within two blocks either way of where each part-way prompt stood."""
    first_chunk = _chunk_tokens(*windows[0][:2])

    def held(attended: Callable[[float, float], float], first: float, second: float) -> tuple[float, float]:
        """The lowest and highest of `attended`, decreasing in its first and increasing in its second
        argument, with each within two blocks of where the arithmetic puts it."""
        return (attended(first + 2 * BLOCK_TOKENS, second - 2 * BLOCK_TOKENS),
                attended(first - 2 * BLOCK_TOKENS, second + 2 * BLOCK_TOKENS))

    before, after, window = windows[0]
    low, high = held(lambda _, first_so_far: first_so_far ** 2 / 2, 0.0, first_chunk)
    assert low <= _attended_in(before, after, window) <= high

    before, after, window = windows[1]
    second_step = _chunk_tokens(before, after)
    second_prompt_so_far = second_step - (AGENT_PROMPT_TOKENS - first_chunk)
    low, high = held(lambda first_so_far, second_so_far: (AGENT_PROMPT_TOKENS ** 2 - first_so_far ** 2) / 2
                     + second_so_far ** 2 / 2, first_chunk, second_prompt_so_far)
    assert low <= _attended_in(before, after, window) <= high

    before, after, window = windows[2]
    chat_prompt = _delta(before, after, "vllm:prefix_cache_queries_total")  # one chat's, admitted and counted here
    low, high = held(lambda second_so_far, _: (AGENT_PROMPT_TOKENS ** 2 - second_so_far ** 2) / 2
                     + chat_prompt ** 2 / 2, second_prompt_so_far, 0.0)
    assert low <= _attended_in(before, after, window) <= high


def test_over_the_windows_each_prompts_attention_is_read_once(windows: list[tuple[str, str, Window]]) -> None:
    """Each poll has one reading of how far a part-way prompt had got, so what the windows read of its
    attention adds up to its own, L^2 / 2, however far off each reading is: the two agents' prompts and
    the chat prompt counted in the last window, from no prompt part-way at the first page to none at the last."""
    chat_prompt = _delta(*windows[2][:2], "vllm:prefix_cache_queries_total")
    total = sum(_attended_in(before, after, window) for before, after, window in windows)
    assert total == pytest.approx(2 * AGENT_PROMPT_TOKENS ** 2 / 2 + chat_prompt ** 2 / 2, rel=1e-9)
