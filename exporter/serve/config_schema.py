"""The daemon config's JSON schema, generated from config_keys.py's key tables.

`stepbudget check-config` validates a config with the key tables in exporter/serve/config_keys.py (core keys
plus the sections `config.daemon_sections()` lists). The Helm chart checks `values.config` at `helm install`
time with a JSON schema; this module derives that schema from the same tables, so both refuse
the same unknown keys, missing required keys and wrongly typed values. The chart's copy lives
under `properties.config` of helm/stepbudget/values.schema.json, rewritten by
`python -m exporter.serve.config_schema --write` (`make chart-schema`); tests/serve/test_config_schema.py
fails when it drifts.

What the schema cannot check stays with check-config: that files exist, that model and GPU
presets exist, cross-key rules of registered sections (CHECK_CONFIG_ONLY) and value ranges of
numbers written as strings.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exporter import config_validators
from exporter.serve import config
from exporter.serve.engines import server_kinds
from exporter.units import DURATION_PATTERN, FLOPS_UNITS, PER_SECOND_SUFFIX, SIZE_UNITS

NUMBER_TEXT = r"^\s*[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?\s*$"


def _case_insensitive(unit: str) -> str:
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in unit)


def _unit_pattern(units: dict[str, int] | dict[str, float], *, per_second: bool = False) -> str:
    """A number with one of `units` (any case), as units.py reads it; a rate may end with `/s`."""
    suffix = rf"\s*(?:{_case_insensitive(PER_SECOND_SUFFIX)})?" if per_second else ""
    return (r"^\s*[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?\s*(?:"
            + "|".join(_case_insensitive(u) for u in sorted(units, key=len, reverse=True) if u)
            + rf")?{suffix}\s*$")


SIZE_PATTERN = _unit_pattern(SIZE_UNITS)
BANDWIDTH_PATTERN = _unit_pattern(SIZE_UNITS, per_second=True)
FLOPS_PATTERN = _unit_pattern(FLOPS_UNITS, per_second=True)

_NON_EMPTY = {"type": "string", "pattern": r"\S"}
_POSITIVE = {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "string", "pattern": NUMBER_TEXT}]}
_SIZE = {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "string", "pattern": SIZE_PATTERN}]}
_BANDWIDTH = {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "string", "pattern": BANDWIDTH_PATTERN}]}
_FLOPS = {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "string", "pattern": FLOPS_PATTERN}]}
_DURATION = {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "string", "pattern": DURATION_PATTERN}]}
# No `@` between `//` and the query: credentials in a URL are refused (config_validators.url).
_URL = {"type": "string", "pattern": r"^\s*https?://[^?#@]*(?:[?#].*)?$"}

_LABEL_SET: dict[str, Any] = {
    "type": "object",
    "propertyNames": {"pattern": config_validators.LABEL_NAME_PATTERN, "not": {"anyOf": [
        {"pattern": "^__"}, {"const": "alertname"}]}},
    "additionalProperties": {"anyOf": [{"type": "string", "pattern": r"\S"}, {"type": "number"}]}}

# Each plain validator of exporter/config_validators.py (and config_keys.py's `listen_address`), by its
# qualified name: all public, so this table names nothing private of another module.
PARSER_SCHEMAS: dict[str, dict[str, Any]] = {
    "string": _NON_EMPTY,
    "existing_file": _NON_EMPTY,  # existence is checked by check-config, where the file is
    "duration": _DURATION,
    "size": _SIZE,
    "bandwidth": _BANDWIDTH,
    "flops": _FLOPS,
    "gpu_preset": _NON_EMPTY,  # that the preset exists is checked by check-config, which has the table
    "positive": _POSITIVE,
    "non_negative_seconds": {"anyOf": [{"type": "number", "minimum": 0},
                                       {"type": "string", "pattern": DURATION_PATTERN}]},
    "ratio": {"anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                        {"type": "string", "pattern": NUMBER_TEXT}]},
    "whole_positive": {"type": "integer", "minimum": 1},
    "whole_non_negative": {"type": "integer", "minimum": 0},
    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
    "boolean": {"type": "boolean"},
    "url": _URL,
    "url_path": {"type": "string", "pattern": r"^\s*/"},
    "url_list": {"anyOf": [_URL, {"type": "array", "minItems": 1, "items": _URL}]},
    "listen_address": {"type": ["string", "integer"]},
    "promql_selector": {"type": "string", "pattern": config_validators.SELECTOR_PATTERN},
    "label_set": _LABEL_SET,
    "alert_labels": {**_LABEL_SET, "propertyNames": {**_LABEL_SET["propertyNames"], "not": {"anyOf": [
        {"pattern": "^__"}, {"const": "alertname"}, {"const": "severity"}]}}},
    "prometheus_duration": {"anyOf": [{"type": "integer", "minimum": 0},
                                      {"type": "string", "pattern": config_validators.PROMETHEUS_DURATION_PATTERN}]},
    "alert_threshold": {"type": "number", "minimum": 1e-4, "maximum": 100},
}

# Cross-key checks the schema does not express; check-config still runs them.
CHECK_CONFIG_ONLY = {"check_shard_section", "check_admission_section", "check_pools_section"}


def _name(function: Callable[..., Any]) -> str:
    return function.__qualname__.split(".<locals>")[0]


def _check_schema(check: Callable[..., Any] | None) -> dict[str, Any]:
    if check is None or _name(check) in CHECK_CONFIG_ONLY:
        return {}
    if _name(check) == "targets_check":
        # check-config also refuses prometheus given with another source; the schema asks for one.
        return {"anyOf": [{"required": [name]} for name in ("static", "dns", "kubernetes", "prometheus")]}
    if _name(check) == "gpu_check":
        # A device without a preset gives every figure; `preset: null` is no preset.
        given = {"not": {"type": "null"}}
        custom = list(config.CUSTOM_DEVICE_KEYS)
        return {"anyOf": [{"required": ["preset"], "properties": {"preset": given}},
                          {"required": custom, "properties": dict.fromkeys(custom, given)}]}
    given = {"not": {"type": "null"}}
    if _name(check) == "basic_auth_check":
        # Exactly one of the two places for the password (`required` passes a null section by, as it should).
        names = ("password_file", "password_env")
        both = {"type": "object", "required": list(names), "properties": dict.fromkeys(names, given)}
        return {"anyOf": [{"required": [name], "properties": {name: given}} for name in names], "not": both}
    if _name(check) == "tls_check":
        # key_file only with cert_file.
        return {"not": {"type": "object", "required": ["key_file"], "properties": {"key_file": given},
                        "not": {"required": ["cert_file"], "properties": {"cert_file": given}}}}
    if _name(check) == "one_of_keys":
        names = inspect.getclosurevars(check).nonlocals["names"]
        given = {"not": {"type": "null"}}
        pairs = [{"type": "object", "required": [a, b], "properties": {a: given, b: given}}
                 for i, a in enumerate(names) for b in names[i + 1:]]
        return {"not": pairs[0] if len(pairs) == 1 else {"anyOf": pairs}}
    raise ValueError(f"no JSON schema for the config check {check.__qualname__}: "
                     "add it to exporter/serve/config_schema.py (or to CHECK_CONFIG_ONLY)")


def parser_schema(parse: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of what one key parser accepts."""
    name = _name(parse)
    if name in PARSER_SCHEMAS:
        return dict(PARSER_SCHEMAS[name])
    captured = inspect.getclosurevars(parse).nonlocals
    if name == "choice":
        return {"enum": list(captured["choices"])}
    if name == "server_kind":
        return {"enum": list(server_kinds())}  # the adapter registry's, as server_kind checks
    if name == "list_of":
        schema = {"type": "array", "items": parser_schema(captured["item"])}
        return {**schema, "minItems": 1} if captured["non_empty"] else schema
    if name == "section":
        return table_schema(captured["table"], captured["check"])
    if name == "gpu_device":
        # A preset's name, or a mapping of GPU_KEYS (gpu_device builds the Gpu from either).
        return {"anyOf": [_NON_EMPTY, table_schema(config.GPU_KEYS, config.gpu_check)]}
    raise ValueError(f"no JSON schema for the config parser {parse.__qualname__}: "
                     "add it to exporter/serve/config_schema.py")


