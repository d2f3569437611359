"""Refits on a steady load do not jump: once a term is identified, consecutive refits move it less than 10%.

A refit that trades one term against another (bandwidth 12.6 -> 27.9 -> 12.6 GB/s within 90 s was seen on a
real engine) makes every prediction between refits a coin toss. On a steady load the windows the fit sees
change only at the edges of its history, so an identified term has no reason to move much.

A steady open-loop load (Poisson arrivals of chats whose lengths spread +-80%, so running requests and their
contexts both move from window to window and every linear term is identified), served by a stand-in whose
physics is neither the model's nor the simulator's (the one tests/test_online_calibration.py converges on), in
simulated time.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

from exporter.capacity import model
from exporter.serve.config import Deployment, config_from_mapping
from exporter.serve.online_calibration import FitWindow, OnlineCalibrator, Parameters, fitted_step_seconds
from exporter.simulator import ServerSpec, Simulator
from exporter.simulator.hardware import StepCost
from exporter.simulator.scenarios import PoissonGroup, Scenario, TokenCount
from tests.support.simulated_polls import TARGET_URL, simulated_polls

POLL_SECONDS = 5.0
H100_BANDWIDTH, H100_BF16 = 3.35e12, 989e12
MOVE_RATIO = 0.10
STEP_MOVE_RATIO = 0.02
SETTLED_SECONDS = 600.0  # the holdout and half the history


class _StandIn:
    """2.5 ms a step, 60 us per running request, weights at 55% and the KV cache at 80% of the peak bandwidth,
    GEMMs at 40% of the dense peak."""

    def __init__(self, physics: Any) -> None:
        self.physics = physics

    def step_cost(self, sequences: list[Any]) -> StepCost:
        base = self.physics.step_cost(sequences)
        sim_compute = self.physics.compute_flops_per_second
        memory = base.weight_read_bytes / (0.55 * H100_BANDWIDTH) + base.kv_read_bytes / (0.80 * H100_BANDWIDTH)
        compute = base.compute_seconds * sim_compute / (0.40 * H100_BF16)
        seconds = 2.5e-3 + 60e-6 * len(sequences) + max(memory, compute)
        return replace(base, seconds=seconds, overhead_seconds=2.5e-3 + 60e-6 * len(sequences))


def _deployment() -> Deployment:
    config = config_from_mapping({
        "poll_interval": "1s", "alerting": {"drift_for": "1s"},
        "defaults": {"online_calibration": {"history": "20m", "holdout": "1m", "min_windows": 30}},
        "deployments": [{"name": "pool", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": [TARGET_URL]}}]})
    return config.deployments[0]


STEADY = Scenario("steady-poisson", "chats arriving at 2 a second, 1,500 +- 80% prompt and 600 +- 80% output tokens",
                  (PoissonGroup("chat", 2.0, TokenCount(1500, 0.8), TokenCount(600, 0.8)),))


@dataclass(frozen=True)
class Refit:
    at_seconds: float
    parameters: Parameters
    held: frozenset[str]  # the terms this refit kept at the seed


def _refits(scenario: Scenario, until_seconds: float) -> tuple[list[Refit], FitWindow, model.ServingSetup]:
    """Each refit that replaced the seed, the load's median window (by tokens in flight) and the seed."""
    deployment = _deployment()
    calibrator = OnlineCalibrator([deployment])
    calibration = calibrator.deployments["pool"]
    sim = Simulator(ServerSpec(), scenario, record_steps=True)
    sim.engines[0].physics = _StandIn(sim.engines[0].physics)
    refits: list[Refit] = []
    last_fit = None
    for sampled in simulated_polls(sim, deployment, POLL_SECONDS, until_seconds):
        calibrator.observe([sampled.reading], sampled.seconds)
        fit = calibration.fit
        if fit is not last_fit and fit is not None and fit.parameters is not None:
            refits.append(Refit(sampled.seconds, fit.parameters, frozenset(h.parameter for h in fit.held)))
        last_fit = fit
    windows = sorted(calibration.windows.between(0.0, until_seconds), key=lambda window: window.tokens_in_flight)
    return refits, windows[len(windows) // 2], calibration.seed


def _contributions(seed: model.ServingSetup, window: FitWindow, parameters: Parameters) -> dict[str, float]:
    """What each linear term adds to the window's predicted step: the step less the step without it."""
    (step,) = fitted_step_seconds(seed, [window], parameters)
    without = {
        "bandwidth_bytes_per_second": replace(parameters, bandwidth_bytes_per_second=math.inf),
        "step_overhead_seconds": replace(parameters, step_overhead_seconds=0.0),
        "per_request_seconds": replace(parameters, per_request_seconds=0.0),
    }
    return {name: step - fitted_step_seconds(seed, [window], other)[0] for name, other in without.items()}


def test_identified_terms_move_less_than_ten_percent_between_consecutive_refits() -> None:
    """Once the fit has seen SETTLED_SECONDS of the load: every identified term that carries at least a tenth
    of the median window's step moves less than 10% from one refit to the next, and the predicted step of
    that window less than 2%. A term carrying less (here the per-request cost, a few us a request) is
    measured by the step it changes: its own value is then set by noise, a 5 us to 20 us move is 4x and
    under 2% of the step.

    Not from the first refit: the compute rate is chosen on a coarse grid (0.5x to 2x the seed's), and at
    505 s one refit took the 1.4x rate, 40% up, and the next went back; after that it holds."""
    refits, window, seed = _refits(STEADY, 1500.0)
    settled = [refit for refit in refits if refit.at_seconds >= SETTLED_SECONDS]
    assert len(settled) >= 10, len(settled)
    moves, steps = [], []
    for before, after in itertools.pairwise(settled):
        (step_before,), (step_after,) = (fitted_step_seconds(seed, [window], r.parameters) for r in (before, after))
        steps.append((after.at_seconds, step_after / step_before - 1))
        carried = _contributions(seed, window, before.parameters)
        for name, old in before.parameters.as_dict().items():
            if name in before.held | after.held or carried.get(name, step_before) < 0.1 * step_before:
                continue
            moves.append((after.at_seconds, name, after.parameters.as_dict()[name] / old - 1))
    # The bandwidth (held here: the KV bytes follow the running requests), the overhead and the compute rate.
    assert {name for _, name, _ in moves} >= {"step_overhead_seconds", "compute_flops_per_second"}, moves
    assert all(abs(move) < MOVE_RATIO for _, _, move in moves), [m for m in moves if abs(m[2]) >= MOVE_RATIO]
    assert all(abs(move) < STEP_MOVE_RATIO for _, move in steps), steps
