"""What the clients of a real vLLM know, set beside what the daemon read of its page: the bounds the
real-engine tests hold each poll's tokens in flight, KV used and request counts to.

Two figures, two truths. Tokens in flight are each open request's whole context, read from the request
counters (exporter/serve/open_context.py): the clients' prompt plus every token generated, to the token.
KV used is the blocks the cache holds: a request's context rounded up to whole blocks, which the daemon
reads from the usage ratio and takes half a block off per request.

Shared by the live run (tests/real_vllm/test_real_vllm_pipeline.py) and the runs recorded from it
(tests/real_vllm/test_real_vllm_recorded.py, tests/data/real-vllm-runs/), so a CI run that failed is kept and
checked again on every `make test`, without an engine.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

from exporter.real_vllm.loadgen import Stream, outstanding_at
from exporter.serve.reading import Reading
from tests.support.real_vllm import BLOCK_SIZE_TOKENS

MARGIN_SECONDS = 0.3  # the page and the clients' clock: a request may cross a block between the two
# What a front end starved of a core adds between the server's clock and the clients': a CI run on 2 cores
# read a mean time to first token of 1.10 s at the clients where the server's histogram held 0.78 s.
DELIVERY_SECONDS = 1.0



def clients_mean_gap_ratio(windows: Sequence[tuple[float, Sequence[float]]]) -> float:
    """The measured step over windows taken together (each window's measured step weighted by the clients'
    token gaps in it) against the clients' mean gap over them all, minus 1. Together, not window by window:
    a front end starved of a core hands a window's last tokens to the clients in the next one (a CI run on 2
    cores read one window's clients at 63 ms a token where the server measured 48 ms), and the tokens a
    window's clients miss reach them in the next, so the pair evens out where a single window does not."""
    gaps = [gap for _, window_gaps in windows for gap in window_gaps]
    assert gaps, "no client token gaps in the windows"
    measured = sum(step * len(window_gaps) for step, window_gaps in windows) / len(gaps)
    return measured / (sum(gaps) / len(gaps)) - 1


class Polled(Protocol):
    """A poll as these checks read it: a PollRecord of a live run, or one read back from a recorded run."""

    @property
    def at_seconds(self) -> float: ...

    @property
    def phase(self) -> str: ...

    @property
    def reading(self) -> Reading: ...


@dataclass(frozen=True)
class RecordedPoll:
    at_seconds: float
    phase: str
    reading: Reading


def blocks(tokens: int) -> int:
    return math.ceil(tokens / BLOCK_SIZE_TOKENS)


def stalled_about(stream: Stream, at_seconds: float, margin_seconds: float = MARGIN_SECONDS) -> bool:
    return any(start < at_seconds + margin_seconds and end > at_seconds - margin_seconds
               for start, end in stream.delivery_stalls())


def unsettled(stream: Stream, at_seconds: float, margin_seconds: float = MARGIN_SECONDS) -> bool:
    """Whether the engine may or may not hold this request at `at_seconds`: sent but not yet back with a
    first token (the front end admits it a moment after the client sent it), finished about then
    (the engine frees its blocks in the step that ends it, a moment before the client reads the end),
    or its delivery stalled then (`Stream.delivery_stalls`: the engine may have ended it meanwhile)."""
    early, late = at_seconds - margin_seconds, at_seconds + margin_seconds
    end = stream.finished_at_seconds
    starting = stream.sent_at_seconds < late and (not stream.arrivals or stream.arrivals[0][0] > early)
    return ((starting and (end is None or end > early)) or (end is not None and early <= end <= late)
            or stalled_about(stream, at_seconds, margin_seconds))


def context_bounds(streams: Sequence[Stream], at_seconds: float) -> tuple[float, float]:
    """The open requests' whole context as the clients know it: each running request's prompt and the
    tokens that reached it. A request the clients cannot place (`unsettled`) may be counted with none of
    its context (not yet past its prefill, or already finished) or with all it may have by then (a
    stalled stream: every token it will ever make); the truth is taken MARGIN_SECONDS either side."""
    low = high = 0
    early_seconds, late_seconds = at_seconds - MARGIN_SECONDS, at_seconds + MARGIN_SECONDS
    for stream in streams:
        if not (stream.running_at(early_seconds) or stream.running_at(late_seconds)):
            continue
        early, late = stream.tokens_held_at(early_seconds), stream.tokens_held_at(late_seconds)
        if unsettled(stream, at_seconds):
            generated = stream.max_tokens if stalled_about(stream, at_seconds) else stream.generated_by(late_seconds)
            high += max(early, late, stream.prompt_tokens + generated)
        else:
            low += min(early, late)
            high += max(early, late)
    return float(low), float(high)


def kv_used_bounds(streams: Sequence[Stream], at_seconds: float) -> tuple[float, float]:
    """What the page's used blocks may say, worked out from the clients: each running request holds
    ceil(context / 128) blocks, and the daemon takes (128 - 1) / 2 of each last block as empty (once
    per request the page counts as running). A request the clients cannot place (just starting, in
    its prefill, ending or stalled: `unsettled`) may hold none of its blocks or all of them; the truth
    is taken MARGIN_SECONDS either side of the poll."""
    low_blocks = high_blocks = 0
    settled = unplaced = 0
    early_seconds, late_seconds = at_seconds - MARGIN_SECONDS, at_seconds + MARGIN_SECONDS
    for stream in streams:
        if not (stream.running_at(early_seconds) or stream.running_at(late_seconds)):
            continue
        early = blocks(stream.tokens_held_at(early_seconds)) if stream.running_at(early_seconds) else 0
        late = blocks(stream.tokens_held_at(late_seconds)) if stream.running_at(late_seconds) else 0
        if unsettled(stream, at_seconds):
            unplaced += 1
            # A stream whose delivery stalled about the poll went on being decoded while its tokens were
            # held (CI, 2026-12-02: one held 156 tokens for 5.7 s and crossed a block meanwhile), so it
            # may hold every token it will ever hold; one just starting, at most what reached it soon after.
            generated = stream.max_tokens if stalled_about(stream, at_seconds) else stream.generated_by(late_seconds)
            high_blocks += max(early, late, blocks(stream.prompt_tokens + generated))
        else:
            settled += 1
            low_blocks += min(early, late)
            high_blocks += max(early, late)
    empty = (BLOCK_SIZE_TOKENS - 1) / 2
    return (low_blocks * BLOCK_SIZE_TOKENS - (settled + unplaced) * empty,
            high_blocks * BLOCK_SIZE_TOKENS - settled * empty)


