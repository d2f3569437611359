"""The simulator's shared-prefix physics: memory held once, context read per request.

Many requests that begin with one system prompt hold its KV blocks once (vLLM's prefix cache counts
a shared block once: `kv_cache_usage_perc`), while every decode step reads each request's whole block
table, the shared prefix included (vLLM 0.32.0 has no cascade attention). The page's counters give
the context read: prompt_tokens_total + generation_tokens_total - request_prompt_tokens_sum -
request_generation_tokens_sum is the context of the requests past their prefill and not finished.

Every expectation here is worked out by hand from the inputs (token counts, block size, the preset's
architecture and the hardware truth's efficiencies), in simulated time only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.capacity.presets import get_gpu, get_model_preset
from exporter.errors import InputError
from exporter.simulator import HardwareTruth, ServerSpec, SimRequest, Simulator, StepRecord, load_scenario
from exporter.simulator.scenarios import ClosedLoopGroup, builtin_scenarios, scenario_from_dict

BLOCK_TOKENS = 16  # ServerSpec's default block size
SYSTEM_PROMPT_TOKENS = 4000
SYSTEM_PROMPT_BLOCKS = SYSTEM_PROMPT_TOKENS // BLOCK_TOKENS  # 250 whole blocks, all shareable
USERS = 48
# No noise and no long-context slowdown, so a step's memory time is exactly its bytes over bandwidth.
EXACT_TRUTH = HardwareTruth(noise_ratio=0.0, kv_read_long_context_drop=0.0)


@dataclass(frozen=True)
class PageFigures:
    """What one engine's page says, as the daemon reads it."""

    prompt_tokens: float
    generation_tokens: float
    request_prompt_tokens_sum: float
    request_generation_tokens_sum: float
    kv_usage_ratio: float
    num_gpu_blocks: int
    prefix_queries: float
    prefix_hits: float
    prompt_cache_hit_tokens: float
    prompt_compute_tokens: float
    prompt_cached_tokens: float
    finished_requests: float

    @property
    def context_in_flight_tokens(self) -> float:
        """The daemon's tokens in flight: the context of the requests past their prefill, not finished."""
        return (self.prompt_tokens + self.generation_tokens - self.request_prompt_tokens_sum
                - self.request_generation_tokens_sum)

    @property
    def used_blocks(self) -> int:
        # vLLM's usage is used / (num_gpu_blocks - 1): the null block is never handed out.
        return round(self.kv_usage_ratio * (self.num_gpu_blocks - 1))


def _page(sim: Simulator, engine: str = "0") -> PageFigures:
    values: dict[str, float] = {}
    num_gpu_blocks = 0
    for family in text_string_to_metric_families(sim.render_metrics().decode()):
        for sample in family.samples:
            if sample.labels.get("engine") != engine:
                continue
            if sample.name == "vllm:cache_config_info":
                num_gpu_blocks = int(sample.labels["num_gpu_blocks"])
            key = sample.name + "".join(f"|{value}" for name, value in sorted(sample.labels.items())
                                        if name in ("source", "finished_reason"))
            values[key] = sample.value
    return PageFigures(
        values["vllm:prompt_tokens_total"], values["vllm:generation_tokens_total"],
        values["vllm:request_prompt_tokens_sum"], values["vllm:request_generation_tokens_sum"],
        values["vllm:kv_cache_usage_perc"], num_gpu_blocks, values["vllm:prefix_cache_queries_total"],
        values["vllm:prefix_cache_hits_total"], values["vllm:prompt_tokens_by_source_total|local_cache_hit"],
        values["vllm:prompt_tokens_by_source_total|local_compute"], values["vllm:prompt_tokens_cached_total"],
        sum(value for key, value in values.items() if key.startswith("vllm:request_success_total|")))


def _table_blocks(request: SimRequest) -> int:
    """Right after a step commits, a request's block table covers exactly the tokens it has computed."""
    return math.ceil(request.computed_tokens / BLOCK_TOKENS)


def _counted_context_tokens(sim: Simulator) -> int:
    """Context of the requests the counters have counted: past their first token and not finished.
    A preempted request waits to be recomputed but stays counted (vLLM counted its prompt already)."""
    return sum(r.known_tokens for r in (*sim.running, *sim.waiting) if r.first_token_seconds is not None)


