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

The step's duration comes from `hardware.StepPhysics`; simulated time advances by it.

One job: one engine core (a data-parallel rank): its scheduler, KV block pool, step and counters.
Why apart from the server around it (simulation.py: arrivals, data-parallel ranks, the clock): the
scheduler is where vLLM's behaviour is mirrored line by line, and it reads best without the rest.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from exporter.simulator.hardware import ScheduledSequence, StepCost, StepPhysics
from exporter.simulator.spec import ServerSpec, SimRequest, StepRecord
from exporter.simulator.vllm_metrics import EngineCounters

# vLLM's DP load balancing (vllm/v1/engine/core_client.py): the engine with the lowest
# 4 x waiting + running gets the next request.
_WAITING_WEIGHT = 4


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
