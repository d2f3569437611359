"""The chart and the image as a release ships them, each through the real tool a user runs: the chart
pushed to a real OCI registry (Debian's docker-registry, the distribution registry, on 127.0.0.1) with
`helm push`, pulled back and rendered; the image built from a Debian base made here and run.

Why: `helm template` on the source folder (tests/deploy/test_helm_chart.py) does not show that the packaged
chart is whole, that an OCI registry takes it, or that what comes back renders the release's image.
Slow and needing apt packages, so only `make release-check` runs it (it sets STEPBUDGET_RELEASE_CHECK).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tarfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from tests.support.processes import stop_process
from tests.support.servers import free_port, wait_until
from tests.support.tools import REPO, require_tool

pytestmark = [
    pytest.mark.release_check,
    pytest.mark.skipif(not os.environ.get("STEPBUDGET_RELEASE_CHECK"),
                       reason="runs under `make release-check`, CI's step after `make test` (.ci/run; "
                              "tests/deploy/test_artifacts.py checks CI calls it): it installs a registry, buildah and "
                              "podman and builds an image"),
]

CHART_DIR = REPO / "helm" / "stepbudget"
CHART_META = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
VERSION: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
# What `helm push` writes as the OCI manifest's config type: the artifact is a chart, not an image.
HELM_CONFIG_MEDIA_TYPE = "application/vnd.cncf.helm.config.v1+json"
START_SECONDS = 30


@dataclass(frozen=True)
class Registry:
    address: str  # 127.0.0.1:PORT

    def get(self, path: str, **headers: str) -> requests.Response:
        return requests.get(f"http://{self.address}{path}", headers=headers, timeout=10)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """The distribution registry on a free 127.0.0.1 port, with its storage in a temporary folder."""
    binary = require_tool("docker-registry")
    work = tmp_path_factory.mktemp("registry")
    address = f"127.0.0.1:{free_port()}"
    config = work / "config.yml"
    config.write_text(yaml.safe_dump({
        "version": 0.1, "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(work / "data")}},
        "http": {"addr": address},
    }))
    log = (work / "registry.log").open("wb")
    process = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT, cwd=work)
    try:
        def up() -> bool:
            assert process.poll() is None, (work / "registry.log").read_text()
            return Registry(address).get("/v2/").status_code == 200

        wait_until(up, timeout_seconds=START_SECONDS)
        yield Registry(address)
    finally:
        stop_process(process)
        log.close()


@pytest.fixture(scope="module")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Helm's config, cache and data in a temporary folder: no registry login or cache of the user's is read."""
    home = tmp_path_factory.mktemp("helm-home")
    return {**os.environ, "HELM_CONFIG_HOME": str(home / "config"), "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_DATA_HOME": str(home / "data")}


def run_helm(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([require_tool("helm"), *args], capture_output=True, text=True, env=env, timeout=120,
                            check=False)
    assert result.returncode == 0, f"helm {' '.join(args)}: {result.stdout}{result.stderr}"
    return result


def pushed_digest(result: subprocess.CompletedProcess[str]) -> str:
    """The digest `helm push` and `helm pull` print (helm 4 on stdout, helm 3 on stderr)."""
    (line,) = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("Digest: ")]
    return line.removeprefix("Digest: ").strip()


def test_chart_and_app_version_follow_the_package() -> None:
    """The chart renders the image of the release it ships with."""
    assert CHART_META["appVersion"] == VERSION


