"""The context a vLLM server's open requests hold, from its request counters: what its decode steps read.

Why not the KV cache: `vllm:kv_cache_usage_perc` counts memory held. With prefix caching (vLLM's default)
a block shared by several running requests is held once (0.32.0 vllm/v1/core/block_pool.py `get_usage`,
l. 884-888; a cached block no request holds counts as free), while each request's attention reads its
whole block table, shared blocks included (cascade attention, the one kernel that read a common prefix
once, is gone in 0.32.0). Sixteen streams behind one 3,000-token system prompt hold 8k tokens of KV and
read 52k a step.

The counters count each request whole. `vllm:prompt_tokens_total` takes a prompt's full length, cache
hits included, when its prefill ends, and `vllm:generation_tokens_total` every sampled token (0.32.0
vllm/v1/metrics/stats.py l. 505-523); the `_sum`s of `vllm:request_prompt_tokens` and
`vllm:request_generation_tokens` take both back out when the request finishes (vllm/v1/metrics/loggers.py
l. 1289-1323). Their difference is the context of the requests past their prefill and not finished.

One kind of request leaves no finished record: one its client aborts (a disconnect, a timeout, a user's
"stop"). `OutputProcessor.abort_requests` drops the request's state and records no stats
(vllm/v1/engine/output_processor.py l. 552-611), and the engine's later outputs for it are ignored
(l. 711-715), so its context would stay in the difference for as long as the server runs. The request
counts tell how many: every request past its prefill observed one time to first token (stats.py
l. 517-522) and every finished one a `request_prompt_tokens` observation, so first tokens less finished
requests is the open requests plus the aborted ones, while the open ones are at most the running
requests, and the waiting ones where a preemption sent some back. `OpenContext` keeps that ledger
across polls: an idle server (nothing running or waiting) anchors it exactly; between anchors each
request found missing is taken out at the mean context of the open requests at the poll before, and
the reading says the figure holds such an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from exporter.serve.snapshot import Snapshot


@dataclass(frozen=True)
class OpenContext:
    """One poll's ledger of one vLLM engine's open requests.

    `held_tokens` and `open_requests` are the counters' differences (open requests plus the ones aborted
    since the server started); `gone_tokens` and `gone_requests` are the aborted ones' share as far as it
    is known; `estimated` is True where some of it is an estimate (no idle poll since the abort)."""

    held_tokens: float
    open_requests: float
    gone_tokens: float = 0.0
    gone_requests: float = 0.0
    estimated: bool = False
    preemptions_total: float | None = None
    first_tokens_total: float = 0.0

    @property
    def context_tokens(self) -> float:
        """The context of the requests still open past their prefill: what their decode steps read."""
        return max(0.0, self.held_tokens - self.gone_tokens)

    @property
    def requests(self) -> float:
        return max(0.0, self.open_requests - self.gone_requests)

    @property
    def mean_context_tokens(self) -> float | None:
        return self.context_tokens / self.requests if self.requests > 0 else None


def open_context(snapshot: Snapshot, previous: OpenContext | None) -> OpenContext | None:
    """This poll's ledger, carrying `previous` (the same engine's at the poll before) forward.

    None where the page lacks a counter it needs (another engine, or a vLLM without the families)."""
    counters = _counters(snapshot)
    if counters is None:
        return None
    held, opened, first_tokens = counters
    running, waiting = snapshot.requests_running, snapshot.requests_waiting
    preemptions = snapshot.preemptions_total
    if running is None or waiting is None:
        return OpenContext(held, opened, *_carried(previous), preemptions_total=preemptions,
                           first_tokens_total=first_tokens)
    if running + waiting == 0:
        # Nothing is open: whatever the counters still hold left without a finished record. Exact.
        return OpenContext(held, opened, held, opened, False, preemptions, first_tokens)
    if previous is not None and _went_backwards(previous, first_tokens):
        previous = None  # the server restarted: its counters began again
    most_open = running + (waiting if _preempted_since(previous, preemptions) else 0.0)
    if previous is None:
        # A server first seen busy: requests beyond what it can hold open left before we watched. Their
        # context is not known; the mean of all the counters hold is the best guess.
        missing = max(0.0, opened - most_open)
        gone = held * missing / opened if opened > 0 else 0.0
        return OpenContext(held, opened, gone, missing, missing > 0, preemptions, first_tokens)
    missing = max(0.0, opened - previous.gone_requests - most_open)
    if missing <= 0:
        return OpenContext(held, opened, previous.gone_tokens, previous.gone_requests, previous.estimated,
                           preemptions, first_tokens)
    mean = previous.mean_context_tokens
    if mean is None:
        still_open = opened - previous.gone_requests
        mean = max(0.0, held - previous.gone_tokens) / still_open if still_open > 0 else 0.0
    return OpenContext(held, opened, previous.gone_tokens + missing * mean, previous.gone_requests + missing, True,
                       preemptions, first_tokens)


def _counters(snapshot: Snapshot) -> tuple[float, float, float] | None:
    """(context tokens, requests) past their prefill and without a finished record, and the first tokens
    so far; None where the page lacks one of the six figures."""
    ttft = snapshot.time_to_first_token
    values = (snapshot.prompt_tokens_total, snapshot.generation_tokens_total, snapshot.finished_prompt_tokens_total,
              snapshot.finished_generation_tokens_total, snapshot.finished_requests_total)
    if ttft is None or any(value is None for value in values):
        return None
    prompt, generated, finished_prompt, finished_generated, finished = (float(value or 0.0) for value in values)
    return prompt + generated - finished_prompt - finished_generated, ttft.count - finished, ttft.count


def _carried(previous: OpenContext | None) -> tuple[float, float, bool]:
    if previous is None:
        return 0.0, 0.0, False
    return previous.gone_tokens, previous.gone_requests, previous.estimated


def _went_backwards(previous: OpenContext, first_tokens_total: float) -> bool:
    """Fewer first tokens than the poll before: the server restarted and its counters began again."""
    return first_tokens_total < previous.first_tokens_total


def _preempted_since(previous: OpenContext | None, preemptions: float | None) -> bool:
    """Whether a preemption may have sent an open request back to the waiting queue since the poll
    before (vLLM readmits a preempted request ahead of new ones: 0.32.0 vllm/v1/core/sched/scheduler.py
    `_preempt_request` prepends it to the waiting queue). Where the page cannot say, assume so."""
    if preemptions is None or previous is None or previous.preemptions_total is None:
        return True
    return preemptions > previous.preemptions_total
