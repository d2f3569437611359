"""Plays a load shape through the load generator: its lanes as the generator's phases, each open-loop request
in a thread of its own, held to its process's caps.

One job: run a `LoadShape` (exporter/real_vllm/shapes.py) against a server in real time, and count what it
did beside what the shape says (`PlayStats`). Why apart: it is the one part with threads and a clock; a
shape and its draw (exporter/real_vllm/shape_draws.py) are data from a seed, tested without a server.

Standard library only, like the load generator: it runs beside the daemon in any venv.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from exporter.real_vllm.loadgen import LoadGenerator, Phase
from exporter.real_vllm.shapes import Arrival, LanesProcess, LoadShape, OpenLoopProcess


def make_load(shape: LoadShape, base_url: str, model: str, *, vocab_size: int,
              clock: Callable[[], float] = time.time) -> LoadGenerator:
    """A fresh load generator for one shape: its seed, and repeated-id prompts where it wants speculation
    (one generator a shape: phases are named per shape, and a name's shared prefix is drawn once)."""
    return LoadGenerator(base_url, model, vocab_size=vocab_size, seed=shape.load_seed, clock=clock,
                         repeat_ids=shape.repeat_ids)


@dataclass
class PlayStats:
    """What the player did beside what the shape says: the open-loop requests sent, those held back by their
    process's caps (and for how long in all), and those still held when the shape ended (dropped)."""

    sent: int = 0
    held: int = 0
    held_seconds: float = 0.0
    dropped: int = 0
    # When each lanes process actually started (seconds into the shape: a shared prefix is warmed first).
    lanes_started_seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class _OpenLoopState:
    """One open-loop process's streams and KV blocks out, and its arrivals waiting for room (each with the
    second it was queued)."""

    process: OpenLoopProcess
    in_flight: int = 0
    blocks_out: int = 0
    waiting: deque[tuple[Arrival, float]] = field(default_factory=deque)


class ShapePlayer:
    """Plays a shape through a load generator: lanes as the generator's phases, each open-loop request in a
    thread of its own from its time on. `start()` returns at once; the schedule runs in a thread, on
    `clock` (seconds, monotonic); `started_at_seconds` is the load generator's clock at the start, so
    streams and polls can be placed in the shape (`LoadShape.label_at(t - started_at_seconds)`)."""

    def __init__(self, shape: LoadShape, load: LoadGenerator, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.shape = shape
        self.load = load
        self.stats = PlayStats()
        self.started_at_seconds: float | None = None
        self._clock = clock
        self._wall_clock = wall_clock
        self._condition = threading.Condition()
        self._halt = threading.Event()
        self._done = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stopped: set[str] = set()
        self._open = [_OpenLoopState(process) for process in shape.open_loops]
        self._started_monotonic: float | None = None

    def start(self) -> None:
        if self._started_monotonic is not None:
            raise RuntimeError("a player plays its shape once")
        self._started_monotonic = self._clock()
        self.started_at_seconds = self._wall_clock()
        self._spawn(self._schedule, "shape-schedule")

    def elapsed_seconds(self) -> float:
        """Seconds since the start (0 before it)."""
        return 0.0 if self._started_monotonic is None else self._clock() - self._started_monotonic

    def label_now(self) -> str:
        return self.shape.label_at(self.elapsed_seconds())

    def wait(self, timeout_seconds: float) -> bool:
        """Until the schedule has run to the shape's end (True) or the timeout passed (False)."""
        return self._done.wait(timeout_seconds)

    def stop(self) -> None:
        """No new request from now on: the schedule halts, lanes stop, arrivals waiting are dropped."""
        self._halt.set()
        self._finish()

    def join(self, timeout_seconds: float) -> bool:
        """Waits for every request sent to end (lanes and open loop); False if some still run."""
        deadline = self._clock() + timeout_seconds
        while True:
            with self._condition:
                alive = [thread for thread in self._threads if thread.is_alive()]
            if not alive or self._clock() >= deadline:
                break
            alive[0].join(max(0.0, deadline - self._clock()))
        return self.load.join(max(0.0, deadline - self._clock())) and not alive

    # --- the schedule ------------------------------------------------------------------------------

    def _events(self) -> list[tuple[float, int, Callable[[], None]]]:
        """(when, order at the same time, action): a lanes process stopping before one starting."""
        events: list[tuple[float, int, Callable[[], None]]] = []
        for lanes in self.shape.lanes:
            events.append((lanes.stop_seconds, 0, partial(self._stop_lanes, lanes)))
            events.append((lanes.start_seconds, 1, partial(self._start_lanes, lanes)))
        for state in self._open:
            events.extend((arrival.at_seconds, 2, partial(self._arrive, state, arrival))
                          for arrival in state.process.arrivals)
        return sorted(events, key=lambda event: (event[0], event[1]))

    def _schedule(self) -> None:
        assert self._started_monotonic is not None
        for at_seconds, _, action in self._events():
            if self._halt.wait(max(0.0, self._started_monotonic + at_seconds - self._clock())):
                return
            action()
        if not self._halt.wait(max(0.0, self._started_monotonic + self.shape.duration_seconds - self._clock())):
            self._finish()

    def _finish(self) -> None:
        with self._condition:
            for lanes in self.shape.lanes:
                self._stopped.add(lanes.name)
                self.load.stop(lanes.name)
            for state in self._open:
                self.stats.dropped += len(state.waiting)
                state.waiting.clear()
        self._done.set()

    def _start_lanes(self, lanes: LanesProcess) -> None:
        phase = lanes.phase()
        if not phase.shared_prefix_tokens:
            self._start_phase(lanes, phase)
            return

        def warm_then_start() -> None:  # warmed first, so every lane shares the prefix's blocks from its start
            self.load.warm_prefix(phase)
            self._start_phase(lanes, phase)

        self._spawn(warm_then_start, f"shape-warm-{lanes.name}")

    def _start_phase(self, lanes: LanesProcess, phase: Phase) -> None:
        with self._condition:
            if lanes.name in self._stopped or self._halt.is_set():
                return  # stopped while its prefix warmed: a phase started after its stop would run on
            self.load.start(phase)
            self.stats.lanes_started_seconds[lanes.name] = self.elapsed_seconds()

    def _stop_lanes(self, lanes: LanesProcess) -> None:
        with self._condition:
            self._stopped.add(lanes.name)
            self.load.stop(lanes.name)

    def _arrive(self, state: _OpenLoopState, arrival: Arrival) -> None:
        with self._condition:
            if self._done.is_set():  # stopped while the schedule reached it
                self.stats.dropped += 1
                return
            state.waiting.append((arrival, self.elapsed_seconds()))
            self._admit(state)
            if state.waiting and state.waiting[-1][0] is arrival:
                self.stats.held += 1  # no room at its time: it waits for a request of its process to end

    def _admit(self, state: _OpenLoopState) -> None:
        """Sends the waiting arrivals, oldest first, while the process has room (the condition held)."""
        limits, process = self.shape.limits, state.process
        while state.waiting and not self._halt.is_set():
            arrival, queued_seconds = state.waiting[0]
            blocks = limits.blocks(arrival.prompt_tokens + arrival.max_tokens)
            if state.in_flight >= process.max_in_flight or state.blocks_out + blocks > process.kv_blocks(limits):
                return
            state.waiting.popleft()
            self.stats.held_seconds += self.elapsed_seconds() - queued_seconds
            state.in_flight += 1
            state.blocks_out += blocks
            self.stats.sent += 1
            self._spawn(partial(self._send, state, arrival, blocks), f"shape-{process.name}")

    def _send(self, state: _OpenLoopState, arrival: Arrival, blocks: int) -> None:
        try:
            self.load.one(arrival.prompt_tokens, arrival.max_tokens)
        finally:
            with self._condition:
                state.in_flight -= 1
                state.blocks_out -= blocks
                self._admit(state)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        with self._condition:
            self._threads.append(thread)
        thread.start()


def play(shape: LoadShape, load: LoadGenerator, *, drain_timeout_seconds: float = 300.0) -> PlayStats:
    """Plays the whole shape, then waits for its last requests (up to `drain_timeout_seconds`)."""
    player = ShapePlayer(shape, load)
    player.start()
    try:
        player.wait(shape.duration_seconds + 60.0)
    finally:
        player.stop()
        player.join(drain_timeout_seconds)
    return player.stats
