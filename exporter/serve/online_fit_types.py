"""The online fit's vocabulary: one engine's window (FitWindow), the terms fitted (Parameters), a fit's
outcome (Fit, and the terms it Held at the seed) and the sane ranges it fits within (Bounds).

Why a module of its own: the fit's math (exporter.serve.online_fit), the calibrator that runs it
(exporter.serve.online_calibration), the setups in use and the collector (which exports a fit's held
terms and the windows' prefill mixes) all speak of these; none of them needs the math or the
calibrator's threads to do so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from exporter.capacity import model
from exporter.capacity.deployment import fit_bounds
from exporter.capacity.fit import DEFAULT_FIT_BOUNDS, FitBounds

if TYPE_CHECKING:
    from exporter.capacity.deployment import ResolvedSetup


# Prefill mixes are kept (and exported, and read back from Prometheus after a restart) in at most this
# many parts: vLLM's iteration-tokens buckets rarely hold more than a decode part, a chunk part and
# one or two in between, and merging the nearest parts keeps the prefill tokens.
MIX_PARTS = 4
MIN_RATE_SHARE_OF_PEAK = 0.05  # fitted bandwidth and compute: at least this share of the datasheet peak


@dataclass(frozen=True)
class FitWindow:
    """One poll window of one engine: what it held and how long its steps took on average."""

    end_seconds: float
    tokens_in_flight: float
    running: float
    prefill_tokens_per_step: float
    measured_step_seconds: float
    # The window's steps by prefill tokens ((tokens, share) pairs), where the page has the histogram:
    # a few steps with big chunks cost more than the same tokens spread evenly (compute-bound GEMMs).
    prefill_mix: tuple[tuple[float, float], ...] | None = None
    # The KV cache dtype and block size the engine's page reported (None: the config's). The window's
    # bytes are counted with them, as its reading predicted with them (reading.page_setup): fitted with
    # the config's, a page's fp8 cache would read as half the bandwidth's worth of KV bytes too many.
    kv_cache_dtype: str | None = None
    block_size_tokens: int | None = None
    # The mean context the window's prefill tokens attended to (Window.prefill_mean_context_tokens): a
    # chunk after thousands of its prompt's tokens takes longer than the same chunk at its prompt's start.
    prefill_mean_context_tokens: float | None = None
    # The KV bytes per token the engine allocated, where its page says (a float32 server behind a bfloat16
    # config.json): counted as the reading counted them.
    kv_bytes_per_token: float | None = None

    @property
    def usable(self) -> bool:
        numbers = (self.end_seconds, self.tokens_in_flight, self.running, self.prefill_tokens_per_step,
                   self.measured_step_seconds)
        return (all(math.isfinite(value) for value in numbers) and self.running >= 1
                and self.tokens_in_flight >= 0 and self.prefill_tokens_per_step >= 0
                and 0 < self.measured_step_seconds < 60)


@dataclass(frozen=True)
class Parameters:
    bandwidth_bytes_per_second: float
    step_overhead_seconds: float
    per_request_seconds: float
    compute_flops_per_second: float

    @classmethod
    def of(cls, setup: model.ServingSetup) -> Parameters:
        return cls(setup.effective_bandwidth_bytes_per_second, setup.step_overhead_seconds,
                   setup.per_request_seconds, setup.effective_compute_flops_per_second)

    def applied_to(self, setup: model.ServingSetup) -> model.ServingSetup:
        return replace(setup, effective_bandwidth_bytes_per_second=self.bandwidth_bytes_per_second,
                       step_overhead_seconds=self.step_overhead_seconds,
                       per_request_seconds=self.per_request_seconds,
                       effective_compute_flops_per_second=self.compute_flops_per_second)

    def as_dict(self) -> dict[str, float]:
        return {"bandwidth_bytes_per_second": self.bandwidth_bytes_per_second,
                "step_overhead_seconds": self.step_overhead_seconds,
                "per_request_seconds": self.per_request_seconds,
                "compute_flops_per_second": self.compute_flops_per_second}


# Why a term stays at its seed (the `reason` label of stepbudget_online_fit_held_info).
HELD_REASONS = {
    "tokens_follow_running_requests": "tokens in flight only follow running requests (a steady context per "
                                      "request): the KV bytes cannot be told from the per-request cost",
    "tokens_steady": "tokens in flight barely change (at a steady running count): the KV bytes cannot be told "
                     "from the per-step overhead",
    "bandwidth_at_peak": "the windows' best fit put the bandwidth at the device's peak, which no server reaches: "
                         "the KV bytes moved the step too little, or the model reads them wrong, to measure it",
    "bandwidth_not_identified": "the windows cannot split the step between the per-step overhead and the bytes, "
                                "and the seed's bandwidth is a datasheet share: the overhead stays at the seed's "
                                "and the bandwidth takes the gap",
    "running_requests_steady": "running requests barely change: the per-request cost cannot be told from the "
                               "per-step overhead",
    "no_prefill_mix": "fewer than half the windows say how their prefill split into steps (vLLM's "
                      "iteration_tokens_total): spread evenly, a few big chunks read as a slow GPU",
    "no_compute_bound_steps": "no window holds a step past the compute roof: the compute rate changes no prediction",
}
BANDWIDTH, OVERHEAD, PER_REQUEST, COMPUTE = ("bandwidth_bytes_per_second", "step_overhead_seconds",
                                             "per_request_seconds", "compute_flops_per_second")


@dataclass(frozen=True)
class Held:
    """A term the windows do not identify, kept at its seed: `reason` is a HELD_REASONS code, `detail`
    the numbers behind it."""

    parameter: str  # a Parameters field
    reason: str
    detail: str = ""


@dataclass(frozen=True)
class Fit:
    """A fit's outcome. `parameters` is None when the seed stays (`reason` says why); otherwise the
    terms in `held` are the seed's (the windows do not identify them) and the others are fitted."""

    parameters: Parameters | None
    windows: int  # windows offered (inside history, outside the holdout)
    windows_used: int  # after leaving out the outliers
    residual_ratio: float | None  # median |relative residual| of the windows used
    reason: str = ""
    held: tuple[Held, ...] = ()


