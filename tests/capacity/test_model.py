"""Golden tests for DESIGN §1's reference numbers and tests of each piece of the physics.

Every expected value is computed here from the inputs (layers, heads, bytes, bandwidth), then also
compared with the rounded figure the worked examples quote.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.capacity import fit, kv_cache, model
from exporter.capacity.architecture import (
    Architecture,
    check_tensor_parallel,
    expected_distinct_experts,
    kv_bytes_for_context,
    kv_bytes_per_token,
    kv_heads_per_gpu,
    weight_bytes,
    weight_read_bytes,
)
from exporter.capacity.deployment import build_setup
from exporter.capacity.fit import CalibrationPoint
from exporter.capacity.model import RequestGroup
from exporter.capacity.presets import MODELS, get_model_preset
from exporter.errors import InputError

KIB = 1024
H100_PEAK_BYTES_PER_SECOND = 3.35e12
H100_BF16_DENSE_FLOPS = 989.4e12
QWEN3_8B_PARAMS = 8.19e9


def qwen3_setup(**overrides: object) -> model.ServingSetup:
    return build_setup(get_model_preset("qwen3-8b"), "h100-sxm", **overrides).setup  # type: ignore[arg-type]  # overrides: any of build_setup's keywords


# --- Qwen3-8B bf16 on an H100 SXM at 60% of 3.35 TB/s ------------------------------------------

QWEN3_KV_BYTES_PER_TOKEN = 2 * 36 * 8 * 128 * 2  # K and V, 36 layers, 8 KV heads, head_dim 128, bf16
QWEN3_WEIGHT_BYTES = QWEN3_8B_PARAMS * 2
EFFECTIVE_BANDWIDTH = 0.6 * H100_PEAK_BYTES_PER_SECOND


def test_qwen3_kv_bytes_per_token_is_144_kib() -> None:
    arch = get_model_preset("qwen3-8b")
    assert kv_bytes_per_token(arch, 2.0) == QWEN3_KV_BYTES_PER_TOKEN
    assert QWEN3_KV_BYTES_PER_TOKEN == 144 * KIB


def test_qwen3_one_user_alone_gets_about_122_tokens_per_second() -> None:
    expected = EFFECTIVE_BANDWIDTH / (QWEN3_WEIGHT_BYTES + QWEN3_KV_BYTES_PER_TOKEN * 1)
    got = model.predict_step(qwen3_setup(), [RequestGroup(1, 1)]).user_tokens_per_second
    assert got == pytest.approx(expected, rel=1e-9)
    assert got == pytest.approx(122, rel=0.01)


def test_qwen3_forty_chats_of_2000_tokens_get_about_71_tokens_per_second() -> None:
    read_bytes = QWEN3_WEIGHT_BYTES + 40 * 2000 * QWEN3_KV_BYTES_PER_TOKEN
    step = model.predict_step(qwen3_setup(), [RequestGroup(40, 2000)])
    assert step.read_bytes == pytest.approx(read_bytes)
    assert step.user_tokens_per_second == pytest.approx(EFFECTIVE_BANDWIDTH / read_bytes, rel=1e-9)
    assert step.user_tokens_per_second == pytest.approx(71, rel=0.01)


def test_two_agent_sessions_of_100000_tokens_halve_everyones_speed_to_about_35() -> None:
    read_bytes = QWEN3_WEIGHT_BYTES + (40 * 2000 + 2 * 100_000) * QWEN3_KV_BYTES_PER_TOKEN
    step = model.predict_step(qwen3_setup(), [RequestGroup(40, 2000), RequestGroup(2, 100_000)])
    assert step.tokens_in_flight == 280_000
    assert step.user_tokens_per_second == pytest.approx(EFFECTIVE_BANDWIDTH / read_bytes, rel=1e-9)
    assert step.user_tokens_per_second == pytest.approx(35, rel=0.02)


def test_token_budget_at_50_tokens_per_second_with_headroom_is_about_134000() -> None:
    step_budget = 0.9 / 50
    expected = (step_budget * EFFECTIVE_BANDWIDTH - QWEN3_WEIGHT_BYTES) / QWEN3_KV_BYTES_PER_TOKEN
    assert model.step_budget_seconds(50, 0.9) == pytest.approx(step_budget)
    got = model.token_budget_tokens(qwen3_setup(), step_budget)
    assert got == pytest.approx(expected, rel=1e-9)
    assert got == pytest.approx(134_000, rel=0.01)


def test_kv_capacity_at_90_percent_of_80_gb_is_about_377000() -> None:
    cache_bytes = 80e9 * 0.9 - QWEN3_WEIGHT_BYTES
    expected = math.floor(cache_bytes / (QWEN3_KV_BYTES_PER_TOKEN * 16)) * 16
    got = kv_cache.kv_capacity_tokens(qwen3_setup(gpu_memory_utilization=0.9))
    assert got == expected
    assert got == pytest.approx(377_000, rel=0.01)


def test_a_2048_token_prefill_chunk_in_every_step_drops_forty_chats_to_about_13() -> None:
    """DESIGN §1 quotes ~15 tok/s: that figure came from one global max(memory, compute), which
    hid the KV read under the GEMMs. By phase, the chunk's GEMMs (compute-bound) and the 40 chats'
    KV read (memory-bound) run one after the other: 69.1 ms + 5.9 ms, so ~13.3 tok/s."""
    gemm_seconds = 2 * QWEN3_8B_PARAMS * (40 + 2048) / (0.5 * H100_BF16_DENSE_FLOPS)
    kv_seconds = 40 * 2000 * QWEN3_KV_BYTES_PER_TOKEN / EFFECTIVE_BANDWIDTH
    step = model.predict_step(qwen3_setup(), [RequestGroup(40, 2000)], prefill_tokens_per_step=2048)
    assert step.gemm_compute_seconds == pytest.approx(gemm_seconds, rel=1e-9)
    assert step.gemm_seconds == step.gemm_compute_seconds > step.weight_memory_seconds
    assert step.attention_seconds == pytest.approx(kv_seconds, rel=1e-9)  # the chunk's attention FLOPs are smaller
    assert step.user_tokens_per_second == pytest.approx(1 / (gemm_seconds + kv_seconds), rel=1e-9)
    assert step.user_tokens_per_second == pytest.approx(13.3, rel=0.01)


def test_a_prefill_chunk_deep_into_a_long_prompt_costs_its_attention_flops() -> None:
    """A 2,048-token chunk after 100,000 tokens of its prompt: each of its tokens attends to ~101,024
    tokens on all 36 layers and 32 query heads of 128 dims, 4 FLOPs per pair: ~1.2 PFLOP, ~2.5 s per step,
    that dwarfs its GEMMs."""
    setup = qwen3_setup()
    attention_flops = 4 * 36 * 32 * 128 * 2048 * (100_000 + 1024)
    step = model.predict_step(setup, [], prefill_tokens_per_step=2048, prefill_context_tokens=100_000)
    assert step.attention_compute_seconds == pytest.approx(attention_flops / (0.5 * H100_BF16_DENSE_FLOPS), rel=1e-9)
    assert step.attention_seconds > step.gemm_seconds
    assert step.step_seconds == pytest.approx(step.gemm_seconds + attention_flops / (0.5 * H100_BF16_DENSE_FLOPS))


# --- Llama-3.1-8B fp16 -------------------------------------------------------------------------

LLAMA_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2


def test_llama_31_8b_kv_bytes_per_token_is_128_kib_and_250_mib_per_2000_token_request() -> None:
    arch = get_model_preset("llama-3.1-8b")
    assert kv_bytes_per_token(arch, 2.0) == LLAMA_KV_BYTES_PER_TOKEN == 128 * KIB
    per_request = kv_cache.sequence_cache_bytes(arch, 2000, 2.0)
    assert per_request == 2000 * LLAMA_KV_BYTES_PER_TOKEN  # 2,000 is 125 whole blocks of 16
    assert per_request / 2**20 == pytest.approx(250, rel=0.01)


def test_52_gb_of_cache_holds_about_200_sequences_at_2000_and_50_at_8000() -> None:
    arch = get_model_preset("llama-3.1-8b")
    cache_bytes = 52e9
    weights = arch.params * 2
    # A setup whose cache is exactly 52 GB: 90% of 80 GB minus the weights minus the reserve.
    setup = build_setup(arch, "h100-sxm", weight_dtype="fp16",
                        reserved_memory_bytes=80e9 * 0.9 - weights - cache_bytes).setup
    assert kv_cache.kv_cache_bytes(setup) == pytest.approx(cache_bytes)
    at_2000 = math.floor(cache_bytes / (2000 * LLAMA_KV_BYTES_PER_TOKEN))
    at_8000 = math.floor(cache_bytes / (8000 * LLAMA_KV_BYTES_PER_TOKEN))
    assert kv_cache.max_concurrency(setup, 2000) == at_2000
    assert kv_cache.max_concurrency(setup, 8000) == at_8000
    assert at_2000 == pytest.approx(200, rel=0.02)
    assert at_8000 == pytest.approx(50, rel=0.03)


def test_a_1001_token_sequence_holds_63_blocks_of_16() -> None:
    assert kv_cache.blocks_for_tokens(1001, 16) == math.ceil(1001 / 16) == 63
    arch = get_model_preset("llama-3.1-8b")
    assert kv_cache.sequence_cache_bytes(arch, 1001, 2.0) == 63 * 16 * LLAMA_KV_BYTES_PER_TOKEN


# --- the pieces of the physics -----------------------------------------------------------------


def test_gqa_uses_key_value_heads_not_attention_heads() -> None:
    gqa = get_model_preset("llama-3.1-8b")
    mha = replace(gqa, kv_heads=gqa.attention_heads)
    assert kv_bytes_per_token(mha, 2.0) == 2 * 32 * 32 * 128 * 2
    assert kv_bytes_per_token(mha, 2.0) / kv_bytes_per_token(gqa, 2.0) == 32 / 8


def test_head_dim_is_used_as_given() -> None:
    arch = get_model_preset("gemma-3-27b")  # head_dim 128 although hidden / heads = 168
    assert kv_bytes_per_token(arch, 2.0) == 2 * 62 * 16 * 128 * 2


def test_fp8_kv_cache_halves_the_kv_term_only() -> None:
    loads = [RequestGroup(40, 2000)]
    bf16 = model.predict_step(qwen3_setup(), loads)
    fp8 = model.predict_step(qwen3_setup(kv_cache_dtype="fp8"), loads)
    assert fp8.kv_read_bytes == bf16.kv_read_bytes / 2
    assert fp8.weight_read_bytes == bf16.weight_read_bytes
    assert kv_cache.kv_capacity_tokens(qwen3_setup(kv_cache_dtype="fp8")) == pytest.approx(
        2 * kv_cache.kv_capacity_tokens(qwen3_setup()), abs=16)


def test_weight_quantization_leaves_the_kv_term_untouched() -> None:
    loads = [RequestGroup(40, 2000)]
    bf16 = model.predict_step(qwen3_setup(), loads)
    int4 = model.predict_step(qwen3_setup(weight_dtype="awq"), loads)
    assert int4.weight_read_bytes == QWEN3_8B_PARAMS * 0.5
    assert int4.kv_read_bytes == bf16.kv_read_bytes


def test_mla_caches_one_latent_plus_rotary_key_per_layer_with_no_factor_two() -> None:
    arch = get_model_preset("deepseek-v3")
    expected = 61 * (512 + 64) * 2
    assert kv_bytes_per_token(arch, 2.0) == expected
    # Every TP rank holds the whole latent: tensor parallelism does not split it.
    assert kv_bytes_per_token(arch, 2.0, tensor_parallel=8) == expected


def test_sliding_window_layers_hold_at_most_the_window() -> None:
    mistral = get_model_preset("mistral-7b")  # every layer slides, window 4096
    per_layer = 2 * 8 * 128 * 2
    assert kv_bytes_for_context(mistral, 1000, 2.0) == 32 * per_layer * 1000
    assert kv_bytes_for_context(mistral, 10_000, 2.0) == 32 * per_layer * 4096
    gemma = get_model_preset("gemma-3-27b")  # 52 sliding layers at 1024, 10 full
    gemma_layer = 2 * 16 * 128 * 2
    for context in (500, 1024, 30_000):
        expected = gemma_layer * (10 * context + 52 * min(context, 1024))
        assert kv_bytes_for_context(gemma, context, 2.0) == expected


def test_moe_expected_distinct_experts_follows_the_coverage_formula() -> None:
    experts, k = 128, 8
    for tokens in (1, 2, 16, 100):
        assert expected_distinct_experts(experts, k, tokens) == pytest.approx(
            experts * (1 - (1 - k / experts) ** tokens))
    assert expected_distinct_experts(experts, k, 1) == pytest.approx(k)
    assert expected_distinct_experts(experts, k, 0) == 0


def test_small_moe_batches_read_far_less_than_the_whole_model() -> None:
    arch = get_model_preset("qwen3-30b-a3b")
    shared = arch.params - arch.routed_expert_params
    one_token = weight_read_bytes(arch, 2.0, 1)
    assert one_token == pytest.approx((shared + arch.routed_expert_params * 8 / 128) * 2)
    assert one_token < 0.15 * weight_bytes(arch, 2.0)
    big_batch = weight_read_bytes(arch, 2.0, 1000)
    assert big_batch == pytest.approx(weight_bytes(arch, 2.0), rel=1e-3)


def test_tensor_parallel_splits_weights_and_kv_heads_down_to_one_head_per_gpu() -> None:
    arch = get_model_preset("llama-3.1-8b")  # 8 KV heads
    assert weight_bytes(arch, 2.0, 4) == arch.params * 2 / 4
    assert kv_bytes_per_token(arch, 2.0, 2) == 2 * 32 * (8 / 2) * 128 * 2
    assert kv_bytes_per_token(arch, 2.0, 16) == 2 * 32 * 1 * 128 * 2  # max(1, 8/16)


# Phi-3-medium's attention layout: 40 query heads, 10 KV heads (head_dim 128, 40 layers).
PHI3_MEDIUM = Architecture("phi-3-medium", layers=40, hidden_size=5120, attention_heads=40, kv_heads=10,
                           head_dim=128, params=14e9)


@pytest.mark.parametrize("tp, vllm_says", [
    (3, "Total number of attention heads (40) must be divisible by tensor parallel size (3)."),
    (4, "10 is not divisible by 4"),  # 40 % 4 == 0, but 4 GPUs cannot split 10 KV heads evenly
    (8, "10 is not divisible by 8"),
])
def test_tensor_parallel_vllm_refuses_is_refused_with_its_reason(tp: int, vllm_says: str) -> None:
    with pytest.raises(InputError) as caught:
        check_tensor_parallel(PHI3_MEDIUM, tp)
    assert vllm_says in str(caught.value) and "tensor parallel" in str(caught.value)
    with pytest.raises(InputError, match="vLLM refuses it"):
        build_setup(PHI3_MEDIUM, "h100-sxm", tensor_parallel=tp)


@pytest.mark.parametrize("tp", [1, 2, 5, 10, 20, 40])  # divisors of 10, or multiples of 10 that divide 40
def test_tensor_parallel_vllm_accepts_is_accepted(tp: int) -> None:
    check_tensor_parallel(PHI3_MEDIUM, tp)
    assert build_setup(PHI3_MEDIUM, "h100-sxm", tensor_parallel=tp).setup.tensor_parallel == tp


def test_kv_heads_per_gpu_splits_or_replicates_as_vllm_does() -> None:
    assert kv_heads_per_gpu(PHI3_MEDIUM, 2) == 5   # 10 // 2
    assert kv_heads_per_gpu(PHI3_MEDIUM, 5) == 2   # 10 // 5
    assert kv_heads_per_gpu(PHI3_MEDIUM, 20) == 1  # 20 GPUs, each KV head held by 2 of them
    setup = build_setup(PHI3_MEDIUM, "h100-sxm", tensor_parallel=20).setup
    assert kv_bytes_per_token(PHI3_MEDIUM, 2.0, setup.tensor_parallel) == 2 * 40 * 1 * 128 * 2


def test_mla_needs_only_the_attention_heads_to_divide() -> None:
    """vLLM's MLA attention checks num_heads % tp only; its latent cache has no KV heads to split."""
    odd_kv = replace(get_model_preset("deepseek-v3"), kv_heads=3)
    check_tensor_parallel(odd_kv, 8)
    with pytest.raises(InputError, match=r"attention heads \(128\) must be divisible by tensor parallel size \(3\)"):
        check_tensor_parallel(odd_kv, 3)


