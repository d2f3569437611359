"""The simulated server in simulated time: its engines (data-parallel ranks), the workload's arrivals, its clock.

Data parallelism: a Simulator runs `data_parallel_size` engines, each with its own batch, KV
cache, clock and counters; requests go to the least loaded (4 x waiting + running, as vLLM's
front end balances), except that a session with a cached prefix stays on the engine holding it.

The step's duration comes from `hardware.StepPhysics`; simulated time advances by it. Nothing
here reads a wall clock: `run_until(t)` is deterministic for a seed, and the HTTP wrapper
(server.py) paces it against the wall clock.

One job: the server around the engines (engine.py), which are handed requests and stepped here.
Why apart: routing, arrivals and the shared clock span every rank, while an engine knows only its own.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import random
from collections.abc import Callable

from exporter.capacity.presets import get_gpu, get_model_preset
from exporter.errors import InputError
from exporter.simulator.engine import Engine
from exporter.simulator.hardware import ModelBytes, StepPhysics, model_bytes, num_gpu_blocks
from exporter.simulator.scenarios import ClosedLoopGroup, Group, PoissonGroup, Scenario, ScriptedGroup
from exporter.simulator.spec import ServerSpec, SimRequest, StepRecord
from exporter.simulator.vllm_metrics import EngineCounters, VllmPage

_KV_DTYPE_BYTES = {"auto": 2.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0}


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
