"""vLLM's prompt accounting over a window: the prompt tokens the engine computed between two polls, the
prompts part-way through their prefill placed in the windows their chunks ran in, and where in their
prompts the computed tokens stood.

Why its own module, beside the vLLM adapter: every fact it reads is a vLLM counter (prefix-cache queries
and hits, prompt tokens by source, the finished requests' sums, the KV blocks in use) and every rule it
applies is vLLM's scheduler's (chunked prefill, a prompt counted when its last chunk finishes). The
window (exporter/serve/window.py) stays generic: it asks this module for the prompt tokens, and a page
without these counters (SGLang, TGI) gets the counted ones with nothing placed.
"""

from __future__ import annotations

from dataclasses import dataclass

from exporter.serve.snapshot import Snapshot, counter_delta


@dataclass(frozen=True)
class _PartWay:
    """What a poll says of the prompts part-way through their prefill, read once per snapshot a window
    holds: their whole uncounted length (`_uncounted_prompt_tokens`, exact) and the KV cache's tokens
    beyond the counted ones (`_kv_tokens_beyond_counted`: their computed chunks, plus each running
    request's partly filled last block, of which `partly_filled` is half a block each on average). With
    vLLM's defaults one prompt at most is part-way at a time: a chunk is cut by the step's budget, which
    it then leaves empty for any other, and a running request's next chunk is scheduled before a waiting
    one (0.32.0 vllm/v1/core/sched/scheduler.py l. 659 and 708-712; long_prefill_token_threshold 0)."""

    uncounted: float
    beyond: float
    partly_filled: float

    @classmethod
    def at(cls, snapshot: Snapshot) -> _PartWay | None:
        uncounted, beyond = _uncounted_prompt_tokens(snapshot), _kv_tokens_beyond_counted(snapshot)
        if uncounted is None or beyond is None:
            return None
        return cls(uncounted, beyond, (snapshot.requests_running or 0.0) * (snapshot.block_size_tokens or 0) / 2.0)

    @property
    def done(self) -> float:
        """The part-way prompts' tokens computed so far: at least 0, at most their length."""
        return min(max(0.0, self.beyond - self.partly_filled), self.uncounted)


@dataclass(frozen=True)
class PromptTokens:
    """A window's prompt tokens, read once: what the server counted as computed in it, and what each end
    says of the prompts part-way through their prefill (None where the page cannot say)."""

    counted: float | None
    start: _PartWay | None
    end: _PartWay | None
    notes: tuple[str, ...]

    @classmethod
    def of(cls, previous: Snapshot, current: Snapshot) -> PromptTokens:
        notes: list[str] = []
        counted = _counted_prompt_tokens(previous, current, notes)
        start, end = _PartWay.at(previous), _PartWay.at(current)
        in_progress = _in_progress_change(start, end)
        if counted is not None and in_progress:
            notes.append(f"a prompt was part-way through its prefill at an end of the window: {in_progress:+.0f} "
                         "prompt tokens computed here and counted in another window (vLLM counts a prompt when "
                         "its last chunk finishes), from the KV cache's growth")
        return cls(counted, start, end, tuple(notes))

    @property
    def in_progress(self) -> float | None:
        """`_in_progress_change` over the window."""
        return _in_progress_change(self.start, self.end)

    @property
    def computed(self) -> float | None:
        """Prompt tokens the engine computed in the window: prefix-cache hits cost no prefill work, and
        the chunks of a prompt part-way at either end are counted where they ran."""
        in_progress = self.in_progress
        if self.counted is None or not in_progress:
            return self.counted
        return max(0.0, self.counted + in_progress)


def _in_progress_change(start: _PartWay | None, end: _PartWay | None) -> float | None:
    """The change over the window in prompt tokens computed but not yet counted; None where none was
    part-way through its prefill at either end, or the page cannot say.

    vLLM counts a prompt, as prompt_tokens_total and by source, in the step that finishes its prefill
    and emits its first token (0.32.0 vllm/v1/metrics/stats.py l. 516-519); the chunks before it emit
    nothing (vllm/v1/core/sched/scheduler.py l. 2200-2202). A prompt longer than the step's token
    budget (2,048 by default) is computed over several steps, and on a slow engine over several
    windows: counted, the window of its last chunk would hold all of it and the windows before none,
    while their steps took seconds. Two facts on the page place the chunks:
      * the prompt tokens admitted and not yet counted, `_uncounted_prompt_tokens`: what may be
        part-way (0 at both ends: the counters are exact, no correction);
      * the KV cache: a chunk's blocks are allocated as it is scheduled (kv_cache_manager.py
        `allocate_slots`), so the tokens the cache holds beyond those of the requests past their
        prefill (`_kv_tokens_beyond_counted`) grow by each chunk and drop by the prompt when it is
        counted.
    The change of the latter is the chunks' tokens, give or take the partly filled last block of each
    request (a few hundred tokens on the CPU backend's 128-token blocks, against a 2,048-token chunk),
    held within what was part-way at each end: at least 0, at most the admitted, uncounted prompt.
    """
    if start is None or end is None or (start.uncounted <= 0 and end.uncounted <= 0):
        return None
    return min(end.uncounted, max(-start.uncounted, end.beyond - start.beyond))