def test_chart_round_trips_through_an_oci_registry(registry: Registry, helm_env: dict[str, str],
                                                     tmp_path: Path) -> None:
    name, chart_version = CHART_META["name"], CHART_META["version"]
    packaged = tmp_path / "packaged"
    run_helm(helm_env, "package", str(CHART_DIR), "--destination", str(packaged))
    (archive,) = packaged.glob("*.tgz")
    assert archive.name == f"{name}-{chart_version}.tgz"

    pushed = run_helm(helm_env, "push", str(archive), f"oci://{registry.address}/charts", "--plain-http")
    assert f"Pushed: {registry.address}/charts/{name}:{chart_version}" in pushed.stdout + pushed.stderr

    # The registry holds it as a Helm chart under its version.
    assert registry.get(f"/v2/charts/{name}/tags/list").json()["tags"] == [chart_version]
    manifest = registry.get(f"/v2/charts/{name}/manifests/{chart_version}",
                            Accept="application/vnd.oci.image.manifest.v1+json").json()
    assert manifest["config"]["mediaType"] == HELM_CONFIG_MEDIA_TYPE

    pulled_dir = tmp_path / "pulled"
    pulled_dir.mkdir()  # helm pull writes into an existing folder only
    pulled = run_helm(helm_env, "pull", f"oci://{registry.address}/charts/{name}", "--version", chart_version,
                      "--plain-http", "--destination", str(pulled_dir))
    assert pushed_digest(pulled) == pushed_digest(pushed)
    (pulled_archive,) = pulled_dir.glob("*.tgz")
    assert pulled_archive.read_bytes() == archive.read_bytes()
    with tarfile.open(pulled_archive) as chart:
        members = set(chart.getnames())
    # The files the templates read with .Files: the alert and recording rules and the dashboards.
    for needed in ("values.schema.json", "files/rules/stepbudget.alerts.yaml", "files/rules/stepbudget.rules.yaml"):
        assert f"{name}/{needed}" in members, needed
    assert any(member.startswith(f"{name}/files/dashboards/") for member in members)

    rendered = run_helm(helm_env, "template", "sb", str(pulled_archive), "--namespace", "monitoring").stdout
    documents = [doc for doc in yaml.safe_load_all(rendered) if doc]
    (deployment,) = [doc for doc in documents if doc["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"stepbudget/stepbudget:{VERSION}"
    # The daemon's config, rendered from the pulled chart's values, is one the daemon's own loader takes.
    (config_map,) = [doc for doc in documents if doc["kind"] == "ConfigMap"]
    config = tmp_path / "config.yaml"
    config.write_text(config_map["data"]["config.yaml"])
    checked = subprocess.run([sys.executable, "-m", "exporter.cli", "check-config", str(config)],
                             capture_output=True, text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr


# ---- The image: built from the Dockerfile on a Debian base made here (scripts/build-image.sh), run by podman.

IMAGE = f"localhost/stepbudget/stepbudget:{VERSION}"
UID_GID = "65532:65532"  # the chart's runAsUser/runAsGroup
BUILD_SECONDS = 900  # mmdebstrap of the base, then pip installs of the dependencies


def podman_sandbox_flags() -> list[str]:
    """What `podman run` needs in this project's VMs, each harmless elsewhere.

    podman asks the runtime for a higher open-files limit (and, for root, process limit) than the VM
    lets a process raise to (crun/runc: `setrlimit RLIMIT_NOFILE: Operation not permitted`), so the
    limits are set at or below the current ones; and crun refuses the VM's hybrid cgroup v1/v2 layout
    (`cgroups in hybrid mode not supported`) where runc takes it. On a normal machine a plain
    `podman run --network host` works.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return ["--runtime", "runc", "--ulimit", f"nofile={soft}:{hard}", "--ulimit", "nproc=4096:4096"]


@pytest.fixture(scope="module")
def containers_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """buildah and podman with a containers store of their own (removed after), not the machine's."""
    store = tmp_path_factory.mktemp("containers")
    conf = store / "storage.conf"
    conf.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{store / "root"}"\nrunroot = "{store / "run"}"\n')
    env = {**os.environ, "CONTAINERS_STORAGE_CONF": str(conf)}
    try:
        yield env
    finally:
        # Unmounts the store's overlay mounts as it removes it (a plain rm would leave them mounted).
        subprocess.run([require_tool("podman"), "system", "reset", "--force"], env=env, capture_output=True,
                       timeout=300, check=False)


@pytest.fixture(scope="module")
def image(containers_env: dict[str, str]) -> str:
    result = subprocess.run(["sh", str(REPO / "scripts" / "build-image.sh"), IMAGE], cwd=REPO, env=containers_env,
                            capture_output=True, text=True, timeout=BUILD_SECONDS, check=False)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    return IMAGE


def podman(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_tool("podman"), *args], env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def run_image(image: str, *args: str, options: tuple[str, ...] = ()) -> list[str]:
    """The `podman run` command line: host network (the simulator is on 127.0.0.1), read-only root as in the chart."""
    return [require_tool("podman"), "run", "--rm", "--network", "host", "--read-only", *podman_sandbox_flags(),
            *options, image, *args]


def run_to_end(env: dict[str, str], command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)


def config_volume(config: Path) -> tuple[str, str]:
    return ("--volume", f"{config}:/etc/stepbudget/config.yaml:ro")


def test_image_is_the_charts_non_root_stepbudget(containers_env: dict[str, str], image: str) -> None:
    inspected = podman(containers_env, "image", "inspect", image)
    assert inspected.returncode == 0, inspected.stderr
    (config,) = [entry["Config"] for entry in json.loads(inspected.stdout)]
    assert config["User"] == UID_GID
    assert config["Entrypoint"] == ["stepbudget"]
    assert config["Cmd"] == ["serve", "--config", "/etc/stepbudget/config.yaml"]
    result = run_to_end(containers_env, run_image(image, "--version"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"stepbudget {VERSION}"
    whoami = run_to_end(containers_env, run_image(image, "-u", options=("--entrypoint", "id")))
    assert whoami.stdout.strip() == UID_GID.split(":")[0], whoami.stderr


@pytest.fixture
def simulator() -> Iterator[str]:
    """The simulated vLLM on 127.0.0.1 (from the source tree); its /metrics URL."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "exporter.cli", "simulate", "--host", "127.0.0.1", "--port",
                                str(port), "--speed", "30", "--seed", "1"], cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        wait_until(lambda: process.poll() is None and requests.get(url, timeout=2).ok, timeout_seconds=START_SECONDS)
        yield url
    finally:
        stop_process(process)


def daemon_config(path: Path, simulator: str, listen: str) -> Path:
    path.write_text(yaml.safe_dump({
        "listen": listen, "poll_interval": "1s", "log_format": "json",
        "deployments": [{"name": "sim", "model": "qwen3-8b", "gpu": "h100-sxm", "kind": "vllm",
                         "targets": {"static": [simulator]}}],
    }))
    path.chmod(0o644)  # read by the image's non-root user
    return path


def test_image_serves_the_simulator_as_the_chart_runs_it(containers_env: dict[str, str], image: str,
                                                           simulator: str, tmp_path: Path) -> None:
    """The image's own command (`serve --config /etc/stepbudget/config.yaml`) reads the target and exports it."""
    listen = f"127.0.0.1:{free_port()}"
    config = daemon_config(tmp_path / "config.yaml", simulator, listen)
    name = f"stepbudget-release-check-{os.getpid()}"
    command = run_image(image, options=("--name", name, *config_volume(config)))
    log = (tmp_path / "serve.log").open("wb")
    process = subprocess.Popen(command, env=containers_env, stdout=log, stderr=subprocess.STDOUT)
    target = simulator.removeprefix("http://").removesuffix("/metrics")
    up_line = f'stepbudget_target_up{{deployment="sim",engine="0",model_name="qwen3-8b",target="{target}"}} 1.0'
    try:
        def reading() -> bool:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            return up_line in requests.get(f"http://{listen}/metrics", timeout=2).text

        wait_until(reading, timeout_seconds=BUILD_SECONDS / 5)
        page = requests.get(f"http://{listen}/metrics", timeout=2).text
        assert f'stepbudget_tokens_in_flight{{deployment="sim",engine="0",model_name="qwen3-8b",target="{target}"}}' \
            in page
    finally:
        podman(containers_env, "stop", "--time", "10", name)
        stop_process(process)
        log.close()
    # SIGTERM from `podman stop` reached the daemon (PID 1 in the container) and it shut down cleanly.
    assert '"event": "stopped"' in (tmp_path / "serve.log").read_text()


def test_image_serve_once_reads_the_simulator(containers_env: dict[str, str], image: str, simulator: str,
                                              tmp_path: Path) -> None:
    config = daemon_config(tmp_path / "config.yaml", simulator, f"127.0.0.1:{free_port()}")
    result = run_to_end(containers_env, run_image(image, "serve", "--once", "--once-interval-seconds", "0.5",
                                                  "--config", "/etc/stepbudget/config.yaml",
                                                  options=config_volume(config)))
    assert result.returncode == 0, result.stdout + result.stderr
    instance = simulator.removeprefix("http://").removesuffix("/metrics")
    assert f"sim/{instance}: up, vllm page" in result.stdout, result.stdout
    assert "tokens in flight of" in result.stdout, result.stdout