@pytest.mark.parametrize("overhead", [-0.001, math.nan, math.inf])
def test_a_setup_refuses_a_negative_or_non_finite_step_overhead(overhead: float) -> None:
    with pytest.raises(InputError, match="step_overhead_seconds must be a finite number >= 0"):
        qwen3_setup(step_overhead_seconds=overhead)
    assert qwen3_setup(step_overhead_seconds=0.0).step_overhead_seconds == 0


def test_step_is_overhead_plus_per_request_cost_plus_each_phase_at_its_own_roof() -> None:
    setup = qwen3_setup(step_overhead_seconds=0.002)
    setup = replace(setup, per_request_seconds=50e-6)
    memory_bound = model.predict_step(setup, [RequestGroup(10, 1000)])
    assert memory_bound.step_seconds == pytest.approx(0.002 + 10 * 50e-6 + memory_bound.memory_seconds)
    compute_bound = model.predict_step(setup, [RequestGroup(10, 1000)], prefill_tokens_per_step=8192,
                                       prefill_context_tokens=0)
    gemm_seconds = 2 * QWEN3_8B_PARAMS * (10 + 8192) / (0.5 * H100_BF16_DENSE_FLOPS)
    kv_seconds = 10 * 1000 * QWEN3_KV_BYTES_PER_TOKEN / EFFECTIVE_BANDWIDTH
    attention_seconds = 4 * 36 * 32 * 128 * (10 * 1000 + 8192 * 4096) / (0.5 * H100_BF16_DENSE_FLOPS)
    assert compute_bound.step_seconds == pytest.approx(
        0.002 + 10 * 50e-6 + gemm_seconds + max(kv_seconds, attention_seconds), rel=1e-9)


