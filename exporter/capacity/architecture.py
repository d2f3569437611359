"""What the capacity model knows about a model: its architecture, and the bytes its weights and KV cache take.

One job: describe a model (attention layout, size, experts, sliding windows, what its checkpoint keeps in
16 bits), refuse what the formulas cannot describe, and turn that description into bytes per GPU: KV
bytes per token and per context, resident weights, weights one step reads. Dtype names into bytes per
element belong here too, as vLLM's flags spell them.

Why apart from the step math (exporter/capacity/model.py): these depend on the model alone (and the
tensor-parallel size that splits it), never on a GPU's rates or a load, so presets, config.json reading
and the simulator's data need only this module. Pure functions over a dataclass: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exporter.errors import InputError, UnsupportedModelError

# Bytes per element by dtype name, as vLLM's --dtype / --kv-cache-dtype / --quantization spell them.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0, "float32": 4.0,
    "fp16": 2.0, "float16": 2.0, "half": 2.0, "bf16": 2.0, "bfloat16": 2.0, "auto": 2.0,
    "fp8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "fp8_inc": 1.0, "int8": 1.0, "w8a8": 1.0,
    "int4": 0.5, "awq": 0.5, "gptq": 0.5, "w4a16": 0.5,
}

ATTENTION_KINDS = ("mha", "mla")  # mha covers MHA, GQA and MQA: K and V per key-value head
UNSUPPORTED_ATTENTION_KINDS = ("ssm", "linear", "hybrid-ssm", "attention-free")

UNQUANTIZED_BYTES_PER_PARAM = 2.0  # quantized checkpoints keep embeddings, lm_head and norms in 16 bits


def dtype_bytes(name: str, what: str = "dtype") -> float:
    """Bytes per element for a dtype name; InputError naming the flag otherwise."""
    key = name.strip().lower()
    if key not in DTYPE_BYTES:
        raise InputError(f"{what}: unknown dtype {name!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


@dataclass(frozen=True)
class Architecture:
    """What the capacity model needs to know about a model: its attention layout and its size.

    `params` is the total parameter count; for mixture-of-experts models `routed_expert_params`
    is the part of it that lives in routed experts (all experts, all layers), of which each token
    uses `experts_per_token` of `experts`.
    """

    name: str
    layers: int
    hidden_size: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    params: float
    attention_kind: str = "mha"
    # MLA (DeepSeek-V2/V3): the cache holds one compressed latent plus the rotary key per layer.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    # Sliding-window attention: `sliding_window_layers` of the layers attend to the last
    # `sliding_window` tokens only; the rest attend to the whole context.
    sliding_window: int | None = None
    sliding_window_layers: int = 0
    # Mixture of experts.
    experts: int = 0
    experts_per_token: int = 0
    routed_expert_params: float = 0.0
    # What the checkpoint says about its weights (0 / None: unknown, every parameter counts alike).
    # input_embedding_params: the input-embedding table when it is not tied to lm_head: a step looks
    # up one row per token instead of reading it. unquantized_params: parameters a quantized checkpoint
    # keeps in 16 bits (embeddings, lm_head, norms). checkpoint_weight_dtype: from quantization_config.
    input_embedding_params: float = 0.0
    unquantized_params: float = 0.0
    checkpoint_weight_dtype: str | None = None
    source: str = ""

    def __post_init__(self) -> None:
        validate_architecture(self)

    @property
    def full_attention_layers(self) -> int:
        return self.layers - self.sliding_window_layers

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def is_linear(self) -> bool:
        """True when bytes read grow linearly with tokens in flight (closed-form budget applies)."""
        return not self.is_moe and not self.sliding_window_layers

    @property
    def active_params(self) -> float:
        """Parameters one token multiplies through: shared weights plus k of E routed experts."""
        if not self.is_moe:
            return self.params
        shared = self.params - self.routed_expert_params
        return shared + self.routed_expert_params * self.experts_per_token / self.experts


def validate_architecture(arch: Architecture) -> None:
    """Reject architectures the formulas cannot describe, with a message naming the field."""
    where = f"model {arch.name!r}"
    if arch.attention_kind in UNSUPPORTED_ATTENTION_KINDS:
        raise UnsupportedModelError(
            f"{where}: attention kind {arch.attention_kind!r} is not supported: its per-token state "
            "does not grow as a KV cache does, so tokens in flight do not predict its step time"
        )
    if arch.attention_kind not in ATTENTION_KINDS:
        raise UnsupportedModelError(f"{where}: unknown attention kind {arch.attention_kind!r}")
    for name in ("layers", "hidden_size", "attention_heads", "kv_heads", "head_dim"):
        if getattr(arch, name) <= 0:
            raise InputError(f"{where}: {name} must be a positive integer, got {getattr(arch, name)!r}")
    if not arch.params > 0:
        raise InputError(f"{where}: params must be greater than zero, got {arch.params!r}")
    if arch.attention_kind == "mla" and (arch.kv_lora_rank <= 0 or arch.qk_rope_head_dim < 0):
        raise InputError(f"{where}: MLA needs kv_lora_rank > 0 and qk_rope_head_dim >= 0")
    if arch.sliding_window_layers:
        if not arch.sliding_window or arch.sliding_window <= 0:
            raise InputError(f"{where}: sliding_window must be positive when sliding layers exist")
        if not 0 < arch.sliding_window_layers <= arch.layers:
            raise InputError(f"{where}: sliding_window_layers must be between 1 and layers")
    if arch.is_moe:
        if not 0 < arch.experts_per_token <= arch.experts:
            raise InputError(f"{where}: experts_per_token must be between 1 and experts ({arch.experts})")
        if not 0 < arch.routed_expert_params < arch.params:
            raise InputError(f"{where}: routed_expert_params must be between 0 and params")
    for name in ("input_embedding_params", "unquantized_params"):
        value = getattr(arch, name)
        if not (math.isfinite(value) and 0 <= value < arch.params):
            raise InputError(f"{where}: {name} must be between 0 and params, got {value!r}")
    if arch.input_embedding_params > arch.unquantized_params > 0:
        raise InputError(f"{where}: unquantized_params must include the input embedding")


# --- bytes -------------------------------------------------------------------------------------


def check_tensor_parallel(arch: Architecture, tensor_parallel: int, what: str = "tensor parallel") -> None:
    """Refuse a tensor-parallel size vLLM refuses for this model, with the reason vLLM gives.

    vLLM 0.33.0 applies two rules (line numbers in its source distribution):
      * vllm/config/model.py:1559, ModelConfig.verify_with_parallel_config: the attention heads must
        divide evenly, "Total number of attention heads (H) must be divisible by tensor parallel size (T)."
      * vllm/model_executor/layers/linear.py:1066-1070, QKVParallelLinear.__init__: with T >= the KV
        heads K each KV head is replicated T // K times, so K must divide T; with T < K each rank holds
        K // T heads, so T must divide K. Both go through divide() (vllm/distributed/utils.py:53), whose
        assertion reads "K is not divisible by T" / "T is not divisible by K".
    MLA models (DeepSeek-V2/V3) do not use QKVParallelLinear for their cache: only the first rule holds
    (vllm/model_executor/models/deepseek_v2.py:1041, `assert num_heads % tp_size == 0`).
    """
    heads, kv_heads = arch.attention_heads, arch.kv_heads
    if heads % tensor_parallel:
        raise InputError(
            f"{what} {tensor_parallel} does not fit model {arch.name!r}: vLLM refuses it with \"Total number of "
            f"attention heads ({heads}) must be divisible by tensor parallel size ({tensor_parallel}).\"; "
            f"use a size that divides {heads}"
        )
    if arch.attention_kind == "mla":
        return
    numerator, denominator = (tensor_parallel, kv_heads) if tensor_parallel >= kv_heads else (kv_heads, tensor_parallel)
    if numerator % denominator:
        raise InputError(
            f"{what} {tensor_parallel} does not fit model {arch.name!r}: its {kv_heads} KV heads can be neither "
            f"split evenly across {tensor_parallel} GPUs nor replicated a whole number of times, and vLLM refuses it "
            f"with \"{numerator} is not divisible by {denominator}\" (QKVParallelLinear); use a size that divides "
            f"{kv_heads} or a multiple of {kv_heads} that divides {heads}"
        )


def kv_heads_per_gpu(arch: Architecture, tensor_parallel: int) -> float:
    """KV heads are split across TP ranks; with more ranks than heads each rank keeps a replica.

    As vLLM's ModelConfig.get_num_kv_heads (vllm/config/model.py:1683): max(1, K // T); for a size
    `check_tensor_parallel` accepts the division is exact.
    """
    return float(max(1, arch.kv_heads // tensor_parallel))


def kv_bytes_per_token_per_layer(arch: Architecture, kv_bytes_per_element: float, tensor_parallel: int = 1) -> float:
    if arch.attention_kind == "mla":
        # MLA caches the compressed latent (kv_lora_rank) plus the decoupled rotary key, once per
        # layer, with no separate K and V, and every TP rank holds the whole latent
        # (DeepSeek-V2 paper §2.1; vLLM's MLA backends replicate it across ranks).
        return (arch.kv_lora_rank + arch.qk_rope_head_dim) * kv_bytes_per_element
    return 2 * kv_heads_per_gpu(arch, tensor_parallel) * arch.head_dim * kv_bytes_per_element


def kv_bytes_per_token(arch: Architecture, kv_bytes_per_element: float, tensor_parallel: int = 1) -> float:
    """KV bytes one token costs on every layer (inside every window): 2·layers·kv_heads·head_dim·bytes."""
    return arch.layers * kv_bytes_per_token_per_layer(arch, kv_bytes_per_element, tensor_parallel)


def kv_bytes_for_context(
    arch: Architecture, context_tokens: float, kv_bytes_per_element: float, tensor_parallel: int = 1
) -> float:
    """KV bytes one request of this context holds and reads: sliding layers stop at the window."""
    per_layer = kv_bytes_per_token_per_layer(arch, kv_bytes_per_element, tensor_parallel)
    windowed = min(context_tokens, arch.sliding_window or context_tokens)
    return per_layer * (arch.full_attention_layers * context_tokens + arch.sliding_window_layers * windowed)


def weight_bytes(arch: Architecture, weight_bytes_per_param: float, tensor_parallel: int = 1) -> float:
    """Weights resident on each GPU. A quantized checkpoint keeps its unquantized parameters
    (embeddings, lm_head, norms) in 16 bits; unknown (0) means every parameter at the given width."""
    return _weight_bytes_of(arch.params, arch, weight_bytes_per_param, tensor_parallel)


def _weight_bytes_of(params: float, arch: Architecture, weight_bytes_per_param: float, tensor_parallel: int) -> float:
    """Bytes of `params` parameters of `arch`, of which all its unquantized ones are 16-bit."""
    if weight_bytes_per_param >= UNQUANTIZED_BYTES_PER_PARAM:
        return params * weight_bytes_per_param / tensor_parallel
    sixteen_bit = min(arch.unquantized_params, params)
    return (sixteen_bit * UNQUANTIZED_BYTES_PER_PARAM
            + (params - sixteen_bit) * weight_bytes_per_param) / tensor_parallel


def input_embedding_bytes(arch: Architecture, weight_bytes_per_param: float, tensor_parallel: int = 1) -> float:
    """The untied input-embedding table on each GPU (16-bit when the checkpoint is quantized)."""
    width = weight_bytes_per_param if weight_bytes_per_param >= UNQUANTIZED_BYTES_PER_PARAM or \
        not arch.unquantized_params else UNQUANTIZED_BYTES_PER_PARAM
    return arch.input_embedding_params * width / tensor_parallel


def expected_distinct_experts(experts: int, experts_per_token: int, tokens: float) -> float:
    """Expected distinct experts a layer touches when `tokens` tokens each pick k of E at random.

    Each expert is missed by one token with probability 1 - k/E, so by all n with (1 - k/E)^n.
    """
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - math.pow(1.0 - experts_per_token / experts, tokens))


def weight_read_bytes(
    arch: Architecture, weight_bytes_per_param: float, tokens_in_step: float, tensor_parallel: int = 1
) -> float:
    """Weight bytes one step reads: all of a dense model, shared weights plus touched experts of an
    MoE, less the input-embedding table, of which a step looks up one row per token."""
    embedding = input_embedding_bytes(arch, weight_bytes_per_param, tensor_parallel)
    rows = min(tokens_in_step, arch.input_embedding_params / arch.hidden_size) * arch.hidden_size
    looked_up = embedding * rows / arch.input_embedding_params if arch.input_embedding_params else 0.0
    if not arch.is_moe:
        return weight_bytes(arch, weight_bytes_per_param, tensor_parallel) - embedding + looked_up
    shared = arch.params - arch.routed_expert_params
    touched = expected_distinct_experts(arch.experts, arch.experts_per_token, max(tokens_in_step, 1.0))
    routed_read = arch.routed_expert_params * touched / arch.experts
    return (_weight_bytes_of(shared, arch, weight_bytes_per_param, tensor_parallel)
            + routed_read * weight_bytes_per_param / tensor_parallel - embedding + looked_up)