def _counted_prompt_tokens(previous: Snapshot, current: Snapshot, notes: list[str]) -> float | None:
    """Prompt tokens the server counted as computed in the window.

    vLLM's prompt_tokens_total counts a prompt's full length, cache hits included (0.33.0
    vllm/v1/metrics/loggers.py l. 1262); prefix caching is on by default, so an agent re-sending a
    long, mostly cached conversation would read as a huge prefill.
    """
    computed = counter_delta(previous, current, "prompt_tokens_computed_total")
    if computed is not None:
        return computed
    prompt = counter_delta(previous, current, "prompt_tokens_total")
    cached = counter_delta(previous, current, "prompt_tokens_cached_total")
    if prompt is not None and cached is not None:
        return max(0.0, prompt - cached)
    if prompt is not None:
        notes.append("prompt tokens include prefix-cache hits (the page has no computed-token count): "
                     "prefill per step is an upper bound")
    return prompt


def prefill_mean_context_tokens(previous: Snapshot, current: Snapshot, prompt: PromptTokens,
                                 counted_steps: list[tuple[float, float]] | None) -> float | None:
    """The mean context a prompt token computed in the window attended to: its position in its prompt.

    Why: a prompt token attends to every token of its prompt before it, so a chunk's attention grows
    with what its prompt already holds. A 2,048-token chunk after 4,096 tokens of its prompt attends to
    2,048 x 5,120 pairs, five times the first chunk's 2,048 x 1,024; the GEMMs are the same. A prompt
    whose first h tokens were prefix-cache hits computes c more, which attend to c x h + c^2 / 2 in all.

    vLLM only (its pages say where a prompt is; SGLang's and TGI's do not):
      * a prompt part-way at the window's start (`_PartWay`: its whole uncounted length, known
        since its admission, and the tokens computed so far) either finished here, when the window
        counted at least its length, or went on; one part-way at the end and not at the start began
        here. Each poll has one reading of how far it had got, so over a prompt's windows its chunks'
        attention adds up to its own, whatever each reading's error (`_part_way_attended`);
      * the other prompts counted in the window are its first tokens (`_first_tokens`). What their
        computed tokens attend to of each other, the sum of c^2 / 2, is read from the iteration-tokens
        histogram, which observes each prompt's computed tokens in the step that finishes it
        (`_counted_prefill_steps`; several finishing in one step read as one, an upper bound), held
        between what equal prompts and one prompt would give; their cache hits, the sum of c x h, are
        taken as the same for each prompt (the window's hits over its prompts).
    Where it is off: a part-way prompt's own cache hits are not on the page (its positions start at 0),
    and how far it had got is the KV cache's tokens beyond the counted ones less half a block for each
    running request (the partly filled last blocks), give or take a few hundred tokens on the CPU
    backend's 128-token blocks.
    """
    computed, counted = prompt.computed, prompt.counted
    positions = counter_delta(previous, current, "prompt_tokens_total")
    prompts = _first_tokens(previous, current)
    if current.kind != "vllm" or not computed or computed <= 0 or counted is None or positions is None \
            or prompts is None:
        return None
    attended, finished_length = _part_way_attended(prompt, counted)
    own_squares = None if counted_steps is None else sum(n * tokens ** 2 / 2.0 for tokens, n in counted_steps)
    if finished_length:  # the part-way prompt finished here: the rest are the window's own prompts
        counted, positions, prompts = counted - finished_length, positions - finished_length, prompts - 1
        own_squares = None if own_squares is None else own_squares - finished_length ** 2 / 2.0
    if counted > 0:
        if prompts < 1:  # counted prompt tokens, yet no first token: the page contradicts itself
            return None
        equal, one = counted ** 2 / 2.0 / prompts, counted ** 2 / 2.0
        hits = max(0.0, positions - counted) / prompts
        attended += min(max(own_squares if own_squares is not None else equal, equal), one) + counted * hits
    return attended / computed


