"""The capacity model: bytes read per decode step, step time, token budget, KV capacity.

Pure functions over dataclasses; no I/O, no clocks, no logging. Sizes are bytes, times seconds,
rates per second. Everything is *per GPU* of one model replica: with tensor parallelism each GPU
holds 1/tp of the weights and of the KV heads, reads them from its own memory at its own bandwidth,
and all GPUs of the replica step together, so the per-GPU step time is the replica's step time.

Physics (see docs/model.md and DESIGN §1):
  * A decode step produces one token for every running request. It reads the weights once for the
    whole batch (memory-bound) plus every running request's KV cache.
  * A step runs its GEMMs and its attention as separate kernels, so the phases add up; they do not
    overlap into one global max(memory, compute):
      step        = overhead + per_request * running + t_gemm + t_attention
      t_gemm      = max(weight bytes read / bandwidth, 2 * GEMM params * tokens in the step / compute)
      t_attention = max(KV bytes read / bandwidth, attention FLOPs / compute)
    Attention FLOPs matter only for prefill chunks, which attend to their whole context.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

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

DEFAULT_BLOCK_SIZE_TOKENS = 16
DEFAULT_HEADROOM = 0.9
DEFAULT_BANDWIDTH_EFFICIENCY = 0.6
DEFAULT_COMPUTE_EFFICIENCY = 0.5
AGREEMENT_TOLERANCE = 0.15
UNQUANTIZED_BYTES_PER_PARAM = 2.0  # quantized checkpoints keep embeddings, lm_head and norms in 16 bits
_BUDGET_SEARCH_CEILING_TOKENS = 1e10


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


@dataclass(frozen=True)
class ServingSetup:
    """One model replica on `tensor_parallel` GPUs, with the effective rates it achieves per GPU."""

    architecture: Architecture
    gpu_memory_bytes: float
    effective_bandwidth_bytes_per_second: float
    effective_compute_flops_per_second: float
    tensor_parallel: int = 1
    weight_bytes_per_param: float = 2.0
    kv_bytes_per_element: float = 2.0
    step_overhead_seconds: float = 0.0
    # Sampling and per-sequence bookkeeping, paid once per running request per step (0 unless fitted).
    per_request_seconds: float = 0.0
    gpu_memory_utilization: float = 0.9
    reserved_memory_bytes: float = 0.0
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS

    def __post_init__(self) -> None:
        positive = {
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "effective_bandwidth_bytes_per_second": self.effective_bandwidth_bytes_per_second,
            "effective_compute_flops_per_second": self.effective_compute_flops_per_second,
            "tensor_parallel": self.tensor_parallel,
            "weight_bytes_per_param": self.weight_bytes_per_param,
            "kv_bytes_per_element": self.kv_bytes_per_element,
            "block_size_tokens": self.block_size_tokens,
        }
        for name, value in positive.items():
            if not value > 0:
                raise InputError(f"{name} must be greater than zero, got {value!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InputError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name, value in (("step_overhead_seconds", self.step_overhead_seconds),
                            ("per_request_seconds", self.per_request_seconds),
                            ("reserved_memory_bytes", self.reserved_memory_bytes)):
            if not (math.isfinite(value) and value >= 0):
                raise InputError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class RequestGroup:
    """`count` running requests, each holding `context_tokens` tokens (prompt + generated so far)."""

    count: int
    context_tokens: float

    def __post_init__(self) -> None:
        if self.count < 0 or self.context_tokens < 0:
            raise InputError(f"a load needs a non-negative count and context, got {self.count}x{self.context_tokens}")

    @property
    def tokens(self) -> float:
        return self.count * self.context_tokens


@dataclass(frozen=True)
class StepPrediction:
    """The model's view of one decode step, phase by phase.

    Each phase takes the longer of its memory time and its compute time; phases run one after
    the other, so the step is their sum plus the fixed and per-request costs.
    """

    tokens_in_flight: float
    decode_tokens: float
    prefill_tokens: float
    weight_read_bytes: float
    kv_read_bytes: float
    weight_memory_seconds: float
    kv_memory_seconds: float
    gemm_compute_seconds: float
    attention_compute_seconds: float
    overhead_seconds: float
    per_request_seconds: float = 0.0  # per-request cost times running requests

    @property
    def read_bytes(self) -> float:
        return self.weight_read_bytes + self.kv_read_bytes

    @property
    def tokens_in_step(self) -> float:
        return self.decode_tokens + self.prefill_tokens

    @property
    def memory_seconds(self) -> float:
        """All bytes read at the effective bandwidth (what a purely memory-bound step would take)."""
        return self.weight_memory_seconds + self.kv_memory_seconds

    @property
    def compute_seconds(self) -> float:
        """All FLOPs at the effective compute (what a purely compute-bound step would take)."""
        return self.gemm_compute_seconds + self.attention_compute_seconds

    @property
    def gemm_seconds(self) -> float:
        return max(self.weight_memory_seconds, self.gemm_compute_seconds)

    @property
    def attention_seconds(self) -> float:
        return max(self.kv_memory_seconds, self.attention_compute_seconds)

    @property
    def step_seconds(self) -> float:
        return self.overhead_seconds + self.per_request_seconds + self.gemm_seconds + self.attention_seconds

    @property
    def user_tokens_per_second(self) -> float:
        """Every decoding request gets one token per step."""
        return 1.0 / self.step_seconds


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


def gemm_flops(arch: Architecture, tokens_in_step: float, tensor_parallel: int = 1) -> float:
    """2 FLOPs per weight per token through every matrix; an embedding lookup multiplies nothing."""
    return 2.0 * (arch.active_params - arch.input_embedding_params) / tensor_parallel * tokens_in_step


def attention_flops(arch: Architecture, attended_tokens: float, tensor_parallel: int = 1) -> float:
    """QK^T and softmax·V: 2 + 2 FLOPs per query head dimension per attended token per layer.

    `attended_tokens` is summed over the query tokens (a decode token attends to its context; a
    prefill chunk of n tokens after P tokens attends to n·(P + n/2) in all, causally)."""
    heads = arch.attention_heads / tensor_parallel
    return 4.0 * arch.layers * heads * arch.head_dim * attended_tokens


def _attended_tokens(arch: Architecture, context_tokens: float) -> float:
    """Tokens one query at this context attends to, averaged over layers (sliding layers stop at the window)."""
    windowed = min(context_tokens, arch.sliding_window or context_tokens)
    return (arch.full_attention_layers * context_tokens + arch.sliding_window_layers * windowed) / arch.layers


def prefill_attended_tokens(arch: Architecture, chunk_tokens: float, context_before_tokens: float) -> float:
    """Sum over a chunk's tokens of what each attends to: the context before it plus the chunk so far."""
    if chunk_tokens <= 0:
        return 0.0
    mean_context = context_before_tokens + chunk_tokens / 2.0
    return chunk_tokens * _attended_tokens(arch, mean_context)


