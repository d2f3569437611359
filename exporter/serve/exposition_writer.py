"""The /metrics text (format 0.0.4) written straight from a registry's families, byte for byte what
prometheus_client's `generate_latest` writes, at a fraction of its cost.

Why: at 1,000 targets the page is ~22,000 samples, and `generate_latest` validates and escapes every
label of every sample (benchmarks/results/profile_hotpath_before_metrics.txt: 90% of a render). The
stepbudget families repeat one label set per reading across ~22 families, and the same label sets
from one poll to the next: here each distinct label set is escaped once and its text remembered (by
its content, so a changed or reused dict can never be written with stale text), and the per-sample
work is one lookup, one number and one string.

A family this writer does not handle on its fast path (a non-legacy name, a sample timestamp, the
OpenMetrics-only `_created`/`_gsum`/`_gcount` samples, an unusual type) is written by
`generate_latest` itself, alone: the output stays exactly prometheus_client's. OpenMetrics pages
(asked for by Accept) are not written here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import cast

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

try:  # prometheus_client 0.21+ (names escaped for UTF-8 support); tests compare bytes with 0.26
    from prometheus_client.openmetrics.exposition import escape_label_name, escape_metric_name
except ImportError:  # pragma: no cover - an older client: its own generate_latest writes every page
    escape_label_name = escape_metric_name = None  # type: ignore[assignment]  # older prometheus_client lacks them

# A number as prometheus_client writes it (Go's formatting: `+Inf`, `NaN`, `1e+22`); untyped there.
_go_string = cast(Callable[[float], str], floatToGoString)

MAX_CACHED_LABEL_SETS = 50_000
# The text of each label set already written, by its items in the dict's order: `{k="v",...}`.
_LABEL_TEXTS: dict[tuple[tuple[str, str], ...], str] = {}
_LEGACY_NAMES: dict[str, bool] = {}
_TYPES = {"counter": "counter", "gauge": "gauge", "info": "gauge", "histogram": "histogram",
          "summary": "summary", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}
_OPENMETRICS_SUFFIXES = ("_created", "_gsum", "_gcount")


class _One(Collector):
    """One family as a registry, for `generate_latest` to write alone."""

    def __init__(self, metric: Metric) -> None:
        self._metric = metric

    def collect(self) -> Iterable[Metric]:
        return [self._metric]


# prometheus_client's legacy name check (validation.METRIC_NAME_RE, `$` and all): such a name is
# written as it is; any other name is escaped, which is left to generate_latest.
_LEGACY_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def _legacy(name: str) -> bool:
    known = _LEGACY_NAMES.get(name)
    if known is None:
        if len(_LEGACY_NAMES) >= MAX_CACHED_LABEL_SETS:
            _LEGACY_NAMES.clear()
        known = _LEGACY_NAMES[name] = bool(name) and _LEGACY_NAME.match(name) is not None
    return known


def _escape_value(value: str) -> str:
    """A label value as prometheus_client escapes it: backslash, newline, double quote."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _label_text(key: tuple[tuple[str, str], ...]) -> str:
    """`{name="value",...}` as generate_latest writes it: names sorted, values escaped."""
    return "{" + ",".join(f'{escape_label_name(k)}="{_escape_value(v)}"' for k, v in sorted(key)) + "}"


def _family(metric: Metric, out: list[str]) -> bool:
    """Appends the family's lines to `out`; False (nothing appended) if it needs generate_latest."""
    mtype = _TYPES.get(metric.type)
    if mtype is None or not _legacy(metric.name):
        return False
    name = metric.name
    if metric.type == "counter":
        name += "_total"
    elif metric.type == "info":
        name += "_info"
    if not _legacy(name):
        return False
    special = {metric.name + suffix for suffix in _OPENMETRICS_SUFFIXES}
    escaped = escape_metric_name(name)
    lines = [f"# HELP {escaped} {_escape_help(metric.documentation)}\n# TYPE {escaped} {mtype}\n"]
    texts = _LABEL_TEXTS
    legacy = _LEGACY_NAMES
    inf, minus_inf = math.inf, -math.inf
    for sample in metric.samples:
        sample_name = sample.name
        if sample.timestamp is not None or sample_name in special:
            return False
        if not (legacy.get(sample_name) or _legacy(sample_name)):
            return False
        labels = sample.labels
        if labels:
            key = tuple(labels.items())
            text = texts.get(key)
            if text is None:
                if len(texts) >= MAX_CACHED_LABEL_SETS:
                    texts.clear()
                text = texts[key] = _label_text(key)
        else:
            text = ""
        value = float(sample.value)
        if value != value or value == inf or value == minus_inf:
            number = _go_string(value)
        else:
            number = repr(value)
            if value > 0 and number.find(".") > 6:
                number = _go_string(value)  # Go's exponent form for large numbers
        lines.append(f"{sample_name}{text} {number}\n")
    out.extend(lines)
    return True


def render_text(registry: Collector) -> bytes:
    """`generate_latest(registry)`, written faster: the same bytes."""
    if escape_label_name is None:  # pragma: no cover
        return generate_latest(registry)
    out: list[str] = []
    for metric in registry.collect():
        if not _family(metric, out):
            out.append(generate_latest(_One(metric)).decode("utf-8"))
    return "".join(out).encode("utf-8")
