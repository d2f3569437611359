"""The vocabulary of the daemon config's key tables: `Key`, `Section`, `Where` and the value validators.

Why a module of its own (and public): the config's optional sections (`shard` in sharding.py,
`admission` and `pools` in admission.py) are declared next to their features with the same
validators the core keys use. Those features must not import the config loader (the loader
lists their sections, so that would be a cycle), nor reach into its private helpers. This module
depends on nothing of the daemon, so every table can be written against it, and
`exporter/serve/config_keys.py` assembles them all in one place (`config_keys.top_level_keys`).

A validator is a function `(value, where) -> parsed value` that raises `Invalid` with the problem
only; `parse_at` (and `section`, `list_of` for nested values) turns that into a `ConfigError`
reading `FILE:LINE: PATH: problem`. The file name travels in `Where.source`, so validating one
file never depends on global state.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from exporter.errors import InputError
from exporter.redaction import has_userinfo, redact
from exporter.suggest import close_names
from exporter.units import (
    parse_bandwidth_bytes_per_second,
    parse_duration_seconds,
    parse_flops_per_second,
    parse_overhead_seconds,
    parse_size_bytes,
)

if TYPE_CHECKING:
    from exporter.serve.config_model import Config


class ConfigError(InputError):
    """A config problem: the message carries file, line and key path."""


class Invalid(Exception):
    """Raised by a validator with the problem alone; `parse_at` adds file, line and path."""


class LineDict(dict[Any, Any]):
    """A mapping that remembers the file line of itself and of each key (messages name the line)."""

    def __init__(self, *args: Any, line: int = 0, key_lines: Mapping[Any, int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.line = line
        self.key_lines: dict[Any, int] = dict(key_lines or {})


class LineList(list[Any]):
    """A list that remembers the file line of itself and of each item."""

    def __init__(self, items: Any = (), *, line: int = 0, item_lines: list[int] | None = None) -> None:
        super().__init__(items)
        self.line = line
        self.item_lines: list[int] = list(item_lines or [])


@dataclass
class OfflineReads:
    """The files an offline validation (`check-config --offline`) did not read, by key path.

    Why a record rather than silence: a config checked on a laptop or in CI, away from the pod's
    mounted Secrets and ConfigMaps, passes only on what was checked; the SRE is told which files
    the daemon will still need to find at start."""

    skipped: dict[str, str] = field(default_factory=dict)  # key path -> the file it names

    def lines(self) -> list[str]:
        return [f"not read (offline): {path} {file}" for path, file in self.skipped.items()]


@dataclass(frozen=True)
class Where:
    """Where a value sits: its path like `deployments[1].targets`, its line and its file (may be empty).

    `offline` (set for `check-config --offline`) travels to every child, so a validator that would
    open a file asks `skips_read` instead of reaching for global state."""

    path: str
    line: int
    source: str = ""
    offline: OfflineReads | None = field(default=None, compare=False)

    def skips_read(self, file: str, unchecked: str = "") -> bool:
        """Offline: note that the file this key names was not read (and what that leaves `unchecked`),
        and say so (True); else False."""
        if self.offline is None:
            return False
        self.offline.skipped.setdefault(self.path, f"{file} ({unchecked})" if unchecked else file)
        return True

    def child(self, name: str | int, line: int | None) -> Where:
        if isinstance(name, int):
            path = f"{self.path}[{name}]"
        else:
            path = f"{self.path}.{name}" if self.path else name
        return replace(self, path=path, line=line or self.line)

    def message(self, problem: str) -> str:
        """`FILE:LINE: PATH: problem` (or `line N:` without a file, nothing without a line)."""
        if self.source:
            place = f"{self.source}:{self.line}: "
        else:
            place = f"line {self.line}: " if self.line else ""
        return f"{place}{self.path or 'config'}: {problem}"

    def error(self, problem: str) -> ConfigError:
        return ConfigError(self.message(problem))


Parser = Callable[[Any, Where], Any]
SectionCheck = Callable[[dict[str, Any], Where], None]
REQUIRED: Any = object()  # a Key's default meaning: the key must be given


@dataclass(frozen=True)
class Key:
    """One config key: how to read it, its default (REQUIRED: must be given), what it means."""

    parse: Parser
    default: Any = None
    doc: str = ""


Table = Mapping[str, Key]


@dataclass(frozen=True)
class Section:
    """An optional top-level config section, declared by the feature that reads it.

    `check` runs on the section's own parsed values; `config_check` runs on the whole built Config
    (e.g. `pools` naming deployments that exist) and raises ConfigError naming the key.
    """

    name: str
    table: Table
    doc: str = ""
    check: SectionCheck | None = None
    config_check: Callable[[Config], None] | None = None

    def key(self) -> Key:
        return Key(section(self.table, check=self.check), None, self.doc)


def parse_at(parser: Parser, value: Any, where: Where) -> Any:
    """Run one validator; any problem becomes a ConfigError at `where`."""
    try:
        return parser(value, where)
    except Invalid as bad:
        raise where.error(str(bad)) from None
    except ConfigError:
        raise
    except InputError as error:
        raise where.error(str(error)) from None


# --- scalar validators ---------------------------------------------------------------------------


def string(value: Any, where: Where) -> str:
    """A non-empty string, stripped."""
    if not isinstance(value, str) or not value.strip():
        raise Invalid(f"expected a non-empty string, got {value!r}")
    return value.strip()


def _with_unit(parse: Callable[[Any, str], float], value: Any) -> float:
    """A units.py parser's value; its message, less the placeholder name, becomes the key's problem."""
    try:
        return parse(value, "value")
    except InputError as error:
        raise Invalid(str(error).removeprefix("value: ")) from None


def duration(value: Any, where: Where) -> float:
    """Seconds, or a duration such as `1m30s`; greater than zero."""
    return _with_unit(parse_duration_seconds, value)


PROMETHEUS_DURATION_PATTERN = r"^(?:[0-9]+(?:ms|s|m|h|d|w|y))+$"
_PROMETHEUS_DURATION = re.compile(PROMETHEUS_DURATION_PATTERN)


def prometheus_duration(value: Any, where: Where) -> str:
    """A duration as a Prometheus rule's `for` takes it (`5m`, `1h30m`, `0s`; a whole number is seconds),
    kept as text: the rules the chart renders and the daemon's loop then write the same."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return f"{value}s"
    text = value.strip() if isinstance(value, str) else ""
    if not _PROMETHEUS_DURATION.match(text):
        raise Invalid(f"expected a Prometheus duration such as 5m, 1h30m or 90s (units ms, s, m, h, d, w, y, "
                      f"whole numbers only), got {value!r}")
    return text