def test_a_per_request_cost_needs_a_context_for_the_token_budget() -> None:
    setup = replace(qwen3_setup(), per_request_seconds=100e-6)
    with pytest.raises(InputError, match="context"):
        model.token_budget_tokens(setup, 0.018)
    # 1,000 requests of 2,000 tokens are far over; the budget is where 0.018 s is reached.
    budget = model.token_budget_tokens(setup, 0.018, context_tokens_per_request=2000)
    requests = budget / 2000
    step = (QWEN3_WEIGHT_BYTES + budget * QWEN3_KV_BYTES_PER_TOKEN) / EFFECTIVE_BANDWIDTH + 100e-6 * math.ceil(requests)
    assert step == pytest.approx(0.018, rel=0.01)


def test_a_quantized_checkpoint_keeps_its_embeddings_in_16_bits_and_looks_the_input_table_up() -> None:
    arch = replace(get_model_preset("qwen3-8b"), input_embedding_params=151_936 * 4096,
                   unquantized_params=2 * 151_936 * 4096 + 73 * 4096)
    sixteen_bit = 2 * 151_936 * 4096 + 73 * 4096
    resident = sixteen_bit * 2 + (QWEN3_8B_PARAMS - sixteen_bit) * 0.5
    assert weight_bytes(arch, 0.5) == pytest.approx(resident)
    # A step of 3 tokens reads everything but the input table, of which it looks up 3 rows.
    table = 151_936 * 4096 * 2
    assert weight_read_bytes(arch, 0.5, 3) == pytest.approx(resident - table + 3 * 4096 * 2)
    # Unquantized, every parameter is 16-bit and the table is still looked up, not read.
    assert weight_read_bytes(arch, 2.0, 1) == pytest.approx(QWEN3_WEIGHT_BYTES - table + 4096 * 2)