def _run_to_step_end(sim: Simulator, t_seconds: float) -> None:
    """Stop right after the first step ending after `t_seconds` commits: the moment the page describes."""
    sim.run_until(t_seconds)
    assert sim.run_one_step()


# --- the scenario --------------------------------------------------------------------------------------

def test_shared_prefix_scenario_is_built_in() -> None:
    scenario = builtin_scenarios()["shared-prefix"]
    (group,) = scenario.groups
    assert isinstance(group, ClosedLoopGroup)
    assert (group.users, group.shared_prefix_tokens) == (USERS, SYSTEM_PROMPT_TOKENS)
    assert load_scenario("shared-prefix") == scenario


def test_scenario_files_say_the_same() -> None:
    scenario = scenario_from_dict({"name": "shared-prefix", "groups": [
        {"kind": "closed", "name": "assistant", "users": USERS, "shared_prefix_tokens": SYSTEM_PROMPT_TOKENS,
         "prompt_tokens": {"mean": 400, "spread": 0.25}, "output_tokens": {"mean": 300, "spread": 0.25}}]})
    assert scenario.groups == builtin_scenarios()["shared-prefix"].groups
    for kind, extra in (("poisson", {"rate_per_second": 1}), ("scripted", {"at": 0})):
        (group,) = scenario_from_dict({"groups": [{"kind": kind, "prompt_tokens": 10, "output_tokens": 10,
                                                   "shared_prefix_tokens": 64, **extra}]}).groups
        assert group.shared_prefix_tokens == 64


@pytest.mark.parametrize(("value", "message"), [
    (-1, r"groups\[0\]\.shared_prefix_tokens: must be at least 0, got -1"),
    (1.5, r"groups\[0\]\.shared_prefix_tokens: must be a whole number, got 1\.5"),
    ("4k", r"groups\[0\]\.shared_prefix_tokens: must be a whole number, got '4k'"),
    (True, r"groups\[0\]\.shared_prefix_tokens: must be a whole number, got True"),
])
def test_a_bad_shared_prefix_is_refused_clearly(value: object, message: str) -> None:
    with pytest.raises(InputError, match=message):
        scenario_from_dict({"groups": [{"kind": "closed", "users": 1, "prompt_tokens": 10, "output_tokens": 10,
                                        "shared_prefix_tokens": value}]})


def test_a_misspelt_key_is_named() -> None:
    with pytest.raises(InputError, match=r"unknown key 'shared_prefix'.*shared_prefix_tokens"):
        scenario_from_dict({"groups": [{"kind": "closed", "users": 1, "prompt_tokens": 10, "output_tokens": 10,
                                        "shared_prefix": 4000}]})


def test_every_prompt_is_the_system_prompt_and_its_own_tokens() -> None:
    sim = Simulator(ServerSpec(), load_scenario("shared-prefix"))
    sim.run_until(12.0)
    assert len(sim.running) == USERS
    for request in sim.running:
        assert request.shared_prefix_tokens == SYSTEM_PROMPT_TOKENS
        assert SYSTEM_PROMPT_TOKENS + 300 <= request.prompt_tokens <= SYSTEM_PROMPT_TOKENS + 500  # 400 x (1 ± 0.25)


# --- (a) the counters' context and (b) the blocks held, at several moments ------------------------------

def test_the_counters_give_the_running_contexts_and_the_blocks_are_held_once() -> None:
    sim = Simulator(ServerSpec(), load_scenario("shared-prefix"))
    # The first step: the first user's 4,000 + ~400-token prompt is part-way (2,048 tokens, the budget).
    assert sim.run_one_step()
    (first,) = sim.running
    assert (first.computed_tokens, first.first_token_seconds) == (2048, None)
    page = _page(sim)
    # Part-way through its prefill it is not counted yet: vLLM counts a prompt when its first token comes.
    assert page.context_in_flight_tokens == 0
    assert page.used_blocks == 2048 // BLOCK_TOKENS
    moments = (4.0, 12.0, 45.0, 90.0)
    for t_seconds in moments:
        _run_to_step_end(sim, t_seconds)
        page = _page(sim)
        assert sim.counters.preemptions == 0 and not any(r.first_token_seconds for r in sim.waiting)
        # (a) Every running request's whole context (its share of the system prompt included), less the
        # prompts of requests still part-way through their prefill, which the counters have not counted.
        part_way = [r for r in sim.running if r.first_token_seconds is None]
        expected = sum(r.known_tokens for r in sim.running) - sum(r.prompt_tokens for r in part_way)
        assert page.context_in_flight_tokens == expected, t_seconds
        # (b) The system prompt's 250 blocks once, plus each request's blocks beyond it.
        assert all(r.computed_tokens >= SYSTEM_PROMPT_TOKENS for r in sim.running)  # all hold the whole prefix
        own_blocks = sum(_table_blocks(r) - SYSTEM_PROMPT_BLOCKS for r in sim.running)
        assert page.used_blocks == SYSTEM_PROMPT_BLOCKS + own_blocks, t_seconds
        # What the steps read is far more: the system prompt once per request.
        read_blocks = sum(_table_blocks(r) for r in sim.running)
        assert read_blocks == page.used_blocks + (len(sim.running) - 1) * SYSTEM_PROMPT_BLOCKS
    assert len(sim.running) == USERS  # at the last moments every user is in flight