def check_tokens_in_flight(polls: Sequence[Polled], streams: Sequence[Stream], phases: Sequence[str]) -> list[str]:
    """Every poll of these phases has its tokens in flight within 2% of the clients' context bounds
    (`context_bounds`). Returns the phases of the polls where every request was settled (the bounds
    then one figure)."""
    return _check_figure(polls, streams, phases, "tokens_in_flight", context_bounds)


def check_kv_used(polls: Sequence[Polled], streams: Sequence[Stream], phases: Sequence[str]) -> list[str]:
    """Every poll of these phases has its KV used within 2% of the clients' block bounds
    (`kv_used_bounds`). Returns the phases of the polls where every request was settled (the bounds then
    one figure's block rounding apart)."""
    return _check_figure(polls, streams, phases, "kv_cache_used_tokens", kv_used_bounds)


def _check_figure(polls: Sequence[Polled], streams: Sequence[Stream], phases: Sequence[str], figure: str,
                  bounds: Callable[[Sequence[Stream], float], tuple[float, float]]) -> list[str]:
    exact_phases = []
    for poll in polls:
        reading, t = poll.reading, poll.at_seconds
        # A waiting request may be one the engine preempted: it has streamed, holds no blocks, and the
        # clients cannot tell.
        if poll.phase not in phases or reading.requests_waiting:
            continue
        low, high = bounds(streams, t)
        read = getattr(reading, figure)
        assert read is not None, (figure, poll.phase, t)
        assert low * 0.98 <= read <= high * 1.02, (figure, poll.phase, t, read, low, high)
        if not any(unsettled(s, t) for s in streams):
            exact_phases.append(poll.phase)
    return exact_phases


def check_an_exact_poll_in_each(exact_phases: Sequence[str], *loads: Sequence[str]) -> None:
    """Each load (the phases that ran it) had a poll where every request was settled, so the 2% check
    was held to one figure's block rounding there and not only to bounds a stream's blocks wide."""
    missing = [load for load in loads if not set(load) & set(exact_phases)]
    assert not missing, (missing, exact_phases)


def check_running_and_waiting(polls: Sequence[Polled], streams: Sequence[Stream]) -> None:
    """Between what the clients know for sure is in the engine (a token came back, the request has not
    ended and its delivery is not stalled) and all they have outstanding (sent, not ended): the front
    end holds a request a moment before the scheduler sees it, and the engine ends one a moment before
    the client reads the end (seconds before, when its delivery stalls)."""
    for poll in polls:
        reading, t = poll.reading, poll.at_seconds
        assert reading.requests_running is not None and reading.requests_waiting is not None
        in_engine = sum(1 for s in streams if s.arrivals and s.arrivals[0][0] < t - MARGIN_SECONDS
                        and (s.finished_at_seconds is None or s.finished_at_seconds > t + MARGIN_SECONDS)
                        and not stalled_about(s, t))
        outstanding = max(outstanding_at(streams, t + offset) for offset in (-MARGIN_SECONDS, 0.0, MARGIN_SECONDS))
        assert in_engine <= reading.requests_running + reading.requests_waiting <= outstanding, (poll.phase, t)


def _tuples(value: Any) -> Any:
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value


def recorded_run(path: Path) -> tuple[list[RecordedPoll], list[Stream]]:
    """A run as `exporter.real_vllm.drive.dump_run` wrote it (gzipped): each poll's reading and every
    stream. The snapshots are left out: these checks read the readings, and a single-engine run has no
    rank readings to rebuild."""
    document = json.loads(gzip.decompress(path.read_bytes()))
    reading_fields = {field.name for field in fields(Reading)}
    polls = []
    for poll in document["polls"]:
        recorded = {name: _tuples(value) for name, value in poll["reading"].items() if name in reading_fields}
        if "kv_cache_used_tokens" not in recorded:
            # Recorded before the daemon read tokens in flight from the request counters: its tokens in
            # flight then were the KV cache's used blocks, and its context is not on record.
            recorded["kv_cache_used_tokens"] = recorded["tokens_in_flight"]
            recorded["tokens_in_flight"] = None
        if recorded.get("ranks"):
            raise ValueError(f"{path}: a poll with rank readings; recorded_run rebuilds single-engine runs only")
        polls.append(RecordedPoll(poll["at_seconds"], poll["phase"], Reading(**recorded)))
    streams = [Stream(prompt_tokens=s["prompt_tokens"], max_tokens=s["max_tokens"],
                      sent_at_seconds=s["sent_at_seconds"], arrivals=[(at, total) for at, total in s["arrivals"]],
                      finished_at_seconds=s["finished_at_seconds"], error=s["error"],
                      shared_prefix=s.get("shared_prefix", ""), shared_prefix_tokens=s.get("shared_prefix_tokens", 0))
               for s in document["streams"]]
    return polls, streams
