"""The daemon's pipeline against an in-process simulator, in simulated time: each poll renders the
simulator's page, reads it (exporter.serve.engines.read_page), takes the window over the previous
poll (exporter.serve.window.compute_window) and derives the reading (exporter.serve.reading)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from exporter.serve.config import Deployment
from exporter.serve.derivation import derive_reading
from exporter.serve.discovery import Target
from exporter.serve.engines import read_page
from exporter.serve.reading import Reading
from exporter.serve.setups_in_use import SetupsInUse
from exporter.serve.window import compute_window
from exporter.simulator import Simulator

TARGET_URL = "http://127.0.0.1:8000/metrics"


@dataclass(frozen=True)
class SimulatedPoll:
    seconds: float
    reading: Reading
    steps: list[Any]  # the simulator's steps in the window


def simulated_polls(sim: Simulator, deployment: Deployment, poll_seconds: float, until_seconds: float, *,
                    before: Callable[[float, float], None] | None = None,
                    setups_in_use: SetupsInUse | None = None) -> Iterator[SimulatedPoll]:
    """One SimulatedPoll every `poll_seconds` until `until_seconds`; `before(start, end)` runs first in
    each window (to change the server mid-run). The simulator must record its steps. Each reading
    predicts with `setups_in_use`'s setup (an online calibrator's), as the poller does; None: the seed."""
    assert sim.steps is not None
    target = Target(deployment=deployment.name, url=TARGET_URL, target="127.0.0.1:8000")
    previous, seen, t = None, 0, 0.0
    while t < until_seconds:
        if before is not None:
            before(t, t + poll_seconds)
        t += poll_seconds
        sim.run_until(t)
        (snapshot,) = read_page(sim.render_metrics()).snapshots
        window = compute_window(previous, snapshot)
        previous = snapshot
        predicting = setups_in_use.predicting_setup(deployment) if setups_in_use is not None else None
        reading = derive_reading(deployment, target, snapshot, window, now_seconds=t, scrape_duration_seconds=0.0,
                                 predicting=predicting)
        steps = sim.steps[seen:]
        seen = len(sim.steps)
        yield SimulatedPoll(t, reading, steps)
