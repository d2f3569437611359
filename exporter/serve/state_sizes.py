"""The daemon's own state, measured: how many entries each structure keyed by target, series, engine or
connection holds, and the bound it must stay within (docs/operations.md, "Memory bounds").

    # HELP stepbudget_state_entries Entries held now by one of the daemon's structures ...
    # TYPE stepbudget_state_entries gauge
    stepbudget_state_entries{structure="poller_targets"} 1000.0
    # HELP stepbudget_state_max_entries The most entries the structure may hold ...
    # TYPE stepbudget_state_max_entries gauge
    stepbudget_state_max_entries{structure="fetch_pools"} 100001.0

The sizes are sampled once per poll (`sample`, a poll listener), not at every scrape: the /metrics page is
encoded once per poll (exporter/serve/server.py's MetricsPage), and a value read at every scrape would
make every scrape render it again. A structure whose bound follows from something else (the targets
discovery lists, a time window) has no `max_entries` series: its bound is said in the docs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(frozen=True)
class Watched:
    structure: str
    size: Callable[[], int]
    max_entries: int | None


class StateSizes(Collector):
    """Structures to measure, by name; `sample()` reads them all, `collect()` exports the last sample."""

    def __init__(self) -> None:
        self._watched: list[Watched] = []
        self._lock = threading.Lock()
        self._sample: tuple[tuple[str, int], ...] = ()

    def watch(self, structure: str, size: Callable[[], int], max_entries: int | None = None) -> None:
        with self._lock:
            if any(watched.structure == structure for watched in self._watched):
                raise ValueError(f"structure {structure!r} is already watched")
            self._watched.append(Watched(structure, size, max_entries))
        self.sample()

    def on_poll(self, result: object) -> None:
        """A Poller listener: sample at the poll's end."""
        self.sample()

    def sample(self) -> tuple[tuple[str, int], ...]:
        """Read every structure's size now."""
        with self._lock:
            watched = list(self._watched)
        sample = tuple((w.structure, int(w.size())) for w in watched)
        with self._lock:
            self._sample = sample
        return sample

    def sizes(self) -> dict[str, int]:
        """The last sample, by structure."""
        return dict(self._sample)

    def describe(self) -> Iterable[Metric]:
        return []

    def generation(self) -> tuple[tuple[str, int], ...]:
        """The last sample itself: the page changes when a sample does."""
        return self._sample

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sample, watched = self._sample, list(self._watched)
        entries = GaugeMetricFamily(
            "stepbudget_state_entries",
            "Entries held by one of the daemon's structures (targets, series, engines, connections, caches), "
            "sampled at the end of each poll; bounds in docs/operations.md",
            labels=["structure"])
        for structure, size in sample:
            entries.add_metric([structure], size)
        yield entries
        bounds = GaugeMetricFamily(
            "stepbudget_state_max_entries",
            "The most entries the structure may hold (structures bounded by a count; the others are bounded by "
            "the targets discovered or by a time window: docs/operations.md)",
            labels=["structure"])
        for w in watched:
            if w.max_entries is not None:
                bounds.add_metric([w.structure], w.max_entries)
        yield bounds
