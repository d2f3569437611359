"""One version for everything a release ships: the package (pyproject.toml), the version the code
reports (`stepbudget --version`, exporter.__version__), the chart's appVersion, and the image the
chart runs by default (values.yaml leaves image.tag empty, so the templates use appVersion)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import yaml

from tests.support.chart import CHART
from tests.support.tools import REPO

PACKAGE_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


def _chart() -> dict:
    return yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))


def test_the_chart_ships_the_package_version_as_its_app_version() -> None:
    assert _chart()["appVersion"] == PACKAGE_VERSION


def test_the_default_image_tag_is_the_app_version() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    assert values["image"]["tag"] == "", "an explicit default tag would pin the image apart from appVersion"
    helpers = (CHART / "templates" / "_helpers.tpl").read_text(encoding="utf-8")
    assert "(default .Chart.AppVersion .Values.image.tag)" in helpers


def test_stepbudget_version_prints_the_package_version() -> None:
    # The checkout's code (cwd first on sys.path with -m), not whatever copy the venv installed.
    result = subprocess.run([sys.executable, "-m", "exporter.cli", "--version"], cwd=REPO,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"stepbudget {PACKAGE_VERSION}\n"


def test_versions_are_release_numbers() -> None:
    for name, version in (("pyproject.toml", PACKAGE_VERSION), ("Chart.yaml version", str(_chart()["version"]))):
        parts = version.split(".")
        assert len(parts) == 3 and all(part.isdigit() for part in parts), f"{name}: {version!r} is not x.y.z"