# --- prefix-cache hits on the page -------------------------------------------------------------------

def _run_until_finished(sim: Simulator, *requests: SimRequest) -> None:
    while not all(r.finished for r in requests):
        assert sim.run_one_step()


def test_hits_show_on_the_page_as_vllm_counts_them() -> None:
    sim = Simulator(ServerSpec(), record_steps=True)
    first = sim.submit(SYSTEM_PROMPT_TOKENS + 400, 50, group="assistant", shared_prefix_tokens=SYSTEM_PROMPT_TOKENS)
    while first.first_token_seconds is None:
        assert sim.run_one_step()
    second = sim.submit(SYSTEM_PROMPT_TOKENS + 300, 50, group="assistant", shared_prefix_tokens=SYSTEM_PROMPT_TOKENS)
    assert sim.run_one_step()
    # The second prompt's step computed only its own 300 tokens beside the first's decode token.
    step = sim.steps[-1] if sim.steps else None
    assert step is not None and (step.prefill_tokens, step.decode_tokens) == (300, 1)
    assert second.first_token_seconds is not None
    page = _page(sim)
    assert page.prefix_queries == (SYSTEM_PROMPT_TOKENS + 400) + (SYSTEM_PROMPT_TOKENS + 300)
    assert page.prefix_hits == SYSTEM_PROMPT_TOKENS
    assert page.prompt_cache_hit_tokens == page.prompt_cached_tokens == SYSTEM_PROMPT_TOKENS
    assert page.prompt_compute_tokens == (SYSTEM_PROMPT_TOKENS + 400) + 300
    assert page.prompt_tokens == (SYSTEM_PROMPT_TOKENS + 400) + (SYSTEM_PROMPT_TOKENS + 300)  # whole prompts
    # Held once: 250 shared blocks, then ceil(4,4xx / 16) - 250 of each request's own.
    own = [_table_blocks(r) - SYSTEM_PROMPT_BLOCKS for r in (first, second)]
    assert page.used_blocks == SYSTEM_PROMPT_BLOCKS + sum(own)
    _run_until_finished(sim, first, second)
    # Nobody holds the system prompt now: its blocks are free (usage 0) but stay cached for the next one.
    assert _page(sim).used_blocks == 0
    third = sim.submit(SYSTEM_PROMPT_TOKENS + 100, 5, group="assistant", shared_prefix_tokens=SYSTEM_PROMPT_TOKENS)
    _run_until_finished(sim, third)
    assert third.reported_cached_tokens == SYSTEM_PROMPT_TOKENS
    assert _page(sim).prefix_hits == 2 * SYSTEM_PROMPT_TOKENS


def test_without_prefix_caching_every_request_holds_its_own_copy() -> None:
    sim = Simulator(ServerSpec(enable_prefix_caching=False))
    requests = [sim.submit(SYSTEM_PROMPT_TOKENS + 400, 50, group="assistant",
                           shared_prefix_tokens=SYSTEM_PROMPT_TOKENS) for _ in range(3)]
    while any(r.first_token_seconds is None for r in requests):
        assert sim.run_one_step()
    page = _page(sim)
    assert page.used_blocks == sum(_table_blocks(r) for r in requests)  # 3 x ceil(4,4xx / 16), nothing shared
    assert page.prefix_queries == page.prefix_hits == page.prompt_cached_tokens == 0  # no lookup at all


def _small_pool() -> Simulator:
    """A pool of 601 blocks (600 usable): qwen3-8b on an H100 at 26% of its memory."""
    sim = Simulator(ServerSpec(gpu_memory_utilization=0.26, max_model_len=8192))
    assert sim.num_gpu_blocks == 601
    return sim


