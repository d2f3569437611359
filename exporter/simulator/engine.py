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

The step's duration comes from `hardware.StepPhysics`; simulated time advances by it. Nothing
here reads a wall clock: `run_until(t)` is deterministic for a seed, and the HTTP wrapper
(server.py) paces it against the wall clock.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from exporter.errors import InputError
from exporter.presets import get_gpu, get_model_preset
from exporter.simulator.hardware import HardwareTruth, ModelBytes, ScheduledSequence, StepPhysics, model_bytes, num_gpu_blocks
from exporter.simulator.scenarios import ClosedLoopGroup, PoissonGroup, Scenario, ScriptedGroup
from exporter.simulator.vllm_metrics import VllmPage

_KV_DTYPE_BYTES = {"auto": 2.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0}


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
    vllm_version: str = "latest"
    engine_index: str = "0"
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
    on_token: Callable[["SimRequest"], None] | None = None
    on_finish: Callable[["SimRequest"], None] | None = None
    output_tokens: int = 0
    computed_tokens: int = 0
    blocks: int = 0
    preemptions: int = 0
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
    prefill_tokens: int
    running: int
    waiting: int
    held_tokens: int  # block-rounded tokens held by all running requests
    used_blocks: int
    memory_seconds: float
    compute_seconds: float


@dataclass
class _PlannedStep:
    start_seconds: float
    end_seconds: float
    scheduled: list[tuple[SimRequest, int]]
    cost_memory_seconds: float
    cost_compute_seconds: float


