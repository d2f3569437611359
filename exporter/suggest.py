"""Close-name suggestions for unknown presets, verbs and config keys."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest_names(name: str, known: Iterable[str], *, count: int = 3, cutoff: float = 0.5) -> list[str]:
    """The known names most like `name` (case folded), best first."""
    return difflib.get_close_matches(name.lower(), [k.lower() for k in known], n=count, cutoff=cutoff)


def close_names(name: str, known: Iterable[str]) -> str:
    """' (did you mean: a, b?)' or '' — appended to an 'unknown X' message."""
    matches = closest_names(name, known)
    return f" (did you mean: {', '.join(matches)}?)" if matches else ""
