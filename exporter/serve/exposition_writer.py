"""The /metrics text (format 0.0.4) written straight from a registry's families, byte for byte what
prometheus_client's `generate_latest` writes, at a fraction of its cost.

Why: at 1,000 targets the page is ~22,000 samples, and `generate_latest` validates and escapes every
label of every sample (benchmarks/results/profile_hotpath_before_metrics.txt at commit 54bfaa1: 90% of a render). The
stepbudget families repeat one label set per reading across ~22 families, and the same label sets
from one poll to the next: here each distinct label set is escaped once and its text remembered (by
its content, so a changed or reused dict can never be written with stale text), and the per-sample
work is one lookup, one number and one string.

A family this writer does not handle on its fast path (a non-legacy name, a sample timestamp, the
OpenMetrics-only `_created`/`_gsum`/`_gcount` samples, an unusual type) is written by
`generate_latest` itself, alone: the output stays exactly prometheus_client's.

OpenMetrics (what Prometheus asks for first in its Accept header, so what a real scrape of the daemon
gets) is written the same way by `render_openmetrics`: byte for byte prometheus_client's
`openmetrics.exposition.generate_latest` with its default (underscores) escaping, each label set's
text remembered; a family with exemplars, timestamps or native histograms is left to it, and so is
any other escaping or version.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import cast

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics

# Names escaped for UTF-8 support, and openmetrics' escaping argument: prometheus_client 0.23+ (the floor in
# pyproject.toml, which `make test-floors` runs the tests on); tests compare bytes with 0.26 as well.
from prometheus_client.openmetrics.exposition import escape_label_name, escape_metric_name
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

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


def _labels_written(labels: dict[str, str], texts: dict[tuple[tuple[str, str], ...], str],
                    write: Callable[[tuple[tuple[str, str], ...]], str]) -> str:
    """A sample's label text, written by `write` once per distinct label set (remembered in `texts`)."""
    if not labels:
        return ""
    key = tuple(labels.items())
    text = texts.get(key)
    if text is None:
        if len(texts) >= MAX_CACHED_LABEL_SETS:
            texts.clear()
        text = texts[key] = write(key)
    return text


def _number(value: float) -> str:
    """`floatToGoString(value)`: Python's repr, but Go's `+Inf`/`NaN` and exponent form for large numbers."""
    if value != value or value == math.inf or value == -math.inf:
        return _go_string(value)
    number = repr(value)
    if value > 0 and number.find(".") > 6:
        return _go_string(value)  # Go's exponent form for large numbers
    return number


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
    for sample in metric.samples:
        sample_name = sample.name
        if sample.timestamp is not None or sample_name in special:
            return False
        if not (legacy.get(sample_name) or _legacy(sample_name)):
            return False
        text = _labels_written(sample.labels, texts, _label_text)
        lines.append(f"{sample_name}{text} {_number(float(sample.value))}\n")
    out.extend(lines)
    return True


def render_text(registry: Collector) -> bytes:
    """`generate_latest(registry)`, written faster: the same bytes."""
    out: list[str] = []
    for metric in registry.collect():
        if not _family(metric, out):
            out.append(generate_latest(_One(metric)).decode("utf-8"))
    return "".join(out).encode("utf-8")


# --- OpenMetrics ------------------------------------------------------------------------------------

_OM_LABEL_TEXTS: dict[tuple[tuple[str, str], ...], str] = {}
_OM_NAMES: dict[str, str] = {}  # a sample name as openmetrics writes it (underscores for other runes)


def _om_name(name: str) -> str:
    """`_escape(name, UNDERSCORES, _is_legacy_labelname_rune)`, as openmetrics writes sample names."""
    known = _OM_NAMES.get(name)
    if known is None:
        if len(_OM_NAMES) >= MAX_CACHED_LABEL_SETS:
            _OM_NAMES.clear()
        known = _OM_NAMES[name] = openmetrics._escape(name, openmetrics.UNDERSCORES,
                                                      openmetrics._is_legacy_labelname_rune)
    return known


def _om_label_text(key: tuple[tuple[str, str], ...]) -> str:
    """`{name="value",...}` as openmetrics writes it: names sorted and escaped, values escaped."""
    return "{" + ",".join(f'{openmetrics.escape_label_name(k, openmetrics.UNDERSCORES)}="{_escape_value(v)}"'
                          for k, v in sorted(key)) + "}"


def _om_family(metric: Metric, out: list[str]) -> bool:
    """Appends the family's OpenMetrics lines to `out`; False (nothing appended) if it needs openmetrics'
    own generate_latest (exemplars, timestamps, native histograms)."""
    escaped = openmetrics.escape_metric_name(metric.name, openmetrics.UNDERSCORES)
    lines = [f"# HELP {escaped} {_escape_value(metric.documentation)}\n# TYPE {escaped} {metric.type}\n"]
    if metric.unit:
        lines.append(f"# UNIT {escaped} {metric.unit}\n")
    texts = _OM_LABEL_TEXTS
    names = _OM_NAMES
    for sample in metric.samples:
        if sample.timestamp is not None or sample.exemplar or sample.native_histogram:
            return False
        text = _labels_written(sample.labels, texts, _om_label_text)
        number = "" if sample.value is None else _number(float(sample.value))
        name = names.get(sample.name) or _om_name(sample.name)
        lines.append(f"{name}{text} {number}\n")
    out.extend(lines)
    return True


def _openmetrics_latest(registry: Collector, *, escaping: str, version: str) -> bytes:
    """prometheus_client's own OpenMetrics writer (untyped there), looked up at each call."""
    latest: Callable[..., bytes] = openmetrics.generate_latest
    return latest(registry, escaping=escaping, version=version)


def render_openmetrics(registry: Collector, escaping: str = openmetrics.UNDERSCORES, version: str = "1.0.0") -> bytes:
    """`openmetrics.exposition.generate_latest(registry, escaping, version)`, written faster: the same bytes."""
    if escaping != openmetrics.UNDERSCORES or version != "1.0.0":
        return _openmetrics_latest(registry, escaping=escaping, version=version)
    out: list[str] = []
    for metric in registry.collect():
        try:
            written = _om_family(metric, out)
        except (TypeError, ValueError):  # a value float() refuses: openmetrics words the error
            written = False
        if not written:
            whole = _openmetrics_latest(_One(metric), escaping=escaping, version=version).decode("utf-8")
            out.append(whole.removesuffix("# EOF\n"))
    out.append("# EOF\n")
    return "".join(out).encode("utf-8")
