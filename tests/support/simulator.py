"""The simulated engine worked by hand, for the simulator's test modules: its KV blocks as vLLM sizes
them, stepping it one event at a time, its ground-truth step over a poll window, a /metrics page's
structure to diff against vLLM's, and what `calibrate --url` measures on it (`simulated_calibration`,
of the server `SPEC`)."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from functools import lru_cache

from prometheus_client.parser import text_string_to_metric_families

from exporter.capacity import calibrate, fit
from exporter.capacity.deployment import build_setup, load_architecture
from exporter.capacity.presets import GPUS, MODELS
from exporter.serve.config import Deployment, config_from_mapping
from exporter.simulator import ServerSpec, Simulator, StepRecord
from exporter.simulator.simulation import single_stream_token_seconds

QWEN = MODELS["qwen3-8b"]
SPEC = ServerSpec()


def kv_bytes_per_token_by_hand() -> float:
    return 2 * QWEN.layers * QWEN.kv_heads * QWEN.head_dim * 2  # K and V, bf16


def blocks_by_hand(utilization: float, reserve: float = 3.0e9) -> int:
    available = GPUS["h100-sxm"].memory_bytes * utilization - QWEN.params * 2 - reserve
    return math.floor(available / (16 * kv_bytes_per_token_by_hand()))


def step(sim: Simulator) -> None:
    next_event = sim.next_event_seconds()
    assert next_event is not None
    sim.run_until(next_event)


def true_mean_step_seconds(steps: Sequence[StepRecord]) -> float | None:
    """The simulator's ground truth for a poll window: the mean of its ITL observations, one per
    decoding request per step, each the step's duration (None: nothing decoded in the window).
    The mean, not the median: the daemon predicts the window's mean step (DESIGN §2)."""
    observations = [s.seconds for s in steps for _ in range(s.decode_tokens)]
    return statistics.fmean(observations) if observations else None


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


@lru_cache(maxsize=1)
def simulated_calibration() -> fit.Calibration:
    """What `calibrate --url` does (a short and a long lone stream), in simulated time."""
    setup = build_setup(load_architecture("qwen3-8b"), "h100-sxm").setup
    measurements = []
    for context in (calibrate.DEFAULT_SHORT_CONTEXT_TOKENS, calibrate.DEFAULT_LONG_CONTEXT_TOKENS):
        times = single_stream_token_seconds(SPEC, context, calibrate.DEFAULT_OUTPUT_TOKENS)
        gaps = tuple(later - earlier for earlier, later in itertools.pairwise(times))
        measurements.append(calibrate.StreamMeasurement(context, len(times), times[0], gaps))
    return fit.calibrate(calibrate.points_from_measurements(setup, measurements))


def calibrated_deployment() -> Deployment:
    """A qwen3-8b / h100-sxm deployment seeded with the simulator's one-stream calibration."""
    calibration = simulated_calibration()
    config = config_from_mapping({"deployments": [{
        "name": "pool", "model": "qwen3-8b", "gpu": "h100-sxm",
        "effective_bandwidth": calibration.effective_bandwidth_bytes_per_second,
        "step_overhead": calibration.step_overhead_seconds,
        "targets": {"static": ["http://127.0.0.1:8000/metrics"]}}]})
    return config.deployments[0]