def _prefill_attended_at_mean(arch: Architecture, prefill_tokens: float, mean_context_tokens: float) -> float:
    """What `prefill_tokens` attend to in all where each attends to `mean_context_tokens` on average (a
    server's window, wherever in their prompts its tokens stood; sliding layers stop at the window)."""
    return prefill_tokens * _attended_tokens(arch, mean_context_tokens)


# --- step time -------------------------------------------------------------------------------


def predict_step(
    setup: ServingSetup, groups: Sequence[RequestGroup], prefill_tokens_per_step: float = 0.0,
    *, prefill_context_tokens: float | None = None, prefill_mean_context_tokens: float | None = None,
) -> StepPrediction:
    """Predict one decode step for the running requests in `groups` plus a prefill chunk of
    `prefill_tokens_per_step` tokens that follows `prefill_context_tokens` tokens of its own prompt,
    or prefill tokens that each attend to `prefill_mean_context_tokens` on average (a server's
    window: its prompt tokens, wherever in their prompts they stood, not one chunk).

    With neither (a server's page that cannot say where its prompt tokens stood) the prefill's attention
    FLOPs are left out rather than guessed: taking a window's prefill tokens as one causal chunk would
    count n²/2 pairs for what were many chunks."""
    if prefill_context_tokens is not None and prefill_mean_context_tokens is not None:
        raise InputError("give a prefill chunk's context or its tokens' mean context, not both")
    if prefill_tokens_per_step < 0 or (prefill_context_tokens or 0.0) < 0 or (prefill_mean_context_tokens or 0.0) < 0:
        raise InputError(f"prefill tokens per step and their context must not be negative, got "
                         f"{prefill_tokens_per_step!r} after {prefill_context_tokens or prefill_mean_context_tokens!r}")
    arch, tp = setup.architecture, setup.tensor_parallel
    decode_tokens = float(sum(group.count for group in groups))
    weights, weight_memory_seconds, gemm_compute_seconds = _gemm_phase(setup, decode_tokens + prefill_tokens_per_step)
    kv = sum(
        group.count * kv_bytes_for_context(arch, group.context_tokens, setup.kv_bytes_per_element, tp)
        for group in groups
    )
    attended = sum(group.count * _attended_tokens(arch, group.context_tokens) for group in groups)
    if prefill_context_tokens is not None:
        attended += prefill_attended_tokens(arch, prefill_tokens_per_step, prefill_context_tokens)
    elif prefill_mean_context_tokens is not None:
        attended += _prefill_attended_at_mean(arch, prefill_tokens_per_step, prefill_mean_context_tokens)
    return StepPrediction(
        tokens_in_flight=float(sum(group.tokens for group in groups)),
        decode_tokens=decode_tokens,
        prefill_tokens=float(prefill_tokens_per_step),
        weight_read_bytes=weights,
        kv_read_bytes=kv,
        weight_memory_seconds=weight_memory_seconds,
        kv_memory_seconds=kv / setup.effective_bandwidth_bytes_per_second,
        gemm_compute_seconds=gemm_compute_seconds,
        attention_compute_seconds=attention_flops(arch, attended, tp) / setup.effective_compute_flops_per_second,
        overhead_seconds=setup.step_overhead_seconds,
        per_request_seconds=setup.per_request_seconds * decode_tokens,
    )


def prefill_tokens_per_second(setup: ServingSetup, prefill_tokens_per_step: float,
                              mean_context_tokens: float | None = None) -> float:
    """The prompt tokens a second a server that only prefills can compute, in steps of
    `prefill_tokens_per_step` prompt tokens attending to `mean_context_tokens` each (None: their attention
    left out): the step `predict_step` gives for such a step with no request decoding. A P/D prefill
    server's budget: beyond it, prompts queue and the time to first token grows without bound."""
    if prefill_tokens_per_step <= 0:
        raise InputError(f"prefill tokens per step must be greater than zero, got {prefill_tokens_per_step!r}")
    step = predict_step(setup, [], prefill_tokens_per_step, prefill_mean_context_tokens=mean_context_tokens)
    return prefill_tokens_per_step / step.step_seconds


def _gemm_phase(setup: ServingSetup, tokens_in_step: float) -> tuple[float, float, float]:
    """(weight bytes read, their memory seconds, GEMM compute seconds) of a step of `tokens_in_step` tokens:
    the one phase a step's prefill tokens change when their context is not known."""
    arch, tp = setup.architecture, setup.tensor_parallel
    weights = weight_read_bytes(arch, setup.weight_bytes_per_param, tokens_in_step, tp)
    return (weights, weights / setup.effective_bandwidth_bytes_per_second,
            gemm_flops(arch, tokens_in_step, tp) / setup.effective_compute_flops_per_second)


