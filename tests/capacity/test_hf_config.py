"""Reading Hugging Face config.json files: architecture fields, parameter counts, refusals.

The fixtures under tests/data/hf_configs/ carry each family's real key names (as in the models'
published config.json files). Published parameter counts come from the model cards and
shared/reference/validation/model_architectures.csv.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from exporter.capacity.architecture import kv_bytes_for_context, kv_bytes_per_token, weight_bytes, weight_read_bytes
from exporter.capacity.deployment import build_setup, load_architecture
from exporter.capacity.hf_config import load_hf_config
from exporter.capacity.presets import get_model_preset
from exporter.errors import InputError, UnsupportedModelError
from tests.support.tools import DATA

CONFIGS = DATA / "hf_configs"

# folder -> published total parameters (source)
PUBLISHED_PARAMS: dict[str, tuple[float, str]] = {
    "Llama-2-7b-hf": (6.738e9, "model_architectures.csv, Llama-2 model card 7B"),
    "Llama-3.1-8B": (8.03e9, "model_architectures.csv, Llama 3.1 model card 8B"),
    "Mistral-7B-v0.1": (7.241e9, "model_architectures.csv, Mistral 7B paper 7.3B"),
    "Mixtral-8x7B-v0.1": (46.701e9, "model_architectures.csv, Mixtral paper 47B"),
    "Qwen2-7B": (7.615e9, "model_architectures.csv, Qwen2 model card 7.6B"),
    "Qwen3-8B": (8.2e9, "Qwen3-8B model card: 8.2B"),
    "Qwen3-30B-A3B": (30.5e9, "Qwen3-30B-A3B model card: 30.5B"),
    "gemma-2-9b": (9.24e9, "Gemma 2 9B: 9.24B safetensors total"),
    "gemma-3-27b-it": (27.0e9, "Gemma 3 27B: 27.4B with the 0.4B SigLIP vision tower"),
    "DeepSeek-V3": (671e9, "DeepSeek-V3 technical report: 671B (plus 14B MTP module)"),
    "mpt-7b": (6.649e9, "model_architectures.csv, MPT-7B 6.7B"),
    "opt-1.3b": (1.311e9, "model_architectures.csv, OPT paper 1.3B"),
}


def config(folder: str) -> str:
    return str(CONFIGS / folder / "config.json")


@pytest.mark.parametrize("folder", sorted(PUBLISHED_PARAMS))
def test_counted_parameters_match_the_published_count_within_two_percent(folder: str) -> None:
    published, _source = PUBLISHED_PARAMS[folder]
    assert load_hf_config(config(folder)).params == pytest.approx(published, rel=0.02)


def test_llama_31_8b_count_is_exact_by_hand() -> None:
    hidden, layers, inter, vocab = 4096, 32, 14336, 128256
    attention = hidden * 4096 * 2 + hidden * 1024 * 2  # q, o: 32x128 wide; k, v: 8x128
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    expected = layers * per_layer + 2 * vocab * hidden + hidden  # untied embeddings + final norm
    arch = load_hf_config(config("Llama-3.1-8B"))
    assert arch.params == expected
    assert (arch.layers, arch.hidden_size, arch.attention_heads, arch.kv_heads, arch.head_dim) == (32, 4096, 32, 8, 128)
    assert kv_bytes_per_token(arch, 2.0) == kv_bytes_per_token(get_model_preset("llama-3.1-8b"), 2.0)


def test_mpt_tied_plain_mlp_count_by_hand() -> None:
    d, layers, vocab = 4096, 32, 50432
    per_layer = 4 * d * d + 2 * d * 4 * d + 2 * d  # Wqkv + out_proj, up + down, two LayerNorm weights
    expected = layers * per_layer + vocab * d + d  # tied embedding, ALiBi (no positions), final norm
    arch = load_hf_config(config("mpt-7b"))
    assert arch.params == expected
    assert arch.kv_heads == 32 and arch.head_dim == 128


def test_opt_counts_biases_learned_positions_and_tied_embeddings() -> None:
    h, ffn, layers, vocab, positions = 2048, 8192, 24, 50272, 2048 + 2
    per_layer = 4 * (h * h + h) + (h * ffn + ffn) + (ffn * h + h) + 2 * 2 * h
    expected = layers * per_layer + vocab * h + positions * h + 2 * h
    assert load_hf_config(config("opt-1.3b")).params == expected


def test_gqa_heads_and_default_head_dim() -> None:
    arch = load_hf_config(config("Qwen2-7B"))  # no head_dim key: hidden / heads
    assert arch.head_dim == 3584 // 28 == 128
    assert arch.kv_heads == 4
    assert arch.sliding_window_layers == 0  # use_sliding_window is false


def test_mistral_slides_on_every_layer() -> None:
    arch = load_hf_config(config("Mistral-7B-v0.1"))
    assert (arch.sliding_window, arch.sliding_window_layers) == (4096, 32)


def test_gemma2_slides_on_every_other_layer() -> None:
    arch = load_hf_config(config("gemma-2-9b"))
    assert (arch.sliding_window, arch.sliding_window_layers) == (4096, 21)
    assert arch.head_dim == 256


def test_gemma3_reads_text_config_and_one_global_layer_in_six() -> None:
    arch = load_hf_config(config("gemma-3-27b-it"))
    assert (arch.layers, arch.kv_heads, arch.head_dim) == (62, 16, 128)
    assert (arch.sliding_window, arch.sliding_window_layers) == (1024, 62 - 62 // 6)
    preset = get_model_preset("gemma-3-27b")
    assert kv_bytes_for_context(arch, 5000, 2.0) == kv_bytes_for_context(preset, 5000, 2.0)


def test_layer_types_decide_which_layers_slide(tmp_path: Path) -> None:
    raw = json.loads(Path(config("Qwen3-8B")).read_text())
    raw.update(num_hidden_layers=4, sliding_window=512,
               layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    arch = load_hf_config(str(path))
    assert (arch.sliding_window, arch.sliding_window_layers) == (512, 3)


def test_mixtral_and_qwen3_moe_expert_fields() -> None:
    mixtral = load_hf_config(config("Mixtral-8x7B-v0.1"))
    assert (mixtral.experts, mixtral.experts_per_token) == (8, 2)
    assert mixtral.routed_expert_params == 32 * 8 * 3 * 4096 * 14336
    assert mixtral.active_params == pytest.approx(12.9e9, rel=0.02)  # "12.9B active" (Mixtral paper)
    qwen = load_hf_config(config("Qwen3-30B-A3B"))
    assert (qwen.experts, qwen.experts_per_token) == (128, 8)
    assert qwen.routed_expert_params == 48 * 128 * 3 * 2048 * 768
    assert qwen.active_params == pytest.approx(3.3e9, rel=0.03)  # "3.3B activated" (model card)


def test_deepseek_v3_mla_and_experts() -> None:
    arch = load_hf_config(config("DeepSeek-V3"))
    assert arch.attention_kind == "mla"
    assert (arch.kv_lora_rank, arch.qk_rope_head_dim) == (512, 64)
    assert kv_bytes_per_token(arch, 2.0) == 61 * (512 + 64) * 2
    assert (arch.experts, arch.experts_per_token) == (256, 8)
    assert arch.routed_expert_params == (61 - 3) * 256 * 3 * 7168 * 2048
    assert arch.active_params == pytest.approx(37e9, rel=0.03)  # "37B activated" (technical report)


def test_params_flag_overrides_the_count() -> None:
    arch = load_architecture(config("Qwen3-30B-A3B"), params=31e9)
    assert arch.params == 31e9
    counted = load_hf_config(config("Qwen3-30B-A3B"))
    assert arch.routed_expert_params / arch.params == pytest.approx(counted.routed_expert_params / counted.params)


def test_a_missing_key_names_the_key_and_the_file() -> None:
    path = config("broken/missing-layers")
    with pytest.raises(InputError) as error:
        load_hf_config(path)
    assert "num_hidden_layers" in str(error.value) and path in str(error.value)


@pytest.mark.parametrize("folder, why", [
    ("unsupported/Jamba-v0.1", "jamba"),
    ("unsupported/Qwen3-Next-80B-A3B", "qwen3_next"),
    ("unsupported/mamba-2.8b", "mamba"),
    ("unsupported/linear-hybrid", "linear_attention"),
])
def test_state_space_and_linear_hybrids_are_refused(folder: str, why: str) -> None:
    with pytest.raises(UnsupportedModelError) as error:
        load_hf_config(config(folder))
    assert why in str(error.value) and "KV cache" in str(error.value)


def test_unreadable_files_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "config.json"
    with pytest.raises(InputError, match="no such file"):
        load_hf_config(str(missing))
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_hf_config(str(bad))


def test_an_awq_checkpoint_reads_4_bit_matrices_and_16_bit_embeddings_and_norms(tmp_path: Path) -> None:
    raw = json.loads(Path(config("Llama-3.1-8B")).read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    arch = load_hf_config(str(path))
    hidden, layers, vocab = 4096, 32, 128256
    sixteen_bit = 2 * vocab * hidden + (2 * layers + 1) * hidden  # embed_tokens, lm_head, norms
    assert (arch.input_embedding_params, arch.unquantized_params) == (vocab * hidden, sixteen_bit)
    assert arch.checkpoint_weight_dtype == "int4"
    setup = build_setup(arch, "h100-sxm").setup  # no weight dtype given: the checkpoint's
    assert setup.weight_bytes_per_param == 0.5
    assert weight_bytes(arch, 0.5) == sixteen_bit * 2 + (arch.params - sixteen_bit) * 0.5
    # One decode token reads all but the input table, of which it looks up one row.
    assert weight_read_bytes(arch, 0.5, 1) == pytest.approx(
        weight_bytes(arch, 0.5) - vocab * hidden * 2 + hidden * 2)


def test_a_block_fp8_deepseek_checkpoint_keeps_its_router_norms_and_embeddings_in_16_bits(tmp_path: Path) -> None:
    """DeepSeek-V3's config.json as published carries quantization_config fp8 (block 128 x 128): every
    projection and expert is FP8, the router, norms and both embedding tables 16-bit. Read without it, the
    671B weights would count 2 bytes each: 1.34 TB where the checkpoint is 0.67 TB."""
    raw = json.loads(Path(config("DeepSeek-V3")).read_text())
    assert load_hf_config(config("DeepSeek-V3")).checkpoint_weight_dtype is None  # the copy here has none
    raw["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128]}
    arch = load_hf_config(write_config(tmp_path, "DeepSeek-V3", raw))
    hidden, layers, vocab, q_lora, kv_lora, moe_layers, experts = 7168, 61, 129280, 1536, 512, 61 - 3, 256
    norms = layers * (2 * hidden + q_lora + kv_lora) + hidden  # two a layer, q_a's and kv_a's, the final one
    routers = moe_layers * experts * (hidden + 1)  # gate weight and its score-correction bias
    sixteen_bit = 2 * vocab * hidden + norms + routers
    assert (arch.checkpoint_weight_dtype, arch.unquantized_params, arch.input_embedding_params) == (
        "fp8", sixteen_bit, vocab * hidden)
    setup = build_setup(arch, "h200", tensor_parallel=8).setup  # no weight dtype given: the checkpoint's
    assert setup.weight_bytes_per_param == 1.0
    assert weight_bytes(arch, 1.0, 8) == (sixteen_bit * 2 + (arch.params - sixteen_bit) * 1) / 8
    # The presets count the same: DeepSeek-R1 is DeepSeek-V3's architecture.
    preset = get_model_preset("deepseek-r1")
    assert (preset.checkpoint_weight_dtype, preset.unquantized_params, preset.input_embedding_params) == (
        arch.checkpoint_weight_dtype, arch.unquantized_params, arch.input_embedding_params)


def test_an_unquantized_checkpoint_reads_16_bit_weights() -> None:
    arch = load_hf_config(config("Llama-3.1-8B"))
    assert arch.checkpoint_weight_dtype is None
    assert build_setup(arch, "h100-sxm").setup.weight_bytes_per_param == 2.0


@pytest.mark.parametrize(("quantization", "dtype"), [
    ({"quant_method": "fp8"}, "fp8"),
    ({"quant_method": "fbgemm_fp8"}, "fp8"),
    ({"quant_method": "gptq", "bits": 8}, "int8"),
    ({"quant_method": "awq", "w_bit": 4}, "int4"),  # AutoAWQ's spelling of bits
    ({"quant_method": "compressed-tensors", "config_groups": {}}, None),  # the width is in its groups: unknown
    ({"quant_method": "bitsandbytes"}, None),
])
def test_the_checkpoint_dtype_comes_from_the_method_or_its_bits(
        tmp_path: Path, quantization: dict[str, object], dtype: str | None) -> None:
    raw = json.loads(Path(config("Llama-3.1-8B")).read_text())
    raw["quantization_config"] = quantization
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    assert load_hf_config(str(path)).checkpoint_weight_dtype == dtype


# --- families written in the test: each dict mirrors the published config.json's keys and values -------

def write_config(tmp_path: Path, folder: str, raw: dict[str, object]) -> str:
    path = tmp_path / folder / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(raw))
    return str(path)


def gpt_oss_config(layers: int, experts: int) -> dict[str, object]:
    """openai/gpt-oss-120b's config.json (gpt-oss-20b's differs in layers and experts), its keys as published."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "intermediate_size": 2880,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
        "num_hidden_layers": layers, "num_key_value_heads": 8, "num_local_experts": experts,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"],
                                "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05, "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 201088,
    }