@dataclass(frozen=True)
class Bounds:
    """Sane ranges, from the GPU's datasheet peaks and FitBounds."""

    min_bandwidth: float
    max_bandwidth: float
    max_overhead: float
    max_per_request: float
    min_compute: float
    max_compute: float

    @classmethod
    def of(cls, peak_bandwidth: float, peak_compute: float,
           fit_bounds: FitBounds = DEFAULT_FIT_BOUNDS) -> Bounds:
        return cls(MIN_RATE_SHARE_OF_PEAK * peak_bandwidth, peak_bandwidth, fit_bounds.max_step_overhead_seconds,
                   fit_bounds.max_per_request_seconds, MIN_RATE_SHARE_OF_PEAK * peak_compute, peak_compute)

    @classmethod
    def of_setup(cls, resolved: ResolvedSetup) -> Bounds:
        """The bounds of a deployment's setup: its GPU's peaks and the limits `calibrate` fits within
        (capacity.deployment.fit_bounds), so the online fit and a calibration file agree on what is sane."""
        limits = fit_bounds(resolved)
        return cls.of(limits.max_bandwidth_bytes_per_second, limits.max_compute_flops_per_second, limits)


def fit_mix(mix: Sequence[tuple[float, float]] | None, parts: int = MIX_PARTS
            ) -> tuple[tuple[float, float], ...] | None:
    """A window's prefill mix as the fit keeps it: (tokens, share) parts in token order, shares summing
    to 1, at most `parts` of them. Past that the two neighbours whose merge moves the fewest
    share-weighted tokens (Ward's criterion) become one part at their mean, so the window's prefill
    tokens are kept and a decode part is never averaged with a chunk part while closer parts remain."""
    points = sorted((float(tokens), float(share)) for tokens, share in mix or ()
                    if math.isfinite(tokens) and tokens >= 0 and math.isfinite(share) and share > 0)
    total = sum(share for _, share in points)
    if not points or not total > 0:
        return None
    merged: list[tuple[float, float]] = []
    for tokens, share in points:  # parts of equal tokens (buckets under the decode tokens all read 0) are one
        if merged and merged[-1][0] == tokens:
            merged[-1] = (tokens, merged[-1][1] + share / total)
        else:
            merged.append((tokens, share / total))
    while len(merged) > max(1, parts):
        def cost(i: int) -> float:
            (a, wa), (b, wb) = merged[i], merged[i + 1]
            return wa * wb / (wa + wb) * (b - a) ** 2
        i = min(range(len(merged) - 1), key=cost)
        (a, wa), (b, wb) = merged[i], merged[i + 1]
        merged[i:i + 2] = [((a * wa + b * wb) / (wa + wb), wa + wb)]
    return tuple(merged)


def setup_key(resolved: ResolvedSetup) -> str:
    """What a window's step time depends on besides its own load: the model's architecture, the device
    (name, memory, peaks), the tensor parallelism and the weights' bytes per parameter. Windows of
    another setup (a new GPU, TP or quantization) say nothing about this one's terms. Not in it: the
    rates (what the fit finds), the KV dtype and block size (each window carries its engine's own)."""
    setup = resolved.setup
    architecture = {name: value for name, value in dataclasses.asdict(setup.architecture).items() if name != "source"}
    gpu = resolved.gpu
    identity = {"architecture": architecture, "gpu": gpu.name, "gpu_memory_bytes": setup.gpu_memory_bytes,
                "peak_bandwidth": gpu.peak_bandwidth_bytes_per_second,
                "peak_flops": sorted(gpu.peak_flops_per_second.items()), "tensor_parallel": setup.tensor_parallel,
                "weight_bytes_per_param": setup.weight_bytes_per_param}
    text = json.dumps(identity, sort_keys=True, default=repr)
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()
