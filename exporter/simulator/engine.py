"""A discrete-step model of a continuous-batching server (vLLM V1-like scheduler).

Each engine step: the scheduler picks work under a token budget (`max_num_batched_tokens`):
running requests first, in admission order (a decoding request needs 1 token, a request still
prefilling takes the next chunk of its prompt), then waiting requests in arrival order while budget,
free KV blocks and `max_num_seqs` allow. KV is held in blocks of `block_size` tokens. When a
running request cannot get the block it needs, the newest running request is preempted: its blocks
are freed and it goes back to the front of the queue, to be recomputed from scratch later
(vllm/v1/core/sched/scheduler.py: `self.running.pop()`, `num_computed_tokens = 0`). A request
samples a token whenever all its known tokens are computed: the step that finishes its prompt
gives the first token, every later step one more.

Prefix caching (vLLM's kv_cache_manager): a request may carry a cached prefix (a conversation
re-sent by its next turn). When a request with no computed tokens is admitted, the hit is the
cached prefix in whole blocks, at most prompt - 1 tokens; those tokens count as computed, their
blocks are held (used) like any other, and only the rest is prefilled, so the step costs follow
the computed tokens. A request may also begin with its group's shared prefix (one system prompt
for all): its whole blocks are cached once the first request schedules them, later requests hit
them, and the blocks are held ONCE however many running requests share them (reference counts,
as vLLM's block pool keeps them), while every sharer's attention still reads its whole block
table, shared blocks included: memory held and context read differ. The page's counters follow
vLLM's accounting (see VllmPage and docs/simulator.md): prefix-cache queries and hits at a
request's first admission, prompt tokens (cache hits included, split by source) when the
prompt's last chunk finishes, and one iteration_tokens observation per step of the prompt tokens
computed by the requests that got their first token in it, plus the tokens sampled in it.

Data parallelism: a Simulator runs `data_parallel_size` engines, each with its own batch, KV
cache, clock and counters; requests go to the least loaded (4 x waiting + running, as vLLM's
front end balances), except that a session with a cached prefix stays on the engine holding it.

The step's duration comes from `hardware.StepPhysics`; simulated time advances by it. Nothing
here reads a wall clock: `run_until(t)` is deterministic for a seed, and the HTTP wrapper
(server.py) paces it against the wall clock.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from exporter.capacity.presets import get_gpu, get_model_preset
from exporter.errors import InputError
from exporter.simulator.hardware import (
    HardwareTruth,
    ModelBytes,
    ScheduledSequence,
    StepCost,
    StepPhysics,
    model_bytes,
    num_gpu_blocks,
)
from exporter.simulator.scenarios import ClosedLoopGroup, Group, PoissonGroup, Scenario, ScriptedGroup
from exporter.simulator.vllm_metrics import DEFAULT_VERSION, EngineCounters, VllmPage

_KV_DTYPE_BYTES = {"auto": 2.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0}


# vLLM's DP load balancing (vllm/v1/engine/core_client.py): the engine with the lowest
# 4 x waiting + running gets the next request.
_WAITING_WEIGHT = 4


@dataclass(frozen=True)
class ServerSpec:
    """How the simulated server is set up (the public side: what `vllm serve` flags would say)."""

    model: str = "qwen3-8b"
    gpu: str = "h100-sxm"
    served_model_name: str | None = None  # default: the model preset's name
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float = 3.0e9  # vLLM profiles peak activations + CUDA graphs; fixed here
    block_size_tokens: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 131072
    kv_cache_dtype: str = "auto"
    weight_bytes_per_param: float = 2.0
    vllm_version: str = DEFAULT_VERSION
    engine_index: str = "0"  # the first engine's label; data-parallel engines count on from it
    data_parallel_size: int = 1
    enable_prefix_caching: bool = True  # vLLM V1's default
    enable_mfu_metrics: bool = False  # vLLM's --enable-mfu-metrics: count the steps' FLOPs and bytes on the page
    # Speculative decoding (--speculative-config num_speculative_tokens): every decoding request-step
    # verifies this many draft tokens beside its own, and yields 1 + the accepted ones, whose mean is
    # `spec_acceptance_length` - 1 (vLLM's "mean acceptance length" 1 + accepted / drafts).
    num_speculative_tokens: int = 0
    spec_acceptance_length: float = 1.0
    seed: int = 0
    truth: HardwareTruth = field(default_factory=HardwareTruth)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def fit_context(self, prompt_tokens: int, output_tokens: int) -> tuple[int, int]:
        """A scenario draw clipped to the context window rather than rejected."""
        prompt_tokens = min(prompt_tokens, self.max_model_len - 1)
        return prompt_tokens, max(1, min(output_tokens, self.max_model_len - prompt_tokens))


@dataclass
class SimRequest:
    """One request inside the simulated engine."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrival_seconds: float
    group: str = "http"
    user: int | None = None
    leave_at_seconds: float | None = None
    finish_reason_at_max: str = "length"  # "stop" for scenario requests: they model a natural end
    on_token: Callable[[SimRequest], None] | None = None
    on_finish: Callable[[SimRequest], None] | None = None
    cached_prefix_tokens: int = 0  # of the prompt, already in this engine's prefix cache
    shared_prefix_tokens: int = 0  # of the prompt, its group's common prefix (one system prompt for all)
    engine: int = 0  # index into Simulator.engines
    output_tokens: int = 0
    computed_tokens: int = 0
    blocks: int = 0  # its whole block table (shared prefix blocks included): what its attention reads
    shared_blocks: int = 0  # of those, leading blocks that are its group's cached shared-prefix blocks
    preemptions: int = 0
    prefix_hit_tokens: int = 0  # the hit at its first admission (vLLM's PrefillStats.num_local_cached_tokens)
    reported_cached_tokens: int = 0  # the hit reported with the first token (OutputProcessor's num_cached_tokens)
    first_scheduled_seconds: float | None = None
    first_token_seconds: float | None = None
    last_token_seconds: float | None = None
    finished_seconds: float | None = None
    finish_reason: str | None = None

    @property
    def known_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepRecord:
    """One engine step, for tests and benchmarks (not on the page)."""

    start_seconds: float
    end_seconds: float
    seconds: float
    decode_tokens: int
    prefill_tokens: int  # prompt (and recomputed) tokens computed in the step; cache hits excluded
    running: int
    waiting: int
    held_tokens: int  # block-rounded tokens the cache holds after the step (used blocks: a shared one once)
    used_blocks: int
    memory_seconds: float
    compute_seconds: float
    engine: int = 0
    sampled_tokens: int = 0  # tokens generated in the step (first tokens included)
    reported_prompt_tokens: int = 0  # prompt tokens vLLM reports with this step's first tokens
    iteration_tokens: int = 0  # what vLLM's iteration_tokens_total observes for the step
    read_tokens: int = 0  # block-rounded tokens the step's attention read: every scheduled block table, whole