def size(value: Any, where: Where) -> float:
    """Bytes, or a size such as `80GB` or `4GiB`."""
    return _with_unit(parse_size_bytes, value)


def _number(value: Any) -> float:
    if isinstance(value, str):
        # PyYAML (YAML 1.1) reads `8.0e9` and `2e12` as strings: accept plain numbers written so.
        try:
            value = float(value.strip())
        except ValueError:
            raise Invalid(f"expected a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Invalid(f"expected a number, got {value!r}")
    return float(value)


def positive(value: Any, where: Where) -> float:
    """A finite number greater than zero."""
    number = _number(value)
    if not number > 0:
        raise Invalid(f"must be greater than zero, got {value!r}")
    return number


def non_negative(value: Any, where: Where) -> float:
    """A finite number, zero allowed."""
    number = _number(value)
    if number < 0:
        raise Invalid(f"must not be negative, got {value!r}")
    return number


def non_negative_seconds(value: Any, where: Where) -> float:
    """Seconds or a duration such as `2ms`; zero is allowed (a per-step overhead of none)."""
    return _with_unit(parse_overhead_seconds, value)


def ratio(value: Any, where: Where) -> float:
    """A share in (0, 1]."""
    number = _number(value)
    if not 0 < number <= 1:
        raise Invalid(f"must be a ratio in (0, 1], got {value!r}")
    return number


def whole_positive(value: Any, where: Where) -> int:
    """A whole number >= 1 (a bool is not a number here, though Python says it is)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Invalid(f"expected a whole number >= 1, got {value!r}")
    return value


def whole_non_negative(value: Any, where: Where) -> int:
    """A whole number >= 0, e.g. an index."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Invalid(f"expected a whole number >= 0, got {value!r}")
    return value


def port(value: Any, where: Where) -> int:
    """A TCP port, 1..65535."""
    number = whole_positive(value, where)
    if number > 65535:
        raise Invalid(f"a port is at most 65535, got {value!r}")
    return number


def boolean(value: Any, where: Where) -> bool:
    """`true` or `false` only: a string such as `"no"` is refused rather than guessed."""
    if not isinstance(value, bool):
        raise Invalid(f"expected true or false, got {value!r}")
    return value


def bandwidth(value: Any, where: Where) -> float:
    """Bytes per second: a number, or a rate such as `2TB/s` (`2TB` reads as per second too)."""
    return _with_unit(parse_bandwidth_bytes_per_second, value)


def flops(value: Any, where: Where) -> float:
    """FLOP per second: a number such as `125e12`, or a rate such as `125TFLOP/s`."""
    return _with_unit(parse_flops_per_second, value)


def choice(*choices: str) -> Parser:
    """One of `choices`, case-insensitive; a near miss is named in the message."""

    def parse(value: Any, where: Where) -> str:
        text = string(value, where).lower()
        if text not in choices:
            raise Invalid(f"expected one of {', '.join(choices)}, got {value!r}{close_names(str(value), choices)}")
        return text

    return parse


# Why a URL with credentials is refused rather than taken apart (docs/operations.md, "Credentials"):
# a password in the config is a password in a ConfigMap, in `helm get values` and in every diff.
USERINFO_REFUSED = (
    "the URL holds credentials (`user:password@` before the host), which would show wherever the URL "
    "does (logs, the `target` label, alerts) and sit in the config file: give the URL without them, the "
    "username as `basic_auth.username` and the password in a file (`basic_auth.password_file`, e.g. a "
    "mounted Secret) or an environment variable (`basic_auth.password_env`), under the `auth` that "
    "applies to this URL (the deployment's `auth`, `targets.prometheus.auth` or `alerting.auth`); "
    "an `@` that belongs to the path is written %40")


def url(value: Any, where: Where) -> str:
    """An http:// or https:// URL without credentials in it; one trailing slash after a path is dropped."""
    text = string(value, where)
    if not text.startswith(("http://", "https://")):
        raise Invalid(f"expected an http:// or https:// URL, got {redact(str(value))!r}")
    if has_userinfo(text):
        raise Invalid(f"{redact(text)}: {USERINFO_REFUSED}")
    return text.rstrip("/") if text.count("/") > 2 and text.endswith("/") else text


LABEL_NAME_PATTERN = r"^[a-zA-Z_][a-zA-Z0-9_]*$"
_LABEL_NAME = re.compile(LABEL_NAME_PATTERN)


def label_set(value: Any, where: Where) -> dict[str, str]:
    """A mapping of Prometheus label names to non-empty string values, e.g. `{cluster: prod-eu}`; names
    that start with `__` are Prometheus's own and refused, as is `alertname`, which names the alert."""
    if not isinstance(value, dict):
        raise Invalid(f"expected a mapping of label names to values, got {type(value).__name__} {value!r}")
    labels: dict[str, str] = {}
    lines = getattr(value, "key_lines", {})
    for name, label_value in value.items():
        at = where.child(str(name), lines.get(name))
        if not isinstance(name, str) or not _LABEL_NAME.match(name):
            raise at.error(f"{name!r} is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*)")
        if name.startswith("__") or name == "alertname":
            raise at.error(f"{name!r} is reserved: names starting with __ are Prometheus's, alertname the alert's")
        scalar = isinstance(label_value, (str, int, float)) and not isinstance(label_value, bool)
        if not scalar or not str(label_value).strip():
            raise at.error(f"expected a non-empty string, got {label_value!r}")
        labels[name] = str(label_value).strip()
    return labels


# One PromQL label matcher: `name="value"`, `name!="value"`, `name=~"re"` or `name!~"re"`.
_MATCHER = r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\\n]|\\.)*"\s*'
SELECTOR_PATTERN = rf"^\s*\{{?(?:{_MATCHER})(?:,(?:{_MATCHER}))*,?\s*\}}?\s*$"
_SELECTOR_RE = re.compile(SELECTOR_PATTERN)


