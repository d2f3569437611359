"""One process per target: a page from another process told apart from a restart.

A URL that load-balances replicas (a ClusterIP Service in `targets.static`, a non-headless name in
`targets.dns`) answers each poll from whichever replica the proxy picks. The counters of two processes
are not one series: a window taken between pages of two of them is a phantom (the ITL deltas of one
batch against another's, prompt tokens of one against the steps of the other), and whenever the second
has counted less than the first, it reads as a "counter reset".

Each page says which process wrote it: `process_start_time_seconds` (the process collector, on vLLM's
page) and the `_created` series of its counters (when the process created them, Snapshot.created_seconds;
two replicas started in the same second still differ there). Between two polls of one engine:

- the same values: the same process, the window stands;
- other values, of a process that started after the previous poll: the server restarted. window.py
  treats it as a counter reset (no window this time, the next one measures the new process);
- other values, of a process that was already running at the previous poll (it started more than
  CLOCK_TOLERANCE_SECONDS before that poll), when another process answered: two processes answer at
  this URL. The target is marked mixed (ProcessWatch): while it is, no window is computed (no measured
  step, no prefill per step, no counter reset), `target_mixed_processes` is logged once, and
  `stepbudget_target_mixed_processes` is 1. It is cleared after STEADY_POLLS_TO_CLEAR polls in a row
  from one process (the Service scaled down to one replica), logged `target_single_process`.

Pages that carry neither value (SGLang's and TGI's, vLLM's under prometheus_client's multiprocess mode)
cannot be told apart: docs/operations.md says to point stepbudget at pods or a headless Service.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from exporter.serve.snapshot import Snapshot

# Two start times this close are one process (process_start_time_seconds has the kernel's 10 ms clock
# tick behind it and is the same float at every scrape; `_created` values are the same floats).
SAME_PROCESS_SECONDS = 1e-3
# A process whose start is more than this before the previous poll was running then. The daemon's clock
# and the server's differ by this much at most (NTP keeps cluster nodes within milliseconds); a restart
# starts its process after the old one's last answer, so it never reads as running before.
CLOCK_TOLERANCE_SECONDS = 30.0
# Polls in a row from one process that clear a mixed target: 5 minutes at the default 15 s interval. Two
# replicas picked at random give 20 in a row from one about once in 500,000 polls.
STEADY_POLLS_TO_CLEAR = 20


def other_process(previous: Snapshot, current: Snapshot) -> str | None:
    """What says the two snapshots of one engine come from different processes; None when nothing does
    (the same values, or a page that carries none)."""
    changed = []
    for name, before, now in (("process_start_time_seconds", previous.process_start_seconds,
                               current.process_start_seconds),
                              ("the counters' _created", previous.created_seconds, current.created_seconds)):
        if before is not None and now is not None and abs(now - before) > SAME_PROCESS_SECONDS:
            changed.append(f"{name} {before:.3f} then {now:.3f}")
    return "; ".join(changed) or None


def started_seconds(snapshot: Snapshot) -> float | None:
    """When the page's process started, as late as its page allows saying (its counters are created
    after the process starts): Unix seconds, the server's clock."""
    values = [value for value in (snapshot.process_start_seconds, snapshot.created_seconds) if value is not None]
    return max(values) if values else None


def _carries_identity(snapshot: Snapshot) -> bool:
    return snapshot.process_start_seconds is not None or snapshot.created_seconds is not None


@dataclass(frozen=True)
class Verdict:
    """One poll's page against the previous poll's: `same`, `restart`, `mixed` or `unknown`."""

    kind: str
    reason: str = ""


def judge(previous: Mapping[tuple[str, str], Snapshot], snapshots: Sequence[Snapshot],
          previous_poll_seconds: float | None) -> Verdict:
    """This page's engines against the previous good poll's (`previous`, by (model_name, engine)), read
    at `previous_poll_seconds` (Unix seconds, the daemon's clock)."""
    restarted, compared = "", False
    for snapshot in snapshots:
        before = previous.get((snapshot.model_name, snapshot.engine))
        if before is None or not (_carries_identity(before) and _carries_identity(snapshot)):
            continue
        compared = True
        change = other_process(before, snapshot)
        if change is None:
            continue
        started = started_seconds(snapshot)
        if (previous_poll_seconds is not None and started is not None
                and started < previous_poll_seconds - CLOCK_TOLERANCE_SECONDS):
            return Verdict("mixed", (
                f"pages from different processes at one URL ({change}): this poll's process was already "
                f"running at the previous poll, which another answered. A load-balanced URL (a Service, a "
                f"non-headless DNS name)? Point stepbudget at the pods (targets.kubernetes) or a headless "
                f"Service (targets.dns). No window is computed from the mix"))
        restarted = change
    if restarted:
        return Verdict("restart", restarted)
    return Verdict("same" if compared else "unknown")


@dataclass
class ProcessWatch:
    """Per target (the poller's TargetState): whether its pages come from more than one process."""

    mixed: bool = False
    reason: str = ""
    steady_polls: int = 0  # polls in a row from one process since the last mixed one

    def observe(self, previous: Mapping[tuple[str, str], Snapshot], snapshots: Sequence[Snapshot],
                previous_poll_seconds: float | None) -> bool:
        """Judge this poll's page; True while the target is mixed (then no window may be computed)."""
        verdict = judge(previous, snapshots, previous_poll_seconds)
        if verdict.kind == "mixed":
            self.mixed, self.reason, self.steady_polls = True, verdict.reason, 0
        elif self.mixed:
            # A restart of one replica says nothing about how many answer; the same process again does.
            self.steady_polls = self.steady_polls + 1 if verdict.kind == "same" else 0
            if self.steady_polls >= STEADY_POLLS_TO_CLEAR:
                self.mixed, self.reason, self.steady_polls = False, "", 0
        return self.mixed