def _or_null(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` or null (a key given as null takes its default)."""
    if "enum" in schema:
        return {**schema, "enum": [*schema["enum"], None]}
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        return {**schema, "type": [*types, "null"]}
    return {**schema, "anyOf": [*schema["anyOf"], {"type": "null"}]}


def table_schema(table: config.Table, check: Callable[..., Any] | None = None) -> dict[str, Any]:
    """A mapping of `table`'s keys: unknown keys refused, REQUIRED keys required, null meaning the default."""
    properties = {}
    for name, key in table.items():
        key_schema = parser_schema(key.parse)
        if key.default is not config.REQUIRED:
            key_schema = _or_null(key_schema)
        properties[name] = {"description": key.doc, **key_schema} if key.doc else key_schema
    schema: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": properties}
    required = [name for name, key in table.items() if key.default is config.REQUIRED]
    if required:
        schema["required"] = required
    return {**schema, **_check_schema(check)}


def config_schema() -> dict[str, Any]:
    """The whole daemon config: the core keys and every section `config.daemon_sections()` lists."""
    return table_schema(config.top_level_keys())


def chart_config_schema() -> dict[str, Any]:
    """`values.config` of the chart: the daemon config less `listen`, which the chart sets from `port`."""
    schema = config_schema()
    schema["properties"] = {k: v for k, v in schema["properties"].items() if k != "listen"}
    schema["description"] = ("The daemon's YAML config (DESIGN §3), generated from exporter/serve/config_keys.py's "
                             "key tables by exporter/serve/config_schema.py; `listen` comes from `port`.")
    return schema


def write_chart_schema(path: Path) -> bool:
    """Rewrite `properties.config` of the chart's values.schema.json; True when it changed."""
    document = json.loads(path.read_text())
    new = chart_config_schema()
    if document["properties"].get("config") == new:
        return False
    document["properties"]["config"] = new
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, metavar="VALUES_SCHEMA_JSON",
                        help="rewrite properties.config of this values.schema.json")
    args = parser.parse_args(argv)
    if args.write:
        print(f"{args.write}: {'updated' if write_chart_schema(args.write) else 'unchanged'}")
    else:
        print(json.dumps(config_schema(), indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