@dataclass
class _PlannedStep:
    start_seconds: float
    end_seconds: float
    scheduled: list[tuple[SimRequest, int]]
    cost: StepCost
    prefix_lookups: list[tuple[int, int]] = field(default_factory=list)  # (queried tokens, hit tokens)
    read_blocks: int = 0  # the block tables the step's cost was computed over


@dataclass
class _SharedPrefix:
    """A group's common prompt prefix in one engine's prefix cache: its leading whole blocks cached
    so far, and how many running requests hold each (vLLM's KVCacheBlock.ref_cnt). Every holder holds
    a leading run of them, so the counts never grow along the prefix and the unheld ones are a tail."""

    holders: list[int] = field(default_factory=list)

    def unheld_among_first(self, blocks: int) -> int:
        return sum(1 for count in self.holders[:blocks] if count == 0)


@dataclass
class _StepTally:
    decode_tokens: int = 0
    prefill_tokens: int = 0
    sampled_tokens: int = 0
    reported_prompt_tokens: int = 0
    itl_same_step: int = 0


class Engine:
    """One engine core (a data-parallel rank): scheduler + KV block pool + step physics + its counters."""

    def __init__(self, index: int, spec: ServerSpec, num_gpu_blocks: int, physics: StepPhysics,
                 counters: EngineCounters, *, count_computed_prompt: bool, record_steps: bool) -> None:
        self.index = index
        self.spec = spec
        self.num_gpu_blocks = num_gpu_blocks
        self.physics = physics
        self.counters = counters
        self.count_computed_prompt = count_computed_prompt
        self.now_seconds = 0.0
        # vLLM's block pool takes one block as the null block at start (vllm/v1/core/block_pool.py:187):
        # requests share the other num_gpu_blocks - 1.
        self.usable_blocks = num_gpu_blocks - 1
        # Free blocks include cached blocks no running request holds: vLLM keeps them in its free queue
        # (block_pool.py:774-818 free_blocks) until an allocation evicts them (block_pool.py:666-690).
        self.free_blocks = self.usable_blocks
        self.shared_prefixes: dict[str, _SharedPrefix] = {}  # by group name
        self.unheld_cached_blocks = 0  # shared-prefix blocks still cached but held by no running request
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.steps: list[StepRecord] | None = [] if record_steps else None
        self.step_count = 0
        self.leaving: list[SimRequest] = []
        self.planned: _PlannedStep | None = None
        self._acceptance_rng = random.Random(spec.seed * 7919 + index)

    @property
    def used_blocks(self) -> int:
        return self.usable_blocks - self.free_blocks

    @property
    def load(self) -> int:
        return _WAITING_WEIGHT * len(self.waiting) + len(self.running)

    def enqueue(self, request: SimRequest) -> None:
        request.engine = self.index
        self.waiting.append(request)
        if request.leave_at_seconds is not None:
            self.leaving.append(request)
        self.update_gauges()

    def abort(self, request: SimRequest) -> None:
        self.finish(request, "abort")
        if self.planned is not None:
            self.planned.scheduled = [(r, n) for r, n in self.planned.scheduled if r is not request]
        self.update_gauges()

    # --- scheduling ----------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.spec.block_size_tokens)

    def prefix_hit(self, request: SimRequest) -> int:
        """The local hit at admission: whole blocks of the cached prefix, at most all tokens but one
        (vllm/v1/core/kv_cache_manager.py: the last token is always recomputed)."""
        block = self.spec.block_size_tokens
        return min(request.cached_prefix_tokens, request.known_tokens - 1) // block * block

    def shareable_blocks(self, request: SimRequest) -> int:
        """The whole blocks of the request's shared prefix: only full blocks are hashed, so only they are
        shared (vllm/v1/core/kv_cache_manager.py:264 get_computed_blocks: "the computed blocks must be full")."""
        return request.shared_prefix_tokens // self.spec.block_size_tokens

    def shared_hit_blocks(self, request: SimRequest) -> int:
        """The cached blocks of its group's shared prefix a request admitted now would hit, at most all
        tokens but one (kv_cache_manager.py:295 max_cache_hit_length = num_tokens - 1)."""
        prefix = self.shared_prefixes.get(request.group)
        if prefix is None:
            return 0
        limit = (request.known_tokens - 1) // self.spec.block_size_tokens
        return min(len(prefix.holders), self.shareable_blocks(request), limit)

    def plan_step(self) -> _PlannedStep | None:
        """Schedule the next step at this engine's current time (once; cached until committed)."""
        if self.planned is not None:
            return self.planned
        self._release_leavers()
        if not self.running and not self.waiting:
            return None
        budget = self.spec.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        budget, preempted = self._schedule_running(scheduled, budget)
        lookups: list[tuple[int, int]] = []
        if not preempted:  # vLLM admits no new request in a step that had to preempt
            self._admit_waiting(scheduled, budget, lookups)
        if not scheduled:
            return None
        # Each sequence reads its whole block table, shared prefix blocks included: vLLM 0.32.0's attention
        # has no cascade (shared-prefix) kernel, so every request's attention reads every block it maps.
        cost = self.physics.step_cost([
            ScheduledSequence(new, req.computed_tokens, req.blocks) for req, new in scheduled])
        self.planned = _PlannedStep(self.now_seconds, self.now_seconds + cost.seconds, scheduled, cost, lookups,
                                    sum(req.blocks for req, _ in scheduled))
        return self.planned

    def _schedule_running(self, scheduled: list[tuple[SimRequest, int]], budget: int) -> tuple[int, bool]:
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            new_tokens = min(request.known_tokens - request.computed_tokens, budget)
            if self._decoding(request):  # the verification step: its token and the draft tokens
                new_tokens = min(1 + self.spec.num_speculative_tokens, budget)
            needed = self.blocks_for(request.computed_tokens + new_tokens) - request.blocks
            preempted_itself = False
            while needed > self.free_blocks:
                victim = self.running.pop()  # the newest running request loses its blocks
                self._preempt(victim)
                preempted = True
                if victim is request:
                    preempted_itself = True
                    break
            if preempted_itself:
                break  # nothing older is left to schedule and no room remains
            self._allocate(request, needed)
            self._cache_shared_prefix(request, request.computed_tokens + new_tokens)
            scheduled.append((request, new_tokens))
            budget -= new_tokens
            index += 1
        return budget, preempted

    @staticmethod
    def _decoding(request: SimRequest) -> bool:
        return request.output_tokens > 0 and request.computed_tokens == request.known_tokens - 1

    def _accepted(self, drafts: int) -> int:
        """Accepted draft tokens of one request-step: the mean's whole part, plus one with the
        probability of its fraction, so the mean over request-steps is spec_acceptance_length - 1."""
        mean = self.spec.spec_acceptance_length - 1.0
        whole = int(mean)
        return min(drafts, whole + (1 if self._acceptance_rng.random() < mean - whole else 0))

    def _admit_waiting(self, scheduled: list[tuple[SimRequest, int]], budget: int,
                       lookups: list[tuple[int, int]]) -> None:
        block = self.spec.block_size_tokens
        while self.waiting and budget > 0 and len(self.running) < self.spec.max_num_seqs:
            request = self.waiting[0]
            # The prefix cache is looked up only for a request with nothing computed (scheduler.py).
            looks_up = request.computed_tokens == 0 and self.spec.enable_prefix_caching
            shared = self.shared_hit_blocks(request) if looks_up else 0
            # The longest hit: its own cached conversation or its group's shared prefix.
            hit = max(self.prefix_hit(request), shared * block) if looks_up else 0
            computed = request.computed_tokens + hit
            new_tokens = min(request.known_tokens - computed, budget)
            own_blocks = self.blocks_for(computed + new_tokens) - request.blocks - shared
            # Hit blocks no running request holds leave the free queue (block_pool.py:752 touch).
            if own_blocks + self._unheld_hit_blocks(request, shared) > self.free_blocks:
                break
            self.waiting.popleft()
            self.running.append(request)
            self._hold_shared(request, shared)  # shared blocks: one more holder, no new memory
            self._allocate(request, own_blocks)  # its own cached blocks are held by it alone: used blocks
            self._cache_shared_prefix(request, computed + new_tokens)
            if looks_up:
                request.computed_tokens = computed
            if looks_up and request.preemptions == 0:
                # A re-admitted (preempted) request's lookup counts apart from the page's queries and hits
                # (vllm/v1/metrics/stats.py:146-151), and its prefill stats keep its first admission's
                # hit (vllm/v1/core/sched/scheduler.py:1074-1081).
                request.prefix_hit_tokens = hit
                lookups.append((request.known_tokens, hit))
            if request.first_scheduled_seconds is None:
                request.first_scheduled_seconds = self.now_seconds
            scheduled.append((request, new_tokens))
            budget -= new_tokens

    def _allocate(self, request: SimRequest, blocks: int) -> None:
        if blocks > 0:
            request.blocks += blocks
            self.free_blocks -= blocks
            self._evict_unheld(self.unheld_cached_blocks - self.free_blocks)

    def _unheld_hit_blocks(self, request: SimRequest, shared_blocks: int) -> int:
        prefix = self.shared_prefixes.get(request.group)
        return prefix.unheld_among_first(shared_blocks) if prefix is not None else 0

    def _hold_shared(self, request: SimRequest, shared_blocks: int) -> None:
        """The request maps the first `shared_blocks` cached blocks of its group's prefix into its table."""
        if shared_blocks == 0:
            return
        prefix = self.shared_prefixes[request.group]
        unheld = prefix.unheld_among_first(shared_blocks)
        for position in range(shared_blocks):
            prefix.holders[position] += 1
        self.free_blocks -= unheld
        self.unheld_cached_blocks -= unheld
        request.blocks += shared_blocks
        request.shared_blocks = shared_blocks

    def _cache_shared_prefix(self, request: SimRequest, tokens: int) -> None:
        """The request's full blocks of its shared prefix, up to `tokens`, become the cached copies.

        vLLM caches full blocks when it schedules them, before they are computed
        (kv_cache_manager.py:606-616 allocate_slots -> cache_blocks), so a request admitted later in the
        same step already hits them. Only a request holding every cached block so far extends the cache:
        one that hit fewer (admitted while the first was still prefilling) keeps its own copies of the
        rest, held by it alone, as vLLM's duplicate blocks are.
        """
        if not (request.shared_prefix_tokens and self.spec.enable_prefix_caching):
            return
        prefix = self.shared_prefixes.setdefault(request.group, _SharedPrefix())
        full_blocks = min(self.shareable_blocks(request), tokens // self.spec.block_size_tokens)
        while request.shared_blocks == len(prefix.holders) < full_blocks:
            prefix.holders.append(1)  # its own block, now findable by hash: no new memory
            request.shared_blocks += 1

    def _evict_unheld(self, blocks: int) -> None:
        """Evict `blocks` unheld shared-prefix blocks, each prefix's tail first.

        vLLM frees a request's blocks tail first and appends cached ones to the end of the free queue
        (single_type_kv_cache_manager.py:588-589, block_pool.py:774-818), so they are reused after
        blocks that were never cached. Simplification: the simulator does not track other requests'
        freed full blocks as cached, so a shared prefix nobody holds is evicted only when no other free
        block is left (vLLM's queue would evict whatever was freed least recently).
        """
        for prefix in self.shared_prefixes.values():
            while blocks > 0 and prefix.holders and prefix.holders[-1] == 0:
                prefix.holders.pop()
                self.unheld_cached_blocks -= 1
                blocks -= 1

    def _free(self, request: SimRequest) -> None:
        """Give back the request's blocks: its own to the pool; shared ones lose a holder, and those
        left with none become free but stay cached (block_pool.py:774-818)."""
        released = 0
        if request.shared_blocks:
            prefix = self.shared_prefixes[request.group]
            for position in range(request.shared_blocks):
                prefix.holders[position] -= 1
                released += prefix.holders[position] == 0
        self.unheld_cached_blocks += released
        self.free_blocks += request.blocks - request.shared_blocks + released
        request.blocks = request.shared_blocks = 0

    def _preempt(self, request: SimRequest) -> None:
        self._free(request)
        request.computed_tokens = 0  # recomputed from scratch (prompt + tokens generated so far)
        request.preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(request)

    def _release_leavers(self) -> None:
        if not self.leaving:
            return
        leaving_now = [r for r in self.leaving
                       if r.leave_at_seconds is not None and r.leave_at_seconds <= self.now_seconds]
        for request in leaving_now:
            if not request.finished:
                # A session ending while it generates stops; one that never got a token cannot have
                # stopped (a stop is a sampled token): its client went away, an abort.
                self.finish(request, "stop" if request.first_token_seconds is not None else "abort")
                self.update_gauges()
        self.leaving = [r for r in self.leaving if not r.finished]

    # --- completing a step ---------------------------------------------------------------

    def commit(self) -> None:
        """Finish the planned step: advance this engine's clock to its end and record what it did."""
        planned = self.planned
        assert planned is not None
        self.planned = None
        self.now_seconds = now = planned.end_seconds
        step_seconds = planned.end_seconds - planned.start_seconds
        counters = self.counters
        for queried, hit in planned.prefix_lookups:  # SchedulerStats.prefix_cache_stats of this step
            counters.prefix_queries += queried
            counters.prefix_hits += hit
        tally = _StepTally()
        for request, new_tokens in planned.scheduled:
            if not request.finished:
                self._advance(request, new_tokens, now, step_seconds, tally)
        if tally.itl_same_step:
            # One observation per request per decode step, each equal to the step's duration.
            counters.histograms["itl"].observe(step_seconds, tally.itl_same_step)
        iteration_tokens = tally.reported_prompt_tokens + tally.sampled_tokens
        counters.histograms["iteration_tokens"].observe(iteration_tokens)
        if self.spec.enable_mfu_metrics:  # PerfStats of the step, one GPU (vllm/v1/core/sched/scheduler.py:2052)
            counters.estimated_flops += planned.cost.flops
            counters.estimated_read_bytes += planned.cost.weight_read_bytes + planned.cost.kv_read_bytes
            counters.estimated_write_bytes += planned.cost.kv_write_bytes
        self.step_count += 1
        self.update_gauges()
        if self.steps is not None:
            self.steps.append(StepRecord(
                planned.start_seconds, now, step_seconds, tally.decode_tokens, tally.prefill_tokens,
                len(self.running), len(self.waiting), self.used_blocks * self.spec.block_size_tokens,
                self.used_blocks, planned.cost.memory_seconds, planned.cost.compute_seconds, self.index,
                tally.sampled_tokens, tally.reported_prompt_tokens, iteration_tokens,
                planned.read_blocks * self.spec.block_size_tokens))

    def _advance(self, request: SimRequest, new_tokens: int, now: float, step_seconds: float,
                 tally: _StepTally) -> None:
        sampled = 1
        if self._decoding(request):
            tally.decode_tokens += 1
            drafts = new_tokens - 1
            if drafts > 0:
                # vLLM keeps the accepted drafts and rolls the rejected ones back (scheduler.py l. 2116-2128);
                # the counters count them before the output is cut at max_tokens (stop checks come after).
                accepted = self._accepted(drafts)
                self._count_draft(drafts, accepted)
                sampled += accepted
            new_tokens = sampled
        else:
            tally.prefill_tokens += new_tokens
        request.computed_tokens += new_tokens
        if request.computed_tokens < request.known_tokens:
            return  # a chunk that does not finish the prompt emits no output
        # All known tokens are computed: the step samples the next one (and the accepted drafts).
        sampled = min(sampled, request.max_tokens - request.output_tokens)
        request.output_tokens += sampled
        tally.sampled_tokens += sampled
        self.counters.generation_tokens += sampled
        if request.first_token_seconds is None:
            request.first_token_seconds = now
            self.counters.histograms["ttft"].observe(now - request.arrival_seconds)
            tally.reported_prompt_tokens += self._report_prefill(request)
        elif request.last_token_seconds is not None and now - request.last_token_seconds == step_seconds:
            tally.itl_same_step += 1  # the common case: batched into one observation
        else:
            self.counters.histograms["itl"].observe(
                now - request.last_token_seconds if request.last_token_seconds else step_seconds)
        request.last_token_seconds = now
        if request.on_token is not None:
            request.on_token(request)
        if request.output_tokens >= request.max_tokens:
            self.finish(request, request.finish_reason_at_max)

    def _count_draft(self, drafts: int, accepted: int) -> None:
        """SpecDecodingStats.observe_draft (vllm/v1/spec_decode/metrics.py l. 41-49)."""
        counters = self.counters
        counters.spec_drafts += 1
        counters.spec_draft_tokens += drafts
        counters.spec_accepted_tokens += accepted
        for position in range(accepted):
            counters.spec_accepted_per_pos[position] += 1

    def _report_prefill(self, request: SimRequest) -> int:
        """The PrefillStats the first output carries: the whole prompt, split into computed and
        cached tokens. Returns the prompt tokens iteration_tokens_total counts for it."""
        cached = request.reported_cached_tokens = request.prefix_hit_tokens
        computed = request.prompt_tokens - cached
        counters = self.counters
        counters.prompt_tokens += request.prompt_tokens
        counters.prompt_tokens_by_source["local_compute"] += computed
        counters.prompt_tokens_by_source["local_cache_hit"] += cached
        counters.prompt_tokens_cached += cached
        return computed if self.count_computed_prompt else request.prompt_tokens

    def finish(self, request: SimRequest, reason: str) -> None:
        """End a request. `abort` is the client going away (the simulator's only abort): vLLM's front
        end then drops the request's state (vllm/v1/engine/output_processor.py:552-614) and records no
        finished-request stats, which come only from engine outputs carrying a finish reason (l. 712-715,
        816-826): no request_success, no per-request histograms. Its prompt and generated tokens stay
        counted in prompt_tokens_total and generation_tokens_total, as on a real server."""
        request.finish_reason = reason
        request.finished_seconds = self.now_seconds
        self._free(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if reason != "abort":
            counters = self.counters
            counters.request_success[reason] = counters.request_success.get(reason, 0.0) + 1
            self._observe_finished(request)
        if request.on_finish is not None:
            request.on_finish(request)

    def _observe_finished(self, request: SimRequest) -> None:
        """The per-request histograms of a finished request (vllm/v1/metrics/loggers.py:1278-1330).

        Every request observed here got its first token, so its whole prompt is already in
        prompt_tokens_total: prompt + generation totals less these two histograms' sums is the
        context of the requests past their prefill and not finished (aborted ones stay in it)."""
        histograms = self.counters.histograms
        histograms["e2e"].observe(self.now_seconds - request.arrival_seconds)
        histograms["request_prompt_tokens"].observe(request.prompt_tokens)
        histograms["request_generation_tokens"].observe(request.output_tokens)
        histograms["request_preemptions"].observe(request.preemptions)
        histograms["prefill_kv_computed"].observe(request.prompt_tokens - request.reported_cached_tokens)
        # n = 1 (no parallel sampling): the most generated of its samples is its own output
        # (vllm/v1/engine/parallel_sampling.py:151).
        histograms["max_num_generation"].observe(request.output_tokens)
        histograms["params_n"].observe(1)
        histograms["params_max_tokens"].observe(request.max_tokens)
        scheduled = request.first_scheduled_seconds
        first, last = request.first_token_seconds, request.last_token_seconds
        if scheduled is None:
            return  # never left the queue: no phase to time
        # The phases (vllm/v1/metrics/stats.py:593-605); preemptions stay inside the phase they hit.
        histograms["queue_time"].observe(scheduled - request.arrival_seconds)
        if first is None or last is None:
            return
        histograms["prefill_time"].observe(first - scheduled)
        histograms["decode_time"].observe(last - first)
        histograms["inference_time"].observe(last - scheduled)
        # The mean gap after the first token, 0 for a single token (stats.py:608).
        tokens_after_first = request.output_tokens - 1
        histograms["request_tpot"].observe((last - first) / tokens_after_first if tokens_after_first > 0 else 0.0)

    def update_gauges(self) -> None:
        counters = self.counters
        counters.running = float(len(self.running))
        counters.waiting = float(len(self.waiting))
        # vLLM's block-pool usage, the null block left out: 1 - free / (num_gpu_blocks - 1)
        # (vllm/v1/core/block_pool.py:885 get_usage; 0 for a pool of the null block alone).
        counters.kv_usage_ratio = 1.0 - self.free_blocks / self.usable_blocks if self.usable_blocks else 0.0


class Simulator:
    """The server: its engines (data-parallel ranks), the workload's arrivals and the vLLM page,
    in simulated time."""

    def __init__(self, spec: ServerSpec | None = None, scenario: Scenario | None = None, *,
                 record_steps: bool = False, created_unix_seconds: float | None = None) -> None:
        spec = spec or ServerSpec()
        self.spec = spec = scenario.settings.applied_to(spec) if scenario is not None else spec
        self._validate_spec(spec)
        self.gpu = get_gpu(spec.gpu)
        self.architecture = get_model_preset(spec.model)
        kv_element_bytes = _KV_DTYPE_BYTES.get(spec.kv_cache_dtype.lower())
        if kv_element_bytes is None:
            raise InputError(f"--kv-cache-dtype: unknown {spec.kv_cache_dtype!r}; known: {', '.join(_KV_DTYPE_BYTES)}")
        self.model_bytes: ModelBytes = model_bytes(self.architecture, spec.weight_bytes_per_param, kv_element_bytes)
        self.num_gpu_blocks = num_gpu_blocks(self.gpu.memory_bytes, spec.gpu_memory_utilization,
                                             self.model_bytes.weight_bytes, spec.activation_reserve_bytes,
                                             spec.block_size_tokens, self.model_bytes.kv_bytes_per_token)
        self.capacity_tokens = self.num_gpu_blocks * spec.block_size_tokens  # per engine
        if spec.max_model_len > self.capacity_tokens:
            raise InputError(
                f"--max-model-len {spec.max_model_len} is more than the KV cache holds ({self.capacity_tokens} tokens "
                f"on {spec.gpu} for {spec.model}); lower --max-model-len (vLLM refuses to start the same way)")
        self._rng = random.Random(spec.seed)
        self.page = VllmPage(spec.vllm_version, spec.model_name, spec.max_model_len,
                             created_unix_seconds=created_unix_seconds,
                             num_speculative_tokens=spec.num_speculative_tokens)
        self.engines = [self._make_engine(index, record_steps) for index in range(spec.data_parallel_size)]
        self.scenario = scenario
        self.now_seconds = 0.0
        self._arrivals: list[tuple[float, int, Callable[[], None]]] = []
        self._arrival_order = itertools.count()
        self._ids = itertools.count()
        self._session_engines: dict[tuple[str, int], Engine] = {}
        if scenario is not None:
            for group in scenario.groups:
                self._plan_group(group)

    # --- setup ---------------------------------------------------------------------------

    @staticmethod
    def _validate_spec(spec: ServerSpec) -> None:
        if not 0 < spec.gpu_memory_utilization <= 1:
            raise InputError(f"--gpu-memory-utilization must be in (0, 1], got {spec.gpu_memory_utilization!r}")
        for name in ("block_size_tokens", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
                     "data_parallel_size"):
            if getattr(spec, name) < 1:
                raise InputError(f"{name} must be at least 1, got {getattr(spec, name)!r}")
        if spec.num_speculative_tokens < 0 or not 1.0 <= spec.spec_acceptance_length <= spec.num_speculative_tokens + 1:
            raise InputError(f"speculative decoding: the acceptance length must be in [1, num_speculative_tokens + 1], "
                             f"got {spec.spec_acceptance_length!r} with {spec.num_speculative_tokens!r} draft tokens")

    def _make_engine(self, index: int, record_steps: bool) -> Engine:
        spec = self.spec
        physics = StepPhysics(spec.truth, self.gpu, self.model_bytes, spec.block_size_tokens,
                              spec.weight_bytes_per_param, random.Random(spec.seed + 1 + 1_000_003 * index))
        counters = self.page.add_engine(str(int(spec.engine_index) + index), self._cache_config())
        return Engine(index, spec, self.num_gpu_blocks, physics, counters,
                      count_computed_prompt=self.page.layout.iteration_counts_computed_prompt,
                      record_steps=record_steps)

    def _cache_config(self) -> dict[str, str]:
        """One engine's CacheConfig as vLLM's front end logs it (CacheConfig.metrics_info() stringifies
        every field): `num_gpu_blocks` summed over the data-parallel engines, `kv_cache_size_tokens`
        per engine (vllm/v1/engine/core_client.py)."""
        spec = self.spec
        return {
            "block_size": str(spec.block_size_tokens),
            "effective_attention_block_size": str(spec.block_size_tokens),  # set by a running engine (real page)
            "gpu_memory_utilization": str(spec.gpu_memory_utilization),
            "cache_dtype": spec.kv_cache_dtype,
            "enable_prefix_caching": str(spec.enable_prefix_caching),
            "num_gpu_blocks": str(self.num_gpu_blocks * spec.data_parallel_size),
            "kv_cache_size_tokens": str(self.capacity_tokens),
            "kv_cache_max_concurrency": str(self.capacity_tokens / spec.max_model_len),
            "sliding_window": str(self.architecture.sliding_window),
        }

    def _plan_group(self, group: Group) -> None:
        if isinstance(group, ClosedLoopGroup):
            for user in range(group.users):
                self._schedule_arrival(group.first_arrival_seconds(user, self._rng),
                                       functools.partial(self._closed_loop_request, group, user))
        elif isinstance(group, PoissonGroup):
            self._schedule_arrival(group.start_seconds + self._rng.expovariate(group.rate_per_second),
                                   functools.partial(self._poisson_request, group))
        else:
            for _ in range(group.count):
                self._schedule_arrival(group.at_seconds, functools.partial(self._add_scenario_request, group, None))

    def _schedule_arrival(self, at_seconds: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._arrivals, (at_seconds, next(self._arrival_order), action))

    def _closed_loop_request(self, group: ClosedLoopGroup, user: int) -> None:
        if group.stop_seconds is not None and self.now_seconds >= group.stop_seconds:
            return
        self._add_scenario_request(group, user)

    def _poisson_request(self, group: PoissonGroup) -> None:
        if group.stop_seconds is not None and self.now_seconds >= group.stop_seconds:
            return
        self._add_scenario_request(group, None)
        self._schedule_arrival(self.now_seconds + self._rng.expovariate(group.rate_per_second),
                               lambda: self._poisson_request(group))

    def _think_then_ask_again(self, group: ClosedLoopGroup, user: int, finished: SimRequest) -> None:
        """A closed-loop user's answer is done: the next request after the group's think time.

        An `on_finish` callback: `finish` calls it at the finishing time, so `now_seconds` is `finished`'s end.
        """
        self._schedule_arrival(self.now_seconds + group.think_seconds,
                               functools.partial(self._closed_loop_request, group, user))

    def _add_scenario_request(self, group: Group, user: int | None) -> None:
        # A group's prompts are its shared prefix (if any) followed by each request's own tokens.
        prompt, output = self.spec.fit_context(group.shared_prefix_tokens + group.prompt_tokens.draw(self._rng),
                                               group.output_tokens.draw(self._rng))
        on_finish = None
        if isinstance(group, ClosedLoopGroup) and user is not None:
            on_finish = functools.partial(self._think_then_ask_again, group, user)
        leave_at = group.leave_at_seconds if isinstance(group, ScriptedGroup) else None
        self.submit(prompt, output, group=group.name, user=user, leave_at_seconds=leave_at,
                    finish_reason_at_max="stop", on_finish=on_finish,
                    cached_prefix_tokens=round(prompt * group.cached_ratio),
                    shared_prefix_tokens=min(group.shared_prefix_tokens, prompt))

    # --- the public API ------------------------------------------------------------------

    def submit(self, prompt_tokens: int, max_tokens: int, *, arrival_seconds: float | None = None,
               group: str = "http", user: int | None = None, leave_at_seconds: float | None = None,
               finish_reason_at_max: str = "length", on_token: Callable[[SimRequest], None] | None = None,
               on_finish: Callable[[SimRequest], None] | None = None, cached_prefix_tokens: int = 0,
               shared_prefix_tokens: int = 0) -> SimRequest:
        """Add a request to an engine's waiting queue (it joins that engine's batch at its next step).

        `cached_prefix_tokens`: how much of the prompt is already in the prefix cache (a re-sent
        conversation); the hit is found in whole blocks at admission. `shared_prefix_tokens`: how much
        of the prompt is the prefix every request of its `group` begins with (a system prompt); it is
        cached once a request of the group schedules it, and its blocks are then held once."""
        if prompt_tokens < 1 or max_tokens < 1:
            raise InputError(f"prompt tokens and max_tokens must be at least 1, got {prompt_tokens} and {max_tokens}")
        if prompt_tokens + max_tokens > self.spec.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.spec.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion).")
        if not 0 <= cached_prefix_tokens <= prompt_tokens:
            raise InputError(f"cached prefix must be 0 to {prompt_tokens} tokens, got {cached_prefix_tokens}")
        if not 0 <= shared_prefix_tokens <= prompt_tokens:
            raise InputError(f"shared prefix must be 0 to {prompt_tokens} tokens, got {shared_prefix_tokens}")
        request = SimRequest(f"cmpl-{next(self._ids)}", prompt_tokens, max_tokens,
                             max(self.now_seconds, arrival_seconds or 0.0), group=group, user=user,
                             leave_at_seconds=leave_at_seconds, finish_reason_at_max=finish_reason_at_max,
                             on_token=on_token, on_finish=on_finish, cached_prefix_tokens=cached_prefix_tokens,
                             shared_prefix_tokens=shared_prefix_tokens)
        self._engine_for(request).enqueue(request)
        return request

    def abort(self, request: SimRequest) -> None:
        """The client went away: free the request at once (counted as `abort`)."""
        if not request.finished:
            self.engines[request.engine].abort(request)

    def next_event_seconds(self) -> float | None:
        """Simulated time of the next thing that will happen (a step ending or an arrival)."""
        earliest = self._earliest_step()
        if earliest is not None:
            return earliest[0]
        return self._arrivals[0][0] if self._arrivals else None

    def run_until(self, t_seconds: float) -> None:
        """Advance simulated time to `t_seconds`, running every step that ends by then. Arrivals
        are handed to the engines at step boundaries (of any engine), or at once when all are idle."""
        while True:
            self._admit_arrivals()
            earliest = self._earliest_step()
            if earliest is None:
                next_arrival = self._arrivals[0][0] if self._arrivals else None
                if next_arrival is None or next_arrival > t_seconds:
                    self.now_seconds = max(self.now_seconds, t_seconds)
                    return
                self.now_seconds = max(self.now_seconds, next_arrival)
                continue
            end_seconds, engine = earliest
            if end_seconds > t_seconds:
                return
            self.now_seconds = end_seconds  # callbacks of the step (tokens, finishes) see its end
            engine.commit()

    def run_one_step(self) -> bool:
        """Run until the next step (of any engine) ends and stop right after it commits, before the
        engine plans its next one: the engine's state is then the state its page shows (vLLM makes its
        scheduler stats at the end of update_from_output, vllm/v1/core/sched/scheduler.py:2409). Other
        engines keep any step they have planned. False when nothing is left to run."""
        while True:
            self._admit_arrivals()
            earliest = self._earliest_step()
            if earliest is not None:
                break
            if not self._arrivals:
                return False
            self.now_seconds = max(self.now_seconds, self._arrivals[0][0])
        self.now_seconds, engine = earliest
        engine.commit()
        return True

    def render_metrics(self) -> bytes:
        return self.page.render()

    @property
    def engine(self) -> Engine:
        """The only engine (for a server without data parallelism)."""
        if len(self.engines) != 1:
            raise InputError(f"this server runs {len(self.engines)} data-parallel engines: pick one of .engines")
        return self.engines[0]

    @property
    def counters(self) -> EngineCounters:
        return self.engine.counters

    @property
    def steps(self) -> list[StepRecord] | None:
        return self.engine.steps

    @property
    def step_count(self) -> int:
        return self.engine.step_count

    @property
    def used_blocks(self) -> int:
        return self.engine.used_blocks

    @property
    def free_blocks(self) -> int:
        return self.engine.free_blocks

    @property
    def running(self) -> list[SimRequest]:
        """Running requests of every engine."""
        return [request for engine in self.engines for request in engine.running]

    @property
    def waiting(self) -> list[SimRequest]:
        """Waiting requests of every engine."""
        return [request for engine in self.engines for request in engine.waiting]

    # --- scheduling across engines -------------------------------------------------------

    def _engine_for(self, request: SimRequest) -> Engine:
        session = (request.group, request.user) if request.user is not None and request.cached_prefix_tokens else None
        if session is not None and session in self._session_engines:
            return self._session_engines[session]  # its cached prefix lives there
        engine = min(self.engines, key=lambda e: (e.load, e.index))
        if session is not None:
            self._session_engines[session] = engine
        return engine

    def _admit_arrivals(self) -> None:
        while self._arrivals and self._arrivals[0][0] <= self.now_seconds:
            _, _, action = heapq.heappop(self._arrivals)
            action()

    def _earliest_step(self) -> tuple[float, Engine] | None:
        """(end, engine) of the planned step that ends first (idle engines' clocks catch up to now first)."""
        earliest: tuple[float, Engine] | None = None
        for engine in self.engines:
            if engine.planned is None:
                engine.now_seconds = max(engine.now_seconds, self.now_seconds)
            planned = engine.plan_step()
            if planned is not None and (earliest is None or planned.end_seconds < earliest[0]):
                earliest = (planned.end_seconds, engine)
        return earliest


def single_stream_token_seconds(spec: ServerSpec, context_tokens: int, output_tokens: int) -> list[float]:
    """Simulated arrival times of each token of one request alone on a fresh idle server.

    What `calibrate --url` measures over HTTP at speed 1, without the wall clock: the gaps between
    these times are the lone stream's step times.
    """
    simulator = Simulator(spec)
    times: list[float] = []
    simulator.submit(context_tokens, output_tokens, on_token=lambda request: times.append(simulator.now_seconds))
    while len(times) < output_tokens:
        next_event = simulator.next_event_seconds()
        if next_event is None:
            break
        simulator.run_until(next_event)
    return times
