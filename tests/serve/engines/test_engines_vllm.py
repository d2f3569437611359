"""vLLM pages -> Snapshots: captures of several eras, multiprocess/DP variants, and broken pages.

Expected values are read off the page text fed to the reader (the line is quoted beside each one).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from exporter.serve.engines import PageError, read_page
from exporter.serve.snapshot import Snapshot
from tests.support.tools import DATA as TESTS_DATA

DATA = TESTS_DATA / "vllm"
SINGLE = (DATA / "vllm_v1_RECONSTRUCTED_single_process.txt").read_text()
MULTI = (DATA / "vllm_v1_RECONSTRUCTED_multiprocess.txt").read_text()
ITL_EDGES = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]


def only(page: str, kind: str = "auto") -> Snapshot:
    reading = read_page(page, kind)
    assert reading.kind == "vllm"
    assert len(reading.snapshots) == 1
    return reading.snapshots[0]


def test_current_single_process_page_every_field() -> None:
    snap = only(SINGLE)
    assert (snap.kind, snap.model_name, snap.engine) == ("vllm", "Qwen/Qwen3-8B", "0")
    assert snap.requests_running == 3.0  # vllm:num_requests_running{engine="0",...} 3.0
    assert snap.requests_waiting == 0.0
    assert snap.kv_cache_usage_ratio == 0.125  # vllm:kv_cache_usage_perc ... 0.125 (a fraction)
    # cache_config_info: kv_cache_size_tokens="65536" (also num_gpu_blocks="4096" x block_size="16")
    assert snap.kv_cache_capacity_tokens == 65536.0 == 4096 * 16
    assert snap.block_size_tokens == 16
    # counters, not their `_created` twins (~1.7959705e9)
    assert snap.prompt_tokens_total == 1200.0
    assert snap.generation_tokens_total == 640.0
    assert snap.preemptions_total == 0.0
    assert snap.engine_steps_total == 164.0  # vllm:iteration_tokens_total_count
    itl = snap.inter_token_latency
    assert itl is not None
    assert [le for le, _ in itl.buckets] == [*ITL_EDGES, math.inf]  # edges read from the page
    assert [count for _, count in itl.buckets] == [0.0] + [636.0] * 19
    assert (itl.count, itl.sum) == (636.0, 7.631999999999872)
    assert snap.tokens_in_flight is None
    assert [m.split(":")[0] for m in snap.missing] == ["tokens_in_flight", "kv_cache_used_tokens"]


def test_multiprocess_page_reads_the_same_as_single_process() -> None:
    # Same declarations and values rendered by MultiProcessCollector: no _created, other order.
    # ... but for which process wrote it: multiprocess mode has neither a process collector nor `_created`.
    single = only(SINGLE)
    assert (single.process_start_seconds, single.created_seconds) != (None, None)
    assert only(MULTI) == replace(single, process_start_seconds=None, created_seconds=None)
    assert read_page(MULTI).problems == ()


def test_prefers_kv_cache_size_tokens_then_blocks_times_block_size() -> None:
    base = 'vllm:num_requests_running{engine="0",model_name="m"} 1\n'
    group_aware = base + ('vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="218464",'
                          'num_gpu_blocks="24978"} 1\n')
    assert only(group_aware).kv_cache_capacity_tokens == 218464  # not 24978 * 16 = 399648
    older = base + ('vllm:cache_config_info{block_size="32",engine="0",kv_cache_size_tokens="None",'
                    'num_gpu_blocks="1000"} 1\n')
    assert only(older).kv_cache_capacity_tokens == 1000 * 32
    assert only(older).block_size_tokens == 32
    no_blocks = base + 'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="None"} 1\n'
    snap = only(no_blocks)
    assert snap.kv_cache_capacity_tokens is None
    assert any(m.startswith("kv_cache_capacity_tokens: vllm:cache_config_info") for m in snap.missing)


def test_cache_config_applies_by_engine_to_every_model_on_it() -> None:
    # As vLLM writes it: num_gpu_blocks is the front end's sum over both engines (150 + 150 blocks;
    # 0.33.0 vllm/v1/engine/core_client.py l. 873-877), kv_cache_size_tokens is per engine.
    page = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.5\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="b"} 0.75\n'
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="300"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="300",kv_cache_size_tokens="2400"} 1.0\n'
    )
    snaps = {(s.model_name, s.engine): s for s in read_page(page).snapshots}
    assert sorted(snaps) == [("a", "0"), ("a", "1"), ("b", "0")]
    assert snaps["a", "0"].kv_cache_capacity_tokens == 300 / 2 * 16
    assert snaps["a", "1"].kv_cache_capacity_tokens == 2400
    assert snaps["b", "0"].kv_cache_capacity_tokens == 300 / 2 * 16
    assert snaps["a", "0"].kv_cache_blocks == 300 / 2
    assert (snaps["a", "1"].kv_cache_usage_ratio, snaps["b", "0"].kv_cache_usage_ratio) == (0.25, 0.75)


def test_0_8_era_capture_old_names_no_engine_label() -> None:
    snap = only((DATA / "vllm_metrics_sample_v1_0.8era_production-stack_issue318_partial.txt").read_text())
    assert (snap.model_name, snap.engine) == ("Qwen/Qwen2.5-Coder-32B-Instruct", "0")
    assert (snap.requests_running, snap.requests_waiting) == (0.0, 0.0)
    assert snap.kv_cache_usage_ratio == 0.0  # vllm:gpu_cache_usage_perc{...} 0.0
    assert snap.kv_cache_capacity_tokens is None
    assert any("no vllm:cache_config_info" in m for m in snap.missing)


def test_early_v1_design_doc_capture() -> None:
    reading = read_page((DATA / "vllm_metrics_sample_v1_early_docs_design.txt").read_text())
    (snap,) = reading.snapshots
    assert snap.requests_running == 8.0
    assert snap.generation_tokens_total == 27453.0
    # The doc elides cache_config_info's labels with "...": that line is malformed, skipped, said.
    assert snap.kv_cache_capacity_tokens is None
    assert any("malformed" in p for p in reading.problems)


@pytest.mark.parametrize(
    "name", ["vllm_metrics_sample_v0.5era_functionary_pr263_help_type_only.txt",
             "vllm_metrics_sample_docs_usage_iteration_tokens.txt"]
)
def test_captures_without_usable_samples_are_page_errors(name: str) -> None:
    with pytest.raises(PageError):
        read_page((DATA / name).read_text())


def test_prefers_itl_over_tpot_and_falls_back_to_tpot() -> None:
    def hist(name: str, under: float, total: float) -> str:
        return (
            f'{name}_bucket{{le="0.05",model_name="m"}} {under}\n{name}_bucket{{le="+Inf",model_name="m"}} {total}\n'
            f'{name}_count{{model_name="m"}} {total}\n{name}_sum{{model_name="m"}} {total * 0.03}\n'
        )

    both = hist("vllm:time_per_output_token_seconds", 1, 2) + hist("vllm:inter_token_latency_seconds", 5, 9)
    itl = only(both).inter_token_latency
    assert itl is not None and (itl.buckets[0], itl.count) == ((0.05, 5.0), 9.0)
    tpot = only(hist("vllm:time_per_output_token_seconds", 1, 2)).inter_token_latency
    assert tpot is not None and (tpot.buckets[0], tpot.count) == ((0.05, 1.0), 2.0)


def test_pid_labels_gauges_take_largest_counters_sum() -> None:
    # ~0.10.1 with --api-server-count 2: kv_cache_usage_perc had no multiprocess_mode -> one series per pid.
    page = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="m",pid="11"} 0.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m",pid="12"} 0.4\n'
        'vllm:prompt_tokens_total{engine="0",model_name="m",pid="11"} 100\n'
        'vllm:prompt_tokens_total{engine="0",model_name="m",pid="12"} 50\n'
    )
    snap = only(page)
    assert snap.kv_cache_usage_ratio == max(0.0, 0.4)
    assert snap.prompt_tokens_total == 100 + 50


def test_missing_metrics_are_none_and_named() -> None:
    snap = only('vllm:num_requests_running{model_name="m"} 2\n')
    assert snap.requests_running == 2.0
    assert snap.kv_cache_usage_ratio is None and snap.inter_token_latency is None
    named = {m.split(":")[0] for m in snap.missing}
    assert named == {
        "tokens_in_flight", "kv_cache_used_tokens", "requests_waiting", "kv_cache_usage_ratio", "inter_token_latency",
        "prompt_tokens_total",
        "generation_tokens_total", "preemptions_total", "engine_steps_total", "kv_cache_capacity_tokens",
        "block_size_tokens",
    }


def test_page_cut_inside_the_itl_histogram() -> None:
    cut = SINGLE.index('vllm:inter_token_latency_seconds_bucket{engine="0",le="0.5"')
    reading = read_page(SINGLE[:cut])
    (snap,) = reading.snapshots
    assert snap.inter_token_latency is None  # dropped as incomplete, never read from partial buckets
    assert any("inter_token_latency_seconds" in p and "incomplete" in p for p in reading.problems)
    assert snap.requests_running == 3.0  # families before the cut are intact
    assert any(m.startswith("inter_token_latency: ") for m in snap.missing)


def test_nan_inf_and_negative_values_never_pass_as_values() -> None:
    page = (
        'vllm:kv_cache_usage_perc{model_name="m"} NaN\n'
        'vllm:num_requests_running{model_name="m"} -1\n'
        'vllm:num_requests_waiting{model_name="m"} 4\n'
        'vllm:prompt_tokens_total{model_name="m"} +Inf\n'
    )
    reading = read_page(page)
    (snap,) = reading.snapshots
    assert (snap.kv_cache_usage_ratio, snap.requests_running, snap.prompt_tokens_total) == (None, None, None)
    assert snap.requests_waiting == 4.0
    assert len([p for p in reading.problems if "not a valid" in p]) == 3
    assert any(m.startswith("kv_cache_usage_ratio: vllm:kv_cache_usage_perc was nan") for m in snap.missing)


def test_labels_with_quotes_newlines_and_unicode_in_model_name() -> None:
    page = 'vllm:num_requests_running{engine="0",model_name="org/\\"q\\"\\nmodel-ü"} 7\n'
    snap = only(page)
    assert snap.model_name == 'org/"q"\nmodel-ü'
    assert snap.requests_running == 7.0


def test_kind_vllm_on_a_non_vllm_page_is_a_page_error() -> None:
    with pytest.raises(PageError) as caught:
        read_page('sglang:num_running_reqs{model_name="m"} 1\n', kind="vllm")
    assert caught.value.reason == "no vllm metrics"


GENUINE = TESTS_DATA / "genuine"  # pages rendered by vLLM's own metrics code


@pytest.mark.parametrize("name", ["vllm-0.23.0_GENUINE_dp2_t1.prom", "vllm-0.33.0_GENUINE_dp2_t1.prom"])
def test_genuine_data_parallel_page_gives_each_engine_its_own_blocks(name: str) -> None:
    page = (GENUINE / name).read_text()
    # The front end's sum over both engines' 23,574 blocks, written on each engine's series.
    assert page.count('num_gpu_blocks="47148"') == 2
    snaps = {s.engine: s for s in read_page(page).snapshots}
    assert sorted(snaps) == ["0", "1"]
    for snap in snaps.values():
        assert snap.kv_cache_blocks == 47148 / 2
        assert snap.kv_cache_capacity_tokens == 47148 / 2 * 16  # not 47,148 x 16
        assert snap.block_size_tokens == 16


def test_genuine_page_block_size_is_the_full_attention_groups_where_it_says() -> None:
    # vLLM 0.33.0 writes effective_attention_block_size="None" for a model with one KV group.
    page = (GENUINE / "vllm-0.33.0_GENUINE_dp1_t1.prom").read_text()
    assert 'block_size="16"' in page and 'effective_attention_block_size="None"' in page
    snap = only(page)
    assert snap.block_size_tokens == 16
    assert (snap.kv_cache_dtype, snap.kv_cache_blocks) == ("auto", 23574.0)  # cache_dtype="auto", num_gpu_blocks
    # A hybrid model's page names its full-attention group's block size there (0.33.0
    # vllm/v1/engine/core.py l. 418-431), while block_size is the smallest group's (l. 347): it wins.
    hybrid = only(page.replace('effective_attention_block_size="None"', 'effective_attention_block_size="64"'))
    assert hybrid.block_size_tokens == 64
    assert hybrid.kv_cache_capacity_tokens == 377184.0  # kv_cache_size_tokens="377184", group-aware


def test_genuine_prefix_cache_page_computed_and_cached_prompt_tokens() -> None:
    snap = only((GENUINE / "vllm-0.33.0_GENUINE_prefix_cache_dp1_t1.prom").read_text())
    assert snap.prompt_tokens_total == 751189.0  # vllm:prompt_tokens_total: cache hits included
    # vllm:prompt_tokens_by_source_total{source="local_compute"} 240181.0, beside local_cache_hit
    # 511008.0 and external_kv_transfer 0.0: only the computed source, not their sum.
    assert snap.prompt_tokens_computed_total == 240181.0
    assert snap.prompt_tokens_cached_total == 511008.0  # vllm:prompt_tokens_cached_total
    steps = snap.iteration_tokens  # vllm:iteration_tokens_total, its _count the engine steps
    assert steps is not None and steps.count == snap.engine_steps_total == 60.0
