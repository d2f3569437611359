"""This host by its numbers (exporter/real_vllm/host.py): the docs' one-liners, run as they are printed.

The measurement itself runs in every real-engine module (tests/support/real_vllm.py `serving` asks for
it before the first server starts). Here: it is the docs' own commands, what it returns reads as a
device, and a Python that fails, prints nonsense or is missing gives one clear error.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from exporter.capacity.deployment import fit_bounds
from exporter.real_vllm.host import (
    BANDWIDTH_COMMAND,
    FLOPS_COMMAND,
    HOST_MEMORY,
    HOST_NAME,
    HostMeasureError,
    measure_host_device,
)
from exporter.serve.config import config_from_mapping
from exporter.units import parse_bandwidth_bytes_per_second, parse_flops_per_second
from tests.support.real_vllm import MODEL_CONFIG, host_device
from tests.support.tools import REPO

OPERATIONS = REPO / "docs" / "operations.md"


def test_the_commands_are_the_ones_the_docs_tell_a_user_to_run() -> None:
    text = OPERATIONS.read_text()
    assert f'python3 -c "{BANDWIDTH_COMMAND}"' in text
    assert f'python3 -c "{FLOPS_COMMAND}"' in text


@pytest.mark.real_engine  # the vLLM venv's numpy measures it
def test_the_measured_host_is_a_device_the_config_takes() -> None:
    host = host_device()  # as make demo-vllm measures it
    bandwidth = parse_bandwidth_bytes_per_second(host["peak_bandwidth"])
    flops = parse_flops_per_second(host["peak_flops"])
    # A 2-core VM copies at tens of GB/s and multiplies at tens to hundreds of GFLOP/s: not bytes or
    # TB/s by a unit slip.
    assert 1e9 < bandwidth < 1e12 and 1e9 < flops < 1e13, host
    deployment = config_from_mapping({"deployments": [{
        "name": "tiny", "model": str(MODEL_CONFIG), "gpu": host, "weight_dtype": "float32",
        "targets": {"static": ["http://127.0.0.1:1/metrics"]}}]}).deployments[0]
    # The online fit and calibrate fit up to these peaks.
    bounds = fit_bounds(deployment.resolved)
    assert bounds.max_bandwidth_bytes_per_second == bandwidth
    assert bounds.max_compute_flops_per_second == flops


def _python(tmp_path: Path, body: str) -> Path:
    """An executable standing in for a Python: a real process that does what `body` (sh) does."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_each_figure_is_what_its_command_printed(tmp_path: Path) -> None:
    """The docs' two commands run with `-c`, each once, and each printed figure lands under its own key."""
    calls = tmp_path / "calls"
    python = _python(tmp_path, f"""printf '%s\\n%s\\n' "$1" "$2" >> {calls}
case "$2" in *copyto*) echo 31GB/s;; *a@a*) echo 7.5e10;; *) exit 9;; esac""")
    assert measure_host_device(python) == {"name": HOST_NAME, "memory": HOST_MEMORY,
                                           "peak_bandwidth": "31GB/s", "peak_flops": "7.5e10"}
    assert calls.read_text().splitlines() == ["-c", BANDWIDTH_COMMAND, "-c", FLOPS_COMMAND]


def test_a_python_without_numpy_is_named_with_its_last_error_line(tmp_path: Path) -> None:
    python = _python(tmp_path, "echo 'Traceback (most recent call last):' >&2\n"
                               "echo \"ModuleNotFoundError: No module named 'numpy'\" >&2\nexit 1")
    with pytest.raises(HostMeasureError, match=r"peak bandwidth: .*python exited 1: ModuleNotFoundError: No module "
                                               r"named 'numpy'"):
        measure_host_device(python)


def test_a_figure_the_config_cannot_read_is_refused(tmp_path: Path) -> None:
    with pytest.raises(HostMeasureError, match=r"measured peak bandwidth: cannot read 'fast'"):
        measure_host_device(_python(tmp_path, "echo fast"))


def test_a_missing_python_is_named(tmp_path: Path) -> None:
    with pytest.raises(HostMeasureError, match=r"cannot run .*nowhere/python"):
        measure_host_device(tmp_path / "nowhere" / "python")
