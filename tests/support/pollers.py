"""The type of the `make_poller` fixture: pollers driven by hand with injected clocks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exporter.serve.poller import Poller

MakePoller = Callable[..., "Poller"]
