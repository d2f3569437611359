"""The release artifacts as a user gets them: the sdist and wheel `python -m build` makes, checked by
twine, and the wheel installed into a clean venv (no system site packages, no repository on the path)
and run: `--version`, `plan`, the simulator and a one-shot `serve` against it on 127.0.0.1.

Why: the rest of the suite runs the package from the source tree, where a file left out of the wheel
(package data read at run time, a module missed by `packages.find`) or a dependency missing from
pyproject still works. Only an installed wheel shows it. Select with `-m artifacts`; about a minute.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from tests.support.monitoring import REPO
from tests.support.processes import stop_process
from tests.support.servers import free_port, wait_until

pytestmark = pytest.mark.artifacts

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION: str = PYPROJECT["project"]["version"]
# qwen3-8b: 36 layers x 8 KV heads x 128 head dims x K and V x 2 bytes (16-bit cache).
QWEN3_8B_KV_BYTES_PER_TOKEN = 36 * 8 * 128 * 2 * 2
INSTALL_SECONDS = 600  # a cold pip cache downloads every dependency
START_SECONDS = 30


@dataclass(frozen=True)
class Built:
    wheel: Path
    sdist: Path


@dataclass(frozen=True)
class Installed:
    """A clean venv with only the wheel and its dependencies in it."""
    venv: Path
    work: Path  # the cwd for commands: outside the repository, so nothing imports from the source tree

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.venv / "bin" / "stepbudget"), *args], cwd=self.work, capture_output=True,
                              text=True, timeout=timeout, env=_clean_env(), check=False)


def _clean_env() -> dict[str, str]:
    """The environment without anything that would put the source tree or the dev venv on the path."""
    return {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}}


def source_files(under: str = ".") -> list[str]:
    """The files a checkout of this tree holds: tracked ones and new ones git does not ignore."""
    result = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", under],
                            cwd=REPO, capture_output=True, text=True, check=True)
    return [path for path in result.stdout.split("\0") if path and (REPO / path).is_file()]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """`python -m build`: the sdist, then the wheel built from the unpacked sdist (so the sdist must be whole).

    Built from a copy of the checkout's files, as from a fresh clone: a stale *.egg-info or build/ left in
    the working tree would otherwise feed its old file list into the sdist and hide a file left out.
    """
    checkout = tmp_path_factory.mktemp("checkout")
    for path in source_files():
        (checkout / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / path, checkout / path)
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(checkout)],
                            capture_output=True, text=True, timeout=INSTALL_SECONDS, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (wheel,) = out.glob("stepbudget-*.whl")
    (sdist,) = out.glob("stepbudget-*.tar.gz")
    return Built(wheel, sdist)


@pytest.fixture(scope="module")
def installed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("clean-venv")
    venv, work = root / "venv", root / "work"
    work.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=_clean_env())
    # The dependencies come from the package index as for any user (pip's cache makes a rerun quick).
    result = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(built.wheel)],
                            cwd=work, capture_output=True, text=True, timeout=INSTALL_SECONDS, env=_clean_env(),
                            check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return Installed(venv, work)


def test_twine_accepts_the_sdist_and_the_wheel(built: Built) -> None:
    result = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(built.wheel), str(built.sdist)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_artifacts_are_named_for_pyprojects_version(built: Built) -> None:
    assert built.wheel.name == f"stepbudget-{VERSION}-py3-none-any.whl"
    assert built.sdist.name == f"stepbudget-{VERSION}.tar.gz"


def test_wheel_carries_every_file_of_the_package(built: Built) -> None:
    """Every file under exporter/ (modules and the data read at run time: the alert rules, py.typed)."""
    names = set(zipfile.ZipFile(built.wheel).namelist())
    missing = [path for path in source_files("exporter") if path not in names]
    assert not missing, f"left out of the wheel: {missing}"
    assert "exporter/serve/rules/stepbudget.alerts.yaml" in names
    # Nothing but the package and its metadata.
    assert {name.split("/")[0] for name in names} == {"exporter", f"stepbudget-{VERSION}.dist-info"}


def test_sdist_carries_the_sources_the_wheel_is_built_from(built: Built) -> None:
    prefix = f"stepbudget-{VERSION}/"
    with tarfile.open(built.sdist) as archive:
        names = {name.removeprefix(prefix) for name in archive.getnames()}
    for needed in ("pyproject.toml", "README.md", "LICENSE", *source_files("exporter")):
        assert needed in names, f"{needed} is not in the sdist"


def test_installed_version_is_pyprojects(installed: Installed) -> None:
    result = installed.run("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"stepbudget {VERSION}"


def test_installed_package_is_imported_from_the_venv(installed: Installed) -> None:
    """Not from the source tree: the checks below test the wheel's files."""
    result = subprocess.run([str(installed.venv / "bin" / "python"), "-c", "import exporter; print(exporter.__file__)"],
                            cwd=installed.work, capture_output=True, text=True, timeout=60, env=_clean_env(),
                            check=False)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).is_relative_to(installed.venv), result.stdout