def test_closed_form_and_numeric_budget_agree_for_a_plain_model() -> None:
    setup = qwen3_setup()
    step_budget = model.step_budget_seconds(50, 0.9)
    closed = model.token_budget_tokens(setup, step_budget)
    numeric = model.token_budget_tokens(setup, step_budget, context_tokens_per_request=2000)
    assert numeric == pytest.approx(closed, abs=1.0)


def test_budget_is_zero_when_the_model_alone_misses_the_target() -> None:
    setup = qwen3_setup()
    weights_alone_seconds = QWEN3_WEIGHT_BYTES / EFFECTIVE_BANDWIDTH
    target = 1.5 / weights_alone_seconds  # a step budget of 0.9/target is shorter than reading the weights
    step_budget = model.step_budget_seconds(target, 0.9)
    assert step_budget < weights_alone_seconds
    assert model.token_budget_tokens(setup, step_budget) == 0
    assert model.token_budget_tokens(setup, step_budget, context_tokens_per_request=2000) == 0


def test_sliding_window_and_moe_budgets_need_a_context() -> None:
    setup = build_setup(get_model_preset("gemma-3-27b"), "h200").setup
    with pytest.raises(InputError, match="context"):
        model.token_budget_tokens(setup, 0.018)


# --- calibration -------------------------------------------------------------------------------


