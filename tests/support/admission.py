"""A running daemon with admission on, on 127.0.0.1: the admission API's HTTP tests and the ASGI
gateway's tests both ask a real daemon, so both start it the same way from here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from exporter.admission.api import AdmissionApi
from exporter.serve import daemon as daemon_module
from exporter.serve.config import config_from_mapping
from exporter.simulator import ServerSpec, start_server


@dataclass
class RunningDaemon:
    url: str
    daemon: daemon_module.Daemon
    api: AdmissionApi


@contextmanager
def daemon_with_admission(tmp_path: Path, token: str, simulator_speed: float = 1.0) -> Iterator[RunningDaemon]:
    """A daemon on 127.0.0.1 with admission on, after one poll of an idle simulated vLLM server
    (also on 127.0.0.1); everything it started is stopped on exit. Admission is installed the way
    `serve` does it (`start_serving`: the hooks `extensions_for` picks from the config)."""
    token_file = tmp_path / "admission-token"
    token_file.write_text(token + "\n")
    simulated = start_server("127.0.0.1", 0, None, simulator_speed, ServerSpec())
    try:
        config = config_from_mapping({
            "listen": "127.0.0.1:0", "timeout": "5s",
            "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                             "targets": {"static": [f"{simulated.url}/metrics"]}}],
            "admission": {"enabled": True, "token_file": str(token_file)},
        })
        daemon = daemon_module.build_daemon(config)
        try:
            installed = daemon_module.start_serving(daemon)
            (api,) = [extension for extension in installed if isinstance(extension, AdmissionApi)]
            daemon.poller.poll_once()
            yield RunningDaemon(f"http://127.0.0.1:{daemon.server.port}", daemon, api)
        finally:
            daemon.server.stop()
            daemon.poller.stop()
            daemon.fetcher.close()
    finally:
        simulated.stop()
