"""Model presets, each counted by hand from its architecture numbers.

Every count below is written out from the model's config.json numbers (layers, widths, heads, experts,
vocabulary, tied or not) so that a preset's `params` is checked against arithmetic anyone can redo, and
that arithmetic against the figure its makers published (within 2%). The helpers only name the pieces a
transformer layer is made of; which pieces a model has, and their sizes, are spelled out in each test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exporter.capacity.architecture import kv_bytes_for_context, kv_bytes_per_token
from exporter.capacity.hf_config import load_hf_config
from exporter.capacity.presets import get_model_preset
from exporter.errors import UnsupportedModelError


def gqa_attention(hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """q and o are heads x head_dim wide, k and v kv_heads x head_dim; no biases."""
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim


def gated_mlp(hidden: int, intermediate: int) -> int:
    """gate, up and down projections (SwiGLU), no biases."""
    return 3 * hidden * intermediate


# --- gpt-oss ------------------------------------------------------------------------------------

GPT_OSS_HIDDEN, GPT_OSS_VOCAB, GPT_OSS_EXPERT_WIDTH = 2880, 201088, 2880


def gpt_oss_expert() -> int:
    """One expert: gate_up (hidden -> 2 x width) and down (width -> hidden), each with its bias."""
    hidden, width = GPT_OSS_HIDDEN, GPT_OSS_EXPERT_WIDTH
    return hidden * 2 * width + 2 * width + width * hidden + hidden


def gpt_oss_counts(layers: int, experts: int) -> tuple[int, int]:
    """(total, routed) parameters of a gpt-oss model: 64 query heads, 8 KV heads of 64, biased q/k/v/o,
    one sink logit per head, a biased router, two norms per layer, untied embeddings, a final norm."""
    hidden, heads, kv_heads, head_dim = GPT_OSS_HIDDEN, 64, 8, 64
    attention = gqa_attention(hidden, heads, kv_heads, head_dim)
    attention += heads * head_dim + 2 * kv_heads * head_dim + hidden  # q, k, v and o biases
    attention += heads  # the sinks
    router = experts * hidden + experts
    per_layer = attention + 2 * hidden + router + experts * gpt_oss_expert()
    total = layers * per_layer + 2 * GPT_OSS_VOCAB * hidden + hidden
    return total, layers * experts * gpt_oss_expert()


@pytest.mark.parametrize(("name", "layers", "experts", "published_total", "published_active"), [
    ("gpt-oss-120b", 36, 128, 116.83e9, 5.13e9),  # OpenAI's gpt-oss model card, Table 1
    ("gpt-oss-20b", 24, 32, 20.91e9, 3.61e9),
])
def test_gpt_oss_counts_by_hand(name: str, layers: int, experts: int, published_total: float,
                                published_active: float) -> None:
    total, routed = gpt_oss_counts(layers, experts)
    assert total == pytest.approx(published_total, rel=0.02)
    # The card's active count leaves out the input embedding (a lookup), keeps the unembedding.
    input_table = GPT_OSS_VOCAB * GPT_OSS_HIDDEN
    active = total - routed + routed * 4 // experts
    assert active - input_table == pytest.approx(published_active, rel=0.02)
    preset = get_model_preset(name)
    assert (preset.params, preset.routed_expert_params) == (total, routed)
    assert (preset.experts, preset.experts_per_token) == (experts, 4)
    assert preset.input_embedding_params == input_table
    # MXFP4 experts, everything else kept in 16 bits (modules_to_not_convert).
    assert (preset.checkpoint_weight_dtype, preset.unquantized_params) == ("int4", total - routed)


def test_gpt_oss_kv_bytes_by_hand_and_the_window_on_every_other_layer() -> None:
    preset = get_model_preset("gpt-oss-120b")
    layers, kv_heads, head_dim, bf16 = 36, 8, 64, 2
    assert kv_bytes_per_token(preset, bf16) == layers * 2 * kv_heads * head_dim * bf16
    assert (preset.sliding_window, preset.sliding_window_layers) == (128, layers // 2)
    # A 10,000-token request: the 18 full layers hold all of it, the 18 sliding layers their last 128.
    per_layer = 2 * kv_heads * head_dim * bf16
    assert kv_bytes_for_context(preset, 10_000, bf16) == per_layer * (18 * 10_000 + 18 * 128)


# --- dense ---------------------------------------------------------------------------------------


def test_llama_33_70b_count_by_hand() -> None:
    hidden, layers, inter, vocab = 8192, 80, 28672, 128256  # Llama 3.1 70B's architecture
    per_layer = gqa_attention(hidden, 64, 8, 128) + gated_mlp(hidden, inter) + 2 * hidden
    expected = layers * per_layer + 2 * vocab * hidden + hidden  # untied embeddings + final norm
    assert expected == pytest.approx(70.6e9, rel=0.02)  # Llama 3.1/3.3 model card: 70B (70.6B)
    preset = get_model_preset("llama-3.3-70b")
    assert preset.params == expected
    assert (preset.layers, preset.attention_heads, preset.kv_heads, preset.head_dim) == (layers, 64, 8, 128)
    assert kv_bytes_per_token(preset, 2.0) == kv_bytes_per_token(get_model_preset("llama-3.1-70b"), 2.0)


def test_qwen3_32b_count_by_hand() -> None:
    hidden, layers, inter, vocab, head_dim = 5120, 64, 25600, 151936, 128
    qk_norms = 2 * head_dim
    per_layer = gqa_attention(hidden, 64, 8, head_dim) + qk_norms + gated_mlp(hidden, inter) + 2 * hidden
    expected = layers * per_layer + 2 * vocab * hidden + hidden
    assert expected == pytest.approx(32.8e9, rel=0.02)  # Qwen3-32B model card: 32.8B
    preset = get_model_preset("qwen3-32b")
    assert preset.params == expected
    assert (preset.layers, preset.attention_heads, preset.kv_heads, preset.head_dim) == (layers, 64, 8, head_dim)


def test_mistral_small_31_counts_its_language_model_by_hand() -> None:
    hidden, layers, inter, vocab, head_dim = 5120, 40, 32768, 131072, 128
    per_layer = gqa_attention(hidden, 32, 8, head_dim) + gated_mlp(hidden, inter) + 2 * hidden
    expected = layers * per_layer + 2 * vocab * hidden + hidden
    # Model card: 24B with the vision encoder; the language model is what a decode step reads.
    assert expected == pytest.approx(24e9, rel=0.02)
    preset = get_model_preset("mistral-small-3.1-24b")
    assert preset.params == expected
    assert (preset.kv_heads, preset.head_dim, preset.sliding_window_layers) == (8, head_dim, 0)


# --- mixture of experts with GQA -----------------------------------------------------------------


def test_qwen3_235b_a22b_count_by_hand() -> None:
    hidden, layers, vocab, head_dim, experts, width = 4096, 94, 151936, 128, 128, 1536
    router = hidden * experts  # no bias
    per_layer = gqa_attention(hidden, 64, 4, head_dim) + 2 * head_dim + 2 * hidden + router \
        + experts * gated_mlp(hidden, width)
    expected = layers * per_layer + 2 * vocab * hidden + hidden
    routed = layers * experts * gated_mlp(hidden, width)
    assert expected == pytest.approx(235e9, rel=0.02)  # model card: 235B total
    preset = get_model_preset("qwen3-235b-a22b")
    assert (preset.params, preset.routed_expert_params) == (expected, routed)
    assert (preset.experts, preset.experts_per_token, preset.kv_heads) == (experts, 8, 4)
    assert preset.active_params == pytest.approx(22e9, rel=0.02)  # model card: 22B activated


def test_llama_4_scout_counts_its_language_model_by_hand() -> None:
    hidden, layers, vocab, head_dim, experts, width = 5120, 48, 202048, 128, 16, 8192
    router = hidden * experts  # no bias; the qk norm is an L2 norm without weights
    shared_expert = gated_mlp(hidden, width)
    per_layer = gqa_attention(hidden, 40, 8, head_dim) + 2 * hidden + router + shared_expert \
        + experts * gated_mlp(hidden, width)  # interleave_moe_layer_step 1: every layer is MoE
    expected = layers * per_layer + 2 * vocab * hidden + hidden
    routed = layers * experts * gated_mlp(hidden, width)
    assert expected == pytest.approx(109e9, rel=0.02)  # model card: 109B, with the vision encoder
    preset = get_model_preset("llama-4-scout")
    assert (preset.params, preset.routed_expert_params) == (expected, routed)
    assert (preset.experts, preset.experts_per_token) == (experts, 1)
    assert preset.active_params == pytest.approx(17e9, rel=0.02)  # model card: 17B active
    # Chunked attention (8192) on three layers in four, modelled as a window; every fourth layer is full.
    assert (preset.sliding_window, preset.sliding_window_layers) == (8192, layers * 3 // 4)


# --- MLA (DeepSeek-V3's layout) ------------------------------------------------------------------


def mla_attention(hidden: int, heads: int, q_lora: int, kv_lora: int, nope: int, rope: int, v_dim: int) -> int:
    """DeepSeek-V3's attention: q_a (hidden -> q_lora) and its norm, q_b (q_lora -> heads x (nope + rope)),
    kv_a (hidden -> kv_lora + rope) and its norm, kv_b (kv_lora -> heads x (nope + v)), o (heads x v -> hidden)."""
    queries = hidden * q_lora + q_lora + q_lora * heads * (nope + rope)
    keys_values = hidden * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim)
    return queries + keys_values + heads * v_dim * hidden


def deepseek_v3_layout(heads: int, experts: int, dense_layers: int, vocab: int) -> tuple[int, int]:
    """(total, routed) parameters of a DeepSeek-V3-layout model of 61 layers at hidden 7168: MLA with q_lora
    1536, kv_lora 512, nope 128, rope 64, v 128; dense layers of 18432; MoE layers of `experts` routed and one
    shared expert of 2048, a router with one score-correction bias per expert; untied embeddings."""
    hidden, layers, width = 7168, 61, 2048
    attention = mla_attention(hidden, heads, 1536, 512, 128, 64, 128)
    moe_layers = layers - dense_layers
    routed = moe_layers * experts * gated_mlp(hidden, width)
    moe = routed + moe_layers * (gated_mlp(hidden, width) + experts * hidden + experts)
    dense = dense_layers * gated_mlp(hidden, 18432)
    total = layers * (attention + 2 * hidden) + moe + dense + 2 * vocab * hidden + hidden
    return total, routed


def test_deepseek_r1_count_by_hand() -> None:
    total, routed = deepseek_v3_layout(heads=128, experts=256, dense_layers=3, vocab=129280)
    assert total == pytest.approx(671e9, rel=0.02)  # model card: 671B (the MTP layer aside)
    preset = get_model_preset("deepseek-r1")
    assert (preset.params, preset.routed_expert_params) == (total, routed)
    assert preset.active_params == pytest.approx(37e9, rel=0.03)  # model card: 37B activated
    v3 = get_model_preset("deepseek-v3")
    assert (preset.layers, preset.kv_lora_rank, preset.qk_rope_head_dim, preset.experts) == \
        (v3.layers, v3.kv_lora_rank, v3.qk_rope_head_dim, v3.experts)


def test_kimi_k2_count_and_its_latent_cache_by_hand() -> None:
    total, routed = deepseek_v3_layout(heads=64, experts=384, dense_layers=1, vocab=163840)
    assert total == pytest.approx(1.04e12, rel=0.02)  # Moonshot's model card and technical report: 1.04T
    preset = get_model_preset("kimi-k2")
    assert (preset.params, preset.routed_expert_params) == (total, routed)
    assert (preset.experts, preset.experts_per_token, preset.attention_heads) == (384, 8, 64)
    # 32B activated; the count with the input table (a lookup) is 2.7% over it, without it 1% under.
    assert preset.active_params == pytest.approx(32e9, rel=0.03)
    # MLA caches one 512-wide latent and the 64-wide rotary key per layer, not K and V per head.
    layers, kv_lora, rope, bf16 = 61, 512, 64, 2
    assert kv_bytes_per_token(preset, bf16) == layers * (kv_lora + rope) * bf16


def test_a_llama_4_config_json_is_refused_naming_the_preset(tmp_path: Path) -> None:
    """Llama 4 nests its language model under `text_config` (model_type llama4_text) and its `intermediate_size` is
    one expert's: read as a Llama it would lose the shared expert, so it is refused with the preset to use."""
    path = tmp_path / "Llama-4-Scout-17B-16E-Instruct" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"model_type": "llama4", "text_config": {
        "model_type": "llama4_text", "num_hidden_layers": 48, "hidden_size": 5120, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
        "num_local_experts": 16, "num_experts_per_tok": 1, "vocab_size": 202048, "attention_chunk_size": 8192}}))
    with pytest.raises(UnsupportedModelError, match="llama-4-scout"):
        load_hf_config(str(path))
