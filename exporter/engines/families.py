"""From scanned samples to one value per (model_name, engine): the merge rules all adapters share.

A page can hold several series for what is one engine's one value:
- `pid` label (prometheus_client multiprocess mode, gauges left at the default mode "all"; REPORT.md
  §a.1): counters and histograms are each process's share, so they are summed; gauges are each
  process's copy of the same engine state, so the largest is taken (summing would double count).
- other extra labels (SGLang's `tp_rank` copies, `engine_type`): copies of one engine's state, the
  largest is taken and the page gets a problem line, since the adapter cannot tell which is right.
Non-finite (NaN, ±Inf) and negative values are never passed on: the field becomes None with a note.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Literal

from exporter.engines.exposition import Labels, PageScan, histogram_from_samples, parse_value
from exporter.snapshot import Histogram

Kind = Literal["gauge", "counter", "histogram"]
Identity = tuple[str, str]  # (model_name, engine)


@dataclass(frozen=True)
class FamilySpec:
    """Where one Snapshot field comes from: candidate families in order of preference."""

    field: str
    names: tuple[str, ...]  # for histograms the base name (samples `_bucket`, `_count`, `_sum`)
    kind: Kind
    match: tuple[tuple[str, str], ...] = ()  # label values a series must carry (TGI's method="decode")


@dataclass(frozen=True)
class EngineLabels:
    """Which labels name the model and the engine index on one engine's pages."""

    model: tuple[str, ...]  # first present wins; none present -> ""
    engine: str | None  # absent on the series -> the series applies to every engine of its model
    process: str = "pid"
    # (label, value) of the series that hold totals: a series carrying the label with another value
    # is a breakdown and is skipped (SGLang with priority scheduling: totals under priority="").
    totals: tuple[tuple[str, str], ...] = ()


