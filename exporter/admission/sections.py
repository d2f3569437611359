"""The `admission` and `pools` config sections (listed by exporter.serve.config_keys.daemon_sections) and
their checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from exporter.admission.api import read_token_file
from exporter.admission.book import Pools
from exporter.config_validators import (
    REQUIRED,
    ConfigError,
    Key,
    Section,
    Where,
    boolean,
    existing_file,
    string,
    whole_positive,
)
from exporter.errors import InputError
from exporter.suggest import close_names

if TYPE_CHECKING:
    from exporter.serve.config_model import Config

# --- config: the `admission` and `pools` sections (listed by config.top_level_keys) ---------------


def check_admission_section(result: Mapping[str, Any], where: Where) -> None:
    """Enabled needs a readable token: refuse at check-config rather than at the first request (offline,
    the file is noted as not read)."""
    if result["enabled"] and not result["token_file"]:
        raise InputError("enabled: true needs token_file (a file holding the bearer token gateways send)")
    if result["enabled"] and not where.child("token_file", None).skips_read(result["token_file"]):
        read_token_file(result["token_file"])


def check_pools_section(result: Mapping[str, Any], where: Where) -> None:
    """Two pools on one deployment would redirect requests to where they already are."""
    if result["short"] == result["long"]:
        raise InputError(f"short and long name the same deployment {result['short']!r}; "
                         "the long-context pool must be its own deployment")


def pools_from_config(config: Config) -> Pools | None:
    """The `pools` section as Pools, its deployments checked against `deployments[]` (also run by
    the config's own validation, so `check-config` reports a pool naming no deployment)."""
    raw = config.sections.get("pools")
    if not raw:
        return None
    names = [deployment.name for deployment in config.deployments]
    lines = getattr(raw, "key_lines", {})
    for key in ("short", "long"):
        if raw[key] not in names:
            place = f"{config.source}:{lines.get(key, getattr(raw, 'line', 0))}: " if config.source else ""
            raise ConfigError(f"{place}pools.{key}: deployment {raw[key]!r} is not in deployments"
                              f"{close_names(raw[key], names)}; known: {', '.join(names)}")
    return Pools(raw["short"], raw["long"], raw["split_tokens"])


def check_pools_deployments(config: Config) -> None:
    """A cross-section check: `pools` may only name deployments the config has."""
    pools_from_config(config)


ADMISSION_SECTION = Section("admission", {
    "enabled": Key(boolean, False, "serve POST /v1/admission and /v1/release (off by default)"),
    "token_file": Key(existing_file, None, "file holding the bearer token gateways must send; required when enabled"),
}, "admission by tokens in flight (docs/admission.md)", check=check_admission_section)
POOLS_SECTION = Section("pools", {
    "short": Key(string, REQUIRED, "deployment serving contexts up to split_tokens"),
    "long": Key(string, REQUIRED, "deployment serving longer contexts, where slower streaming is expected"),
    "split_tokens": Key(whole_positive, REQUIRED,
                        "context (prompt + output limit) above which a request belongs to the long pool"),
}, "short- and long-context pools for admission and `plan --pools`", check=check_pools_section,
    config_check=check_pools_deployments)