@pytest.mark.parametrize(("name", "layers", "experts"), [("gpt-oss-120b", 36, 128), ("gpt-oss-20b", 24, 32)])
def test_a_gpt_oss_config_reads_as_its_preset(tmp_path: Path, name: str, layers: int, experts: int) -> None:
    arch = load_hf_config(write_config(tmp_path, name, gpt_oss_config(layers, experts)))
    preset = get_model_preset(name)
    # Every field, counts included: sinks, biases, router, MXFP4 experts beside 16-bit everything else.
    assert replace(arch, source=preset.source) == preset


def test_gpt_oss_without_layer_types_slides_on_the_even_layers(tmp_path: Path) -> None:
    raw = gpt_oss_config(36, 128)
    del raw["layer_types"], raw["sliding_window"]  # transformers' GptOssConfig fills both in
    arch = load_hf_config(write_config(tmp_path, "gpt-oss", raw))
    assert (arch.sliding_window, arch.sliding_window_layers) == (128, 18)


def test_a_kimi_k2_config_reads_as_deepseek_v3_and_as_its_preset(tmp_path: Path) -> None:
    # moonshotai/Kimi-K2-Instruct's config.json: its keys and values as published (rope and token ids aside).
    raw = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "attention_bias": False,
        "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
        "kv_lora_rank": 512, "max_position_embeddings": 131072, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
        "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64,
        "num_nextn_predict_layers": 0, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid",
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "v_head_dim": 128,
        "vocab_size": 163840,
    }
    arch = load_hf_config(write_config(tmp_path, "kimi-k2", raw))
    preset = get_model_preset("kimi-k2")
    assert replace(arch, source=preset.source) == preset


