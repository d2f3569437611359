"""Engine adapters: one model server's /metrics page -> one Snapshot per (model_name, engine).

`read_page` is the only entry point the daemon needs. It never raises anything but PageError:
a page that cannot be used is a failed poll of that target, never a crash of the poller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exporter.serve.engines import sglang, tgi, vllm
from exporter.serve.engines.exposition import PageError, PageScan, scan_page
from exporter.serve.engines.families import (
    PROCESS_START,
    Adapter,
    Identity,
    Plan,
    Selection,
    identities,
    index_series,
    plan_selection,
    select,
)
from exporter.serve.snapshot import Snapshot

__all__ = ["ADAPTERS", "PageError", "PageReading", "PageScan", "read_page", "reading_from_scan", "server_kinds",
           "wanted_names"]

# The registry: the one list of engine kinds. `kind: auto` tries every adapter here (ties go to
# the earlier one), and the config key, `--kind`, the schema's enum and the docs derive from it.
ADAPTERS: dict[str, Adapter] = {adapter.kind: adapter for adapter in (vllm.ADAPTER, sglang.ADAPTER, tgi.ADAPTER)}
# Every adapter's sample names, by the registry's kinds: computed once per registry, not per page.
_ALL_WANTED: dict[tuple[str, ...], frozenset[str]] = {}


def server_kinds() -> tuple[str, ...]:
    """Every accepted `kind`: "auto" and each registered adapter's. A function, not a constant, so
    an adapter added to ADAPTERS is accepted wherever a kind is checked, with nothing else to edit."""
    return ("auto", *ADAPTERS)


@dataclass(frozen=True)
class PageReading:
    """What one page says: the server kind, one Snapshot per engine, and page-level oddities."""

    kind: str  # one of ADAPTERS' kinds
    snapshots: tuple[Snapshot, ...]
    problems: tuple[str, ...]  # each worth one log line (truncated histogram, NaN dropped, ...)


def _detect(scan: PageScan) -> Adapter:
    present = {kind: adapter.families_present(scan) for kind, adapter in ADAPTERS.items()}
    kind = max(present, key=lambda k: present[k])  # ties: the registry's order
    if present[kind] == 0:
        raise PageError("no known engine metrics", f"none of the families {', '.join(ADAPTERS)} need is on the page")
    return ADAPTERS[kind]


# Each page layout's plan (families.py's Plan), by adapter and layout; None: not plain, `select` it.
_PLANS: dict[tuple[str, tuple[tuple[str, tuple[tuple[str, str], ...]], ...]], Plan | None] = {}
MAX_CACHED_PLANS = 2_000
_UNPLANNED = Plan((), (), {}, {}, {})  # (this very object) a layout not planned yet


def _selection(adapter: Adapter, scan: PageScan) -> tuple[list[Identity], Selection]:
    """Every identity on the page and its fields: through the layout's plan where there is one (the
    same answer, without re-sorting the series at every poll), else through `select`."""
    if scan.layout is not None:
        key = (adapter.kind, scan.layout)
        plan = _PLANS.get(key, _UNPLANNED)  # one lookup: hashing a layout is ~50 nested tuples
        if plan is _UNPLANNED:
            plan = plan_selection(scan, adapter.sample_names(), adapter.roles, adapter.specs)
            if len(_PLANS) >= MAX_CACHED_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
        if plan is not None:
            planned = plan.run(scan.values)
            if planned is not None:
                return list(plan.who_all), planned
    index = index_series(scan, adapter.sample_names(), adapter.roles)
    who_all = identities(index)
    return who_all, select(index, adapter.specs, who_all)


def _snapshots(adapter: Adapter, scan: PageScan) -> tuple[tuple[Snapshot, ...], list[str]]:
    who_all, selection = _selection(adapter, scan)
    if adapter.finish is not None:
        adapter.finish(scan, selection, who_all)
    started = _process_start(scan)
    snapshots = []
    for who in who_all:
        values = selection.values[who]
        missing = dict(adapter.not_offered) | selection.missing[who]
        snapshots.append(
            Snapshot(
                kind=adapter.kind,
                model_name=who[0],
                engine=who[1],
                missing=tuple(f"{name}: {why}" for name, why in missing.items()),
                server_wide=tuple(sorted(selection.server_wide[who])),
                process_start_seconds=started,
                **values,  # type: ignore[arg-type]  # the selection holds each field under its own name and type
            )
        )
    return tuple(snapshots), selection.problems


def _process_start(scan: PageScan) -> float | None:
    """The page's process_start_time_seconds: one value, or None (absent, unusable, or several processes)."""
    found = {value for _, value in scan.samples.get(PROCESS_START, ()) if math.isfinite(value) and value > 0}
    return found.pop() if len(found) == 1 else None


def _read(text: str | bytes, kind: str) -> PageReading:
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise PageError("not Prometheus text", f"got {type(text).__name__}, not text")
    return reading_from_scan(scan_page(text, wanted_names(kind)), kind)


def wanted_names(kind: str) -> frozenset[str]:
    """The exact sample names `kind`'s adapter reads ("auto": every adapter's), so a reader that
    is not a page (the Prometheus query source) asks for exactly what the page reader keeps."""
    if kind == "auto":
        kinds = tuple(ADAPTERS)
        if kinds not in _ALL_WANTED:
            _ALL_WANTED[kinds] = frozenset().union(*(adapter.wanted() for adapter in ADAPTERS.values()))
        return _ALL_WANTED[kinds]
    if kind not in ADAPTERS:
        raise PageError("unknown server kind", f"{kind!r} (known: {', '.join(server_kinds())})")
    return ADAPTERS[kind].wanted()


def reading_from_scan(scan: PageScan, kind: str = "auto") -> PageReading:
    """One target's samples, however they were gathered, through the same detection and selection
    as a fetched page: a page and a Prometheus query give the same Snapshots for the same samples."""
    wanted_names(kind)  # refuses an unknown kind
    if kind == "auto":
        adapter = _detect(scan)  # raises if no engine's families are on the page
    else:
        adapter = ADAPTERS[kind]
        if adapter.families_present(scan) == 0:
            raise PageError(f"no {adapter.kind} metrics",
                            f"none of {', '.join(adapter.sample_names()[:3])}, ... on the page")
    snapshots, problems = _snapshots(adapter, scan)
    return PageReading(kind=adapter.kind, snapshots=snapshots, problems=tuple(dict.fromkeys(scan.problems + problems)))


def read_page(text: str, kind: str = "auto") -> PageReading:
    """Parses one /metrics page; kind "auto" detects the engine (one of ADAPTERS) from the families present.

    Raises PageError when the page is unusable: not Prometheus text (HTML, binary garbage, empty),
    or none of the families a known engine needs.
    """
    try:
        return _read(text, kind)
    except PageError:
        raise
    except Exception as error:  # a reader bug must fail this one poll, never the daemon
        raise PageError("unreadable page", f"{type(error).__name__}: {error}") from error