def test_an_unheld_prefix_is_evicted_only_when_no_other_block_is_free() -> None:
    sim = _small_pool()
    usable = sim.num_gpu_blocks - 1
    first = sim.submit(SYSTEM_PROMPT_TOKENS + 100, 1, group="assistant", shared_prefix_tokens=SYSTEM_PROMPT_TOKENS)
    _run_until_finished(sim, first)
    # An unrelated prompt needing 40 blocks more than the 350 free blocks that hold no cached prefix.
    other = sim.submit((usable - SYSTEM_PROMPT_BLOCKS + 40) * BLOCK_TOKENS, 1, group="other")
    _run_until_finished(sim, other)
    again = sim.submit(SYSTEM_PROMPT_TOKENS + 50, 1, group="assistant", shared_prefix_tokens=SYSTEM_PROMPT_TOKENS)
    _run_until_finished(sim, again)
    assert again.reported_cached_tokens == (SYSTEM_PROMPT_BLOCKS - 40) * BLOCK_TOKENS  # its tail was evicted
    assert _page(sim).prefix_hits == (SYSTEM_PROMPT_BLOCKS - 40) * BLOCK_TOKENS


def test_a_preempted_request_is_looked_up_again_but_not_counted_again() -> None:
    """Two 4,000-token prompts sharing 2,000 tokens, answering 4,000 each, outgrow 600 blocks: the newer
    is preempted, waits for the older to finish, and is admitted again (hitting the prefix again)."""
    sim = _small_pool()
    older, newer = (sim.submit(4000, 4000, group="assistant", shared_prefix_tokens=2000) for _ in range(2))
    while not newer.preemptions:
        assert sim.run_one_step()
    assert newer in sim.waiting and newer.first_token_seconds is not None
    # Preempted after its first token: still counted, its context waits to be recomputed.
    assert _page(sim).context_in_flight_tokens == _counted_context_tokens(sim)
    _run_until_finished(sim, older, newer)
    page = _page(sim)
    # Only first admissions count (vllm/v1/metrics/stats.py:146-151): the newer hit the 125 shared blocks.
    assert (page.prefix_queries, page.prefix_hits) == (4000 + 4000, 2000)
    assert page.prompt_tokens == 8000 and page.context_in_flight_tokens == 0


# --- (c) step time follows the context read ------------------------------------------------------------

def _decode_step(scenario: dict[str, object], requests: int) -> tuple[Simulator, StepRecord]:
    """The first step in which all `requests` decode (every prompt done), and the simulator right after it."""
    sim = Simulator(ServerSpec(truth=EXACT_TRUTH), scenario_from_dict(scenario), record_steps=True)
    while len(sim.running) < requests or any(r.first_token_seconds is None for r in sim.running):
        assert sim.run_one_step()
    assert sim.run_one_step() and sim.steps
    step = sim.steps[-1]
    assert (step.decode_tokens, step.prefill_tokens, step.running) == (requests, 0, requests)
    return sim, step


def _memory_seconds_by_hand(read_blocks: int) -> float:
    """Weights once plus every block read, from the preset's architecture and the truth's efficiencies."""
    arch = get_model_preset("qwen3-8b")
    kv_bytes_per_token = 2 * arch.layers * arch.kv_heads * arch.head_dim * 2  # K and V, bf16: 147,456 B
    bandwidth = get_gpu("h100-sxm").peak_bandwidth_bytes_per_second * EXACT_TRUTH.bandwidth_efficiency
    weights_seconds = arch.params * 2 / bandwidth
    kv_seconds = read_blocks * BLOCK_TOKENS * kv_bytes_per_token / (bandwidth * EXACT_TRUTH.kv_read_efficiency)
    return weights_seconds + kv_seconds