def test_calibration_with_one_point_divides_bytes_by_the_gap() -> None:
    read_bytes = QWEN3_WEIGHT_BYTES + 2000 * QWEN3_KV_BYTES_PER_TOKEN
    result = fit.calibrate([CalibrationPoint(0.009, 2000, read_bytes)])
    assert result.effective_bandwidth_bytes_per_second == pytest.approx(read_bytes / 0.009)
    assert result.step_overhead_seconds == 0
    assert not result.overhead_fitted
    assert result.agrees


def test_calibration_with_two_points_fits_bandwidth_and_overhead() -> None:
    bandwidth, overhead = 2.2e12, 0.0015
    reads = [QWEN3_WEIGHT_BYTES + c * QWEN3_KV_BYTES_PER_TOKEN for c in (500, 60_000)]
    points = [CalibrationPoint(overhead + r / bandwidth, c, r) for r, c in zip(reads, (500, 60_000), strict=True)]
    result = fit.calibrate(points)
    assert result.overhead_fitted
    assert result.effective_bandwidth_bytes_per_second == pytest.approx(bandwidth, rel=1e-9)
    assert result.step_overhead_seconds == pytest.approx(overhead, rel=1e-6)
    assert all(abs(r) < 1e-9 for r in result.residual_ratios)
    # Each point's own bandwidth (overhead included in its gap) differs: the spread says by how much.
    own = [r / (overhead + r / bandwidth) for r in reads]
    assert result.spread_ratio == pytest.approx(max(own) / min(own) - 1)


def test_calibration_flags_points_that_disagree() -> None:
    reads = [QWEN3_WEIGHT_BYTES + c * QWEN3_KV_BYTES_PER_TOKEN for c in (1000, 100_000)]
    # The long stream is twice as slow per byte as the short one.
    points = [CalibrationPoint(reads[0] / 2e12, 1000, reads[0]), CalibrationPoint(reads[1] / 1e12, 100_000, reads[1])]
    result = fit.calibrate(points)
    assert result.spread_ratio == pytest.approx(1.0)
    assert not result.agrees


# --- properties --------------------------------------------------------------------------------