def predict_mean_step(
    setup: ServingSetup, groups: Sequence[RequestGroup], prefill_mix: Sequence[tuple[float, float]],
    prefill_mean_context_tokens: float | None = None,
) -> float:
    """Mean step time over steps whose prefill tokens follow `prefill_mix` ((tokens, share) pairs), each
    prefill token attending to `prefill_mean_context_tokens` on average (None: attention not counted).

    A step's GEMM phase is max(memory, compute): past the compute roof it grows with its tokens, so a
    few steps carrying big prefill chunks cost more than the same tokens spread evenly over every
    step; so does its attention phase, max(KV read, attention FLOPs), with a chunk's attention. The mean
    of the steps is the mean ITL a server shows, not the step at the mean prefill.
    """
    return mean_step_over_mix(setup, predict_step(setup, groups), prefill_mix, prefill_mean_context_tokens)


def mean_step_over_mix(setup: ServingSetup, step: StepPrediction, prefill_mix: Sequence[tuple[float, float]],
                       prefill_mean_context_tokens: float | None = None) -> float:
    """predict_mean_step from a prediction already made for the same requests (`step`, with any
    prefill tokens): those change only its GEMM phase and its attention FLOPs, so the rest of the step
    is taken from it once (this runs on every reading, over every bucket of the window's mix)."""
    rest = step.overhead_seconds + step.per_request_seconds
    decode_attention = step.attention_compute_seconds - _prefill_attention_seconds(
        setup, step.prefill_tokens, prefill_mean_context_tokens)

    def mean_of(tokens: float) -> float:
        attention = decode_attention + _prefill_attention_seconds(setup, tokens, prefill_mean_context_tokens)
        return (rest + max(_gemm_phase(setup, step.decode_tokens + tokens)[1:])
                + max(step.kv_memory_seconds, attention))
    total_share = sum(share for _, share in prefill_mix)
    if not prefill_mix or total_share <= 0:
        return mean_of(0.0)
    return sum(mean_of(tokens) * share for tokens, share in prefill_mix) / total_share


def _prefill_attention_seconds(setup: ServingSetup, prefill_tokens: float, mean_context_tokens: float | None
                               ) -> float:
    """Attention compute seconds of prefill tokens that each attend to `mean_context_tokens` on average."""
    if mean_context_tokens is None or prefill_tokens <= 0:
        return 0.0
    arch = setup.architecture
    attended = _prefill_attended_at_mean(arch, prefill_tokens, mean_context_tokens)
    return attention_flops(arch, attended, setup.tensor_parallel) / setup.effective_compute_flops_per_second


def groups_from_total(tokens_in_flight: float, running_requests: float) -> list[RequestGroup]:
    """What a server's metrics allow: N running requests sharing T tokens, taken as N of T/N each.

    Exact for plain models (bytes are linear in tokens); for sliding-window models it assumes
    equal contexts, which overestimates the windowed saving when contexts are very unequal.
    """
    if tokens_in_flight < 0 or running_requests < 0:
        raise InputError("tokens in flight and running requests must not be negative")
    count = round(running_requests)
    if count == 0:
        return [RequestGroup(1, tokens_in_flight)] if tokens_in_flight > 0 else []
    return [RequestGroup(count, tokens_in_flight / count)]


def step_budget_seconds(target_tokens_per_second: float, headroom: float = DEFAULT_HEADROOM) -> float:
    """The longest step that still gives every user the target speed, keeping 1-headroom for prompts."""
    if not target_tokens_per_second > 0:
        raise InputError(f"target tokens per second must be greater than zero, got {target_tokens_per_second!r}")
    if not 0 < headroom <= 1:
        raise InputError(f"headroom must be in (0, 1], got {headroom!r}")
    return headroom / target_tokens_per_second


def token_budget_tokens(
    setup: ServingSetup, step_budget: float, context_tokens_per_request: float | None = None
) -> float:
    """The most tokens in flight whose predicted step fits `step_budget`; 0 if the model alone misses.

    Plain models with no per-request cost and no context given use the closed form
    ((budget - overhead) * bandwidth - weights read) / kv_bytes_per_token (memory-bound GEMMs). With a
    context per request (needed for sliding windows, MoE and a per-request cost, where the step is
    not linear in tokens alone) the budget is found numerically, with requests of that context, and
    every phase counts.
    """
    arch = setup.architecture
    if context_tokens_per_request is None:
        if not budget_has_closed_form(setup):
            raise InputError(
                f"model {arch.name!r} has sliding-window layers, experts or a per-request cost: its token "
                "budget depends on the context per request; give one"
            )
        usable_bytes = (step_budget - setup.step_overhead_seconds) * setup.effective_bandwidth_bytes_per_second
        spare = usable_bytes - weight_read_bytes(arch, setup.weight_bytes_per_param, 1.0, setup.tensor_parallel)
        per_token = kv_bytes_per_token(arch, setup.kv_bytes_per_element, setup.tensor_parallel)
        return max(0.0, spare / per_token)
    if not context_tokens_per_request > 0:
        raise InputError(f"context per request must be greater than zero, got {context_tokens_per_request!r}")
    if arch.is_linear:
        solved = _solve_linear_budget(setup, step_budget, context_tokens_per_request)
        if solved is not None:
            return solved
    return _solve_budget_numerically(setup, step_budget, context_tokens_per_request)


def budget_has_closed_form(setup: ServingSetup) -> bool:
    """True when the step grows linearly with tokens in flight whatever their split into requests."""
    return setup.architecture.is_linear and setup.per_request_seconds == 0


def step_seconds_at(setup: ServingSetup, tokens_in_flight: float, context: float) -> float:
    """Predicted step with `tokens_in_flight` held by requests of `context` tokens each (the last
    one shorter); an empty batch is one request of 0 tokens, i.e. the weights alone."""
    return predict_step(setup, [RequestGroup(1, 0.0)] if tokens_in_flight <= 0 else
                        _groups_of_context(tokens_in_flight, context)).step_seconds


