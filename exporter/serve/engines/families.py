"""From scanned samples to one value per (model_name, engine): the merge rules all adapters share.

A page can hold several series for what is one engine's one value:
- `pid` label (prometheus_client multiprocess mode, gauges left at the default mode "all"; REPORT.md
  §a.1): counters and histograms are each process's share, so they are summed; gauges are each
  process's copy of the same engine state, so the largest is taken (summing would double count).
- other extra labels (SGLang's `tp_rank` copies, `engine_type`): copies of one engine's state, the
  largest is taken and the page gets a problem line, since the adapter cannot tell which is right.
- partition labels (SGLang's `is_streaming`; `priority` where the family has no `priority=""` total):
  each request is counted under exactly one value, so the series are shares of the engine's total
  and are summed, gauges included (each share is a different set of requests).
Non-finite (NaN, ±Inf) and negative values are never passed on: the field becomes None with a note.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, NamedTuple, cast

from exporter.serve.engines.exposition import Labels, PageScan, histogram_from_samples, parse_value
from exporter.serve.snapshot import Histogram

Kind = Literal["gauge", "counter", "histogram"]
# The page's own process collector: when the process that wrote the page started (read for every
# engine kind, Snapshot.process_start_seconds; exporter/serve/process_identity.py).
PROCESS_START = "process_start_time_seconds"
Identity = tuple[str, str]  # (model_name, engine)
Pairs = tuple[tuple[str, str], ...]  # label (name, value) pairs


@dataclass(frozen=True)
class FamilySpec:
    """Where one Snapshot field comes from: candidate families in order of preference."""

    field: str
    names: tuple[str, ...]  # for histograms the base name (samples `_bucket`, `_count`, `_sum`)
    kind: Kind
    match: tuple[tuple[str, str], ...] = ()  # label values a series must carry (TGI's method="decode")
    # A refinement older releases lack (their absence is handled downstream, with its own note):
    # not listed in the snapshot's `missing`.
    optional: bool = False
    # A counter the engine creates only at its first increment (SGLang's num_retracted_requests_total):
    # absent for an identity on a page that is otherwise this engine's, it is 0 so far.
    absent_means_zero: bool = False


@dataclass(frozen=True)
class EngineLabels:
    """Which labels name the model and the engine index on one engine's pages."""

    model: tuple[str, ...]  # first present wins; none present -> ""
    engine: str | None  # absent on the series -> the series applies to every engine of its model
    process: str = "pid"
    # (label, value) of the series that hold totals: where a family has such a series, a series
    # carrying the label with another value is a breakdown and is skipped. Where a family has no
    # series with the total value, the label is a partition instead (SGLang 0.5.23 with priority
    # scheduling: scheduler-side families carry priority="", tokenizer-side ones only each request's
    # own priority; sglang/srt/metrics/collector.py).
    totals: tuple[tuple[str, str], ...] = ()
    # Labels whose values split the requests into disjoint shares: summed (SGLang's is_streaming).
    partitions: tuple[str, ...] = ()