class Simulator:
    """The engine: scheduler + KV block pool + step physics + the vLLM page, in simulated time."""

    def __init__(self, spec: ServerSpec | None = None, scenario: Scenario | None = None, *,
                 record_steps: bool = False, created_unix_seconds: float | None = None) -> None:
        self.spec = spec = spec or ServerSpec()
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
        self.capacity_tokens = self.num_gpu_blocks * spec.block_size_tokens
        if spec.max_model_len > self.capacity_tokens:
            raise InputError(
                f"--max-model-len {spec.max_model_len} is more than the KV cache holds ({self.capacity_tokens} tokens "
                f"on {spec.gpu} for {spec.model}); lower --max-model-len (vLLM refuses to start the same way)")
        self._rng = random.Random(spec.seed)
        self.physics = StepPhysics(spec.truth, self.gpu, self.model_bytes, spec.block_size_tokens,
                                   spec.weight_bytes_per_param, random.Random(spec.seed + 1))
        self.page = VllmPage(spec.vllm_version, spec.model_name, spec.max_model_len, self._cache_config(kv_element_bytes),
                             engine_index=spec.engine_index, created_unix_seconds=created_unix_seconds)
        self.counters = self.page.counters
        self.scenario = scenario
        self.now_seconds = 0.0
        self.free_blocks = self.num_gpu_blocks
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.steps: list[StepRecord] | None = [] if record_steps else None
        self.step_count = 0
        self._leaving: list[SimRequest] = []
        self._arrivals: list[tuple[float, int, Callable[[], None]]] = []
        self._arrival_order = itertools.count()
        self._ids = itertools.count()
        self._planned: _PlannedStep | None = None
        if scenario is not None:
            for group in scenario.groups:
                self._plan_group(group)

    # --- setup ---------------------------------------------------------------------------

    @staticmethod
    def _validate_spec(spec: ServerSpec) -> None:
        if not 0 < spec.gpu_memory_utilization <= 1:
            raise InputError(f"--gpu-memory-utilization must be in (0, 1], got {spec.gpu_memory_utilization!r}")
        for name in ("block_size_tokens", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(spec, name) < 1:
                raise InputError(f"{name} must be at least 1, got {getattr(spec, name)!r}")

    def _cache_config(self, kv_element_bytes: float) -> dict[str, str]:
        spec = self.spec
        # CacheConfig.metrics_info() stringifies every field (REPORT.md §a.4). No prefix caching is
        # simulated, so the page says so.
        return {
            "block_size": str(spec.block_size_tokens),
            "gpu_memory_utilization": str(spec.gpu_memory_utilization),
            "cache_dtype": spec.kv_cache_dtype,
            "enable_prefix_caching": "False",
            "prefix_caching_hash_algo": "sha256",
            "num_gpu_blocks": str(self.num_gpu_blocks),
            "num_cpu_blocks": "None",
            "kv_cache_size_tokens": str(self.capacity_tokens),
            "kv_cache_max_concurrency": f"{self.capacity_tokens / spec.max_model_len:.2f}",
            "kv_cache_memory_bytes": "None",
            "sliding_window": str(self.architecture.sliding_window),
            "is_attention_free": "False",
        }

    def _plan_group(self, group: ClosedLoopGroup | PoissonGroup | ScriptedGroup) -> None:
        if isinstance(group, ClosedLoopGroup):
            for user in range(group.users):
                self._schedule_arrival(group.first_arrival_seconds(user, self._rng),
                                       lambda g=group, u=user: self._closed_loop_request(g, u))
        elif isinstance(group, PoissonGroup):
            self._schedule_arrival(group.start_seconds + self._rng.expovariate(group.rate_per_second),
                                   lambda g=group: self._poisson_request(g))
        else:
            for _ in range(group.count):
                self._schedule_arrival(group.at_seconds, lambda g=group: self._add_scenario_request(
                    g.name, g.prompt_tokens.draw(self._rng), g.output_tokens.draw(self._rng), None,
                    g.leave_at_seconds))

    def _schedule_arrival(self, at_seconds: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._arrivals, (at_seconds, next(self._arrival_order), action))

    def _closed_loop_request(self, group: ClosedLoopGroup, user: int) -> None:
        if group.stop_seconds is not None and self.now_seconds >= group.stop_seconds:
            return
        self._add_scenario_request(group.name, group.prompt_tokens.draw(self._rng),
                                   group.output_tokens.draw(self._rng), (group, user), None)

    def _poisson_request(self, group: PoissonGroup) -> None:
        if group.stop_seconds is not None and self.now_seconds >= group.stop_seconds:
            return
        self._add_scenario_request(group.name, group.prompt_tokens.draw(self._rng),
                                   group.output_tokens.draw(self._rng), None, None)
        self._schedule_arrival(self.now_seconds + self._rng.expovariate(group.rate_per_second),
                               lambda: self._poisson_request(group))

    def _add_scenario_request(self, group_name: str, prompt: int, output: int,
                              closed_loop: tuple[ClosedLoopGroup, int] | None, leave_at: float | None) -> None:
        prompt, output = self.spec.fit_context(prompt, output)
        on_finish = None
        if closed_loop is not None:
            group, user = closed_loop
            on_finish = lambda req, g=group, u=user: self._schedule_arrival(  # noqa: E731
                req.finished_seconds + g.think_seconds, lambda: self._closed_loop_request(g, u))
        self.submit(prompt, output, group=group_name, user=None if closed_loop is None else closed_loop[1],
                    leave_at_seconds=leave_at, finish_reason_at_max="stop", on_finish=on_finish)

    # --- the public API ------------------------------------------------------------------

    def submit(self, prompt_tokens: int, max_tokens: int, *, arrival_seconds: float | None = None,
               group: str = "http", user: int | None = None, leave_at_seconds: float | None = None,
               finish_reason_at_max: str = "length", on_token: Callable[[SimRequest], None] | None = None,
               on_finish: Callable[[SimRequest], None] | None = None) -> SimRequest:
        """Add a request to the waiting queue (it joins the batch at the next step)."""
        if prompt_tokens < 1 or max_tokens < 1:
            raise InputError(f"prompt tokens and max_tokens must be at least 1, got {prompt_tokens} and {max_tokens}")
        if prompt_tokens + max_tokens > self.spec.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.spec.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion).")
        request = SimRequest(f"cmpl-{next(self._ids)}", prompt_tokens, max_tokens,
                             max(self.now_seconds, arrival_seconds or 0.0), group=group, user=user,
                             leave_at_seconds=leave_at_seconds, finish_reason_at_max=finish_reason_at_max,
                             on_token=on_token, on_finish=on_finish)
        self.waiting.append(request)
        if leave_at_seconds is not None:
            self._leaving.append(request)
        self._update_gauges()
        return request

    def abort(self, request: SimRequest) -> None:
        """The client went away: free the request at once (counted as `abort`)."""
        if not request.finished:
            self._finish(request, "abort")
            self._planned_drop(request)
            self._update_gauges()

    def next_event_seconds(self) -> float | None:
        """Simulated time of the next thing that will happen (a step ending or an arrival)."""
        planned = self._plan_step()
        if planned is not None:
            return planned.end_seconds
        return self._arrivals[0][0] if self._arrivals else None

    def run_until(self, t_seconds: float) -> None:
        """Advance simulated time to `t_seconds`, running every step that ends by then."""
        while True:
            self._admit_arrivals()
            planned = self._plan_step()
            if planned is None:
                next_arrival = self._arrivals[0][0] if self._arrivals else None
                if next_arrival is None or next_arrival > t_seconds:
                    self.now_seconds = max(self.now_seconds, t_seconds)
                    return
                self.now_seconds = max(self.now_seconds, next_arrival)
                continue
            if planned.end_seconds > t_seconds:
                return
            self._commit(planned)

    def render_metrics(self) -> bytes:
        return self.page.render()

    @property
    def used_blocks(self) -> int:
        return self.num_gpu_blocks - self.free_blocks

    # --- scheduling ----------------------------------------------------------------------

    def _admit_arrivals(self) -> None:
        while self._arrivals and self._arrivals[0][0] <= self.now_seconds:
            _, _, action = heapq.heappop(self._arrivals)
            action()

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.spec.block_size_tokens)

    def _plan_step(self) -> _PlannedStep | None:
        """Schedule the next step at the current time (once; cached until committed)."""
        if self._planned is not None:
            return self._planned
        self._release_leavers()
        if not self.running and not self.waiting:
            return None
        budget = self.spec.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            new_tokens = min(request.known_tokens - request.computed_tokens, budget)
            needed = self._blocks_for(request.computed_tokens + new_tokens) - request.blocks
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
            scheduled.append((request, new_tokens))
            budget -= new_tokens
            index += 1
        if not preempted:  # vLLM admits no new request in a step that had to preempt
            while self.waiting and budget > 0 and len(self.running) < self.spec.max_num_seqs:
                request = self.waiting[0]
                new_tokens = min(request.known_tokens - request.computed_tokens, budget)
                needed = self._blocks_for(request.computed_tokens + new_tokens) - request.blocks
                if needed > self.free_blocks:
                    break
                self.waiting.popleft()
                self.running.append(request)
                self._allocate(request, needed)
                if request.first_scheduled_seconds is None:
                    request.first_scheduled_seconds = self.now_seconds
                scheduled.append((request, new_tokens))
                budget -= new_tokens
        if not scheduled:
            return None
        cost = self.physics.step_cost([
            ScheduledSequence(new, req.computed_tokens, req.blocks) for req, new in scheduled])
        self._planned = _PlannedStep(self.now_seconds, self.now_seconds + cost.seconds, scheduled,
                                     cost.memory_seconds, cost.compute_seconds)
        return self._planned

    def _allocate(self, request: SimRequest, blocks: int) -> None:
        if blocks > 0:
            request.blocks += blocks
            self.free_blocks -= blocks

    def _free(self, request: SimRequest) -> None:
        self.free_blocks += request.blocks
        request.blocks = 0

    def _preempt(self, request: SimRequest) -> None:
        self._free(request)
        request.computed_tokens = 0  # recomputed from scratch (prompt + tokens generated so far)
        request.preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(request)

    def _release_leavers(self) -> None:
        if not self._leaving:
            return
        for request in [r for r in self._leaving if r.leave_at_seconds is not None and r.leave_at_seconds <= self.now_seconds]:
            if not request.finished:
                self._finish(request, "stop")
                self._update_gauges()
        self._leaving = [r for r in self._leaving if not r.finished]

    def _planned_drop(self, request: SimRequest) -> None:
        if self._planned is not None:
            self._planned.scheduled = [(r, n) for r, n in self._planned.scheduled if r is not request]

    # --- completing a step ---------------------------------------------------------------

    def _commit(self, planned: _PlannedStep) -> None:
        self._planned = None
        self.now_seconds = now = planned.end_seconds
        step_seconds = planned.end_seconds - planned.start_seconds
        histograms = self.counters.histograms
        decode_tokens = prefill_tokens = 0
        itl_same_step = 0
        for request, new_tokens in planned.scheduled:
            if request.finished:
                continue
            if new_tokens == 1 and request.computed_tokens == request.known_tokens - 1 and request.output_tokens:
                decode_tokens += 1
            else:
                prefill_tokens += new_tokens
            request.computed_tokens += new_tokens
            if request.computed_tokens < request.known_tokens:
                continue
            # All known tokens are computed: the step samples the next one.
            request.output_tokens += 1
            self.counters.generation_tokens += 1
            if request.first_token_seconds is None:
                request.first_token_seconds = now
                histograms["ttft"].observe(now - request.arrival_seconds)
                self.counters.prompt_tokens += request.prompt_tokens
            elif request.last_token_seconds is not None and now - request.last_token_seconds == step_seconds:
                itl_same_step += 1  # the common case: batched into one observation below
            else:
                histograms["itl"].observe(now - request.last_token_seconds if request.last_token_seconds else step_seconds)
            request.last_token_seconds = now
            if request.on_token is not None:
                request.on_token(request)
            if request.output_tokens >= request.max_tokens:
                self._finish(request, request.finish_reason_at_max)
        if itl_same_step:
            # One observation per request per decode step, each equal to the step's duration.
            histograms["itl"].observe(step_seconds, itl_same_step)
        histograms["iteration_tokens"].observe(decode_tokens + prefill_tokens)
        self.step_count += 1
        self._update_gauges()
        if self.steps is not None:
            self.steps.append(StepRecord(
                planned.start_seconds, now, step_seconds, decode_tokens, prefill_tokens, len(self.running),
                len(self.waiting), self.used_blocks * self.spec.block_size_tokens, self.used_blocks,
                planned.cost_memory_seconds, planned.cost_compute_seconds))

    def _finish(self, request: SimRequest, reason: str) -> None:
        request.finish_reason = reason
        request.finished_seconds = self.now_seconds
        self._free(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        counters = self.counters
        counters.request_success[reason] = counters.request_success.get(reason, 0.0) + 1
        histograms = counters.histograms
        histograms["e2e"].observe(self.now_seconds - request.arrival_seconds)
        histograms["request_prompt_tokens"].observe(request.prompt_tokens)
        histograms["request_generation_tokens"].observe(request.output_tokens)
        histograms["request_preemptions"].observe(request.preemptions)
        if request.first_scheduled_seconds is not None:
            histograms["queue_time"].observe(request.first_scheduled_seconds - request.arrival_seconds)
        if request.first_token_seconds is not None and request.output_tokens > 1:
            histograms["request_tpot"].observe(
                (self.now_seconds - request.first_token_seconds) / (request.output_tokens - 1))
        if request.on_finish is not None:
            request.on_finish(request)

    def _update_gauges(self) -> None:
        counters = self.counters
        counters.running = float(len(self.running))
        counters.waiting = float(len(self.waiting))
        # vLLM's block-pool usage: 1 - free / total (vllm/v1/core/block_pool.py get_usage).
        counters.kv_usage_ratio = 1.0 - self.free_blocks / self.num_gpu_blocks


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
