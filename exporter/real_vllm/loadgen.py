"""A load generator for a real OpenAI-compatible server: streams, token arrival times, tokens held.

Why our own: checking stepbudget against a running engine needs the ground truth a client has and a
benchmark tool does not report: every streamed token's arrival time (to compare the measured step
with the gaps the clients saw, over the daemon's own windows) and, at any moment, each running
request's whole context (prompt + generated so far: what its attention reads, to compare tokens in
flight) and what the KV cache holds for them all (a prefix several requests share held once, to
compare the memory used).

Protocol facts (vLLM 0.32 OpenAI server, `/v1/completions`):
- `prompt` may be a list of token ids: the prompt length is then exact, and random ids share no
  prefix, so prefix caching computes every prompt token.
- A shared system prompt (`Phase.shared_prefix_tokens`): every request of the phase begins with the same
  random ids, then its own. Prefix caching (on by default) shares a prefix's FULL blocks only (a block's
  hash covers the whole block and every block before it: 0.32.0 vllm/v1/core/kv_cache_utils.py
  hash_block_tokens), so the block where the prefix ends holds the request's own ids too and is its own.
  And it shares only blocks already cached when a request is admitted: `warm_prefix` computes the
  prefix once, alone, before the phase's requests start, so none of them computes a copy of its own.
- `max_tokens` 1 is a request a prefill/decode proxy sends to the prefill side: one token back, from the
  step that finished the prompt, and no decode step.
- `"ignore_eos": true` with `max_tokens` gives an exact output length.
- A streamed chunk can carry several tokens when the front end falls behind the engine; with
  `"stream_options": {"include_usage": true, "continuous_usage_stats": true}` every chunk carries
  `usage.completion_tokens` so far, which is what is counted here (never one token per chunk).
Standard library only (http.client, threads): the load runs beside the daemon in any venv.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from exporter.capacity.calibrate import sse_payloads

DEFAULT_TIMEOUT_SECONDS = 600.0  # one streamed read: a CPU step holding a long prompt chunk lasts seconds
FIRST_TOKEN_ID = 3  # ids 0-2 are the tokenizer's special tokens (<s>, </s>, <unk>)
# Server-sent events that reach a client closer together than this were held back on the way: the
# server sends each step's output as its own event, and no engine step here lasts under 10 ms.
TOGETHER_SECONDS = 0.002
STALL_EVENTS = 3  # this many events together make a delivery stall (two can be one step's output)


@dataclass
class Stream:
    """One streamed completion: what was asked, and when each chunk's tokens arrived."""

    prompt_tokens: int
    max_tokens: int
    sent_at_seconds: float
    # (arrival time, completion tokens received so far after this chunk), in arrival order.
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    finished_at_seconds: float | None = None
    error: str | None = None
    # The first `shared_prefix_tokens` ids of the prompt are those every request of the prefix named
    # `shared_prefix` begins with (a system prompt); "" where the whole prompt is the request's own.
    shared_prefix: str = ""
    shared_prefix_tokens: int = 0

    @property
    def first_token_at_seconds(self) -> float | None:
        """When the first token arrived: the server computed the whole prompt by then."""
        return self.arrivals[0][0] if self.arrivals else None

    @property
    def shared_tokens(self) -> int:
        """Of the prompt, the ids other requests' prompts begin with too (0 without a shared prefix)."""
        return self.shared_prefix_tokens if self.shared_prefix else 0

    def generated_by(self, at_seconds: float) -> int:
        """Completion tokens received by `at_seconds`."""
        received = 0
        for arrived, total in self.arrivals:
            if arrived > at_seconds:
                break
            received = total
        return received

    def running_at(self, at_seconds: float) -> bool:
        """Sent and not finished at `at_seconds` (the server holds its KV cache from admission on)."""
        end = self.finished_at_seconds
        return self.sent_at_seconds <= at_seconds and (end is None or at_seconds < end)

    def tokens_held_at(self, at_seconds: float) -> int:
        """Prompt + generated so far while running, else 0: the request's whole context, what its attention
        reads each step (a shared prefix included: `unique_tokens_held_at` counts that once)."""
        return self.prompt_tokens + self.generated_by(at_seconds) if self.running_at(at_seconds) else 0

    def token_gaps_in(self, start_seconds: float, end_seconds: float) -> list[float]:
        """Each token's gap for the tokens that arrived in (start, end], the first token excluded.

        A chunk of k tokens that arrived g after the previous one is k gaps of g / k: the server made
        them a step each and merged them into one event (0.32.0 vllm/v1/engine/output_processor.py
        l. 53-79), and its ITL histogram observed them one by one, so the mean of these gaps is the
        histogram's and their median a step's.
        """
        gaps: list[float] = []
        previous: tuple[float, int] | None = None
        for arrived, total in self.arrivals:
            if previous is not None and start_seconds < arrived <= end_seconds:
                tokens = total - previous[1]
                gaps.extend([(arrived - previous[0]) / tokens] * tokens)
            previous = (arrived, total)
        return gaps

    def delivery_stalls(self) -> list[tuple[float, float]]:
        """Spans (the last arrival before, the burst's arrival) after which several events arrived at
        once: the server had made them a step or more apart (a request whose consumer falls behind
        gets its steps merged into one output, 0.32.0 vllm/v1/engine/output_processor.py l. 53-79,
        so separate events were separate steps), so they waited in delivery (the server's send path
        or this client's thread starved of a core), and their arrival times say nothing of the
        steps. A CI run on 2 cores held 118 tokens of one stream for 10 s while the other streams
        and the server's own ITL ran on at 17 ms a token; the client cannot tell when those tokens
        were made, nor, for a stall at the end, when the engine let the request go."""
        stalls: list[tuple[float, float]] = []
        index = 0
        while index < len(self.arrivals):
            burst_end = index
            while (burst_end + 1 < len(self.arrivals)
                   and self.arrivals[burst_end + 1][0] - self.arrivals[index][0] < TOGETHER_SECONDS):
                burst_end += 1
            if burst_end - index + 1 >= STALL_EVENTS:
                before = self.arrivals[index - 1][0] if index else self.sent_at_seconds
                stalls.append((before, self.arrivals[index][0]))
            index = burst_end + 1
        return stalls