PRESET_NAMES = sorted(MODELS)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(PRESET_NAMES),
    tokens=st.floats(min_value=1, max_value=2e6),
    more_tokens=st.floats(min_value=0, max_value=2e6),
    requests=st.integers(min_value=1, max_value=512),
    more_requests=st.integers(min_value=0, max_value=512),
)
def test_step_time_never_decreases_as_tokens_in_flight_grow(
    name: str, tokens: float, more_tokens: float, requests: int, more_requests: int
) -> None:
    setup = build_setup(get_model_preset(name), "h100-sxm", tensor_parallel=8 if name == "deepseek-v3" else 1).setup
    smaller = model.predict_step(setup, model.groups_from_total(tokens, requests))
    larger = model.predict_step(setup, model.groups_from_total(tokens + more_tokens, requests + more_requests))
    assert larger.step_seconds >= smaller.step_seconds * (1 - 1e-12)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(PRESET_NAMES),
    target=st.floats(min_value=5, max_value=200),
    context=st.floats(min_value=100, max_value=200_000),
)
def test_the_budget_fits_its_step_budget(name: str, target: float, context: float) -> None:
    setup = build_setup(get_model_preset(name), "h200", tensor_parallel=8 if name == "deepseek-v3" else 1).setup
    step_budget = model.step_budget_seconds(target, 0.9)
    budget = model.token_budget_tokens(setup, step_budget, context_tokens_per_request=context)
    if budget > 0:
        groups = model._groups_of_context(budget, context)
        assert model.predict_step(setup, groups).step_seconds <= step_budget * (1 + 1e-12)
    # And it is the most that fits: one more token (the solver stops within half a token) misses.
    more = model._groups_of_context(budget + 1, context)
    assert model.predict_step(setup, more).step_seconds > step_budget


@settings(max_examples=60, deadline=None)
@given(
    per_request=st.floats(min_value=0, max_value=300e-6),
    overhead=st.floats(min_value=0, max_value=0.01),
    compute_efficiency=st.floats(min_value=0.005, max_value=0.6),
    target=st.floats(min_value=5, max_value=200),
    context=st.floats(min_value=1, max_value=200_000),
    looks_up_embeddings=st.booleans(),
)
def test_the_closed_form_budget_with_a_per_request_cost_is_the_most_that_fits(
    per_request: float, overhead: float, compute_efficiency: float, target: float, context: float,
    looks_up_embeddings: bool,
) -> None:
    # A dense model with a fitted per-request cost, overhead and (at low efficiencies) compute-bound
    # GEMMs: the budget is solved in closed form; it must fit, and one more token must not.
    setup = replace(qwen3_setup(), per_request_seconds=per_request, step_overhead_seconds=overhead,
                    effective_compute_flops_per_second=compute_efficiency * H100_BF16_DENSE_FLOPS)
    if looks_up_embeddings:  # each request looks one row of the input table up instead of reading it all
        setup = replace(setup, architecture=replace(setup.architecture, input_embedding_params=151_936 * 4096))
    step_budget = model.step_budget_seconds(target, 0.9)
    budget = model.token_budget_tokens(setup, step_budget, context_tokens_per_request=context)
    if budget > 0:
        assert model.step_seconds_at(setup, budget, context) <= step_budget * (1 + 1e-12)
    else:  # nothing fits: not even one request holding no context yet
        assert model.step_seconds_at(setup, 0.0, context) >= step_budget
    assert model.step_seconds_at(setup, budget + 1, context) > step_budget
    # ...and it agrees with the search it replaced on the poll path.
    assert budget == pytest.approx(model._solve_budget_numerically(setup, step_budget, context), abs=0.5)


NON_LINEAR_PRESETS = [name for name in PRESET_NAMES if not get_model_preset(name).is_linear]


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(NON_LINEAR_PRESETS),
    per_request=st.floats(min_value=0, max_value=300e-6),
    compute_share=st.sampled_from([1.0, 0.05, 0.01]),
    target=st.floats(min_value=3, max_value=100),
    context=st.sampled_from([1.0, 17.5, 300.0, 3000.0, 30_000.0, 200_000.0]),
)
def test_the_searched_budget_for_moe_and_windows_is_the_most_that_fits(
    name: str, per_request: float, compute_share: float, target: float, context: float
) -> None:
    # Steps that jump at each request (per-request cost, experts touched) and bend (windows, the
    # compute roof): the search must still end on the largest fitting count, to half a token.
    setup = build_setup(get_model_preset(name), "h200", tensor_parallel=8 if name == "deepseek-v3" else 1).setup
    setup = replace(setup, per_request_seconds=per_request,
                    effective_compute_flops_per_second=setup.effective_compute_flops_per_second * compute_share)
    step_budget = model.step_budget_seconds(target, 0.9)
    budget = model.token_budget_tokens(setup, step_budget, context_tokens_per_request=context)
    if budget > 0:
        assert model.step_seconds_at(setup, budget, context) <= step_budget
    assert model.step_seconds_at(setup, budget + 0.5, context) > step_budget


