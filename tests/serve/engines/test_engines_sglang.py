"""SGLang pages -> Snapshots: real (partial) captures, dp ranks, pid labels, priority breakdowns."""

from __future__ import annotations

import pytest

from exporter.serve.engines import PageError, read_page
from tests.support.tools import DATA as TESTS_DATA

DATA = TESTS_DATA / "sglang"
GENUINE = TESTS_DATA / "genuine"  # pages rendered by SGLang's own metrics code

LABELS_DP0 = 'dp_rank="0",engine_type="unified",model_name="ds",pp_rank="0",tp_rank="0"'
LABELS_DP1 = 'dp_rank="1",engine_type="unified",model_name="ds",pp_rank="0",tp_rank="1"'
# Scheduler-side gauges per dp rank; tokenizer-side histogram and counters without dp_rank.
DP_PAGE = f"""# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{LABELS_DP0}}} 12.0
sglang:num_running_reqs{{{LABELS_DP1}}} 9.0
sglang:num_queue_reqs{{{LABELS_DP0}}} 3.0
sglang:num_queue_reqs{{{LABELS_DP1}}} 0.0
sglang:token_usage{{{LABELS_DP0}}} 0.5
sglang:token_usage{{{LABELS_DP1}}} 0.25
sglang:num_used_tokens{{{LABELS_DP0}}} 40000.0
sglang:num_used_tokens{{{LABELS_DP1}}} 20000.0
sglang:max_total_num_tokens{{{LABELS_DP0}}} 80000.0
sglang:max_total_num_tokens{{{LABELS_DP1}}} 80000.0
sglang:num_retracted_reqs{{{LABELS_DP0},pid="910"}} 0.0
sglang:page_size{{{LABELS_DP0}}} 64.0
sglang:num_retracted_requests_total{{{LABELS_DP0}}} 5.0
sglang:prompt_tokens_total{{model_name="ds"}} 9000.0
sglang:generation_tokens_total{{model_name="ds"}} 4500.0
sglang:inter_token_latency_seconds_sum{{model_name="ds"}} 2.5
sglang:inter_token_latency_seconds_bucket{{le="0.02",model_name="ds"}} 40.0
sglang:inter_token_latency_seconds_bucket{{le="0.04",model_name="ds"}} 90.0
sglang:inter_token_latency_seconds_bucket{{le="+Inf",model_name="ds"}} 100.0
sglang:inter_token_latency_seconds_count{{model_name="ds"}} 100.0
"""


def test_v0_5_1_capture() -> None:
    reading = read_page((DATA / "sglang_metrics_sample_v0.5.1_issue13485_partial.txt").read_text())
    assert reading.kind == "sglang"
    (snap,) = reading.snapshots
    assert (snap.model_name, snap.engine) == ("Qwen-32B", "0")  # no dp_rank label
    assert snap.requests_running == 1.0  # sglang:num_running_reqs{...} 1.0
    assert snap.kv_cache_used_tokens == 1.0  # sglang:num_used_tokens{...} 1.0
    assert snap.tokens_in_flight is None  # no sglang:decode_sum_seq_lens on a 0.5.1 page: the reading estimates
    assert snap.kv_cache_usage_ratio == 0.0  # sglang:token_usage{...} 0.0
    assert snap.kv_cache_capacity_tokens is None
    assert any(m.startswith("engine_steps_total: SGLang counts prefill and decode passes apart") for m in snap.missing)


def test_2024_capture_labels_the_model_name() -> None:
    reading = read_page((DATA / "sglang_metrics_sample_2024-11_pr1853_partial.txt").read_text())
    (snap,) = reading.snapshots
    assert snap.model_name == ("/shared/public/elr-models/meta-llama/Llama-3.2-3B/"
                               "5cc0ffe09ee49f7be6ca7c794ee6bd7245e84e60/")
    assert snap.kv_cache_capacity_tokens == 570979.0  # sglang:max_total_num_tokens{name=...} 570979.0
    assert snap.prompt_tokens_total == 230794.0


def test_dp8_capture_holds_only_families_we_do_not_need() -> None:
    # num_retracted_reqs / num_paused_reqs (pid-labelled) are not inputs: nothing usable on this excerpt.
    with pytest.raises(PageError):
        read_page((DATA / "sglang_metrics_sample_dp8_pid_label_aibrix_issue1614_partial.txt").read_text())


