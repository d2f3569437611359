"""The type of the `make_poller` fixture: pollers driven by hand with injected clocks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from exporter.serve.poller import Poller

MakePoller = Callable[..., "Poller"]
