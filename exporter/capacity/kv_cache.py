"""The KV cache's capacity: how much of it a replica has, how vLLM lays it out in blocks, and what it holds.

One job: memory, not time. The bytes left for the cache on each GPU, the tokens and sequences they hold
in whole blocks, and the block layout vLLM V1's hybrid allocator gives a sliding-window model (so a
server's used blocks can be read back as context per request).

Why apart from the step math (exporter/capacity/model.py): a step's time and the cache's size are two
questions about one replica that share only its setup and the architecture's bytes per token; the
planner asks both, the daemon's reading asks each on its own. Pure functions: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from exporter.capacity.architecture import Architecture, kv_bytes_for_context, kv_bytes_per_token, weight_bytes
from exporter.errors import InputError

if TYPE_CHECKING:  # only its type: the step math imports this module for the block size
    from exporter.capacity.model import ServingSetup

DEFAULT_BLOCK_SIZE_TOKENS = 16


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