def test_dp_ranks_are_engines_and_server_wide_families_apply_to_each() -> None:
    reading = read_page(DP_PAGE)
    snaps = {s.engine: s for s in reading.snapshots}
    assert sorted(snaps) == ["0", "1"]
    zero, one = snaps["0"], snaps["1"]
    assert (zero.requests_running, one.requests_running) == (12.0, 9.0)
    assert (zero.requests_waiting, one.requests_waiting) == (3.0, 0.0)
    assert (zero.kv_cache_usage_ratio, one.kv_cache_usage_ratio) == (0.5, 0.25)
    assert (zero.kv_cache_used_tokens, one.kv_cache_used_tokens) == (40000.0, 20000.0)
    assert zero.kv_cache_capacity_tokens == one.kv_cache_capacity_tokens == 80000.0
    assert zero.block_size_tokens == 64 and isinstance(zero.block_size_tokens, int)
    # Rank 1 has no num_retracted_requests_total series: SGLang creates it at the first retraction
    # (0.5.23 observability/metrics_collector.py l. 1513-1525), so absent reads as 0.
    assert zero.preemptions_total == 5.0 and one.preemptions_total == 0.0
    for snap in (zero, one):
        itl = snap.inter_token_latency
        assert itl is not None
        assert itl.buckets == ((0.02, 40.0), (0.04, 90.0), (float("inf"), 100.0))
        assert (itl.count, itl.sum) == (100.0, 2.5)
        assert snap.prompt_tokens_total == 9000.0
        assert snap.server_wide == ("generation_tokens_total", "inter_token_latency", "prompt_tokens_total")


def test_priority_breakdowns_are_skipped_for_totals() -> None:
    page = (
        'sglang:num_running_reqs{model_name="m",priority=""} 10\n'
        'sglang:num_running_reqs{model_name="m",priority="1"} 4\n'
        'sglang:num_running_reqs{model_name="m",priority="2"} 6\n'
    )
    (snap,) = read_page(page).snapshots
    assert snap.requests_running == 10.0  # the total, not max(4, 6) nor 4 + 6 + 10


def test_tensor_parallel_copies_take_the_largest_and_say_so() -> None:
    page = (
        'sglang:num_running_reqs{model_name="m",tp_rank="0"} 5\n'
        'sglang:num_running_reqs{model_name="m",tp_rank="1"} 4\n'
    )
    reading = read_page(page)
    assert reading.snapshots[0].requests_running == 5.0
    assert any("2 series" in p for p in reading.problems)


def test_kind_sglang_forced_and_auto_agree() -> None:
    assert read_page(DP_PAGE, "sglang") == read_page(DP_PAGE)


def test_genuine_priority_page_takes_the_total_and_sums_the_shares() -> None:
    """SGLang 0.5.23 with priority scheduling: scheduler gauges carry priority="" (the total) beside
    each priority's share; tokenizer-side counters and the ITL histogram carry only each request's own
    priority (and is_streaming), so there the series are shares and are summed."""
    page = (GENUINE / "sglang-0.5.23_GENUINE_multiprocess_dp1_priority_t1.prom").read_text()
    (snap,) = read_page(page).snapshots
    # num_running_reqs{priority=""} 40.0 beside priority="0" 30.0 and priority="10" 10.0
    assert snap.requests_running == 40.0  # the total, not max(30, 10) nor 40 + 30 + 10
    # num_queue_reqs{priority=""} 3.0 beside priority="0" 3.0 and priority="10" 0.0
    assert snap.requests_waiting == 3.0  # not 3 + 3 + 0
    # prompt_tokens_total: four shares, is_streaming x priority (the fed total: 281,209)
    assert snap.prompt_tokens_total == 36248.0 + 131515.0 + 84349.0 + 29097.0 == 281209
    assert snap.generation_tokens_total == 3000.0 + 10150.0 + 4850.0 + 2200.0 == 20200
    itl = snap.inter_token_latency  # inter_token_latency_seconds_count{priority="10"} 4540, {priority="0"} 13855
    assert itl is not None and itl.count == 4540.0 + 13855.0 == 18395
    assert snap.server_wide == ()  # one rank: the tokenizer's figures are this engine's own


def test_genuine_dp_page_a_rank_before_its_first_retraction_reads_zero() -> None:
    page = (GENUINE / "sglang-0.5.23_GENUINE_multiprocess_dp2_t0.prom").read_text()
    # SGLang creates the counter at a rank's first retraction: only rank 0 has retracted by t0.
    assert 'sglang:num_retracted_requests_total{dp_rank="0",' in page
    assert 'sglang:num_retracted_requests_total{dp_rank="1",' not in page
    snaps = {s.engine: s for s in read_page(page).snapshots}
    assert sorted(snaps) == ["0", "1"]
    assert (snaps["0"].preemptions_total, snaps["1"].preemptions_total) == (2.0, 0.0)
    assert not any(m.startswith("preemptions_total") for m in snaps["1"].missing)
    for snap in snaps.values():
        assert snap.block_size_tokens == 1 and isinstance(snap.block_size_tokens, int)  # page_size 1.0
        # The tokenizer's families carry no dp_rank: one server-wide figure, flagged on every rank.
        assert snap.server_wide == ("generation_tokens_total", "inter_token_latency", "prompt_tokens_total")
        assert snap.prompt_tokens_total == 64994.0 + 109916.0  # is_streaming "false" + "true"
