"""The simulated server's private hardware truth: how long one engine step really takes.

Written apart from `exporter.capacity.model` on purpose (DESIGN §5): the daemon predicts step times with
its own bandwidth-plus-overhead model, and the simulator must not share that code, or agreement
between prediction and simulation would be a tautology. Only the architecture *data* of the
presets (layers, heads, parameters, windows, experts) is shared; every byte and FLOP is counted
here, and the physics differs from the model's in ways real servers do:

  * KV is held and read in whole blocks (a 1,001-token sequence reads 63 blocks of 16);
  * every step pays a launch/scheduling overhead, plus a little per scheduled sequence;
  * the true bandwidth efficiency is not the model's 0.6 default;
  * paged-attention KV reads run a little less efficiently than the weight stream, and less so at
    long context (scattered blocks, split-KV reductions);
  * memory and compute overlap imperfectly; prefill chunks pay attention FLOPs over their context;
  * a few percent of seeded noise.

The daemon never reads these parameters: calibration and prediction error are real measurements.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

from exporter.capacity.presets import Gpu
from exporter.errors import InputError


class ArchitectureData(Protocol):
    """The preset fields the simulator reads (exporter.capacity.presets.MODELS entries satisfy it).

    Read-only properties: a frozen dataclass satisfies them, and the simulator never writes them.
    """

    @property
    def name(self) -> str: ...

    @property
    def layers(self) -> int: ...

    @property
    def attention_heads(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def params(self) -> float: ...

    @property
    def attention_kind(self) -> str: ...

    @property
    def kv_lora_rank(self) -> int: ...

    @property
    def qk_rope_head_dim(self) -> int: ...

    @property
    def sliding_window(self) -> int | None: ...

    @property
    def sliding_window_layers(self) -> int: ...

    @property
    def experts(self) -> int: ...

    @property
    def experts_per_token(self) -> int: ...

    @property
    def routed_expert_params(self) -> float: ...


@dataclass(frozen=True)
class HardwareTruth:
    """The server's private performance truth (defaults: an H100-class server running vLLM)."""

    launch_overhead_seconds: float = 1.6e-3  # scheduler + kernel launches + sampling, per step
    per_sequence_overhead_seconds: float = 4e-6  # input prep and sampling per scheduled sequence
    bandwidth_efficiency: float = 0.64  # of the datasheet peak, on the weight stream
    kv_read_efficiency: float = 0.95  # paged KV reads relative to the weight stream, short context
    kv_read_long_context_drop: float = 0.10  # efficiency lost as context grows large
    kv_read_half_drop_tokens: float = 50_000.0  # context at which half that drop has happened
    compute_efficiency: float = 0.55  # of the dense tensor peak, for GEMMs and attention
    overlap_leak: float = 0.10  # share of the smaller of memory/compute time not hidden by overlap
    noise_ratio: float = 0.02  # standard deviation of multiplicative step noise

    def validate(self) -> None:
        for name in ("bandwidth_efficiency", "kv_read_efficiency", "compute_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise InputError(f"hardware truth: {name} must be in (0, 1], got {value!r}")
        if not 0.0 <= self.kv_read_long_context_drop < self.kv_read_efficiency:
            raise InputError("hardware truth: kv_read_long_context_drop must be below kv_read_efficiency")
        for name in ("launch_overhead_seconds", "per_sequence_overhead_seconds", "noise_ratio", "overlap_leak"):
            if getattr(self, name) < 0:
                raise InputError(f"hardware truth: {name} must not be negative")


@dataclass(frozen=True)
class ModelBytes:
    """Bytes the simulated GPU holds for one model, computed from the preset's architecture data."""

    weight_bytes: float
    kv_bytes_per_token_full_layers: float  # one token's K and V on every full-attention layer
    kv_bytes_per_token_window_layers: float  # the same on sliding-window layers
    sliding_window_tokens: int | None
    shared_weight_bytes: float  # dense part of an MoE (all of a dense model)
    routed_weight_bytes: float  # all routed experts together (0 for a dense model)
    experts: int
    experts_per_token: int
    active_params: float
    attention_flops_per_token_pair: float  # FLOPs of QK^T and AV for one query token x one key token

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv_bytes_per_token_full_layers + self.kv_bytes_per_token_window_layers


def model_bytes(arch: ArchitectureData, weight_bytes_per_param: float = 2.0,
                kv_bytes_per_element: float = 2.0) -> ModelBytes:
    """Count the bytes of weights and KV from architecture data (single GPU, no tensor parallel)."""
    if arch.attention_kind == "mla":
        # MLA caches one compressed latent plus the rotary key per layer: no K/V pair, no heads.
        per_layer = (arch.kv_lora_rank + arch.qk_rope_head_dim) * kv_bytes_per_element
    elif arch.attention_kind == "mha":
        per_layer = 2 * arch.kv_heads * arch.head_dim * kv_bytes_per_element  # K and V per KV head
    else:
        raise InputError(f"the simulator cannot serve attention kind {arch.attention_kind!r} of {arch.name}")
    window_layers = arch.sliding_window_layers if arch.sliding_window else 0
    full_layers = arch.layers - window_layers
    routed = arch.routed_expert_params if arch.experts else 0.0
    active = arch.params - routed + (routed * arch.experts_per_token / arch.experts if arch.experts else 0.0)
    return ModelBytes(
        weight_bytes=arch.params * weight_bytes_per_param,
        kv_bytes_per_token_full_layers=full_layers * per_layer,
        kv_bytes_per_token_window_layers=window_layers * per_layer,
        sliding_window_tokens=arch.sliding_window if window_layers else None,
        shared_weight_bytes=(arch.params - routed) * weight_bytes_per_param,
        routed_weight_bytes=routed * weight_bytes_per_param,
        experts=arch.experts,
        experts_per_token=arch.experts_per_token,
        active_params=active,
        # Per layer: QK^T and AV are each 2 FLOPs x heads x head_dim per (query, key) pair.
        attention_flops_per_token_pair=4.0 * arch.layers * arch.attention_heads * arch.head_dim,
    )


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: how many tokens it computes and how much KV it then holds."""

    new_tokens: int
    context_tokens: int  # tokens computed before this step
    held_blocks: int  # blocks allocated to it for this step


@dataclass(frozen=True)
class StepCost:
    seconds: float
    memory_seconds: float
    compute_seconds: float
    overhead_seconds: float
    kv_read_bytes: float
    weight_read_bytes: float
    flops: float  # GEMMs over the active parameters plus prefill attention
    kv_write_bytes: float  # the K and V of every token computed in the step, on every layer


class StepPhysics:
    """Step time of the simulated GPU for a scheduled batch."""

    def __init__(self, truth: HardwareTruth, gpu: Gpu, model: ModelBytes, block_size_tokens: int,
                 weight_bytes_per_param: float, rng: random.Random) -> None:
        truth.validate()
        self.truth = truth
        self.model = model
        self.block_size_tokens = block_size_tokens
        self.bandwidth_bytes_per_second = gpu.peak_bandwidth_bytes_per_second * truth.bandwidth_efficiency
        self.compute_flops_per_second = gpu.peak_flops_for(weight_bytes_per_param) * truth.compute_efficiency
        self._rng = rng

    def kv_read_efficiency(self, context_tokens: float) -> float:
        truth = self.truth
        return truth.kv_read_efficiency - truth.kv_read_long_context_drop * (
            context_tokens / (context_tokens + truth.kv_read_half_drop_tokens))

    def held_kv_bytes(self, held_blocks: int) -> float:
        """KV bytes a sequence holding `held_blocks` whole blocks reads (window layers capped)."""
        tokens = held_blocks * self.block_size_tokens
        window = self.model.sliding_window_tokens
        window_tokens = (tokens if window is None
                         else min(tokens, math.ceil(window / self.block_size_tokens) * self.block_size_tokens))
        return (tokens * self.model.kv_bytes_per_token_full_layers
                + window_tokens * self.model.kv_bytes_per_token_window_layers)

    def weight_bytes_read(self, tokens_in_step: int) -> float:
        model = self.model
        if not model.experts:
            return model.weight_bytes
        # Each token routes to k of E experts per layer; an expert is read once per step if any
        # token picked it.
        miss = (1.0 - model.experts_per_token / model.experts) ** max(tokens_in_step, 1)
        return model.shared_weight_bytes + model.routed_weight_bytes * (1.0 - miss)

    def step_cost(self, sequences: list[ScheduledSequence]) -> StepCost:
        tokens_in_step = 0
        kv_seconds = 0.0
        kv_bytes = 0.0
        attention_flops = 0.0
        for seq in sequences:
            tokens_in_step += seq.new_tokens
            held = self.held_kv_bytes(seq.held_blocks)
            kv_bytes += held
            kv_seconds += held / (self.bandwidth_bytes_per_second * self.kv_read_efficiency(seq.context_tokens))
            if seq.new_tokens > 1:  # a prefill chunk: each new token attends to the context and the chunk
                attention_flops += self.model.attention_flops_per_token_pair * seq.new_tokens * (
                    seq.context_tokens + seq.new_tokens / 2.0)
        weights = self.weight_bytes_read(tokens_in_step)
        memory = weights / self.bandwidth_bytes_per_second + kv_seconds
        flops = 2.0 * self.model.active_params * tokens_in_step + attention_flops
        compute = flops / self.compute_flops_per_second
        overhead = self.truth.launch_overhead_seconds + self.truth.per_sequence_overhead_seconds * len(sequences)
        busy = max(memory, compute) + self.truth.overlap_leak * min(memory, compute)
        noise = max(0.5, 1.0 + self._rng.gauss(0.0, self.truth.noise_ratio))
        return StepCost(seconds=(overhead + busy) * noise, memory_seconds=memory, compute_seconds=compute,
                        overhead_seconds=overhead, kv_read_bytes=kv_bytes, weight_read_bytes=weights, flops=flops,
                        kv_write_bytes=tokens_in_step * self.model.kv_bytes_per_token)


def num_gpu_blocks(gpu_memory_bytes: float, gpu_memory_utilization: float, weight_bytes: float,
                   activation_reserve_bytes: float, block_size_tokens: int, kv_bytes_per_token: float) -> int:
    """vLLM's sizing: what is left of the memory share after weights and the profiled activation
    peak, in whole blocks (vllm/v1/worker/gpu_worker.py determine_available_memory, then
    kv_cache_utils: available // page size)."""
    available = gpu_memory_bytes * gpu_memory_utilization - weight_bytes - activation_reserve_bytes
    blocks = math.floor(available / (block_size_tokens * kv_bytes_per_token))
    if blocks <= 0:
        raise InputError(
            f"no memory left for the KV cache: {gpu_memory_bytes:.3g} B x {gpu_memory_utilization} "
            f"- weights {weight_bytes:.3g} B - reserve {activation_reserve_bytes:.3g} B <= 0")
    return blocks