def _groups_of_context(tokens_in_flight: float, context: float) -> list[RequestGroup]:
    whole = int(tokens_in_flight // context)
    rest = tokens_in_flight - whole * context
    groups = [RequestGroup(whole, context)] if whole else []
    return groups + ([RequestGroup(1, rest)] if rest > 0 else [])


def _solve_linear_budget(setup: ServingSetup, step_budget: float, context: float) -> float | None:
    """The budget in closed form where every phase is affine in the running requests (dense, full
    attention); None where that does not hold and bisection must do (n past the embedding table).

    With requests of `context` tokens, n requests hold T in ((n-1)·context, n·context] tokens and the
    step is overhead + per_request·n + max(weights(n)/bandwidth, gemm(n)/compute) + s·T, with s the
    attention phase per token (its memory and compute both grow with T alone). So n requests fit
    iff the step at T = (n-1)·context is under the budget, a max of two affine functions of n;
    the largest such n comes from each line's root, and T from the budget left over in its interval.
    This runs on every reading with a fitted per-request cost: no search, a few predict_step calls.
    """
    def lines_at(requests: int) -> tuple[float, float, float]:
        """(memory-bound GEMM line, compute-bound GEMM line, step) at `requests` requests, the last empty."""
        step = predict_step(setup, [RequestGroup(requests - 1, context), RequestGroup(1, 0.0)])
        rest = step.step_seconds - step.gemm_seconds
        return rest + step.weight_memory_seconds, rest + step.gemm_compute_seconds, step.step_seconds

    memory_one, compute_one, first_step = lines_at(1)
    if not first_step < step_budget:
        return 0.0  # even the weights alone, with no context, miss
    memory_two, compute_two, _ = lines_at(2)
    largest = math.inf
    for at_one, at_two in ((memory_one, memory_two), (compute_one, compute_two)):
        slope = at_two - at_one
        if slope > 0:  # the line's root: n with at_one + slope·(n-1) = budget
            largest = min(largest, 1 + (step_budget - at_one) / slope)
    if largest * context > _BUDGET_SEARCH_CEILING_TOKENS:
        return _BUDGET_SEARCH_CEILING_TOKENS
    requests = max(1, math.ceil(largest) - 1)  # the most requests whose first token is strictly under
    arch = setup.architecture
    if arch.input_embedding_params and requests > arch.input_embedding_params / arch.hidden_size:
        return None  # past the table every row is read: the weight line bends, so search instead
    _, _, step = lines_at(requests)
    per_token = predict_step(setup, [RequestGroup(1, context)]).attention_seconds / context
    if not per_token > 0:
        return None
    return min(requests * context, (requests - 1) * context + (step_budget - step) / per_token)


def _solve_budget_numerically(setup: ServingSetup, step_budget: float, context: float) -> float:
    """The most tokens whose step fits, to half a token, for steps no formula inverts (MoE, sliding windows).

    The predicted step never decreases as tokens in flight grow, so a bracket [fits, misses] is kept
    throughout, first guessed from the straight line through 0 and one request. The step jumps where
    a request starts (its per-request cost, the experts its token touches) and is piecewise linear in
    between (kinks at windows and the compute roof). So the number of full requests is narrowed
    first, on the boundaries, where the step is smooth; then the last, partial request's tokens. Both
    by regula falsi, which lands in a few steps on such curves where bisection took ~30 per reading.
    """

    def excess(tokens: float) -> float:
        return step_seconds_at(setup, tokens, context) - step_budget

    at_zero, at_context = excess(0.0), excess(context)
    if at_zero > 0:
        return 0.0  # not even one request with no context yet
    low, below, high, above = 0.0, at_zero, context, at_context
    if at_context <= 0:
        slope = (at_context - at_zero) / context
        low, below = context, at_context
        high = max(2.0 * context, 1.05 * -at_zero / slope) if slope > 0 else 2.0 * context
        while (above := excess(high)) <= 0:
            low, below, high = high, above, 2.0 * high
            if high > _BUDGET_SEARCH_CEILING_TOKENS:
                return _BUDGET_SEARCH_CEILING_TOKENS
    # Full requests: k fit while excess(k * context) <= 0; low's whole requests fit, high's rounded up miss.
    fitting, missing = float(math.floor(low / context)), float(math.ceil(high / context))
    if missing - fitting > 1:
        fitting, fits, missing, misses = _narrow(lambda k: excess(k * context), fitting, missing,
                                                 excess(fitting * context), excess(missing * context), whole=True)
        if fitting * context > low:
            low, below = fitting * context, fits
        if missing * context < high:
            high, above = missing * context, misses
    if high - low > 0.5:  # the next request's first token may itself jump past the budget
        first = excess(low + 0.25)
        if first > 0:
            return low
        low, below = low + 0.25, first
    return _narrow(excess, low, high, below, above, whole=False)[0]


def _narrow(excess: Callable[[float], float], low: float, high: float, below: float, above: float, *,
            whole: bool) -> tuple[float, float, float, float]:
    """Shrink [low, high], excess(low) <= 0 < excess(high), to half a token (or to adjacent whole
    numbers): (low, its excess, high, its excess). Illinois regula falsi, bisecting when two steps
    fail to halve the bracket."""
    margin, done = (1.0, 1.0) if whole else (0.25, 0.5)
    replaced, stalls = 0, 0
    below_weight, above_weight = 1.0, 1.0  # Illinois scales the secant's end values, not the values returned
    while high - low > done:
        width = high - low
        if stalls >= 2:
            guess, stalls = (low + high) / 2, 0
        else:  # the secant's root
            scaled_below, scaled_above = below * below_weight, above * above_weight
            guess = low - scaled_below * width / (scaled_above - scaled_below)
        guess = float(round(guess)) if whole else guess
        guess = min(max(guess, low + margin), high - margin)  # strictly inside: the bracket always shrinks
        value = excess(guess)
        if value <= 0:
            low, below = guess, value
            above_weight = above_weight / 2 if replaced == -1 else above_weight  # Illinois: the stale end halves
            replaced = -1
        else:
            high, above = guess, value
            below_weight = below_weight / 2 if replaced == 1 else below_weight
            replaced = 1
        stalls = stalls + 1 if high - low > width / 2 else 0
    return low, below, high, above


# --- capacity --------------------------------------------------------------------------------


@dataclass(frozen=True)
class HybridKvLayout:
    """How vLLM V1's hybrid allocator lays out a sliding-window model's KV cache.

    Layers of one attention type are cut into groups of `group_layers`; one block is one page for
    every layer of one group, and all groups draw blocks from one pool (vLLM 0.33.0
    vllm/v1/core/kv_cache_planning.py l. 416-555; kv_cache_coordinator.py l. 120). A token of
    context costs 1/block_size blocks in every full-attention group, and in every sliding-window
    group only while inside the window: such a group holds at most cdiv(window - 1, block_size) + 1
    blocks of a decoding request (kv_cache_interface.py l. 938-944; blocks that slide out are freed
    at the request's next step, single_type_kv_cache_manager.py l. 714, 1182).
    """

    group_layers: int
    full_groups: int
    sliding_groups: int
    sliding_blocks_per_request: int  # blocks one decoding request holds in each sliding group


def hybrid_kv_layout(arch: Architecture, block_size_tokens: int) -> HybridKvLayout | None:
    """The layout for a model with both sliding-window and full-attention layers; None otherwise."""
    sliding, full = arch.sliding_window_layers, arch.full_attention_layers
    if not sliding or not full or not arch.sliding_window:
        return None
    smallest, largest = min(sliding, full), max(sliding, full)
    # kv_cache_planning.py l. 521-532: the smaller type's layer count, unless the larger is under 1.5x it.
    group_layers = largest if largest < 1.5 * smallest else smallest
    return HybridKvLayout(
        group_layers=group_layers,
        full_groups=math.ceil(full / group_layers),
        sliding_groups=math.ceil(sliding / group_layers),
        sliding_blocks_per_request=math.ceil((arch.sliding_window - 1) / block_size_tokens) + 1,
    )


def context_from_blocks(layout: HybridKvLayout, blocks_per_request: float, block_size_tokens: int) -> float:
    """Mean context per running request that holds `blocks_per_request` blocks of the shared pool.

    Inverts blocks(C) = full_groups * C / bs + sliding_groups * min(C / bs, sliding blocks): within
    the window every group grows with the context, past it only the full-attention groups do.
    Approximate: it assumes equal contexts and ignores block rounding and shared prefix blocks.
    """
    if blocks_per_request <= 0:
        return 0.0
    groups = layout.full_groups + layout.sliding_groups
    inside_window = groups * layout.sliding_blocks_per_request
    if blocks_per_request <= inside_window:
        return blocks_per_request / groups * block_size_tokens
    return (blocks_per_request - layout.sliding_groups * layout.sliding_blocks_per_request) \
        / layout.full_groups * block_size_tokens


def blocks_for_tokens(tokens: float, block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS) -> int:
    """A sequence holds whole blocks: ceil(tokens / block_size)."""
    return math.ceil(tokens / block_size_tokens)


def kv_cache_bytes(setup: ServingSetup) -> float:
    """Memory left for the KV cache on each GPU: memory·utilization - weights - reserved."""
    weights = weight_bytes(setup.architecture, setup.weight_bytes_per_param, setup.tensor_parallel)
    usable = setup.gpu_memory_bytes * setup.gpu_memory_utilization
    return max(0.0, usable - weights - setup.reserved_memory_bytes)


def kv_capacity_tokens(setup: ServingSetup) -> int:
    """Tokens the cache holds, floored to whole blocks, at the full per-token cost (all layers)."""
    per_token = kv_bytes_per_token(setup.architecture, setup.kv_bytes_per_element, setup.tensor_parallel)
    blocks = math.floor(kv_cache_bytes(setup) / (per_token * setup.block_size_tokens))
    return blocks * setup.block_size_tokens


def sequence_cache_bytes(
    arch: Architecture, context_tokens: float, kv_bytes_per_element: float,
    tensor_parallel: int = 1, block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS,
) -> float:
    """Cache bytes one sequence holds: its context rounded up to whole blocks."""
    held_tokens = blocks_for_tokens(context_tokens, block_size_tokens) * block_size_tokens
    return kv_bytes_for_context(arch, held_tokens, kv_bytes_per_element, tensor_parallel)


def sequences_that_fit(cache_bytes: float, bytes_per_sequence: float) -> int:
    if not bytes_per_sequence > 0:
        raise InputError("bytes per sequence must be greater than zero")
    return max(0, math.floor(cache_bytes / bytes_per_sequence))


def max_concurrency(setup: ServingSetup, context_tokens: float) -> int:
    """How many sequences of this context the cache holds at once."""
    if not context_tokens > 0:
        raise InputError(f"context must be greater than zero, got {context_tokens!r}")
    per_sequence = sequence_cache_bytes(
        setup.architecture, context_tokens, setup.kv_bytes_per_element,
        setup.tensor_parallel, setup.block_size_tokens,
    )
    return sequences_that_fit(kv_cache_bytes(setup), per_sequence)


# --- calibration -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CalibrationPoint:
    """One measured step: its inter-token latency, tokens in flight, the bytes a step read at it,
    and (for batches) the running requests, the weight part of the bytes and the GEMM FLOPs."""

    itl_seconds: float
    tokens_in_flight: float
    read_bytes: float
    running_requests: float = 1.0
    weight_read_bytes: float = 0.0
    gemm_flops: float = 0.0

    @property
    def bandwidth_bytes_per_second(self) -> float:
        """The point's own bandwidth, taking the whole gap as memory time (no overhead)."""
        return self.read_bytes / self.itl_seconds


def residual_ratios(points: Sequence[CalibrationPoint], fitted_seconds: Sequence[float]) -> tuple[float, ...]:
    """(fitted - measured) / measured, point by point."""
    return tuple((fit - p.itl_seconds) / p.itl_seconds for p, fit in zip(points, fitted_seconds, strict=True))


AGREEMENT_ON_BANDWIDTHS, AGREEMENT_ON_FIT_RESIDUALS = "bandwidths", "fit_residuals"
AGREEMENT_ON_WINDOW_RESIDUALS = "window_residuals_p90"  # online fits: many windows, a few may be outliers


@dataclass(frozen=True)
class Calibration:
    effective_bandwidth_bytes_per_second: float
    step_overhead_seconds: float
    points: tuple[CalibrationPoint, ...]
    fitted_seconds: tuple[float, ...]
    spread_ratio: float
    tolerance: float = AGREEMENT_TOLERANCE
    overhead_fitted: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    per_request_seconds: float = 0.0
    per_request_fitted: bool = False
    effective_compute_flops_per_second: float | None = None  # None: not fitted
    # What spread_ratio measures: BANDWIDTHS (one batch size), FIT_RESIDUALS (several batch sizes: the
    # largest miss) or WINDOW_RESIDUALS (an online fit: the 90th percentile miss over its windows).
    agreement_basis: str = AGREEMENT_ON_BANDWIDTHS

    @property
    def agrees(self) -> bool:
        """The model fits this server: the points' own bandwidths agree within tolerance (one batch
        size), or the fitted terms reproduce every point within it (several batch sizes)."""
        return self.spread_ratio <= self.tolerance

    @property
    def residual_ratios(self) -> tuple[float, ...]:
        return residual_ratios(self.points, self.fitted_seconds)

    @property
    def residual_rms_seconds(self) -> float:
        """Root mean square of the fit's residuals: how far the fitted terms are from the points."""
        squares = [(fit - p.itl_seconds) ** 2 for p, fit in zip(self.points, self.fitted_seconds, strict=True)]
        return math.sqrt(sum(squares) / len(squares))


@dataclass(frozen=True)
class FitBounds:
    """Physically sane ranges for fitted terms; a fit that leaves them is not trusted.

    Per-request costs measured on published tables are 50-130 us (sampling, per-sequence input
    preparation, a TP all-reduce growing with the batch); per-step overheads (scheduling, launches)
    are a few ms. Bandwidth and compute cannot exceed the GPU's datasheet peaks (inf: unknown)."""

    max_bandwidth_bytes_per_second: float = math.inf
    max_compute_flops_per_second: float = math.inf
    max_step_overhead_seconds: float = 0.05
    max_per_request_seconds: float = 300e-6

    def __post_init__(self) -> None:
        for name, value in (("max_bandwidth_bytes_per_second", self.max_bandwidth_bytes_per_second),
                            ("max_compute_flops_per_second", self.max_compute_flops_per_second),
                            ("max_step_overhead_seconds", self.max_step_overhead_seconds),
                            ("max_per_request_seconds", self.max_per_request_seconds)):
            if not value > 0:
                raise InputError(f"{name} must be greater than zero, got {value!r}")

    def upper(self, term: str) -> float:
        return self.max_step_overhead_seconds if term == _OVERHEAD else self.max_per_request_seconds


DEFAULT_FIT_BOUNDS = FitBounds()


# Terms a calibration can fit besides the bandwidth, by the point column that carries each.
_OVERHEAD, _PER_REQUEST = "overhead", "per_request"
# Compute rates tried when the points allow a compute fit (FLOP/s): 1 TFLOP/s to 10 PFLOP/s.
_COMPUTE_GRID_FLOPS = tuple(10 ** (12 + step / 20) for step in range(81))
# A compute rate is kept only where it cuts the squared residuals by this share: it must earn its place.
_COMPUTE_MIN_IMPROVEMENT = 0.5


def calibrate(points: Iterable[CalibrationPoint], tolerance: float = AGREEMENT_TOLERANCE,
              bounds: FitBounds = DEFAULT_FIT_BOUNDS) -> Calibration:
    """Fit the step's terms to measured points, least squares.

    itl = overhead + per_request * running + read_bytes / bandwidth (+ the GEMM FLOPs beyond the
    weight read, at a fitted compute rate, where the points allow it). Bandwidth is always fitted;
    a per-request cost where the running requests differ; an overhead where the bytes differ and a
    point is left over; compute where points are left over after those and it halves the residuals.
    A term fitted negative, or past its bound in `bounds` (the points cannot separate it reliably:
    a per-request cost of milliseconds is a bad point, not sampling), is dropped with a note and the
    rest refitted; a bandwidth past the GPU's peak drops the last extra term, and failing that is
    held at the peak; compute rates are searched up to the peak only.

    The agreement verdict, at one batch size, compares the points' own bandwidths (no overhead): a
    spread over `tolerance` means bytes read alone do not explain the gaps (prefix caching, quantized
    cache, MoE routing, or large fixed overheads). At several batch sizes the points' own bandwidths
    differ by the per-request cost even when the model fits exactly (1 request at 7.2 ms and 16 at
    9.5 ms on Qwen3-8B spread 16% with a 90 us cost that reproduces both), so the verdict is the
    fit's largest miss instead; a per-request cost past its bound is dropped first, so a bad point
    still shows as a miss rather than being absorbed.
    """
    points = tuple(points)
    _validate_points(points)
    bandwidths = [point.bandwidth_bytes_per_second for point in points]
    spread = max(bandwidths) / min(bandwidths) - 1.0
    notes: list[str] = []
    terms = _identifiable_terms(points)
    memory_notes: list[str] = []
    coefficients = _fit_non_negative(points, terms, memory_notes, 0.0, bounds)
    # A compute rate needs a point to spare beyond the terms it joins: with none it fits any two points exactly.
    inverse_compute = _fit_compute(points, terms, coefficients, bounds) if len(points) > len(terms) + 2 else 0.0
    if inverse_compute:  # compute-bound points distort a memory-only fit: refit every term with it
        coefficients = _fit_non_negative(points, terms, notes, inverse_compute, bounds)
    else:
        notes += memory_notes
    fitted_seconds = tuple(_fitted_seconds(p, coefficients, inverse_compute) for p in points)
    basis = AGREEMENT_ON_BANDWIDTHS
    if len({p.running_requests for p in points}) >= 2:
        basis = AGREEMENT_ON_FIT_RESIDUALS
        spread = max(abs(ratio) for ratio in residual_ratios(points, fitted_seconds))
    return Calibration(
        effective_bandwidth_bytes_per_second=1.0 / coefficients["inverse_bandwidth"],
        step_overhead_seconds=coefficients.get(_OVERHEAD, 0.0),
        points=points,
        fitted_seconds=fitted_seconds,
        spread_ratio=spread,
        tolerance=tolerance,
        overhead_fitted=_OVERHEAD in coefficients,
        notes=tuple(notes),
        per_request_seconds=coefficients.get(_PER_REQUEST, 0.0),
        per_request_fitted=_PER_REQUEST in coefficients,
        effective_compute_flops_per_second=1.0 / inverse_compute if inverse_compute else None,
        agreement_basis=basis,
    )


def _validate_points(points: tuple[CalibrationPoint, ...]) -> None:
    if not points:
        raise InputError("calibration needs at least one point")
    for point in points:
        if not point.itl_seconds > 0 or not point.read_bytes > 0 or point.tokens_in_flight < 0 \
                or not point.running_requests >= 1:
            raise InputError(
                f"calibration point {point.itl_seconds}@{point.tokens_in_flight}: inter-token latency "
                "must be greater than zero, tokens in flight not negative and running requests at least 1"
            )


def _identifiable_terms(points: tuple[CalibrationPoint, ...]) -> list[str]:
    """Which terms the points can tell apart from the bandwidth: one column each, one point each.

    A per-request cost comes first where the batch sizes differ: it is what carries a fit from
    small batches to large ones. Points at one batch size (one stream) leave it inside the overhead."""
    terms: list[str] = []
    if len({p.running_requests for p in points}) >= 2:
        terms.append(_PER_REQUEST)
    if len({p.read_bytes for p in points}) >= 2 and len(points) > len(terms) + 1:
        terms.append(_OVERHEAD)
    return terms


def _column(point: CalibrationPoint, term: str) -> float:
    return 1.0 if term == _OVERHEAD else point.running_requests


def _design_rows(points: tuple[CalibrationPoint, ...], terms: list[str]) -> list[list[float]]:
    """One least-squares row per point: its bytes (for 1/bandwidth), then one column per extra term."""
    return [[p.read_bytes] + [_column(p, term) for term in terms] for p in points]


def _fit_non_negative(points: tuple[CalibrationPoint, ...], terms: list[str], notes: list[str],
                      inverse_compute: float, bounds: FitBounds = DEFAULT_FIT_BOUNDS) -> dict[str, float]:
    """Least squares over bandwidth and `terms`; a term fitted negative or past its bound is dropped
    (noted) and the rest refitted; a bandwidth past the peak drops the last term, or is held at the peak."""
    active = list(terms)
    while True:
        rows = _design_rows(points, active)
        try:
            solution = _least_squares(rows, [p.itl_seconds for p in points])
            for _ in range(4 if inverse_compute else 0):  # compute-bound points depend on the bandwidth
                targets = [p.itl_seconds - _compute_excess_seconds(p, inverse_compute, solution[0]) for p in points]
                solution = _least_squares(rows, targets)
        except InputError:
            if not active:
                raise
            notes.append(f"the points cannot tell a {active[-1].replace('_', '-')} cost from the others "
                         "(e.g. one context per request at every batch size); refitted without it")
            active.pop()
            continue
        if solution[0] <= 0:
            # A longer point stepped no slower than a shorter one: on a server whose speed moved between
            # the points (a CI run of tests/test_real_vllm_calibration.py: its 7,000-token stream no slower
            # than its 3,000-token one) the overhead takes the whole gap. Fitting the bandwidth alone keeps
            # the points, and the verdict then refuses them by their own bandwidths' spread.
            if not active:
                raise InputError(
                    "calibration points disagree: the inter-token latency does not grow with the bytes read, "
                    "so these points cannot come from one model on one server"
                )
            notes.append(f"the gaps did not grow with the bytes read, so the {active[-1].replace('_', '-')} cost "
                         "took them all; refitted without it")
            active.pop()
            continue
        negative = [(value, term) for value, term in zip(solution[1:], active, strict=True) if value < 0]
        if negative:
            dropped = min(negative)[1]
            notes.append(f"the fit gave a negative {dropped.replace('_', '-')} cost; refitted without it")
            active.remove(dropped)
            continue
        beyond = [(value / bounds.upper(term), term) for value, term in zip(solution[1:], active, strict=True)
                  if value > bounds.upper(term)]
        if beyond:
            ratio, dropped = max(beyond)
            notes.append(f"the fit gave a {dropped.replace('_', '-')} cost {ratio:.1f}x its bound of "
                         f"{_seconds_text(bounds.upper(dropped))}: the points cannot separate it reliably; "
                         "refitted without it")
            active.remove(dropped)
            continue
        if 1.0 / solution[0] > bounds.max_bandwidth_bytes_per_second:
            if active:
                notes.append(f"the fit gave a bandwidth of {1.0 / solution[0] / 1e12:.2f} TB/s, over the GPU's peak: "
                             f"the {active[-1].replace('_', '-')} cost took time the bytes need; refitted without it")
                active.pop()
                continue
            notes.append(f"the points read faster than the GPU's peak bandwidth; held at the peak "
                         f"{bounds.max_bandwidth_bytes_per_second / 1e12:.2f} TB/s")
            solution[0] = 1.0 / bounds.max_bandwidth_bytes_per_second
        return {"inverse_bandwidth": solution[0], **dict(zip(active, solution[1:], strict=True))}


def _seconds_text(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.0f} ms"


def _compute_excess_seconds(point: CalibrationPoint, inverse_compute: float, inverse_bandwidth: float | None) -> float:
    """What the GEMMs add beyond reading the weights when they are compute-bound (0 when not)."""
    if not inverse_compute or inverse_bandwidth is None:
        return 0.0
    return max(0.0, point.gemm_flops * inverse_compute - point.weight_read_bytes * inverse_bandwidth)


def _fitted_seconds(point: CalibrationPoint, coefficients: dict[str, float], inverse_compute: float) -> float:
    inverse_bandwidth = coefficients["inverse_bandwidth"]
    linear = point.read_bytes * inverse_bandwidth + sum(
        value * _column(point, term) for term, value in coefficients.items() if term != "inverse_bandwidth")
    return linear + _compute_excess_seconds(point, inverse_compute, inverse_bandwidth)


def _fit_compute(points: tuple[CalibrationPoint, ...], terms: list[str], memory_fit: dict[str, float],
                 bounds: FitBounds = DEFAULT_FIT_BOUNDS) -> float:
    """The inverse compute rate that best explains what the memory fit leaves, or 0 if none earns its place.

    A 1-D search: for each rate the memory terms are refitted to what the compute excess leaves."""
    if not all(p.gemm_flops > 0 and p.weight_read_bytes > 0 for p in points):
        return 0.0
    baseline = _squared_residuals(points, memory_fit, 0.0)
    best, best_residuals = 0.0, baseline * (1.0 - _COMPUTE_MIN_IMPROVEMENT)
    rows = _design_rows(points, terms)
    for flops in _COMPUTE_GRID_FLOPS:
        if flops > bounds.max_compute_flops_per_second:
            break
        inverse_compute = 1.0 / flops
        coefficients = {"inverse_bandwidth": memory_fit["inverse_bandwidth"]}
        for _ in range(3):  # which points are compute-bound depends on the bandwidth, and back
            excess = [_compute_excess_seconds(p, inverse_compute, coefficients["inverse_bandwidth"]) for p in points]
            try:
                solution = _least_squares(rows, [p.itl_seconds - e for p, e in zip(points, excess, strict=True)])
            except InputError:
                break
            if solution[0] <= 0 or 1.0 / solution[0] > bounds.max_bandwidth_bytes_per_second or any(
                    not 0 <= value <= bounds.upper(term) for value, term in zip(solution[1:], terms, strict=True)):
                break
            coefficients = {"inverse_bandwidth": solution[0], **dict(zip(terms, solution[1:], strict=True))}
        if len(coefficients) != len(terms) + 1:
            continue
        residuals = _squared_residuals(points, coefficients, inverse_compute)
        if residuals < best_residuals:
            best, best_residuals = inverse_compute, residuals
    return best


def _squared_residuals(points: tuple[CalibrationPoint, ...], coefficients: dict[str, float],
                       inverse_compute: float) -> float:
    return sum((_fitted_seconds(p, coefficients, inverse_compute) - p.itl_seconds) ** 2 for p in points)


def _least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """Least-squares coefficients by the normal equations, columns scaled to 1 for conditioning."""
    width = len(rows[0])
    scales = [max(abs(row[j]) for row in rows) or 1.0 for j in range(width)]
    scaled = [[row[j] / scales[j] for j in range(width)] for row in rows]
    gram = [[sum(r[i] * r[j] for r in scaled) for j in range(width)] for i in range(width)]
    moments = [sum(r[i] * t for r, t in zip(scaled, targets, strict=True)) for i in range(width)]
    return [value / scale for value, scale in zip(solve_linear(gram, moments), scales, strict=True)]


def solve_linear(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a singular system is an InputError."""
    size = len(vector)
    augmented = [[*row, value] for row, value in zip(matrix, vector, strict=True)]
    for column in range(size):
        pivot = max(range(column, size), key=lambda r: abs(augmented[r][column]))
        if abs(augmented[pivot][column]) < 1e-12:
            raise InputError("calibration points do not tell the fitted terms apart; measure more varied points")
        augmented[column], augmented[pivot] = augmented[pivot], augmented[column]
        for row in range(column + 1, size):
            factor = augmented[row][column] / augmented[column][column]
            augmented[row] = [a - factor * b for a, b in zip(augmented[row], augmented[column], strict=True)]
    solution = [0.0] * size
    for row in reversed(range(size)):
        known = sum(augmented[row][k] * solution[k] for k in range(row + 1, size))
        solution[row] = (augmented[row][size] - known) / augmented[row][row]
    return solution


def calibration_point(setup: ServingSetup, itl_seconds: float, tokens_in_flight: float,
                      running_requests: float = 1.0) -> CalibrationPoint:
    """A measured gap with what the model says the step did: bytes read (weights and all), GEMM FLOPs.

    `tokens_in_flight` is shared by `running_requests` equal requests (one stream: its context)."""
    step = predict_step(setup, groups_from_total(tokens_in_flight, running_requests))
    return CalibrationPoint(itl_seconds, tokens_in_flight, step.read_bytes, max(1.0, running_requests),
                            step.weight_read_bytes, gemm_flops(setup.architecture, step.tokens_in_step,
                                                               setup.tensor_parallel))