def test_the_step_reads_the_shared_prefix_once_per_request() -> None:
    sharing, shared_step = _decode_step({"groups": [
        {"kind": "scripted", "name": "assistant", "at": 0, "count": USERS, "shared_prefix_tokens": SYSTEM_PROMPT_TOKENS,
         "prompt_tokens": 600, "output_tokens": 1000}]}, USERS)
    shared_tables = [_table_blocks(r) for r in sharing.running]
    assert all(t >= math.ceil((SYSTEM_PROMPT_TOKENS + 600) / BLOCK_TOKENS) for t in shared_tables)  # >= 288
    shared_held = SYSTEM_PROMPT_BLOCKS + sum(t - SYSTEM_PROMPT_BLOCKS for t in shared_tables)
    assert _page(sharing).used_blocks == shared_held  # ~250 + 48 x 38 = ~2,074
    assert shared_step.read_tokens == sum(shared_tables) * BLOCK_TOKENS  # ~48 x 288 = ~13,824 blocks
    assert shared_step.memory_seconds == pytest.approx(_memory_seconds_by_hand(sum(shared_tables)), rel=1e-9)

    # Eight 4,340-token prompts without sharing: at least as many blocks held, by fewer requests.
    alone, alone_step = _decode_step({"groups": [
        {"kind": "scripted", "name": "documents", "at": 0, "count": 8, "prompt_tokens": 4340,
         "output_tokens": 1000}]}, 8)
    alone_tables = [_table_blocks(r) for r in alone.running]
    assert _page(alone).used_blocks == sum(alone_tables) >= shared_held  # ~8 x 272 = ~2,176
    assert alone_step.memory_seconds == pytest.approx(_memory_seconds_by_hand(sum(alone_tables)), rel=1e-9)
    # Same memory held (or more), ~6x less context read: the 48 sharers' step is the longer one.
    assert shared_step.seconds > alone_step.seconds
    assert shared_step.seconds - alone_step.seconds > 0.9 * (
        _memory_seconds_by_hand(sum(shared_tables)) - _memory_seconds_by_hand(sum(alone_tables)))


# --- the counter identity on every scenario, and aborts -------------------------------------------------

@pytest.mark.parametrize(("scenario", "moments"), [
    ("steady-chat", (5.0, 30.0)),
    ("agents-join", (60.0, 125.0, 430.0)),
    ("prefill-burst", (62.0, 120.0)),
    ("agents-cached", (5.0, 30.0)),
    ("overload", (20.0, 40.0)),
    ("shared-prefix", (5.0, 30.0)),
])
def test_every_scenarios_page_keeps_the_counter_identity(scenario: str, moments: tuple[float, ...]) -> None:
    """At any step's end the counters' context is that of the requests past their first token and not
    finished (requests part-way through their prefill not yet counted, preempted ones still counted)."""
    sim = Simulator(ServerSpec(), load_scenario(scenario))
    for t_seconds in moments:
        _run_to_step_end(sim, t_seconds)
        page = _page(sim)
        assert page.context_in_flight_tokens == _counted_context_tokens(sim), (scenario, t_seconds)
        assert page.request_prompt_tokens_sum <= page.prompt_tokens


def test_a_data_parallel_page_keeps_the_identity_per_engine() -> None:
    sim = Simulator(ServerSpec(data_parallel_size=2), load_scenario("shared-prefix"))
    _run_to_step_end(sim, 20.0)
    for engine in sim.engines:
        counted = sum(r.known_tokens for r in (*engine.running, *engine.waiting) if r.first_token_seconds is not None)
        assert _page(sim, str(engine.index)).context_in_flight_tokens == counted


def test_an_abort_records_no_finished_request() -> None:
    """vLLM's front end drops an aborted request's state and never observes it as finished
    (0.32.0 vllm/v1/engine/output_processor.py:552-614): its tokens stay counted."""
    sim = Simulator(ServerSpec())
    request = sim.submit(1000, 100)
    while request.output_tokens < 10:
        assert sim.run_one_step()
    sim.abort(request)
    page = _page(sim)
    assert request.finished and page.used_blocks == 0
    assert page.finished_requests == 0 and page.request_prompt_tokens_sum == 0
    assert page.context_in_flight_tokens == 1000 + 10


def test_a_session_leaving_before_its_first_token_is_an_abort() -> None:
    sim = Simulator(ServerSpec(), scenario_from_dict({"groups": [
        {"kind": "scripted", "name": "agent", "at": 0, "prompt_tokens": 100_000, "output_tokens": 100,
         "leave_at": 0.1}]}))
    sim.run_until(0.2)
    assert not sim.running and not sim.waiting and sim.step_count > 0  # it left part-way through its prompt
    page = _page(sim)
    # A stop is a sampled token: without one, the client went away. Nothing counted, nothing observed.
    assert page.finished_requests == 0 and page.prompt_tokens == 0 and page.context_in_flight_tokens == 0
    assert page.used_blocks == 0
