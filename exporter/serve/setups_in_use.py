"""The setup each deployment predicts with now: the seed until the online fit replaces it.

Why a module of its own: this is the one piece of live state the online calibration swaps while the
poller (which predicts each reading with it) and the collector (which exports its terms and their
sources) read it. Kept out of the config, the config stays data read once at load; kept out of the
fit's threads, the poller and the collector need not load the fit to predict with its result.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from exporter.capacity import model

if TYPE_CHECKING:
    from exporter.serve.config import Deployment
    from exporter.serve.online_fit_types import Held


@dataclass(frozen=True)
class InUse:
    """What a deployment predicts with now: the setup, where its rates came from, and the online fit.
    A term in `held` is the seed's (source `seed_source`), the windows did not identify it."""

    setup: model.ServingSetup
    source: str
    fit_windows: int = 0
    fit_residual_ratio: float | None = None
    held: tuple[Held, ...] = ()
    seed_source: str = ""

    def source_of(self, parameter: str) -> str:
        """Where one term (a Parameters field) came from: the seed's source where the fit held it."""
        if self.seed_source and any(held.parameter == parameter for held in self.held):
            return self.seed_source
        return self.source


class SetupsInUse:
    """Each deployment's InUse by deployment name (none: the seed). The online calibration publishes
    into it; the poller and the collector read it. An entry is swapped whole, so a reader sees an old
    or a new InUse, never a mix."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[str, InUse] = {}

    def get(self, deployment: str) -> InUse | None:
        return self._current.get(deployment)

    def set(self, deployment: str, in_use: InUse | None) -> None:
        with self._lock:
            if in_use is None:
                self._current.pop(deployment, None)
            else:
                self._current[deployment] = in_use

    def predicting_setup(self, deployment: Deployment) -> tuple[model.ServingSetup, str]:
        """The setup to predict with and the source of its bandwidth (`online` once the fit replaced the
        seed's, the seed's own where the fit holds it: InUse.source_of)."""
        return predicting_setup(deployment, self.get(deployment.name))


def predicting_setup(deployment: Deployment, in_use: InUse | None) -> tuple[model.ServingSetup, str]:
    """`in_use`'s setup and bandwidth source, or the deployment's seed where nothing replaced it."""
    if in_use is None:
        return deployment.resolved.setup, deployment.resolved.bandwidth_source
    return in_use.setup, in_use.source_of("bandwidth_bytes_per_second")
