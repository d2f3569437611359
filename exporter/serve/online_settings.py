"""`online_calibration`'s settings: config data, defined on the config side.

Why a module of its own: the config builds these for each deployment and the online calibration
reads them; defined here, the config never imports the fit (its math, its threads) to hold them.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HISTORY_SECONDS = 6 * 3600.0
DEFAULT_HOLDOUT_SECONDS = 1800.0
DEFAULT_MIN_WINDOWS = 30


@dataclass(frozen=True)
class Settings:
    """`online_calibration` of one deployment (defaults merged with its own)."""

    enabled: bool = True
    history_seconds: float = DEFAULT_HISTORY_SECONDS
    holdout_seconds: float = DEFAULT_HOLDOUT_SECONDS
    min_windows: int = DEFAULT_MIN_WINDOWS
    prometheus_url: str | None = None