def outstanding_at(streams: Iterable[Stream], at_seconds: float) -> int:
    """Of these streams, the requests sent and not finished at `at_seconds` (a run's, or one read back)."""
    return sum(1 for stream in streams if stream.running_at(at_seconds))


def contexts_held_at(streams: Iterable[Stream], at_seconds: float) -> int:
    """The whole contexts of the requests running at `at_seconds`, each counted whole (a prefix several
    share counted once for each): what the steps' attention reads, the daemon's tokens in flight."""
    return sum(stream.tokens_held_at(at_seconds) for stream in streams)


def unique_tokens_held_at(streams: Iterable[Stream], at_seconds: float) -> int:
    """The tokens the running requests hold in the KV cache, a prefix several of them share counted once."""
    total = 0
    prefixes: dict[str, int] = {}
    for stream in streams:
        held = stream.tokens_held_at(at_seconds)
        if held:
            total += held - stream.shared_tokens
            if stream.shared_tokens:
                prefixes[stream.shared_prefix] = stream.shared_tokens
    return total + sum(prefixes.values())


def unique_blocks_held_at(streams: Iterable[Stream], at_seconds: float, block_tokens: int) -> int:
    """The KV blocks of `block_tokens` the running requests hold: each ceil(context / block) of its own, less
    the whole blocks of its shared prefix, which the cache holds once for all the requests sharing it (the
    block where the prefix ends holds the request's own ids too, so it is the request's)."""
    total = 0
    shared_blocks: dict[str, int] = {}
    for stream in streams:
        held = stream.tokens_held_at(at_seconds)
        if held:
            full = stream.shared_tokens // block_tokens
            total += -(-held // block_tokens) - full
            if full:
                shared_blocks[stream.shared_prefix] = full
    return total + sum(shared_blocks.values())


def prompt_tokens_first_returned_in(streams: Iterable[Stream], start_seconds: float, end_seconds: float) -> int:
    """The prompt tokens of the requests whose first token arrived in (start, end]: the prompts the server
    finished computing about then (it returns a request's first token from the step that ends its prompt)."""
    return sum(stream.prompt_tokens for stream in streams
               if (first := stream.first_token_at_seconds) is not None and start_seconds < first <= end_seconds)


@dataclass(frozen=True)
class Phase:
    """`concurrency` closed-loop clients, each sending requests of this shape back to back."""

    name: str
    concurrency: int
    prompt_tokens: int  # the whole prompt, a shared prefix included
    max_tokens: int  # 1: prefill-only requests, as a prefill/decode proxy sends them to the prefill side
    # Each request's lengths drawn uniformly within +-this share of the above (of the prompt's own ids past
    # a shared prefix): clients in lockstep would cross block boundaries together, which no real load does.
    spread_ratio: float = 0.0
    # Every request's prompt begins with the same this many ids (a system prompt, drawn once per phase
    # name), then its own random ids: prompt_tokens must exceed it.
    shared_prefix_tokens: int = 0
    # The output lengths' own spread, where it differs from the prompts' (None: spread_ratio).
    output_spread_ratio: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.shared_prefix_tokens < self.prompt_tokens:
            raise ValueError(f"phase {self.name!r}: a shared prefix of {self.shared_prefix_tokens} tokens must be "
                             f"shorter than the {self.prompt_tokens}-token prompt (each request has ids of its own)")
        if self.max_tokens < 1 or self.concurrency < 1:
            raise ValueError(f"phase {self.name!r}: concurrency and max_tokens must be at least 1")


class LoadGenerator:
    """Closed-loop streaming clients against one server; every stream is kept for the ground truth."""

    def __init__(self, base_url: str, model: str, *, vocab_size: int, seed: int = 0,
                 timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS, clock: Callable[[], float] = time.time,
                 repeat_ids: int = 0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"base URL must be http://host:port, got {base_url!r}")
        self._host, self._port = parts.hostname, parts.port or 80
        self._model = model
        self._vocab_size = vocab_size
        self._random = random.Random(seed)
        self._timeout_seconds = timeout_seconds
        self._clock = clock
        # >0: each prompt is this many random ids repeated (the greedy continuation repeats them too, which
        # ngram speculative decoding drafts from); 0: every id random, as before.
        self._repeat_ids = repeat_ids
        self._lock = threading.Lock()
        self._streams: list[Stream] = []
        self._threads: list[threading.Thread] = []
        self._stops: dict[str, threading.Event] = {}
        self._prefixes: dict[str, list[int]] = {}  # each phase's shared prefix, by phase name

    # --- ground truth -------------------------------------------------------------------------------

    @property
    def streams(self) -> list[Stream]:
        with self._lock:
            return list(self._streams)

    def tokens_held_at(self, at_seconds: float) -> int:
        """The running requests' whole contexts at `at_seconds` (prompt + generated so far, each counted
        whole: `contexts_held_at`)."""
        return contexts_held_at(self.streams, at_seconds)

    def unique_tokens_held_at(self, at_seconds: float) -> int:
        """What the KV cache holds for the running requests, a shared prefix once (`unique_tokens_held_at`)."""
        return unique_tokens_held_at(self.streams, at_seconds)

    def unique_blocks_held_at(self, at_seconds: float, block_tokens: int) -> int:
        """The KV blocks held for the running requests, a shared prefix's once (`unique_blocks_held_at`)."""
        return unique_blocks_held_at(self.streams, at_seconds, block_tokens)

    def outstanding_at(self, at_seconds: float) -> int:
        """Requests sent and not finished at `at_seconds`: the server's running plus waiting."""
        return outstanding_at(self.streams, at_seconds)

    def token_gaps_in(self, start_seconds: float, end_seconds: float) -> list[float]:
        """Every stream's token gaps over (start, end] (`Stream.token_gaps_in`)."""
        return [gap for stream in self.streams for gap in stream.token_gaps_in(start_seconds, end_seconds)]

    def errors(self) -> list[str]:
        return [stream.error for stream in self.streams if stream.error]

    # --- driving the load ---------------------------------------------------------------------------

    def start(self, phase: Phase) -> None:
        """Starts `phase.concurrency` clients that loop until `stop(phase.name)`."""
        self._prefix(phase)  # drawn before any client runs, so every one of them shares it
        stop = self._stops[phase.name] = threading.Event()  # a phase started again runs again
        for index in range(phase.concurrency):
            thread = threading.Thread(target=self._loop, args=(phase, stop), daemon=True,
                                      name=f"loadgen-{phase.name}-{index}")
            thread.start()
            self._threads.append(thread)

    def stop(self, name: str) -> None:
        """The phase's clients send no new request; their requests in flight run to the end."""
        self._stops.setdefault(name, threading.Event()).set()

    def stop_all(self) -> None:
        for stop in self._stops.values():
            stop.set()

    def join(self, timeout_seconds: float) -> bool:
        """Waits for every client to finish its last request; False if some are still running."""
        deadline = time.monotonic() + timeout_seconds
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def one(self, prompt_tokens: int, max_tokens: int) -> Stream:
        """One request in the calling thread (for calibration-style single streams)."""
        return self._request(prompt_tokens, max_tokens)

    def warm_prefix(self, phase: Phase) -> Stream:
        """One prefill-only request in the calling thread: the phase's shared prefix and one id of its own.
        The engine then holds the prefix's whole blocks in its prefix cache, and the phase's requests
        share them from their first step (started together on a cold cache, the requests admitted in the
        step that computes the prefix would compute copies of their own). Kept with the other streams."""
        if not phase.shared_prefix_tokens:
            raise ValueError(f"phase {phase.name!r} has no shared prefix to warm")
        return self._request(phase.shared_prefix_tokens + 1, 1, phase.name, self._prefix(phase))

    def _prefix(self, phase: Phase) -> list[int]:
        """The phase's shared prefix, drawn at its first use and the same ever after ([] without one)."""
        if not phase.shared_prefix_tokens:
            return []
        with self._lock:
            prefix = self._prefixes.get(phase.name)
            if prefix is None or len(prefix) != phase.shared_prefix_tokens:
                prefix = self._prefixes[phase.name] = [self._random.randrange(FIRST_TOKEN_ID, self._vocab_size)
                                                       for _ in range(phase.shared_prefix_tokens)]
        return prefix

    def _loop(self, phase: Phase, stop: threading.Event) -> None:
        prefix = self._prefix(phase)
        output_spread = phase.spread_ratio if phase.output_spread_ratio is None else phase.output_spread_ratio
        while not stop.is_set():
            own = self._spread(phase.prompt_tokens - len(prefix), phase.spread_ratio)
            stream = self._request(len(prefix) + own, self._spread(phase.max_tokens, output_spread),
                                   phase.name if prefix else "", prefix)
            if stream.error is not None:
                stop.wait(1.0)  # a refused or broken request: back off instead of spinning

    def _spread(self, tokens: int, spread_ratio: float) -> int:
        with self._lock:
            return max(1, round(tokens * (1.0 + self._random.uniform(-spread_ratio, spread_ratio))))

    def _prompt(self, tokens: int) -> list[int]:
        with self._lock:
            drawn = min(tokens, self._repeat_ids) if self._repeat_ids > 0 else tokens
            unit = [self._random.randrange(FIRST_TOKEN_ID, self._vocab_size) for _ in range(drawn)]
        return [unit[i % len(unit)] for i in range(tokens)] if unit else []

    def _request(self, prompt_tokens: int, max_tokens: int, shared_prefix: str = "",
                 prefix: Sequence[int] = ()) -> Stream:
        """One streamed request whose prompt is `prefix` (shared, named `shared_prefix`) and then random ids
        of its own, `prompt_tokens` in all."""
        body = json.dumps({
            "model": self._model, "prompt": [*prefix, *self._prompt(prompt_tokens - len(prefix))],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        })
        stream = Stream(prompt_tokens, max_tokens, self._clock(), shared_prefix=shared_prefix,
                        shared_prefix_tokens=len(prefix))
        with self._lock:
            self._streams.append(stream)
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_seconds)
        try:
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                stream.error = f"HTTP {response.status}: {response.read(500).decode(errors='replace')}"
                return stream
            for completion_tokens in _usage_counts(response):
                stream.arrivals.append((self._clock(), completion_tokens))
        except (OSError, http.client.HTTPException, ValueError) as error:
            stream.error = f"{type(error).__name__}: {error}"
        finally:
            stream.finished_at_seconds = self._clock()
            connection.close()
        return stream


def _usage_counts(response: http.client.HTTPResponse) -> Iterator[int]:
    """Completion tokens so far, once per server-sent event that carries new tokens."""
    last = 0
    for payload in sse_payloads(response):
        if payload == "[DONE]":
            return
        usage = json.loads(payload).get("usage") or {}
        total = usage.get("completion_tokens")
        if isinstance(total, int) and total > last:
            last = total
            yield total
