"""Pollers driven by hand with injected clocks: the type of the `make_poller` fixture, and what the
collector exports from a poller's readings (`scrape`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.serve.collector import make_registry

if TYPE_CHECKING:
    from exporter.serve.config import Config
    from exporter.serve.poller import Poller

MakePoller = Callable[..., "Poller"]


def scrape(config: Config, poller: Poller) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The collector's exposition, parsed back: sample name -> [(labels, value)]."""
    text = generate_latest(make_registry(poller.readings, config.deployments, poller.deployment_targets,
                                         poller.not_ready, poller.mixed_targets)).decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples
