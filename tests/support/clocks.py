"""Injected clocks: a manual wall clock and a stepping monotonic clock."""

from __future__ import annotations


class ManualClock:
    """An injected clock: time moves only when a test says so."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SteppingClock:
    """A monotonic clock that moves `step` seconds at every read: a fetch (two reads) lasts `step`."""

    def __init__(self, step: float) -> None:
        self.step, self.now = step, 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now

