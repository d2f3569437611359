"""What `serve` polls with, built from a config: discovery (cut to a shard), query sources, the poller.

Why a module of its own: the daemon (`stepbudget serve`) and the one-shot check (`serve --once`)
must find and read targets the same way, with the same timeouts, or the check would vouch for a
pipeline the daemon does not run; neither builds the other's parts (the HTTP server, the alert loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from exporter.serve.config import Config
from exporter.serve.discovery import Discovery
from exporter.serve.fetch import HttpFetcher
from exporter.serve.poller import Poller
from exporter.serve.prometheus_source import PrometheusSource
from exporter.serve.setups_in_use import SetupsInUse
from exporter.serve.sharding import Shard, ShardedDiscovery, keep_targets, shard_from_config


@dataclass
class Polling:
    poller: Poller
    fetcher: HttpFetcher
    sources: tuple[PrometheusSource, ...]
    shard: Shard | None

    def close(self) -> None:
        """Stop the poller's workers and close every connection pool (fetcher, query sources)."""
        self.poller.stop()
        self.fetcher.close()
        for source in self.sources:
            source.close()


def build_polling(config: Config, setups_in_use: SetupsInUse | None = None) -> Polling:
    """Discovery (sharded where the config says), the query sources and the poller, each fetch bounded
    by `timeout` and `max_response_bytes` and each query by its own deadline, as the config says.
    `setups_in_use`: what the poller predicts with (the online fit's; None: the seeds)."""
    fetcher = HttpFetcher(config.timeout_seconds, config.max_response_bytes)
    discovery: Any = Discovery(config.deployments, timeout_seconds=config.timeout_seconds)
    shard = shard_from_config(config)
    if shard is not None:
        discovery = ShardedDiscovery(discovery, shard)
    sources = prometheus_sources(config, shard)
    return Polling(Poller(config, discovery, fetcher, sources=sources, setups_in_use=setups_in_use), fetcher, sources,
                   shard)


def prometheus_sources(config: Config, shard: Shard | None) -> tuple[PrometheusSource, ...]:
    """One query source per `targets.prometheus` deployment; a shard (the one that cuts discovery
    down too) keeps its share of each."""
    keep = None if shard is None else (lambda targets: keep_targets(targets, shard))
    return tuple(PrometheusSource(deployment, timeout_seconds=config.timeout_seconds,
                                  stale_after_seconds=config.stale_after_seconds, keep=keep)
                 for deployment in config.deployments if deployment.prometheus is not None)