def test_installed_plan_sizes_a_preset_model_on_a_preset_gpu(installed: Installed) -> None:
    result = installed.run("plan", "--model", "qwen3-8b", "--gpu", "h100-sxm", "--json")
    assert result.returncode == 0, result.stderr
    plan = yaml.safe_load(result.stdout)
    assert plan["model"] == "qwen3-8b" and plan["gpu"] == "h100-sxm"
    assert plan["kv_bytes_per_token"] == QWEN3_8B_KV_BYTES_PER_TOKEN
    assert plan["weights_fit"] is True and plan["kv_capacity_tokens"] > 0


@pytest.fixture
def simulator(installed: Installed) -> Iterator[str]:
    """The installed wheel's simulated vLLM on 127.0.0.1; its /metrics URL."""
    port = free_port()
    process = subprocess.Popen(
        [str(installed.venv / "bin" / "stepbudget"), "simulate", "--host", "127.0.0.1", "--port", str(port),
         "--speed", "30", "--seed", "1", "--model", "qwen3-8b", "--gpu", "h100-sxm"],
        cwd=installed.work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_clean_env())
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        def up() -> bool:
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else "exited"
            return requests.get(url, timeout=2).ok

        wait_until(up, timeout_seconds=START_SECONDS)
        yield url
    finally:
        stop_process(process)
        if process.stderr:
            process.stderr.close()


def test_installed_simulator_serves_a_vllm_page(simulator: str) -> None:
    page = requests.get(simulator, timeout=5).text
    assert "vllm:kv_cache_usage_perc" in page  # vLLM 0.32's page, the simulator's default


def test_installed_serve_once_reads_the_simulator(installed: Installed, simulator: str) -> None:
    """`serve --once`: one poll of every target, its reading printed, exit 0 (how a release is smoke-tested)."""
    config = installed.work / "stepbudget.yaml"
    config.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{free_port()}", "log_format": "json",
        "deployments": [{"name": "sim", "model": "qwen3-8b", "gpu": "h100-sxm", "kind": "vllm",
                         "targets": {"static": [simulator]}}],
    }))
    result = installed.run("serve", "--once", "--once-interval-seconds", "0.5", "--config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    instance = simulator.removeprefix("http://").removesuffix("/metrics")
    assert f"sim/{instance}: up, vllm page" in result.stdout, result.stdout
    assert "tokens in flight of" in result.stdout, result.stdout


def test_ci_runs_the_release_check_that_make_test_skips() -> None:
    """tests/deploy/test_release_check.py is skipped unless `make release-check` sets STEPBUDGET_RELEASE_CHECK:
    the skip hides nothing only while CI runs that target after `make test`, and the target sets the variable."""
    steps = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip().startswith("make ")]
    assert steps.index("make test") < steps.index("make release-check")
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile[makefile.index("\nrelease-check:"):].split("\n\n", 1)[0]
    assert "STEPBUDGET_RELEASE_CHECK=1" in recipe and "tests/deploy/test_release_check.py" in recipe