@dataclass
class Selection:
    """Per identity, field -> value; plus the reasons a field is None and page-level problems."""

    values: dict[Identity, dict[str, object]] = field(default_factory=dict)
    missing: dict[Identity, dict[str, str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    # Fields read from a series without an engine label while the model has several engines: one
    # server-wide figure (SGLang's tokenizer-side families under --dp-size), not this engine's own.
    server_wide: dict[Identity, set[str]] = field(default_factory=dict)


def sample_names(spec: FamilySpec) -> tuple[str, ...]:
    """The exact sample names a spec needs from the page."""
    if spec.kind != "histogram":
        return spec.names
    return tuple(f"{base}{suffix}" for base in spec.names for suffix in ("_bucket", "_count", "_sum"))


class Series(NamedTuple):
    """One sample with its labels already sorted into roles (a NamedTuple: ~45 are built per page
    per poll, and a frozen dataclass's __init__ costs several times a tuple's)."""

    labels: Labels
    value: float
    process: str  # the `pid` label, "" when absent
    variant: tuple[tuple[str, str], ...]  # the remaining labels (tp_rank, method, ...)
    share: tuple[tuple[str, str], ...] = ()  # partition labels: this series is one share of the total


# sample name -> (model, engine or None when the series has no engine label) -> series
Index = dict[str, dict[tuple[str, str | None], list[Series]]]


def _total_labels(samples: list[tuple[Labels, float]], roles: EngineLabels) -> tuple[set[str], set[str]]:
    """Which `totals` labels name a total series in this family, and which are partitions here."""
    with_total = {label for label, total in roles.totals
                  if any(labels.get(label, total) == total for labels, _ in samples)}
    return with_total, {label for label, _ in roles.totals} - with_total


def index_series(scan: PageScan, names: tuple[str, ...], roles: EngineLabels) -> Index:
    """Sorts every wanted sample by model and engine once, so each identity reads only its own."""
    skip = set(roles.model) | {roles.engine, roles.process, "le"} | {name for name, _ in roles.totals}
    skip |= set(roles.partitions)
    index: Index = {}
    for name in names:
        samples = scan.samples.get(name, [])
        with_total, split_here = _total_labels(samples, roles) if roles.totals else (set(), set())
        shares = tuple(sorted(split_here | set(roles.partitions)))
        by_who: dict[tuple[str, str | None], list[Series]] = {}
        totals = tuple((k, v) for k, v in roles.totals if k in with_total)
        for labels, value in samples:
            if totals and any(labels.get(k, v) != v for k, v in totals):
                continue  # a breakdown (e.g. one priority), not the total
            model = _first_present(labels, roles.model)
            engine = labels.get(roles.engine) if roles.engine else None
            variant = tuple(sorted((k, v) for k, v in labels.items() if k not in skip))
            share = tuple((k, labels[k]) for k in shares if k in labels) if shares else ()
            by_who.setdefault((model, engine), []).append(
                Series(labels, value, labels.get(roles.process, ""), variant, share))
        if by_who:
            index[name] = by_who
    return index


def _first_present(labels: Labels, names: tuple[str, ...]) -> str:
    """The value of the first of `names` the labels carry, "" if none (a plain loop: per sample)."""
    for name in names:
        if name in labels:
            return labels[name]
    return ""


def identities(index: Index) -> list[Identity]:
    """Every (model_name, engine) on the page; a model seen only without an engine label is engine "0"."""
    engines: dict[str, set[str]] = {}
    for by_who in index.values():
        for model, engine in by_who:
            known = engines.setdefault(model, set())
            if engine is not None:
                known.add(engine)
    return sorted((model, engine) for model, found in engines.items() for engine in (found or {"0"}))


def engines_per_model(who_all: list[Identity]) -> dict[str, int]:
    """How many engines each model has on the page: a series without an engine label is server-wide
    where its model has several."""
    engines: dict[str, int] = {}
    for model, _ in who_all:
        engines[model] = engines.get(model, 0) + 1
    return engines


Found = tuple[Labels, float, str, tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]


def _series_for(index: Index, spec: FamilySpec, name: str, who: Identity) -> list[Found]:
    """This identity's series of `name`: its own plus its model's engine-less (server-wide) ones,
    as (labels, value, process, variant, share)."""
    by_who = index.get(name, {})
    found = []
    for series in by_who.get(who, []) + by_who.get((who[0], None), []):
        variant = series.variant
        if spec.match:
            if any(series.labels.get(k) != v for k, v in spec.match):
                continue
            keys = {k for k, _ in spec.match}
            variant = tuple(item for item in variant if item[0] not in keys)
        found.append((series.labels, series.value, series.process, variant, series.share))
    return found


# variant -> share -> process -> value
Groups = dict[tuple[tuple[str, str], ...], dict[tuple[tuple[str, str], ...], dict[str, float]]]


def _merge_scalars(groups: Groups, kind: Kind) -> tuple[float, bool]:
    """Per variant: shares summed; within a share, processes summed (counters: each process's part)
    or the largest taken (gauges: each process's copy). Several variants: the largest."""
    per_variant = [
        sum(sum(by_pid.values()) if kind == "counter" else max(by_pid.values()) for by_pid in shares.values())
        for shares in groups.values()
    ]
    return max(per_variant), len(per_variant) > 1


def _scalar(index: Index, spec: FamilySpec, name: str, who: Identity, out: Selection) -> bool:
    groups: Groups = {}
    for labels, value, process, variant, share in _series_for(index, spec, name, who):
        if not math.isfinite(value) or value < 0:
            out.problems.append(f"{name}{labels} = {value}: not a valid {spec.kind} value, dropped")
            out.missing[who][spec.field] = f"{name} was {value} (not a valid value)"
            return True
        groups.setdefault(variant, {}).setdefault(share, {})[process] = value
    if not groups:
        return False
    value, several = _merge_scalars(groups, spec.kind)
    if several:
        out.problems.append(f"{name} has {len(groups)} series for {who}: took the largest")
    out.values[who][spec.field] = value
    return True


def _histogram(index: Index, spec: FamilySpec, base: str, who: Identity, out: Selection) -> bool:
    # per (variant, process, share): buckets by le, count, sum; processes and shares are then summed
    parts: dict[tuple[Pairs, str, Pairs], dict[str, object]] = {}
    for suffix in ("_bucket", "_count", "_sum"):
        for labels, value, process, variant, share in _series_for(index, spec, base + suffix, who):
            part = parts.setdefault((variant, process, share), {"buckets": []})
            if suffix == "_bucket":
                edge = _edge(labels.get("le"))
                if edge is None:
                    continue
                cast(list[tuple[float, float]], part["buckets"]).append((edge, value))
            else:
                part[suffix] = value
    if not parts:
        return False
    built: dict[Pairs, list[Histogram]] = {}
    for (variant, _process, _share), part in parts.items():
        histogram, why = histogram_from_samples(part["buckets"], part.get("_count"), part.get("_sum"))  # type: ignore[arg-type]  # parts are dicts of mixed values
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
    out.values[who][spec.field] = max(merged, key=lambda h: h.count)  # type: ignore[union-attr]  # None was ruled out above
    return True


def _edge(le: str | None) -> float | None:
    return parse_value(le.strip()) if le is not None else None


def _sum_histograms(histograms: list[Histogram]) -> Histogram | None:
    """Sum of per-process (multiprocess) or per-share histograms; None if their edges differ."""
    first = histograms[0]
    if len(histograms) == 1:
        return first
    edges = [le for le, _ in first.buckets]
    if any([le for le, _ in h.buckets] != edges for h in histograms):
        return None
    counts = [sum(h.buckets[i][1] for h in histograms) for i in range(len(edges))]
    return Histogram(
        buckets=tuple(zip(edges, counts, strict=True)),
        count=sum(h.count for h in histograms),
        sum=sum(h.sum for h in histograms),
    )


def _absent(spec: FamilySpec, values: dict[str, object], missing: dict[str, str]) -> None:
    """An identity's field when none of the spec's families has a series for it: 0, said missing, or
    (optional) left out."""
    if spec.absent_means_zero:
        values[spec.field] = 0.0
    elif not spec.optional:
        missing[spec.field] = f"no {' or '.join(spec.names)} on the page"


def select(index: Index, specs: tuple[FamilySpec, ...], who_all: list[Identity]) -> Selection:
    """Reads every spec's field for every identity; the first family present wins (even if invalid)."""
    out = Selection()
    engines_of = engines_per_model(who_all)
    for who in who_all:
        out.values[who] = {}
        out.missing[who] = {}
        out.server_wide[who] = set()
        for spec in specs:
            reader: Callable[..., bool] = _histogram if spec.kind == "histogram" else _scalar
            name = next((name for name in spec.names if reader(index, spec, name, who, out)), None)
            if name is None:
                _absent(spec, out.values[who], out.missing[who])
            elif engines_of[who[0]] > 1 and _only_engine_less(index, spec, name, who):
                out.server_wide[who].add(spec.field)
    return out


def _only_engine_less(index: Index, spec: FamilySpec, name: str, who: Identity) -> bool:
    sample = name + "_count" if spec.kind == "histogram" else name
    by_who = index.get(sample, {})
    return not by_who.get(who) and bool(by_who.get((who[0], None)))


@dataclass(frozen=True)
class Adapter:
    """One server kind: the families it reads, its labels, and its own finishing step."""

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
    def _core_names(self) -> tuple[str, ...]:
        # Optional refinements do not make a page this engine's (a truncated histogram alone).
        return tuple(name for spec in self.specs if not spec.optional for name in sample_names(spec))

    @cached_property
    def _wanted(self) -> frozenset[str]:
        return frozenset(self._sample_names + self.extra_names + (PROCESS_START,))

    def sample_names(self) -> tuple[str, ...]:
        return self._sample_names

    def wanted(self) -> frozenset[str]:
        return self._wanted

    def families_present(self, scan: PageScan) -> int:
        """How many of this engine's families have samples on the page (for kind detection)."""
        return sum(1 for name in self._core_names if scan.samples.get(name))


# --- a page layout's selection, planned once --------------------------------------------------------
#
# A server's page holds the same wanted series in the same order at every poll; only the values
# change. Which series feed which field of which identity, which fields are absent, and which are
# server-wide depend on the series (names and labels) alone, so they are worked out once per layout
# (with the functions above, so the plan cannot disagree with them) and each poll only reads values.
# Only the plain case is planned: every field fed by exactly one series (one histogram series set),
# as on a single-process page. A layout with anything else, and any poll whose values are not all
# valid (NaN, negative, a histogram that fails its checks), goes through `select`, which words the
# problems.


class _PlannedScalar(NamedTuple):
    field: str
    position: int  # in PageScan.values


class _PlannedHistogram(NamedTuple):
    field: str
    buckets: tuple[tuple[int, float], ...]  # (position, upper edge) in `select`'s order
    count_at: int  # position of `_count`
    sum_at: int  # position of `_sum`
    # The edges sorted, when they pass histogram_from_samples' checks on edges alone (distinct, no
    # NaN, the last +Inf), and the buckets' positions in that order: then only the counts need
    # checking at each poll. None: the edges fail, histogram_from_samples words it (via `select`).
    edges: tuple[float, ...] | None = None
    order: tuple[int, ...] = ()


def _sorted_edges(buckets: list[tuple[int, float]]) -> tuple[tuple[float, ...] | None, tuple[int, ...]]:
    """(edges, positions) in histogram_from_samples' order, or (None, ()) if the edges alone fail it."""
    ordered = sorted(buckets, key=lambda bucket: bucket[1])
    edges = tuple(edge for _, edge in ordered)
    if not edges or edges[-1] != math.inf or any(math.isnan(edge) for edge in edges) or len(set(edges)) != len(edges):
        return None, ()
    return edges, tuple(position for position, _ in ordered)


def _planned_histogram(planned: _PlannedHistogram, values: list[float]) -> Histogram | None:
    """histogram_from_samples' answer for edges already checked: the counts finite, not negative
    and cumulative, the last equal to `_count`, the sum finite; None where it would refuse."""
    edges = planned.edges
    if edges is None:
        buckets = [(edge, values[position]) for position, edge in planned.buckets]
        return histogram_from_samples(buckets, values[planned.count_at], values[planned.sum_at])[0]
    counts = [values[position] for position in planned.order]
    previous = 0.0
    inf = math.inf
    for count in counts:
        if not previous <= count < inf:  # also false for NaN
            return None
        previous = count
    total = values[planned.sum_at]
    if previous != values[planned.count_at] or not -inf < total < inf:
        return None
    # The edges are distinct, so sorting (edge, count) pairs, as histogram_from_samples does, is this order.
    return Histogram(buckets=tuple(zip(edges, counts, strict=True)), count=values[planned.count_at], sum=total)


@dataclass(frozen=True)
class Plan:
    """One layout's selection: positions of the values each identity's fields read."""

    who_all: tuple[Identity, ...]
    fields: tuple[tuple[Identity, tuple[_PlannedScalar, ...], tuple[_PlannedHistogram, ...]], ...]
    missing: dict[Identity, tuple[tuple[str, str], ...]]
    absent_values: dict[Identity, tuple[tuple[str, object], ...]]  # fields an absent family sets (to 0)
    server_wide: dict[Identity, frozenset[str]]

    def run(self, values: list[float]) -> Selection | None:
        """The Selection `select` gives for these values; None where a value needs `select` itself."""
        out = Selection()
        inf = math.inf
        for who, scalars, histograms in self.fields:
            found: dict[str, object] = dict(self.absent_values[who])
            for name, position in scalars:
                value = values[position]
                if not 0 <= value < inf:
                    return None
                found[name] = value + 0.0  # as _merge_scalars' sums give it (-0.0 -> 0.0)
            for planned in histograms:
                histogram = _planned_histogram(planned, values)
                if histogram is None:
                    return None
                found[planned.field] = histogram
            out.values[who] = found
            out.missing[who] = dict(self.missing[who])
            out.server_wide[who] = set(self.server_wide[who])
        return out


def plan_selection(scan: PageScan, names: tuple[str, ...], roles: EngineLabels,
                   specs: tuple[FamilySpec, ...]) -> Plan | None:
    """The plan of `scan`'s layout (None if the scan has none, or the layout is not plain)."""
    if scan.layout is None:
        return None
    position = {key: number for number, key in enumerate(scan.layout)}
    index = index_series(scan, names, roles)
    who_all = identities(index)
    engines_of = engines_per_model(who_all)

    def where(name: str, labels: Labels) -> int:
        return position[(name, tuple(sorted(labels.items())))]

    fields = []
    missing: dict[Identity, tuple[tuple[str, str], ...]] = {}
    absent_values: dict[Identity, tuple[tuple[str, object], ...]] = {}
    server_wide: dict[Identity, frozenset[str]] = {}
    for who in who_all:
        scalars: list[_PlannedScalar] = []
        histograms: list[_PlannedHistogram] = []
        absent: dict[str, str] = {}
        constant: dict[str, object] = {}
        wide: set[str] = set()
        for spec in specs:
            chosen = None
            for name in spec.names:
                if spec.kind == "histogram":
                    parts = {suffix: _series_for(index, spec, name + suffix, who)
                             for suffix in ("_bucket", "_count", "_sum")}
                    if not any(parts.values()):
                        continue
                    groups = {(variant, process, share)
                              for found in parts.values() for _, _, process, variant, share in found}
                    if len(groups) != 1 or len(parts["_count"]) != 1 or len(parts["_sum"]) != 1:
                        return None
                    buckets = []
                    for labels, _, _, _, _ in parts["_bucket"]:
                        edge = _edge(labels.get("le"))
                        if edge is not None:
                            buckets.append((where(name + "_bucket", labels), edge))
                    histograms.append(_PlannedHistogram(spec.field, tuple(buckets),
                                                        where(name + "_count", parts["_count"][0][0]),
                                                        where(name + "_sum", parts["_sum"][0][0]),
                                                        *_sorted_edges(buckets)))
                else:
                    found = _series_for(index, spec, name, who)
                    if not found:
                        continue
                    if len(found) != 1:
                        return None
                    scalars.append(_PlannedScalar(spec.field, where(name, found[0][0])))
                chosen = name
                break
            if chosen is None:
                _absent(spec, constant, absent)
            elif engines_of[who[0]] > 1 and _only_engine_less(index, spec, chosen, who):
                wide.add(spec.field)
        fields.append((who, tuple(scalars), tuple(histograms)))
        missing[who] = tuple(absent.items())
        absent_values[who] = tuple(constant.items())
        server_wide[who] = frozenset(wide)
    return Plan(tuple(who_all), tuple(fields), missing, absent_values, server_wide)