def test_the_mean_step_over_a_prefill_mix_is_the_mean_of_its_steps_by_hand() -> None:
    # 40 requests of 2,000 tokens; half the steps carry no prefill, a quarter 128 tokens and a quarter
    # 4,096: at 0.5 of the dense peak the 4,096-token steps are past the GEMM roof, the others are not.
    setup = replace(qwen3_setup(), step_overhead_seconds=0.001, per_request_seconds=20e-6)
    compute = 0.5 * H100_BF16_DENSE_FLOPS
    rest = 0.001 + 40 * 20e-6 + 40 * 2000 * QWEN3_KV_BYTES_PER_TOKEN / EFFECTIVE_BANDWIDTH
    weights = QWEN3_WEIGHT_BYTES / EFFECTIVE_BANDWIDTH

    def step(prefill: float) -> float:
        return rest + max(weights, 2 * QWEN3_8B_PARAMS * (40 + prefill) / compute)

    assert 2 * QWEN3_8B_PARAMS * 4136 / compute > weights > 2 * QWEN3_8B_PARAMS * 168 / compute
    mix = ((0.0, 2.0), (128.0, 1.0), (4096.0, 1.0))  # shares need not sum to 1
    expected = (2 * step(0) + step(128) + step(4096)) / 4
    got = model.predict_mean_step(setup, [RequestGroup(40, 2000)], mix)
    assert got == pytest.approx(expected, rel=1e-12)
    # ...which is more than the step at the mean prefill (1,056 tokens): the few big chunks cost more.
    assert got > step(1056) * (1 + 0.05)
    # An empty mix is the decode step alone.
    assert model.predict_mean_step(setup, [RequestGroup(40, 2000)], ()) == pytest.approx(step(0), rel=1e-12)
    # From a prediction already made with the window's mean prefill (what a reading has at hand), the
    # same mean, and the same decode step for an empty mix: that prefill changed only its GEMM phase.
    at_mean = model.predict_step(setup, [RequestGroup(40, 2000)], 1056.0)
    assert model.mean_step_over_mix(setup, at_mean, mix) == pytest.approx(expected, rel=1e-12)
    assert model.mean_step_over_mix(setup, at_mean, ()) == pytest.approx(step(0), rel=1e-12)


def test_a_windows_prefill_attends_to_its_mean_context_step_by_step() -> None:
    """A server's window says how many prompt tokens its steps computed and where in their prompts they
    stood on average, not how they split into chunks. 40 requests of 2,000 tokens; half the steps carry
    no prefill, half a 4,096-token chunk whose tokens stood 30,000 tokens into their prompts: those steps'
    attention is 4 FLOPs x 36 layers x 32 heads x 128 dims x 4,096 x 30,000, past the KV read; the others'
    is their KV read."""
    setup = qwen3_setup()
    compute = 0.5 * H100_BF16_DENSE_FLOPS
    kv = 40 * 2000 * QWEN3_KV_BYTES_PER_TOKEN / EFFECTIVE_BANDWIDTH
    weights = QWEN3_WEIGHT_BYTES / EFFECTIVE_BANDWIDTH
    decode_attention = 4 * 36 * 32 * 128 * 40 * 2000 / compute
    chunk_attention = 4 * 36 * 32 * 128 * 4096 * 30_000 / compute
    assert chunk_attention > kv > decode_attention

    def step(prefill: float, attention: float) -> float:
        return max(weights, 2 * QWEN3_8B_PARAMS * (40 + prefill) / compute) + max(kv, attention)

    groups = [RequestGroup(40, 2000)]
    chunk = model.predict_step(setup, groups, 4096, prefill_mean_context_tokens=30_000)
    assert chunk.step_seconds == pytest.approx(step(4096, decode_attention + chunk_attention), rel=1e-12)
    mix = ((0.0, 1.0), (4096.0, 1.0))
    expected = (step(0, decode_attention) + step(4096, decode_attention + chunk_attention)) / 2
    assert model.predict_mean_step(setup, groups, mix, 30_000) == pytest.approx(expected, rel=1e-12)
    at_mean = model.predict_step(setup, groups, 2048, prefill_mean_context_tokens=30_000)
    assert model.mean_step_over_mix(setup, at_mean, mix, 30_000) == pytest.approx(expected, rel=1e-12)
    # The mean context alone, without a mix: the step at the window's mean prefill.
    assert at_mean.step_seconds == pytest.approx(step(2048, decode_attention + chunk_attention / 2), rel=1e-12)
    with pytest.raises(InputError, match="not both"):
        model.predict_step(setup, groups, 2048, prefill_context_tokens=0, prefill_mean_context_tokens=30_000)


