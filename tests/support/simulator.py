"""The simulated engine worked by hand, for the simulator's test modules: its KV blocks as vLLM sizes
them, stepping it one event at a time, and a /metrics page's structure to diff against vLLM's."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from exporter.capacity.presets import GPUS, MODELS
from exporter.simulator import Simulator

QWEN = MODELS["qwen3-8b"]


def kv_bytes_per_token_by_hand() -> float:
    return 2 * QWEN.layers * QWEN.kv_heads * QWEN.head_dim * 2  # K and V, bf16


def blocks_by_hand(utilization: float, reserve: float = 3.0e9) -> int:
    available = GPUS["h100-sxm"].memory_bytes * utilization - QWEN.params * 2 - reserve
    return math.floor(available / (16 * kv_bytes_per_token_by_hand()))


def step(sim: Simulator) -> None:
    next_event = sim.next_event_seconds()
    assert next_event is not None
    sim.run_until(next_event)


Structure = dict[str, tuple[str, str, frozenset[str], tuple[str, ...]]]


def structure(text: str) -> Structure:
    out: Structure = {}
    for family in text_string_to_metric_families(text):
        labels: set[str] = set()
        edges: list[str] = []
        for sample in family.samples:
            labels |= set(sample.labels) - {"le"}
            if sample.name.endswith("_bucket"):
                edges.append(sample.labels["le"])
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = (family.type, family.documentation, frozenset(labels), tuple(dict.fromkeys(edges)))
    return out