def test_deepseek_r1_is_deepseek_v3s_architecture_counted() -> None:
    arch = load_hf_config(config("DeepSeek-V3"))  # DeepSeek-R1's config.json carries the same numbers
    preset = get_model_preset("deepseek-r1")
    assert (arch.params, arch.routed_expert_params) == (preset.params, preset.routed_expert_params)
    assert kv_bytes_per_token(arch, 2.0) == kv_bytes_per_token(preset, 2.0)


def test_a_mistral3_config_reads_its_text_config_as_the_preset(tmp_path: Path) -> None:
    # mistralai/Mistral-Small-3.1-24B-Instruct-2503's config.json: its keys and values as published.
    raw = {
        "architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "image_token_index": 10,
        "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
        "text_config": {
            "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
            "intermediate_size": 32768, "max_position_embeddings": 131072, "model_type": "mistral",
            "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
            "rope_theta": 1000000000.0, "sliding_window": None, "use_cache": True, "vocab_size": 131072,
        },
        "torch_dtype": "bfloat16",
        "vision_config": {"head_dim": 64, "hidden_size": 1024, "image_size": 1540, "intermediate_size": 4096,
                          "model_type": "pixtral", "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14},
        "vision_feature_layer": -1,
    }
    arch = load_hf_config(write_config(tmp_path, "mistral-small", raw))
    preset = get_model_preset("mistral-small-3.1-24b")
    fields = ("layers", "hidden_size", "attention_heads", "kv_heads", "head_dim", "params", "sliding_window_layers")
    assert [getattr(arch, f) for f in fields] == [getattr(preset, f) for f in fields]
