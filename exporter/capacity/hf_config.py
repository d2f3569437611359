"""Read a Hugging Face `config.json` into an Architecture, counting parameters when none are given.

Families and their key names (as each family's transformers config class spells them):
  * Llama, Mistral, Mixtral, Qwen2/2-MoE/3/3-MoE, Gemma 2/3 (and any config with the same keys):
    num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads, head_dim,
    intermediate_size, vocab_size; MoE: num_local_experts | num_experts, num_experts_per_tok,
    moe_intermediate_size, shared_expert_intermediate_size; sliding windows: sliding_window,
    layer_types, sliding_window_pattern (Gemma 3), use_sliding_window/max_window_layers (Qwen).
    Multimodal wrappers (Gemma 3) nest the language model under `text_config`.
    Mistral 3 (Mistral Small 3.1, model_type mistral3) nests a Mistral language model the same way.
  * gpt-oss: the Llama keys plus num_local_experts, num_experts_per_tok, intermediate_size (each
    expert's width), attention_bias, sliding_window and layer_types; biased experts and router and
    one attention sink per head (transformers' GptOssAttention and GptOssExperts); MXFP4 experts.
  * DeepSeek-V2/V3 (MLA), and Kimi K2 (model_type kimi_k2, DeepSeek-V3's layout): kv_lora_rank,
    qk_rope_head_dim, qk_nope_head_dim, v_head_dim, q_lora_rank, n_routed_experts, n_shared_experts,
    num_experts_per_tok, first_k_dense_replace, moe_intermediate_size.
  * MPT: n_layers, d_model, n_heads, expansion_ratio, attn_config.
  * OPT: num_hidden_layers, hidden_size, ffn_dim, word_embed_proj_dim, max_position_embeddings.
State-space and linear-attention hybrids are refused: their per-token state does not grow like a
KV cache, so tokens in flight do not predict their step time.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from exporter.capacity.architecture import Architecture
from exporter.errors import InputError, UnsupportedModelError

# model_type values whose layers are (partly) state-space or linear attention.
SSM_OR_LINEAR_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "jamba", "falcon_h1", "qwen3_next", "zamba", "zamba2", "bamba",
    "nemotron_h", "granitemoehybrid", "rwkv", "rwkv5", "rwkv6", "rwkv7", "recurrent_gemma", "lfm2",
    "minimax", "plamo2", "xlstm", "hymba", "mllama_ssm",
})
# Keys only such models carry.
SSM_OR_LINEAR_KEYS = ("ssm_cfg", "mamba_d_state", "attn_layer_period", "layers_block_type",
                      "hybrid_override_pattern", "linear_attn_config", "linear_num_key_heads")
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# Qwen2/Qwen3 carry sliding_window but apply it only with use_sliding_window (transformers' Qwen2Config).
_QWEN_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
# Families with a per-head RMSNorm on queries and keys (q_norm, k_norm of head_dim each).
_QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text"})
# Families whose decoder layer has four norms (pre/post attention, pre/post feed-forward).
_FOUR_NORM_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text"})
# Values transformers' config classes use when a config.json leaves the key out.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262208, "sliding_window_pattern": 6, "tie_word_embeddings": True,
                    "sliding_window": 4096},
    "gemma2": {"tie_word_embeddings": True},
    "gemma": {"tie_word_embeddings": True},
    # transformers' GptOssConfig.
    "gpt_oss": {"sliding_window": 128, "attention_bias": True},
}
# model_types read as DeepSeek-V3 (Kimi K2's config.json names its own type for the same layout).
_DEEPSEEK_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2"})


@dataclass(frozen=True)
class _Config:
    """A config's values with the file named in every error."""

    values: dict[str, Any]
    path: str
    model_type: str

    def has(self, key: str) -> bool:
        return self.values.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.values.get(key)
        if value is None:
            return _FAMILY_DEFAULTS.get(self.model_type, {}).get(key, default)
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise InputError(f"{self.path}: missing key {key!r}, which a {self.model_type or 'transformer'} model "
                             "needs for the capacity model")
        return value

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.require(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
            raise InputError(f"{self.path}: key {key!r} must be a non-negative whole number, got {value!r}")
        return int(value)


def load_hf_config(path: str, name: str | None = None) -> Architecture:
    """Architecture of the model a Hugging Face config.json describes; `name` names it (else its folder)."""
    raw = _read_json(path)
    top_type = str(raw.get("model_type", ""))
    text = raw.get("text_config")
    values = {**text} if isinstance(text, dict) else raw
    model_type = str(values.get("model_type") or top_type)
    if top_type == "gemma3" and model_type == "gemma3":
        model_type = "gemma3_text"
    config = _Config(values, path, model_type)
    _refuse_state_space(config, raw, top_type)
    _refuse_unread_family(config, top_type)
    name = name or _model_name(path)
    if model_type == "mpt":
        return _mpt(config, name)
    if model_type == "opt":
        return _opt(config, name)
    if model_type == "gpt_oss":
        return _gpt_oss(config, name)
    if model_type in _DEEPSEEK_TYPES or config.has("kv_lora_rank"):
        return _deepseek(config, name)
    return _llama_like(config, name)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file (give a model preset name or the path to a config.json)") from None
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror or error}") from None
    except ValueError as error:
        raise InputError(f"{path}: not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise InputError(f"{path}: expected a JSON object at the top level")
    return raw


def _model_name(path: str) -> str:
    """The folder's name for `.../Qwen3-8B/config.json`, the file's stem otherwise."""
    folder, filename = os.path.split(os.path.abspath(path))
    if filename == "config.json" and os.path.basename(folder):
        return os.path.basename(folder)
    return os.path.splitext(filename)[0]


def _refuse_state_space(config: _Config, raw: dict[str, Any], top_type: str) -> None:
    why = ""
    if config.model_type in SSM_OR_LINEAR_MODEL_TYPES or top_type in SSM_OR_LINEAR_MODEL_TYPES:
        why = f"model_type {config.model_type or top_type!r} is a state-space or linear-attention model"
    for key in SSM_OR_LINEAR_KEYS:
        if not why and (key in config.values or key in raw):
            why = f"key {key!r} marks state-space or linear-attention layers"
    kinds = set(config.get("layer_types") or ())
    if not why and kinds - ATTENTION_LAYER_TYPES:
        why = f"layer_types contains {', '.join(sorted(kinds - ATTENTION_LAYER_TYPES))}"
    if why:
        raise UnsupportedModelError(
            f"{config.path}: unsupported model: {why}; such layers keep a fixed-size state instead of a KV "
            "cache that grows with the context, so tokens in flight do not predict their step time "
            "(supported: MHA/GQA/MQA, MLA and sliding-window attention)"
        )


def _refuse_unread_family(config: _Config, top_type: str) -> None:
    """A family whose layout the readers below would get wrong, refused rather than counted wrong: Llama 4 (its
    config's `intermediate_size` is an expert's, every MoE layer also runs a shared expert, dense layers use
    `intermediate_size_mlp`, and three layers in four attend within chunks: transformers'
    models/llama4/configuration_llama4.py and modeling_llama4.py)."""
    if {config.model_type, top_type} & {"llama4", "llama4_text"}:
        raise UnsupportedModelError(
            f"{config.path}: Llama 4's config.json is not read yet (its shared expert and chunked attention would "
            "be counted wrong); use the `llama-4-scout` preset for Scout, or give the model by its numbers with "
            "a preset near it and --params")


# --- families --------------------------------------------------------------------------------


def _attention_heads(config: _Config) -> tuple[int, int, int]:
    hidden = config.integer("hidden_size")
    heads = config.integer("num_attention_heads")
    kv_heads = config.integer("num_key_value_heads", heads)
    head_dim = config.integer("head_dim", hidden // heads if heads else 0)
    return heads, kv_heads, head_dim


def _llama_like(config: _Config, name: str) -> Architecture:
    layers = config.integer("num_hidden_layers")
    hidden = config.integer("hidden_size")
    heads, kv_heads, head_dim = _attention_heads(config)
    vocab = config.integer("vocab_size")
    experts = config.integer("num_local_experts", 0) or config.integer("num_experts", 0)
    per_layer = _gqa_attention_params(config, hidden, heads, kv_heads, head_dim)
    per_layer += hidden * (4 if config.model_type in _FOUR_NORM_TYPES else 2)
    per_layer += 2 * head_dim if config.model_type in _QK_NORM_TYPES else 0
    mlp_total, routed_total, experts_per_token = _llama_mlp_params(config, layers, hidden, experts)
    params = layers * per_layer + mlp_total + _embedding_params(config, vocab, hidden) + hidden
    window, sliding_layers = _sliding_layers(config, layers)
    norms = layers * (4 if config.model_type in _FOUR_NORM_TYPES else 2) * hidden + hidden
    input_table = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
    return Architecture(
        name=name, layers=layers, hidden_size=hidden, attention_heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, params=float(params), sliding_window=window, sliding_window_layers=sliding_layers,
        experts=experts, experts_per_token=experts_per_token, routed_expert_params=float(routed_total),
        input_embedding_params=float(input_table),
        unquantized_params=float(_embedding_params(config, vocab, hidden) + norms),
        checkpoint_weight_dtype=checkpoint_weight_dtype(config),
        source=f"{config.path} (parameters counted from the architecture)",
    )


# quantization_config.quant_method -> the weight dtype vLLM loads, for methods whose name says it;
# for the others (AWQ, GPTQ, compressed-tensors, bitsandbytes) `bits` decides, when it is given.
# MXFP4 (gpt-oss) stores 4-bit elements with one 8-bit scale per 32: read as int4, half a byte each.
_QUANT_METHOD_DTYPES = {"fp8": "fp8", "fbgemm_fp8": "fp8", "mxfp4": "int4"}


def checkpoint_weight_dtype(config: _Config) -> str | None:
    """The weight dtype a quantized checkpoint stores, from `quantization_config`; None when the
    config has none (16-bit) or a method whose width it does not state."""
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict):
        return None
    method = _quant_method(config)
    bits = quantization.get("bits", quantization.get("w_bit"))
    if method in _QUANT_METHOD_DTYPES:
        return _QUANT_METHOD_DTYPES[method]
    if bits in (4, 8):
        return "int4" if bits == 4 else "int8"
    return None


def _gqa_attention_params(config: _Config, hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Q and O are heads·head_dim wide, K and V kv_heads·head_dim; Qwen2 adds biases to Q, K, V."""
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    params = hidden * q_width * 2 + hidden * kv_width * 2
    if config.get("attention_bias", False) or config.model_type in ("qwen2", "qwen2_moe"):
        params += q_width + 2 * kv_width
    if config.get("attention_bias", False):
        params += hidden  # o_proj bias where attention_bias covers it (Llama's flag)
    return params


def _gated_mlp_params(hidden: int, intermediate: int) -> int:
    """gate, up and down projections (SwiGLU / GeGLU)."""
    return 3 * hidden * intermediate


def _llama_mlp_params(config: _Config, layers: int, hidden: int, experts: int) -> tuple[int, int, int]:
    """(all MLP params, routed-expert params, experts per token) over all layers."""
    if not experts:
        return layers * _gated_mlp_params(hidden, config.integer("intermediate_size")), 0, 0
    experts_per_token = config.integer("num_experts_per_tok")
    expert_width = config.integer("moe_intermediate_size", 0) or config.integer("intermediate_size")
    sparse_step = config.integer("decoder_sparse_step", 1) or 1
    dense_only = set(config.get("mlp_only_layers", []) or [])
    moe_layers = [i for i in range(layers) if i not in dense_only and (i + 1) % sparse_step == 0]
    routed = len(moe_layers) * experts * _gated_mlp_params(hidden, expert_width)
    shared_width = config.integer("shared_expert_intermediate_size", 0)
    # Qwen2-MoE: one shared expert plus a one-output gate on it; router: hidden x experts.
    shared = len(moe_layers) * (_gated_mlp_params(hidden, shared_width) + hidden if shared_width else 0)
    router = len(moe_layers) * hidden * experts
    dense = (layers - len(moe_layers)) * _gated_mlp_params(hidden, config.integer("intermediate_size"))
    return routed + shared + router + dense, routed, experts_per_token


def _embedding_params(config: _Config, vocab: int, hidden: int) -> int:
    tied = bool(config.get("tie_word_embeddings", False))
    return vocab * hidden * (1 if tied else 2)


def _sliding_layers(config: _Config, layers: int) -> tuple[int | None, int]:
    """(window, how many layers use it)."""
    layer_types = config.get("layer_types")
    if layer_types:
        if len(layer_types) != layers:
            raise InputError(f"{config.path}: layer_types has {len(layer_types)} entries for {layers} layers")
        count = sum(1 for kind in layer_types if kind == "sliding_attention")
        return (config.integer("sliding_window"), count) if count else (None, 0)
    window = config.get("sliding_window")
    if not window:
        return None, 0
    window = config.integer("sliding_window")
    if config.model_type in _QWEN_TYPES:
        if not config.get("use_sliding_window", False):
            return None, 0
        # transformers' Qwen2: layers from max_window_layers on use the window.
        first_sliding = config.integer("max_window_layers", layers)
        count = max(0, layers - first_sliding)
        return (window, count) if count else (None, 0)
    if config.model_type in ("gemma2", "gpt_oss"):
        return window, math.ceil(layers / 2)  # even-indexed layers slide (Gemma2DecoderLayer, GptOssConfig)
    if config.model_type == "gemma3_text":
        pattern = config.integer("sliding_window_pattern")
        return window, layers - layers // pattern  # every pattern-th layer is global
    return window, layers  # Mistral-style: every layer slides


def _gpt_oss(config: _Config, name: str) -> Architecture:
    """gpt-oss: biased GQA with one sink logit per head, and on every layer a biased router over
    experts whose gate_up (hidden -> 2 x width) and down (width -> hidden) projections carry biases."""
    layers = config.integer("num_hidden_layers")
    hidden = config.integer("hidden_size")
    heads, kv_heads, head_dim = _attention_heads(config)
    vocab = config.integer("vocab_size")
    experts = config.integer("num_local_experts")
    width = config.integer("intermediate_size")
    expert = hidden * 2 * width + 2 * width + width * hidden + hidden
    attention = _gqa_attention_params(config, hidden, heads, kv_heads, head_dim) + heads  # + the sinks
    per_layer = attention + 2 * hidden + experts * (hidden + 1) + experts * expert
    embeddings = _embedding_params(config, vocab, hidden)
    params = layers * per_layer + embeddings + hidden
    routed = layers * experts * expert
    window, sliding_layers = _sliding_layers(config, layers)
    # The published checkpoints quantize the experts alone (modules_to_not_convert: attention, router,
    # embeddings, lm_head); any other quantization is taken to spare embeddings and norms, as elsewhere.
    sixteen_bit = params - routed if _quant_method(config) == "mxfp4" else embeddings + (2 * layers + 1) * hidden
    return Architecture(
        name=name, layers=layers, hidden_size=hidden, attention_heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        params=float(params), sliding_window=window, sliding_window_layers=sliding_layers, experts=experts,
        experts_per_token=config.integer("num_experts_per_tok"), routed_expert_params=float(routed),
        input_embedding_params=float(0 if config.get("tie_word_embeddings", False) else vocab * hidden),
        unquantized_params=float(sixteen_bit), checkpoint_weight_dtype=checkpoint_weight_dtype(config),
        source=f"{config.path} (parameters counted from the architecture)",
    )


def _quant_method(config: _Config) -> str:
    quantization = config.get("quantization_config")
    return str(quantization.get("quant_method", "")).lower() if isinstance(quantization, dict) else ""


def _deepseek(config: _Config, name: str) -> Architecture:
    layers = config.integer("num_hidden_layers")
    hidden = config.integer("hidden_size")
    heads = config.integer("num_attention_heads")
    vocab = config.integer("vocab_size")
    kv_lora = config.integer("kv_lora_rank")
    rope = config.integer("qk_rope_head_dim")
    nope = config.integer("qk_nope_head_dim")
    v_dim = config.integer("v_head_dim")
    q_lora = config.integer("q_lora_rank", 0)
    q_head = nope + rope
    # MLA projections: queries through an optional low-rank (q_lora) bottleneck with its norm, a joint
    # KV down-projection (latent + rotary key) with its norm, the KV up-projection, the output.
    attention = (hidden * q_lora + q_lora + q_lora * heads * q_head) if q_lora else hidden * heads * q_head
    attention += hidden * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim) + heads * v_dim * hidden
    experts = config.integer("n_routed_experts", 0)
    dense_layers = min(layers, config.integer("first_k_dense_replace", 0)) if experts else layers
    moe_layers = layers - dense_layers
    expert_width = config.integer("moe_intermediate_size") if experts else 0
    routed = moe_layers * experts * _gated_mlp_params(hidden, expert_width)
    shared = moe_layers * config.integer("n_shared_experts", 0) * _gated_mlp_params(hidden, expert_width)
    router = moe_layers * experts * (hidden + 1)  # gate weight plus the score-correction bias (V3)
    dense = dense_layers * _gated_mlp_params(hidden, config.integer("intermediate_size"))
    embeddings = _embedding_params(config, vocab, hidden)
    params = layers * (attention + 2 * hidden) + routed + shared + router + dense + embeddings + hidden
    # What a quantized checkpoint keeps in 16 bits: vLLM builds every projection and expert with the
    # checkpoint's quant_config, and the router without one (vllm/model_executor/models/deepseek_v2.py at
    # 002d607, DeepseekV2MoE.__init__: `self.gate = GateLinear(...)`); the norms and embeddings are not linear
    # layers. DeepSeek-V3/R1 and Kimi K2 publish block-FP8 checkpoints (quantization_config fp8).
    norms = layers * (2 * hidden + q_lora + kv_lora) + hidden
    return Architecture(
        name=name, layers=layers, hidden_size=hidden, attention_heads=heads, kv_heads=heads, head_dim=v_dim,
        params=float(params), attention_kind="mla", kv_lora_rank=kv_lora, qk_rope_head_dim=rope,
        experts=experts, experts_per_token=config.integer("num_experts_per_tok") if experts else 0,
        routed_expert_params=float(routed),
        input_embedding_params=float(0 if config.get("tie_word_embeddings", False) else vocab * hidden),
        unquantized_params=float(embeddings + norms + router), checkpoint_weight_dtype=checkpoint_weight_dtype(config),
        source=f"{config.path} (parameters counted from the architecture; multi-token-prediction layers excluded)",
    )


def _mpt(config: _Config, name: str) -> Architecture:
    layers = config.integer("n_layers")
    hidden = config.integer("d_model")
    heads = config.integer("n_heads")
    vocab = config.integer("vocab_size")
    ffn = int(config.require("expansion_ratio") * hidden)
    attn = config.get("attn_config", {}) or {}
    attn_type = attn.get("attn_type", "multihead_attention")
    kv_heads = {"multiquery_attention": 1,
                "grouped_query_attention": attn.get("kv_n_heads", heads)}.get(attn_type, heads)
    head_dim = hidden // heads
    biased = not config.get("no_bias", False)
    # Fused Wqkv, out_proj, up and down (plain GELU MLP), two LayerNorms; biases unless no_bias.
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + hidden * hidden + 2 * hidden * ffn + 2 * hidden
    if biased:
        per_layer += (heads + 2 * kv_heads) * head_dim + hidden + ffn + hidden + 2 * hidden
    learned_positions = not attn.get("alibi", False) and config.get("learned_pos_emb", True)
    positions = config.integer("max_seq_len") * hidden if learned_positions else 0
    params = layers * per_layer + vocab * hidden + positions + hidden * (2 if biased else 1)
    return Architecture(
        name=name, layers=layers, hidden_size=hidden, attention_heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        params=float(params), source=f"{config.path} (parameters counted from the architecture)",
    )


def _opt(config: _Config, name: str) -> Architecture:
    layers = config.integer("num_hidden_layers")
    hidden = config.integer("hidden_size")
    heads = config.integer("num_attention_heads")
    ffn = config.integer("ffn_dim")
    vocab = config.integer("vocab_size")
    projection = config.integer("word_embed_proj_dim", hidden)
    positions = config.integer("max_position_embeddings") + 2  # OPT's learned positions are offset by 2
    biased = config.get("enable_bias", True)
    per_layer = 4 * hidden * hidden + 2 * hidden * ffn + (4 * hidden + ffn + hidden if biased else 0) + 2 * 2 * hidden
    params = layers * per_layer + vocab * projection + positions * hidden
    if projection != hidden:
        params += 2 * projection * hidden  # project_in and project_out
    if config.get("do_layer_norm_before", True) and not config.get("_remove_final_layer_norm", False):
        params += 2 * hidden
    if not config.get("tie_word_embeddings", True):
        params += vocab * projection
    return Architecture(
        name=name, layers=layers, hidden_size=hidden, attention_heads=heads, kv_heads=heads, head_dim=hidden // heads,
        params=float(params), source=f"{config.path} (parameters counted from the architecture)",
    )