def promql_selector(value: Any, where: Where) -> str:
    """PromQL label matchers such as `job="vllm", namespace="llm"` (braces optional), kept without
    braces so they can be joined into larger selectors; checked here so a typo fails at
    check-config, not as a query error at every poll."""
    text = string(value, where).strip()
    if _SELECTOR_RE.match(text) is None:
        raise Invalid(f'expected PromQL label matchers such as job="vllm", namespace=~"llm-.*", got {value!r}')
    if "__name__" in text:
        raise Invalid("the selector names the engines' series by their labels; the daemon chooses the metric names")
    return text.removeprefix("{").removesuffix("}").strip().rstrip(",")


def existing_file(value: Any, where: Where) -> str:
    """A path to a file that exists now (so a typo fails at check-config, not at the first poll);
    offline, only a non-empty path (the file is noted as not read)."""
    path = string(value, where)
    if not where.skips_read(path) and not os.path.isfile(path):
        raise Invalid(f"file {path!r} does not exist")
    return path


def url_path(value: Any, where: Where) -> str:
    """A URL path such as `/metrics`."""
    text = string(value, where)
    if not text.startswith("/"):
        raise Invalid(f"a URL path starts with '/', got {value!r}")
    return text


# --- nested validators ---------------------------------------------------------------------------


