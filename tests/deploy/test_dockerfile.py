"""The Dockerfile's essentials checked as text, and the one step that matters most — building the wheel
from exactly what it copies — run, in every `make test`. The image itself is built and run by buildah and
podman under `make release-check` (tests/deploy/test_release_check.py), too slow for every run."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

from tests.support.monitoring import REPO

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
CHART_VALUES = REPO / "helm" / "stepbudget" / "values.yaml"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            pairs.append((keyword.upper(), rest.strip()))
    return pairs


def global_args() -> dict[str, str]:
    """The ARGs before the first FROM (usable in FROM lines), with their defaults."""
    args: dict[str, str] = {}
    for keyword, rest in instructions():
        if keyword == "FROM":
            break
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
    return args


def stages() -> list[list[tuple[str, str]]]:
    """The instructions of each build stage, in order."""
    result: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions():
        if keyword == "FROM":
            result.append([])
        if result:
            result[-1].append((keyword, rest))
    return result


def final_stage() -> list[tuple[str, str]]:
    return stages()[-1]


def _all(stage: list[tuple[str, str]], keyword: str) -> list[str]:
    return [rest for kw, rest in stage if kw == keyword]


def test_every_stage_uses_a_slim_python_base() -> None:
    """By default: a build arg may name another base (make release-check's Debian base made here)."""
    for stage in stages():
        image = re.sub(r"\$\{(\w+)\}", lambda m: global_args()[m.group(1)], stage[0][1].split()[0])
        assert re.fullmatch(r"python:3\.1[1-9](\.\d+)?-slim(-\w+)?", image), image


def test_final_stage_runs_as_the_charts_non_root_user() -> None:
    (user,) = _all(final_stage(), "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0, "USER must be a numeric non-root uid (runAsNonRoot checks it)"
    values = yaml.safe_load(CHART_VALUES.read_text())
    assert int(uid) == values["securityContext"]["runAsUser"] == values["podSecurityContext"]["runAsUser"]
    assert int(gid) == values["securityContext"]["runAsGroup"]
    # USER comes after every RUN, so nothing runs as root after the switch.
    keywords = [kw for kw, _ in final_stage()]
    assert keywords.index("USER") > max(i for i, kw in enumerate(keywords) if kw == "RUN")


def test_package_is_installed_from_the_wheel_built_in_the_first_stage() -> None:
    first, last = stages()[0], final_stage()
    assert any("pip wheel" in run and "--no-deps" in run for run in _all(first, "RUN"))
    copies = _all(last, "COPY")
    assert any(c.startswith("--from=") for c in copies), "the final stage must take the wheel from the build stage"
    assert any(re.search(r"pip install \S*\*\.whl", run) for run in _all(last, "RUN"))
    assert not any(c.split()[0] in {".", "exporter", "./exporter"} for c in copies), "no sources in the final image"


def test_entrypoint_and_port_match_the_chart() -> None:
    values = yaml.safe_load(CHART_VALUES.read_text())
    (entrypoint,) = _all(final_stage(), "ENTRYPOINT")
    (command,) = _all(final_stage(), "CMD")
    assert json.loads(entrypoint) == ["stepbudget"]
    assert json.loads(command) == ["serve", "--config", "/etc/stepbudget/config.yaml"]
    (exposed,) = _all(final_stage(), "EXPOSE")
    assert int(exposed) == values["port"]


def _ignored(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path.split("/")[0], p) for p in patterns)


def test_build_context_sources_exist_and_are_not_ignored() -> None:
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for needless in (".git", ".venv", ".tools", "tests"):
        assert needless in patterns, f".dockerignore should exclude {needless}"
    for copy in _all(stages()[0], "COPY"):
        *sources, _destination = copy.split()
        for source in sources:
            assert (REPO / source).exists(), source
            assert not _ignored(source, patterns), f"{source} is copied but .dockerignore drops it"


def test_wheel_builds_from_exactly_what_the_dockerfile_copies(tmp_path: Path) -> None:
    """Builds the wheel offline, as the first stage does, from the copied files only."""
    context = tmp_path / "src"
    context.mkdir()
    for copy in _all(stages()[0], "COPY"):
        *sources, _destination = copy.split()
        for source in sources:
            origin = REPO / source
            if origin.is_dir():
                shutil.copytree(origin, context / source, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(origin, context / source)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-v", "-w", str(tmp_path / "wheels"), str(context)],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The license in SPDX form (PEP 639): no "`project.license` as a TOML table is deprecated".
    assert "deprecated" not in (result.stdout + result.stderr).lower(), result.stdout + result.stderr
    (wheel,) = (tmp_path / "wheels").glob("stepbudget-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "exporter/cli.py" in names and "exporter/__init__.py" in names
    # The rules file the in-process alert loop reads (exporter/serve/alerting.py) is package data.
    assert "exporter/serve/rules/stepbudget.alerts.yaml" in names
    assert not [n for n in names if n.split("/")[0] in {"tests", "helm", "rules", "dashboards", "benchmarks"}]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "stepbudget = exporter.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
