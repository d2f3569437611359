"""Close-name suggestions for unknown presets, verbs and config keys."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def close_names(name: str, known: Iterable[str]) -> str:
    """' (did you mean: a, b?)' or '' — appended to an 'unknown X' message."""
    matches = difflib.get_close_matches(name.lower(), [k.lower() for k in known], n=3, cutoff=0.5)
    return f" (did you mean: {', '.join(matches)}?)" if matches else ""