def list_of(item: Parser, *, non_empty: bool = True) -> Parser:
    """A list whose every element `item` validates, each at its own line and index."""

    def parse(value: Any, where: Where) -> list[Any]:
        if not isinstance(value, list):
            raise Invalid(f"expected a list, got {type(value).__name__} {value!r}")
        if non_empty and not value:
            raise Invalid("the list is empty")
        lines = getattr(value, "item_lines", [where.line] * len(value))
        return [parse_at(item, element, where.child(index, lines[index])) for index, element in enumerate(value)]

    return parse


def url_list(value: Any, where: Where) -> list[str]:
    """One URL or a non-empty list of them."""
    urls: list[str] = list_of(url)([value] if isinstance(value, str) else value, where)
    return urls


# Keys that were renamed: a config still using the old name gets the new one, not "unknown key".
RENAMED_KEYS = {"engine": "kind"}
RENAME_REASONS = {"engine": "the server's page format (auto, vllm, sglang, tgi) is its `kind`; "
                            "`engine` names only the engine index (a data-parallel rank)"}


def section(table: Table, *, check: SectionCheck | None = None) -> Parser:
    """A mapping validated against `table`: unknown keys are errors, defaults fill the rest."""

    def parse(value: Any, where: Where) -> LineDict:
        if value is None:
            value = LineDict()
        if not isinstance(value, dict):
            raise Invalid(f"expected a mapping, got {type(value).__name__} {value!r}")
        lines = getattr(value, "key_lines", {})
        for name in value:
            if name not in table:
                renamed = RENAMED_KEYS.get(str(name))
                problem = (f"renamed to {renamed!r}: {RENAME_REASONS[str(name)]}" if renamed in table else
                           f"unknown key{close_names(str(name), table)}; known: {', '.join(table)}")
                raise where.child(str(name), lines.get(name)).error(problem)
        result = LineDict(line=where.line, key_lines=lines)
        for name, key in table.items():
            if name in value and value[name] is not None:
                result[name] = parse_at(key.parse, value[name], where.child(name, lines.get(name)))
            elif key.default is REQUIRED:
                raise where.error(f"missing required key {name!r}")
            else:
                result[name] = key.default
        if check is not None:
            _run_check(check, result, where)
        return result

    return parse


def _run_check(check: SectionCheck, result: dict[str, Any], where: Where) -> None:
    try:
        check(result, where)
    except Invalid as bad:
        raise where.error(str(bad)) from None


def one_of_keys(*names: str) -> SectionCheck:
    """A section check: at most one of `names` is given."""

    def check(result: dict[str, Any], where: Where) -> None:
        if sum(result[name] is not None for name in names) > 1:
            raise Invalid(f"give at most one of {', '.join(names)}")

    return check