def _part_way_attended(prompt: PromptTokens, counted: float) -> tuple[float, float]:
    """(What the tokens computed in the window of the prompts part-way at either end attended to, the
    uncounted length of the one part-way at the start where it finished in the window, else 0).

    A prompt's tokens k0+1 .. k1 attend to (k1^2 - k0^2) / 2: with one reading of k per poll, the sum
    over the windows a prompt spans is its L^2 / 2 whatever each reading's error."""
    if prompt.in_progress is None or prompt.start is None or prompt.end is None:
        return 0.0, 0.0
    length, done_before, done_now = prompt.start.uncounted, prompt.start.done, prompt.end.done
    if length > 0 and counted >= length:  # finished here; another may have begun
        return (length ** 2 - done_before ** 2) / 2.0 + done_now ** 2 / 2.0, length
    return max(0.0, done_now ** 2 - done_before ** 2) / 2.0, 0.0  # went on, or began here (from 0)


def _first_tokens(previous: Snapshot, current: Snapshot) -> float | None:
    """Prompts that finished their prefill in the window: each emits its first token, counted in
    vllm:generation_tokens_total but observed as a TTFT, not an ITL (0.32.0 vllm/v1/metrics/stats.py
    l. 516-523 and 548-552); a decoding request-step's accepted drafts are generation tokens too."""
    generated = counter_delta(previous, current, "generation_tokens_total")
    before, now = previous.inter_token_latency, current.inter_token_latency
    if generated is None or before is None or now is None:
        return None
    accepted = counter_delta(previous, current, "spec_decode_accepted_tokens_total") or 0.0
    return max(0.0, generated - (now.count - before.count) - accepted)


def _uncounted_prompt_tokens(snapshot: Snapshot) -> float | None:
    """Prompt tokens admitted to compute and not yet counted as computed: the prompts part-way through
    their prefill (a request preempted and readmitted is not admitted again: 0.32.0
    vllm/v1/metrics/stats.py l. 146-151; while prefix caching is off nothing is admitted and this is 0).
    Prompt tokens a KV connector loads from another instance (a P/D decode server) are admitted and miss
    the local cache like any other, but are counted as external_kv_transfer, never as computed (stats.py
    l. 307-346 and 453-462): the connector's hits, counted at admission beside the local ones
    (vllm/v1/core/sched/scheduler.py l. 1294-1311), are taken out, or they would read as a prompt part-way
    for ever, and a request waiting on its KV as one being prefilled."""
    admitted, hits = snapshot.prompt_tokens_admitted_total, snapshot.prompt_tokens_admitted_cached_total
    computed = snapshot.prompt_tokens_computed_total
    if admitted is None or hits is None or computed is None:
        return None
    return max(0.0, admitted - hits - computed - (snapshot.prompt_tokens_admitted_external_total or 0.0))


def _kv_tokens_beyond_counted(snapshot: Snapshot) -> float | None:
    """Tokens the KV cache holds (`Snapshot.used_block_tokens`) beyond the counted prompt and sampled
    tokens of the requests past their prefill, and beyond the cache hits of those still in it: the
    prefilling prompts' computed chunks, plus each request's partly filled last block."""
    counters = [snapshot.prompt_tokens_total, snapshot.generation_tokens_total, snapshot.finished_prompt_tokens_total,
                snapshot.finished_generation_tokens_total, snapshot.prompt_tokens_admitted_cached_total,
                snapshot.prompt_tokens_local_cache_hit_total]
    used = snapshot.used_block_tokens
    known = [value for value in counters if value is not None]
    if used is None or len(known) < len(counters):
        return None
    prompt, generated, finished_prompt, finished_generated, admitted_hits, counted_hits = known
    held = prompt + generated - finished_prompt - finished_generated
    return used - held - (admitted_hits - counted_hits)


def part_way_done_tokens(snapshot: Snapshot) -> float:
    """The tokens computed so far of the prompts part-way through their prefill at this poll (`_PartWay`):
    context their chunks attend to that no counter counts yet; 0 where the page cannot say."""
    part_way = _PartWay.at(snapshot)
    return part_way.done if part_way is not None else 0.0