@dataclass
class Selection:
    """Per identity, field -> value; plus the reasons a field is None and page-level problems."""

    values: dict[Identity, dict[str, object]] = field(default_factory=dict)
    missing: dict[Identity, dict[str, str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def sample_names(spec: FamilySpec) -> tuple[str, ...]:
    """The exact sample names a spec needs from the page."""
    if spec.kind != "histogram":
        return spec.names
    return tuple(f"{base}{suffix}" for base in spec.names for suffix in ("_bucket", "_count", "_sum"))


@dataclass(frozen=True)
class Series:
    """One sample with its labels already sorted into roles."""

    labels: Labels
    value: float
    process: str  # the `pid` label, "" when absent
    variant: tuple[tuple[str, str], ...]  # the remaining labels (tp_rank, method, ...)


# sample name -> (model, engine or None when the series has no engine label) -> series
Index = dict[str, dict[tuple[str, str | None], list[Series]]]


def index_series(scan: PageScan, names: tuple[str, ...], roles: EngineLabels) -> Index:
    """Sorts every wanted sample by model and engine once, so each identity reads only its own."""
    skip = set(roles.model) | {roles.engine, roles.process, "le"} | {name for name, _ in roles.totals}
    index: Index = {}
    for name in names:
        by_who: dict[tuple[str, str | None], list[Series]] = {}
        for labels, value in scan.samples.get(name, ()):
            if any(labels.get(k, v) != v for k, v in roles.totals):
                continue  # a breakdown (e.g. one priority), not the total
            model = next((labels[label] for label in roles.model if label in labels), "")
            engine = labels.get(roles.engine) if roles.engine else None
            variant = tuple(sorted((k, v) for k, v in labels.items() if k not in skip))
            by_who.setdefault((model, engine), []).append(Series(labels, value, labels.get(roles.process, ""), variant))
        if by_who:
            index[name] = by_who
    return index


def identities(index: Index) -> list[Identity]:
    """Every (model_name, engine) on the page; a model seen only without an engine label is engine "0"."""
    engines: dict[str, set[str]] = {}
    for by_who in index.values():
        for model, engine in by_who:
            known = engines.setdefault(model, set())
            if engine is not None:
                known.add(engine)
    return sorted((model, engine) for model, found in engines.items() for engine in (found or {"0"}))


def _series_for(index: Index, spec: FamilySpec, name: str, who: Identity) -> list[tuple[Labels, float, str, tuple]]:
    """This identity's series of `name`: its own plus its model's engine-less (server-wide) ones."""
    by_who = index.get(name, {})
    found = []
    for series in by_who.get(who, []) + by_who.get((who[0], None), []):
        variant = series.variant
        if spec.match:
            if any(series.labels.get(k) != v for k, v in spec.match):
                continue
            keys = {k for k, _ in spec.match}
            variant = tuple(item for item in variant if item[0] not in keys)
        found.append((series.labels, series.value, series.process, variant))
    return found


def _merge_scalars(groups: dict[tuple, dict[str, float]], kind: Kind) -> tuple[float, bool]:
    per_variant = [sum(by_pid.values()) if kind == "counter" else max(by_pid.values()) for by_pid in groups.values()]
    return max(per_variant), len(per_variant) > 1


def _scalar(index: Index, spec: FamilySpec, name: str, who: Identity, out: Selection) -> bool:
    groups: dict[tuple, dict[str, float]] = {}
    for labels, value, process, variant in _series_for(index, spec, name, who):
        if not math.isfinite(value) or value < 0:
            out.problems.append(f"{name}{labels} = {value}: not a valid {spec.kind} value, dropped")
            out.missing[who][spec.field] = f"{name} was {value} (not a valid value)"
            return True
        groups.setdefault(variant, {})[process] = value
    if not groups:
        return False
    value, several = _merge_scalars(groups, spec.kind)
    if several:
        out.problems.append(f"{name} has {len(groups)} series for {who}: took the largest")
    out.values[who][spec.field] = value
    return True


def _histogram(index: Index, spec: FamilySpec, base: str, who: Identity, out: Selection) -> bool:
    # per (variant, process): buckets by le, count, sum
    parts: dict[tuple, dict[str, object]] = {}
    for suffix in ("_bucket", "_count", "_sum"):
        for labels, value, process, variant in _series_for(index, spec, base + suffix, who):
            part = parts.setdefault((variant, process), {"buckets": []})
            if suffix == "_bucket":
                edge = _edge(labels.get("le"))
                if edge is None:
                    continue
                part["buckets"].append((edge, value))  # type: ignore[union-attr]
            else:
                part[suffix] = value
    if not parts:
        return False
    built: dict[tuple, list[Histogram]] = {}
    for (variant, process), part in parts.items():
        histogram, why = histogram_from_samples(part["buckets"], part.get("_count"), part.get("_sum"))  # type: ignore[arg-type]
        if histogram is None:
            out.problems.append(f"histogram {base} for {who} dropped: {why}")
            out.missing[who][spec.field] = f"{base} {why}"
            return True
        built.setdefault(variant, []).append(histogram)
    merged = [_sum_histograms(hs) for hs in built.values()]
    if any(h is None for h in merged):
        out.problems.append(f"histogram {base} for {who} dropped: processes disagree on bucket edges")
        out.missing[who][spec.field] = f"{base} processes disagree on bucket edges"
        return True
    if len(merged) > 1:
        out.problems.append(f"{base} has {len(merged)} series for {who}: took the one with most observations")
    out.values[who][spec.field] = max(merged, key=lambda h: h.count)  # type: ignore[union-attr,return-value]
    return True


def _edge(le: str | None) -> float | None:
    return parse_value(le.strip()) if le is not None else None


def _sum_histograms(histograms: list[Histogram]) -> Histogram | None:
    """Sum of per-process histograms (multiprocess shares); None if their edges differ."""
    first = histograms[0]
    if len(histograms) == 1:
        return first
    edges = [le for le, _ in first.buckets]
    if any([le for le, _ in h.buckets] != edges for h in histograms):
        return None
    counts = [sum(h.buckets[i][1] for h in histograms) for i in range(len(edges))]
    return Histogram(
        buckets=tuple(zip(edges, counts)),
        count=sum(h.count for h in histograms),
        sum=sum(h.sum for h in histograms),
    )


def select(index: Index, specs: tuple[FamilySpec, ...], who_all: list[Identity]) -> Selection:
    """Reads every spec's field for every identity; the first family present wins (even if invalid)."""
    out = Selection()
    for who in who_all:
        out.values[who] = {}
        out.missing[who] = {}
        for spec in specs:
            reader: Callable[..., bool] = _histogram if spec.kind == "histogram" else _scalar
            found = any(reader(index, spec, name, who, out) for name in spec.names)
            if not found:
                out.missing[who][spec.field] = f"no {' or '.join(spec.names)} on the page"
    return out


@dataclass(frozen=True)
class Adapter:
    """One engine kind: the families it reads, its labels, and its own finishing step."""

    kind: str
    specs: tuple[FamilySpec, ...]
    roles: EngineLabels
    # Fields this engine never offers, with the reason `missing` gives.
    not_offered: tuple[tuple[str, str], ...] = ()
    extra_names: tuple[str, ...] = ()  # further exact sample names `finish` reads
    finish: Callable[[PageScan, Selection, list[Identity]], None] | None = None

    # Both are fixed by the specs and asked for several times per page: built once per adapter.
    @cached_property
    def _sample_names(self) -> tuple[str, ...]:
        return tuple(name for spec in self.specs for name in sample_names(spec))

    @cached_property
    def _wanted(self) -> frozenset[str]:
        return frozenset(self._sample_names + self.extra_names)

    def sample_names(self) -> tuple[str, ...]:
        return self._sample_names

    def wanted(self) -> frozenset[str]:
        return self._wanted

    def families_present(self, scan: PageScan) -> int:
        """How many of this engine's families have samples on the page (for kind detection)."""
        return sum(1 for name in self.sample_names() if scan.samples.get(name))
