"""The simulator's /metrics page has vLLM's structure, and the daemon's vLLM adapter reads it.

Structure = families, types, HELP texts, label names and bucket edges, diffed against the
reconstruction of vLLM's own declarations (tests/data/vllm_reference/, see its README).
"""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.errors import InputError
from exporter.serve.engines import read_page
from exporter.simulator import ServerSpec, Simulator, load_scenario
from tests.support.simulator import structure
from tests.support.tools import DATA

REFERENCE = DATA / "vllm_reference" / "vllm_v1_RECONSTRUCTED_single_process.txt"
# Real vLLM families (REPORT.md §a.2) the simulator serves beyond the reconstruction's subset.
EXTRA_VLLM_FAMILIES = {"vllm:request_generation_tokens", "vllm:request_time_per_output_token_seconds",
                       "vllm:request_queue_time_seconds", "vllm:request_num_preemptions"}


def _page(version: str = "latest", scenario: str = "steady-chat", until: float = 20.0) -> tuple[Simulator, str]:
    sim = Simulator(ServerSpec(max_model_len=8192, vllm_version=version, served_model_name="Qwen/Qwen3-8B"),
                    load_scenario(scenario), record_steps=True)
    sim.run_until(until)
    return sim, sim.render_metrics().decode()


def test_page_structure_matches_vllm_reference() -> None:
    reference = structure(REFERENCE.read_text())
    _, text = _page()
    ours = structure(text)
    missing = sorted(set(reference) - set(ours))
    assert not missing, f"families vLLM has and the simulator lacks: {missing}"
    for name, expected in reference.items():
        if name.startswith(("python_", "process_")):
            assert ours[name][0] == expected[0], name  # the process's own collectors
            continue
        assert ours[name] == expected, name
    extra = {name for name in set(ours) - set(reference) if not name.startswith(("python_", "process_"))}
    allowed = EXTRA_VLLM_FAMILIES | {f"{name}_created" for name in EXTRA_VLLM_FAMILIES}
    assert extra <= allowed, f"families vLLM does not have: {sorted(extra - allowed)}"


def test_cache_config_info_describes_the_simulated_cache() -> None:
    sim, text = _page()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info"]
    (sample,) = family.samples
    assert "model_name" not in sample.labels
    assert sample.labels["engine"] == "0"
    assert int(sample.labels["num_gpu_blocks"]) == sim.num_gpu_blocks
    assert int(sample.labels["block_size"]) == 16
    assert int(sample.labels["kv_cache_size_tokens"]) == sim.num_gpu_blocks * 16


def _last_step_blocks(sim: Simulator) -> int:
    """The page reports the state after the last completed step (the next one may already hold
    newly allocated blocks: vLLM logs scheduler stats with each step's output)."""
    assert sim.steps
    return sim.steps[-1].used_blocks


def test_page_values_are_the_engines_counts() -> None:
    sim, text = _page(until=30.0)
    assert sim.steps
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    base = (("engine", "0"), ("model_name", "Qwen/Qwen3-8B"))
    usable_blocks = sim.num_gpu_blocks - 1  # the null block is never used
    assert values[("vllm:kv_cache_usage_perc", base)] == pytest.approx(_last_step_blocks(sim) / usable_blocks)
    assert values[("vllm:num_requests_running", base)] == sim.steps[-1].running
    assert values[("vllm:iteration_tokens_total_count", base)] == sim.step_count
    finished = values[("vllm:request_success_total", tuple(sorted((*base, ("finished_reason", "stop")))))]
    in_flight_output = sum(r.output_tokens for r in list(sim.running) + list(sim.waiting))
    assert values[("vllm:generation_tokens_total", base)] == pytest.approx(
        values[("vllm:request_generation_tokens_sum", base)] + in_flight_output)
    assert finished == values[("vllm:e2e_request_latency_seconds_count", base)] > 0


@pytest.mark.parametrize("version, usage_name, itl_name, engine_label", [
    ("latest", "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds", True),
    ("0.33", "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds", True),
    ("0.23", "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds", True),
    ("0.11", "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds", True),
    ("0.10", "vllm:kv_cache_usage_perc", "vllm:time_per_output_token_seconds", True),
    ("0.8", "vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds", False),
])
def test_versions_use_their_names_and_the_adapter_reads_each(version: str, usage_name: str, itl_name: str,
                                                             engine_label: bool) -> None:
    sim, text = _page(version)
    names = {f.name for f in text_string_to_metric_families(text)}
    assert usage_name in names and itl_name in names
    if version == "0.8":
        assert "vllm:kv_cache_usage_perc" not in names and "vllm:inter_token_latency_seconds" not in names
    if version == "0.10":
        assert "vllm:gpu_cache_usage_perc" in names  # deprecated beside the new name
        assert "vllm:inter_token_latency_seconds" not in names
    assert ('engine="0"' in text) == engine_label
    (snapshot,) = read_page(text).snapshots
    assert snapshot.kind == "vllm" and snapshot.model_name == "Qwen/Qwen3-8B"
    assert snapshot.kv_cache_usage_ratio == pytest.approx(_last_step_blocks(sim) / (sim.num_gpu_blocks - 1))
    assert snapshot.kv_cache_capacity_tokens == sim.capacity_tokens
    assert snapshot.inter_token_latency is not None
    assert snapshot.inter_token_latency.count == sim.counters.histograms["itl"].count
    assert snapshot.engine_steps_total == sim.step_count


def test_unknown_version_is_bad_input() -> None:
    with pytest.raises(InputError, match=re.escape("known: 0.32, latest, 0.33, 0.23, 0.11, 0.10, 0.8")):
        Simulator(ServerSpec(vllm_version="0.5"))
