"""The setup each deployment predicts with now, outside the config: the seed until the online fit
publishes its own, one entry per deployment, and in `serve` one registry shared by the calibrator (which
publishes), the poller (which predicts with it) and the collector (which exports its terms)."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import generate_latest

from exporter.serve import daemon as daemon_module
from exporter.serve.config import Deployment, config_from_mapping
from exporter.serve.online_fit_types import Held
from exporter.serve.setups_in_use import InUse, SetupsInUse


def _deployments() -> tuple[Deployment, ...]:
    return config_from_mapping({"listen": "127.0.0.1:0", "deployments": [
        {"name": name, "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": ["http://127.0.0.1:9/metrics"]}}
        for name in ("a", "b")]}).deployments


def test_with_nothing_published_a_deployment_predicts_with_its_seed() -> None:
    deployment = _deployments()[0]
    assert SetupsInUse().predicting_setup(deployment) == (deployment.resolved.setup,
                                                          deployment.resolved.bandwidth_source)


def test_a_published_setup_replaces_the_seed_for_its_deployment_only() -> None:
    a, b = _deployments()
    setups = SetupsInUse()
    fitted = replace(a.resolved.setup, effective_bandwidth_bytes_per_second=2.0e12)
    setups.set("a", InUse(fitted, "online", fit_windows=40))
    assert setups.predicting_setup(a) == (fitted, "online")
    assert setups.predicting_setup(b) == (b.resolved.setup, b.resolved.bandwidth_source)
    setups.set("a", None)  # withdrawn: the seed again
    assert setups.get("a") is None
    assert setups.predicting_setup(a) == (a.resolved.setup, a.resolved.bandwidth_source)


def test_a_bandwidth_the_fit_held_keeps_the_seeds_source() -> None:
    a, _ = _deployments()
    setups = SetupsInUse()
    held = (Held("bandwidth_bytes_per_second", "bandwidth_at_peak"),)
    setups.set("a", InUse(a.resolved.setup, "online", 40, 0.02, held, seed_source="calibrated"))
    assert setups.predicting_setup(a) == (a.resolved.setup, "calibrated")


def test_serve_hands_the_calibrators_setups_to_the_poller_and_the_collector() -> None:
    """At start the calibrator publishes each enabled deployment's seed (fitted from 0 windows): the
    poller predicts from that same registry, and the page exports it."""
    daemon = daemon_module.build_daemon(config_from_mapping({"listen": "127.0.0.1:0", "deployments": [{
        "name": "pool", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": ["http://127.0.0.1:9/metrics"]}}]}))
    try:
        (deployment,) = daemon.config.deployments
        in_use = daemon.poller.setups_in_use.get("pool")
        assert in_use is not None and in_use.fit_windows == 0
        assert in_use.setup == deployment.resolved.setup
        assert in_use.source == deployment.resolved.bandwidth_source
        page = generate_latest(daemon.server.registry).decode()
        assert 'stepbudget_online_fit_windows{deployment="pool"} 0.0' in page
    finally:
        daemon.server.stop()
        daemon.poller.stop()
        daemon.fetcher.close()
