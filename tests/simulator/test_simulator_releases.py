"""The simulator's vLLM 0.33/0.23 pages: prefix-cache accounting as vLLM 0.33.0 does it,
data-parallel engines on one page, and the release lines' differences.

Counts are worked out by hand from the inputs (block size 16, token budget 2,048 per step); each
release line's structure is diffed against a page rendered by that vLLM release's own metrics code
(tests/data/genuine/, provenance in PROVENANCE.md there).
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.errors import InputError
from exporter.serve.engines import read_page
from exporter.simulator import ServerSpec, Simulator, load_scenario, scenario_from_dict
from tests.support.simulator import blocks_by_hand, step, structure
from tests.support.tools import DATA

GENUINE = DATA / "genuine"
GENUINE_PAGES = {"0.33": GENUINE / "vllm-0.33.0_GENUINE_dp2_t1.prom",
                 "0.23": GENUINE / "vllm-0.23.0_GENUINE_dp2_t1.prom"}
# Every vllm: family of the genuine pages is served (the ones nothing in the simulator moves, such
# as the multimodal cache or the sleep state, at the values a text-only, awake server shows).
NOT_SIMULATED: set[str] = set()
Values = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _values(sim: Simulator) -> Values:
    text = sim.render_metrics().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _get(values: Values, name: str, engine: str = "0", **labels: str) -> float:
    key = tuple(sorted({"engine": engine, "model_name": "qwen3-8b", **labels}.items()))
    return values[(name, key)]


def _cache_config(sim: Simulator) -> list[dict[str, str]]:
    text = sim.render_metrics().decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info"]
    return [sample.labels for sample in family.samples]


# --- prefix caching ----------------------------------------------------------------------------------


def test_a_cached_prefix_is_hit_in_whole_blocks_and_only_the_rest_is_computed() -> None:
    sim = Simulator(ServerSpec(vllm_version="0.33"), record_steps=True)
    request = sim.submit(10_000, 3, cached_prefix_tokens=9_900)
    for _ in range(3):
        step(sim)
    # 9,900 cached tokens are 618 whole blocks = 9,888 tokens; 112 are computed, in one step.
    assert request.prefix_hit_tokens == 9_888
    assert sim.steps is not None
    assert [s.prefill_tokens for s in sim.steps] == [112, 0, 0]
    assert [s.iteration_tokens for s in sim.steps] == [112 + 1, 1, 1]
    assert request.finished and sim.used_blocks == 0
    values = _values(sim)
    assert _get(values, "vllm:prefix_cache_queries_total") == 10_000
    assert _get(values, "vllm:prefix_cache_hits_total") == 9_888
    assert _get(values, "vllm:prompt_tokens_total") == 10_000  # cache hits included
    assert _get(values, "vllm:prompt_tokens_by_source_total", source="local_compute") == 112
    assert _get(values, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 9_888
    assert _get(values, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert _get(values, "vllm:prompt_tokens_cached_total") == 9_888
    assert _get(values, "vllm:prompt_tokens_cached_by_source_total", source="device") == 9_888
    assert _get(values, "vllm:iteration_tokens_total_count") == 3
    assert _get(values, "vllm:iteration_tokens_total_sum") == 115
    assert _get(values, "vllm:iteration_tokens_total_bucket", le="128.0") == 3  # 113, 1 and 1
    assert _get(values, "vllm:request_prefill_kv_computed_tokens_sum") == 112
    assert _get(values, "vllm:generation_tokens_total") == 3


def test_cached_blocks_of_a_running_request_are_used_blocks() -> None:
    sim = Simulator(ServerSpec(vllm_version="0.33"))
    sim.submit(10_000, 5, cached_prefix_tokens=9_900)
    step(sim)
    # After the prompt's step the request holds its 10,000 tokens in 625 blocks, the 618 cached ones
    # included (the next step, already scheduled, holds a 626th for token 10,001).
    assert _get(_values(sim), "vllm:kv_cache_usage_perc") == pytest.approx(625 / (sim.num_gpu_blocks - 1))
    assert sim.used_blocks == 626


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    sim = Simulator(ServerSpec(vllm_version="0.33"), record_steps=True)
    request = sim.submit(10_000, 1, cached_prefix_tokens=10_000)
    step(sim)
    # At most prompt - 1 = 9,999 tokens hit, in whole blocks: 624 x 16 = 9,984; 16 are computed.
    assert request.prefix_hit_tokens == 9_984
    assert sim.steps is not None and sim.steps[0].prefill_tokens == 16


def test_a_chunked_prefill_reports_its_computed_tokens_in_the_step_of_its_last_chunk() -> None:
    sim = Simulator(ServerSpec(vllm_version="0.33"), record_steps=True)
    sim.submit(100_000, 2, cached_prefix_tokens=50_000)
    for _ in range(26):
        step(sim)
    assert sim.steps is not None
    # 50,000 uncached tokens: 24 chunks of 2,048 and one of 848; only the last one emits output.
    assert [s.prefill_tokens for s in sim.steps] == [2048] * 24 + [848, 0]
    assert [s.iteration_tokens for s in sim.steps] == [0] * 24 + [50_000 + 1, 1]
    values = _values(sim)
    assert _get(values, "vllm:iteration_tokens_total_bucket", le="16384.0") == 25
    assert _get(values, "vllm:iteration_tokens_total_bucket", le="+Inf") == 26
    assert _get(values, "vllm:prompt_tokens_by_source_total", source="local_compute") == 50_000


def test_without_prefix_caching_nothing_hits_and_the_page_says_so() -> None:
    sim = Simulator(ServerSpec(vllm_version="0.33", enable_prefix_caching=False), record_steps=True)
    sim.submit(3_000, 1, cached_prefix_tokens=2_900)
    step(sim)
    step(sim)
    assert sim.steps is not None and [s.prefill_tokens for s in sim.steps] == [2048, 952]
    values = _values(sim)
    assert _get(values, "vllm:prefix_cache_queries_total") == 0
    assert _get(values, "vllm:prompt_tokens_by_source_total", source="local_compute") == 3_000
    assert _cache_config(sim)[0]["enable_prefix_caching"] == "False"


def test_the_page_counters_are_the_engines_truth_in_the_agents_cached_scenario() -> None:
    sim = Simulator(ServerSpec(), load_scenario("agents-cached"), record_steps=True)
    requests = []
    submit = sim.submit
    sim.submit = lambda *a, **k: requests.append(submit(*a, **k)) or requests[-1]  # type: ignore[method-assign]  # records each submitted request
    sim.run_until(60.0)
    steps = sim.steps
    assert steps is not None and sim.spec.vllm_version == "0.33"
    values = _values(sim)
    started = [r for r in requests if r.first_token_seconds is not None]
    agents = [r for r in started if r.group == "agent"]
    assert len(agents) > 10 and all(r.prefix_hit_tokens >= 0.99 * r.prompt_tokens - 16 for r in agents)
    computed = sum(r.prompt_tokens - r.reported_cached_tokens for r in started)
    cached = sum(r.reported_cached_tokens for r in started)
    assert _get(values, "vllm:prompt_tokens_by_source_total", source="local_compute") == computed
    assert _get(values, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == cached
    assert _get(values, "vllm:prompt_tokens_total") == computed + cached == sum(r.prompt_tokens for r in started)
    assert cached > 10 * computed  # the agents' conversations dwarf what is computed
    assert _get(values, "vllm:iteration_tokens_total_count") == len(steps)
    assert _get(values, "vllm:iteration_tokens_total_sum") == sum(s.iteration_tokens for s in steps) == (
        computed + sum(s.sampled_tokens for s in steps))
    assert _get(values, "vllm:generation_tokens_total") == sum(s.sampled_tokens for s in steps)
    assert _get(values, "vllm:prefix_cache_hits_total") == sum(r.prefix_hit_tokens for r in requests
                                                               if r.first_scheduled_seconds is not None)


# --- data parallelism --------------------------------------------------------------------------------


def test_data_parallel_engines_have_their_own_batch_cache_and_counters() -> None:
    sim = Simulator(ServerSpec(vllm_version="0.33", data_parallel_size=2), record_steps=True)
    # Least loaded first (4 x waiting + running), ties to the lower index: engines 0, 1, 0, 1.
    requests = [sim.submit(prompt, 2) for prompt in (1000, 2000, 3000, 500)]
    assert [r.engine for r in requests] == [0, 1, 0, 1]
    first, second = sim.engines
    for _ in range(6):
        step(sim)
    assert all(r.finished for r in requests)
    assert first.step_count >= 2 and second.step_count >= 2
    values = _values(sim)
    assert _get(values, "vllm:prompt_tokens_total", "0") == 1000 + 3000
    assert _get(values, "vllm:prompt_tokens_total", "1") == 2000 + 500
    assert _get(values, "vllm:generation_tokens_total", "1") == 4
    assert _get(values, "vllm:iteration_tokens_total_count", "0") == first.step_count
    assert _get(values, "vllm:iteration_tokens_total_count", "1") == second.step_count


def test_cache_config_info_sums_num_gpu_blocks_over_engines_and_keeps_kv_size_per_engine() -> None:
    sim = Simulator(ServerSpec(vllm_version="0.33", data_parallel_size=2, max_model_len=40960))
    blocks = blocks_by_hand(0.9)
    series = _cache_config(sim)
    assert [labels["engine"] for labels in series] == ["0", "1"]
    for labels in series:
        assert labels["num_gpu_blocks"] == str(2 * blocks)
        assert labels["kv_cache_size_tokens"] == str(16 * blocks)
        assert labels["kv_cache_max_concurrency"] == str(16 * blocks / 40960)
    snapshots = read_page(sim.render_metrics()).snapshots
    assert [(s.engine, s.kv_cache_capacity_tokens) for s in snapshots] == [("0", 16 * blocks), ("1", 16 * blocks)]


def test_the_0_23_page_sums_blocks_and_has_no_per_engine_size() -> None:
    sim = Simulator(ServerSpec(vllm_version="0.23", data_parallel_size=2))
    blocks = blocks_by_hand(0.9)
    for labels in _cache_config(sim):
        assert labels["num_gpu_blocks"] == str(2 * blocks)
        assert "kv_cache_size_tokens" not in labels and "kv_cache_max_concurrency" not in labels


def test_a_scenario_sessions_cached_prefix_stays_on_its_engine() -> None:
    scenario = load_scenario("agents-cached")
    sim = Simulator(ServerSpec(data_parallel_size=2), scenario)
    requests = []
    submit = sim.submit
    sim.submit = lambda *a, **k: requests.append(submit(*a, **k)) or requests[-1]  # type: ignore[method-assign]  # records each submitted request
    sim.run_until(60.0)
    engines_of = {}
    for request in requests:
        if request.group == "agent":
            engines_of.setdefault(request.user, set()).add(request.engine)
    assert len(engines_of) == 2 and all(len(engines) == 1 for engines in engines_of.values())
    assert {request.engine for request in requests if request.group == "chat"} == {0, 1}


# --- release lines -----------------------------------------------------------------------------------


def _emitted(version: str) -> dict[str, tuple[str, str, frozenset[str], tuple[str, ...]]]:
    sim = Simulator(ServerSpec(vllm_version=version, data_parallel_size=2, max_model_len=40960,
                               served_model_name="Qwen/Qwen3-8B"), load_scenario("steady-chat"))
    sim.run_until(5.0)
    return {name: shape for name, shape in structure(sim.render_metrics().decode()).items()
            if name.startswith("vllm:") and not name.endswith("_created")}


@pytest.mark.parametrize("version", sorted(GENUINE_PAGES))
def test_each_release_page_has_the_genuine_pages_families_types_labels_and_buckets(version: str) -> None:
    page = GENUINE_PAGES[version].read_text()
    genuine = structure(page)
    ours = _emitted(version)
    assert {"vllm:prompt_tokens_by_source_total", "vllm:prompt_tokens_cached_total",
            "vllm:prefix_cache_hits_total", "vllm:iteration_tokens_total",
            "vllm:request_prefill_kv_computed_tokens"} <= set(ours)
    if version == "0.33":
        assert "vllm:prompt_tokens_cached_by_source_total" in ours
    genuine_vllm = {name for name in genuine if name.startswith("vllm:") and not name.endswith("_created")}
    assert genuine_vllm - set(ours) == NOT_SIMULATED & genuine_vllm, "genuine families lost beyond NOT_SIMULATED"
    for name, shape in ours.items():
        if name == "vllm:cache_config_info":
            continue
        assert name in genuine, f"vLLM {version} has no family {name}"
        assert shape == genuine[name], name
    (genuine_info,) = [f for f in text_string_to_metric_families(page) if f.name == "vllm:cache_config_info"]
    assert ours["vllm:cache_config_info"][2] == frozenset(genuine_info.samples[0].labels)


def test_the_0_23_page_lacks_what_came_later() -> None:
    ours_0_33, ours_0_23 = _emitted("0.33"), _emitted("0.23")
    assert set(ours_0_33) - set(ours_0_23) == {"vllm:prompt_tokens_cached_by_source_total",
                                               "vllm:request_num_preemptions", "vllm:admission_rejections_total"}
    assert set(ours_0_23) <= set(ours_0_33)
    labels_0_33, labels_0_23 = ours_0_33["vllm:cache_config_info"][2], ours_0_23["vllm:cache_config_info"][2]
    assert {"kv_cache_size_tokens", "kv_cache_max_concurrency"} <= labels_0_33 - labels_0_23
    assert {"block_size", "cache_dtype", "num_gpu_blocks", "engine"} <= labels_0_23


def test_cache_config_info_reflects_the_engines_dtype_and_block_size() -> None:
    sim = Simulator(ServerSpec(vllm_version="0.33", kv_cache_dtype="fp8", block_size_tokens=32))
    (labels,) = _cache_config(sim)
    assert labels["cache_dtype"] == "fp8" and labels["block_size"] == "32"
    # fp8 halves the bytes per token: twice the 16-bit tokens, in blocks of 32.
    assert int(labels["kv_cache_size_tokens"]) == sim.num_gpu_blocks * 32
    assert int(labels["kv_cache_size_tokens"]) == pytest.approx(2 * 16 * blocks_by_hand(0.9), rel=1e-3)


# --- scenario settings -------------------------------------------------------------------------------


def test_yaml_scenarios_set_the_server_and_cached_shares() -> None:
    scenario = scenario_from_dict({
        "settings": {"vllm_version": "0.23", "data_parallel_size": 2, "kv_cache_dtype": "fp8"},
        "groups": [{"name": "agent", "kind": "scripted", "at": 0, "prompt_tokens": 4000, "output_tokens": 10,
                    "cached": 0.5}]})
    sim = Simulator(ServerSpec(), scenario)
    assert (sim.spec.vllm_version, sim.spec.data_parallel_size, sim.spec.kv_cache_dtype) == ("0.23", 2, "fp8")
    sim.run_until(10.0)
    assert _get(_values(sim), "vllm:prefix_cache_hits_total") == 2000  # 125 whole blocks of 16
    for bad, message in (({"cached": 1.5}, "cached: a share"), ({"cached": "half"}, "cached: must be a number")):
        with pytest.raises(InputError, match=message):
            scenario_from_dict({"groups": [{"kind": "closed", "users": 1, "prompt_tokens": 10, "output_tokens": 1,
                                            **bad}]})
    with pytest.raises(InputError, match="settings: unknown key 'vllm_release'"):
        scenario_from_dict({"settings": {"vllm_release": "0.33"}, "groups": [
            {"kind": "closed", "users": 1, "prompt_tokens": 10, "output_tokens": 1}]})
