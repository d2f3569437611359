"""Driving a load through a real server while the daemon's own Poller reads its page: the runs the
real-engine tests, `benchmarks/real_vllm.py` and `make demo-vllm` share.

Each poll keeps the daemon's reading and the raw snapshot beside the load generator's ground truth, so a
run can be checked (or written out) after the fact.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from exporter.real_vllm.loadgen import LoadGenerator, Phase
from exporter.serve.config import Config
from exporter.serve.discovery import Discovery
from exporter.serve.engines import PageReading, read_page
from exporter.serve.fetch import HttpFetcher
from exporter.serve.poller import Poller
from exporter.serve.reading import Reading
from exporter.serve.snapshot import Snapshot


@dataclass(frozen=True)
class PollRecord:
    """One poll of the real server: when, in which phase, the daemon's reading and the raw snapshot."""

    at_seconds: float
    phase: str
    reading: Reading
    snapshot: Snapshot
    # When the poll began: the server rendered its page somewhere in [fetch_started_seconds, at_seconds].
    fetch_started_seconds: float = 0.0


@dataclass(frozen=True)
class Step:
    """One line of a load script: stop a phase, start one (in that order), or let `seconds` pass (polling).
    A phase started runs until a later step stops it."""

    start: Phase | None = None
    stop: str | None = None
    seconds: float = 0.0
    drain: bool = False  # wait until no request is outstanding (polling meanwhile)
    label: str = ""


class RecordingPoller:
    """The daemon's own Poller over HTTP against the real server, keeping each poll's snapshot."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.fetcher = HttpFetcher(config.timeout_seconds, config.max_response_bytes)
        self._last: list[Snapshot] = []

        def reading_page(text: str, kind: str) -> PageReading:
            page = read_page(text, kind)
            self._last = list(page.snapshots)
            return page

        self.poller = Poller(config, Discovery(config.deployments, timeout_seconds=1.0), self.fetcher,
                             read_page=reading_page)

    def poll(self, phase: str) -> PollRecord:
        fetch_started_seconds = time.time()
        result = self.poller.poll_once()
        (reading,) = result.readings
        assert reading.target_up, f"the real server's page was not read: {reading.notes}"
        (snapshot,) = self._last
        assert reading.last_success_timestamp_seconds is not None
        return PollRecord(reading.last_success_timestamp_seconds, phase, reading, snapshot, fetch_started_seconds)

    def close(self) -> None:
        self.poller.stop()
        self.fetcher.close()


def drive(recorder: RecordingPoller, load: LoadGenerator, script: list[Step], poll_seconds: float,
          drain_timeout_seconds: float = 240.0) -> list[PollRecord]:
    """Runs the script, polling every `poll_seconds` of wall time; the phase label of a poll is the last
    step's label (or started phase's name)."""
    polls = [recorder.poll("idle")]
    phase = "idle"
    for step in script:
        if step.stop is not None:
            load.stop(step.stop)
        if step.start is not None:
            load.start(step.start)
        phase = step.label or (step.start.name if step.start is not None else phase)
        deadline = time.monotonic() + (drain_timeout_seconds if step.drain else step.seconds)
        while time.monotonic() < deadline:
            time.sleep(max(0.0, min(poll_seconds, deadline - time.monotonic())))
            polls.append(recorder.poll(phase))
            if step.drain and load.outstanding_at(time.time()) == 0:
                break
    assert not load.errors(), f"requests failed: {load.errors()[:3]}"
    return polls


def dump_run(path: Path, polls: list[PollRecord], load: LoadGenerator) -> None:
    """The run as JSON beside the server's log, for reading a failure afterwards: each poll's reading
    and every stream's arrivals."""
    document = {
        "polls": [{"at_seconds": p.at_seconds, "fetch_started_seconds": p.fetch_started_seconds, "phase": p.phase,
                   "reading": asdict(p.reading), "snapshot": asdict(p.snapshot)} for p in polls],
        "streams": [asdict(stream) for stream in load.streams],
    }
    path.write_text(json.dumps(document, default=str))