def test_the_mean_step_matches_predict_step_bucket_by_bucket_for_moe() -> None:
    # MoE: the prefill tokens also change which experts are read; the shortcut must still agree.
    setup = build_setup(get_model_preset("qwen3-30b-a3b"), "h100-sxm").setup
    groups = [RequestGroup(12, 3000)]
    mix = ((0.0, 0.6), (64.0, 0.3), (8192.0, 0.1))
    expected = sum(model.predict_step(setup, groups, tokens).step_seconds * share for tokens, share in mix)
    assert model.predict_mean_step(setup, groups, mix) == pytest.approx(expected, rel=1e-12)


def test_a_per_request_budget_by_hand_from_its_step_lines() -> None:
    # 100 us per request, memory-bound GEMMs, requests of 2,000 tokens at a 30 ms step budget.
    # (The preset reads its whole weights every step: no embedding table is looked up.)
    setup = replace(qwen3_setup(), per_request_seconds=100e-6)
    weights_seconds = QWEN3_WEIGHT_BYTES / EFFECTIVE_BANDWIDTH
    kv_per_request_seconds = 2000 * QWEN3_KV_BYTES_PER_TOKEN / EFFECTIVE_BANDWIDTH
    # n requests fit while the step at (n-1) full requests and an empty n-th is under 30 ms:
    # weights + n*100 us + (n-1)*kv_per_request < 0.030.
    root = (0.030 - weights_seconds + kv_per_request_seconds) / (100e-6 + kv_per_request_seconds)
    requests = math.ceil(root) - 1
    at_start = weights_seconds + requests * 100e-6 + (requests - 1) * kv_per_request_seconds
    expected = min(requests * 2000.0, (requests - 1) * 2000 + (0.030 - at_start) * EFFECTIVE_BANDWIDTH
                   / QWEN3_KV_BYTES_PER_TOKEN)
    assert model.token_budget_tokens(setup, 0.030, context_tokens_per_request=2000) == pytest.approx(
        expected, rel=1e-9)


def test_architecture_rejects_ssm_attention_kinds() -> None:
    with pytest.raises(InputError, match="not supported"):
        Architecture("x", layers=4, hidden_size=64, attention_heads=4, kv_heads=4, head_dim=16, params=1e6,
                     attention_kind="ssm")


def test_calibration_at_two_batch_sizes_fits_bandwidth_and_a_per_request_cost() -> None:
    setup = qwen3_setup()
    bandwidth, per_request = 2.0e12, 80e-6
    points = []
    for running in (1, 16):
        tokens = running * 2000.0
        read = QWEN3_WEIGHT_BYTES + tokens * QWEN3_KV_BYTES_PER_TOKEN
        points.append(model.calibration_point(setup, read / bandwidth + per_request * running, tokens, running))
    result = fit.calibrate(points)
    assert result.per_request_fitted and not result.overhead_fitted
    assert result.effective_bandwidth_bytes_per_second == pytest.approx(bandwidth, rel=1e-9)
    assert result.per_request_seconds == pytest.approx(per_request, rel=1e-6)
    assert result.effective_compute_flops_per_second is None
    assert result.residual_rms_seconds == pytest.approx(0, abs=1e-12)


def test_calibration_with_compute_bound_batches_fits_the_compute_rate() -> None:
    """Six batches from 1 to 512 at several contexts on a server with a 1 ms overhead, 30 us per
    request, 2.0 TB/s and 400 TFLOP/s: the large batches' GEMMs are compute-bound."""
    setup = qwen3_setup()
    bandwidth, compute, overhead, per_request = 2.0e12, 400e12, 1e-3, 30e-6
    points = []
    for running, context in ((1, 500), (8, 4000), (64, 1000), (128, 2000), (256, 700), (512, 1500)):
        tokens = running * float(context)
        weights_seconds = QWEN3_WEIGHT_BYTES / bandwidth
        gemm_seconds = max(weights_seconds, 2 * QWEN3_8B_PARAMS * running / compute)
        itl = overhead + per_request * running + gemm_seconds + tokens * QWEN3_KV_BYTES_PER_TOKEN / bandwidth
        points.append(model.calibration_point(setup, itl, tokens, running))
    result = fit.calibrate(points)
    assert result.per_request_fitted and result.overhead_fitted
    assert result.effective_compute_flops_per_second is not None
    assert result.effective_compute_flops_per_second == pytest.approx(compute, rel=0.06)  # the search grid's step
    assert max(abs(r) for r in result.residual_ratios) < 0.03


def test_one_context_at_every_batch_size_cannot_split_overhead_from_per_request_cost() -> None:
    """read = weights + kv·c·N makes the overhead, per-request and bandwidth columns dependent."""
    setup = qwen3_setup()
    points = [model.calibration_point(setup, 0.008 + 100e-6 * n, n * 1000.0, n) for n in (1, 8, 64)]
    result = fit.calibrate(points)
    assert result.per_request_fitted and not result.overhead_fitted
    assert any("cannot tell" in note for note in result.notes)
