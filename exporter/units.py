"""Parsing of human sizes, rates and durations (`80GB`, `4GiB`, `2TB/s`, `1.2TFLOP/s`, `15s`, `5m`) into
base units."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from exporter.errors import InputError

# Public: the chart's JSON schema (config_schema.py) derives its size pattern from these units.
SIZE_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
# FLOP/s: an SI prefix (as in SIZE_UNITS, `m` is mega) and optionally `FLOP` or `FLOPS`, before the `/s`
# that rates may end with; public for the config schema's pattern, like SIZE_UNITS.
FLOPS_UNITS: dict[str, float] = {
    prefix + word: scale
    for prefix, scale in {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}.items()
    for word in ("", "flop", "flops")
}
# What a rate may end with: `2TB/s`, `1.2TFLOP/s` (case-insensitive).
PER_SECOND_SUFFIX = "/s"
_DURATION_UNITS: dict[str, float] = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "": 1.0}
_NUMBER_WITH_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
# Prometheus-style compound durations, largest unit first, each at most once: `1m30s`, `1h5m`, `2s500ms`.
_COMPOUND_DURATION = re.compile(r"^\s*(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?(?:([0-9]+)ms)?\s*$")
# What parse_duration_seconds reads, as a JSON-schema pattern (the config schema, exporter/serve/config_schema.py).
DURATION_PATTERN = (r"^\s*(?:[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?\s*(?:ms|s|m|h)?"
                    r"|(?:[0-9]+h)?(?:[0-9]+m)?(?:[0-9]+s)?(?:[0-9]+ms)?)\s*$")


def _parse_with_unit(text: str | int | float, units: dict[str, float] | dict[str, int],
                     unit_of: Callable[[str], str], what: str, unreadable: str, *, allow_zero: bool = False,
                     per_second: bool = False) -> float:
    """A number with an optional unit from `units` (a bare int or float is taken as is); must be finite
    and positive (or zero, with `allow_zero`). A rate (`per_second`) may end with `/s`: `2TB/s` is `2TB`
    per second, which is what a rate means anyway."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        body = str(text).rstrip()
        if per_second and body.lower().endswith(PER_SECOND_SUFFIX):
            body = body[:-len(PER_SECOND_SUFFIX)]
        match = _NUMBER_WITH_UNIT.match(body)
        if not match or unit_of(match.group(2)) not in units:
            raise InputError(f"{what}: cannot read {text!r} as {unreadable}")
        value = float(match.group(1)) * units[unit_of(match.group(2))]
    if not math.isfinite(value):  # NaN, inf, or a literal such as 1e999 that overflows
        raise InputError(f"{what}: must be a finite number, got {text!r}")
    if allow_zero and value < 0:
        raise InputError(f"{what}: must not be negative, got {text!r}")
    if not allow_zero and not value > 0:
        raise InputError(f"{what}: must be greater than zero, got {text!r}")
    return value


def parse_size_bytes(text: str | int | float, what: str = "size") -> float:
    """`80GB` -> 80e9, `4GiB` -> 4 * 2**30, `1e9` -> 1e9. Must be positive."""
    return _parse_with_unit(text, SIZE_UNITS, str.lower, what, "a size; use bytes or a unit such as 80GB or 4GiB")


def parse_bandwidth_bytes_per_second(text: str | int | float, what: str = "bandwidth") -> float:
    """`2TB/s` or `2TB` -> 2e12, `600GB/s` -> 6e11, a bare number is bytes/s. Must be positive."""
    return _parse_with_unit(text, SIZE_UNITS, str.lower, what,
                            "a bandwidth; use bytes/s or a rate such as 2TB/s or 600GB/s", per_second=True)


def parse_flops_per_second(text: str | int | float, what: str = "compute") -> float:
    """`1.2TFLOP/s` -> 1.2e12, `125TFLOPS` or `125T` -> 1.25e14, `125e12` -> 1.25e14. Must be positive."""
    return _parse_with_unit(text, FLOPS_UNITS, str.lower, what,
                            "FLOP/s; use a number such as 125e12 or a rate such as 125TFLOP/s", per_second=True)


def _parse_duration(text: str | int | float, what: str, unreadable: str, *, allow_zero: bool) -> float:
    """Seconds from a bare number, a number with one unit (`15s`, `250ms`) or a compound duration
    (`1m30s`): every duration reader goes through here, so each accepts what DURATION_PATTERN says."""
    compound = _COMPOUND_DURATION.match(text) if isinstance(text, str) else None
    if compound and sum(part is not None for part in compound.groups()) > 1:
        hours, minutes, seconds, millis = (int(part or 0) for part in compound.groups())
        value = hours * 3600.0 + minutes * 60.0 + seconds + millis / 1000
        if not allow_zero and not value > 0:
            raise InputError(f"{what}: must be greater than zero, got {text!r}")
        return value
    return _parse_with_unit(text, _DURATION_UNITS, str, what, unreadable, allow_zero=allow_zero)


def parse_duration_seconds(text: str | int | float, what: str = "duration") -> float:
    """`15s` -> 15.0, `5m` -> 300.0, `250ms` -> 0.25, `1m30s` -> 90.0, a bare number is seconds. Must be positive."""
    return _parse_duration(text, what, "a duration; use e.g. 15s, 5m, 1m30s, 250ms", allow_zero=False)


def parse_overhead_seconds(text: str | int | float, what: str = "step overhead") -> float:
    """A duration that may be zero: a per-step overhead (`calibrate` fits 0 when there is none), or an
    alert rule's `for` (Prometheus writes `0s`, `5m` and `1m30s` alike)."""
    return _parse_duration(text, what, "a duration; use e.g. 2ms, 0.002, 0", allow_zero=True)
