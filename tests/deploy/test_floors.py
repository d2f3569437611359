"""scripts/floors.py: pyproject's runtime floors as the pip constraints `make test-floors` installs."""

from __future__ import annotations

import tomllib

import pytest

from scripts import floors
from tests.support.tools import REPO


@pytest.mark.parametrize(("requirement", "expected"), [
    ("lightkube>=1.0", floors.Floor("lightkube", "1.0")),
    ("urllib3>=2.8,<3", floors.Floor("urllib3", "2.8")),
    ("uvicorn<0.56, >=0.55", floors.Floor("uvicorn", "0.55")),
    ("PyYAML[extra] >= 6.0", floors.Floor("pyyaml", "6.0")),
    ("Prometheus_Client>=0.23", floors.Floor("prometheus-client", "0.23")),
])
def test_a_floor_is_the_requirement_at_its_lowest_release(requirement: str, expected: floors.Floor) -> None:
    assert floors.floor_of(requirement) == expected
    assert expected.constraint == f"{expected.name}=={expected.version}"


@pytest.mark.parametrize("requirement", ["requests", "requests<3", "requests==2.31", "a>=1,>=2"])
def test_a_requirement_without_one_floor_is_refused(requirement: str) -> None:
    with pytest.raises(floors.FloorError, match="exactly one `>=` floor"):
        floors.floor_of(requirement)


def test_every_runtime_dependency_has_a_floor() -> None:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    names = [floor.name for floor in floors.floors(REPO / "pyproject.toml")]
    assert len(names) == len(dependencies) == len(set(names))


@pytest.mark.parametrize(("installed", "floor", "same"), [
    ("2.8.0", "2.8", True), ("2.8", "2.8.0", True), ("2.8.1", "2.8", False), ("0.23.0", "0.23", True),
    ("1.0.1", "1.0", False), ("6.0.post1", "6.0", False),
])
def test_an_installed_release_is_at_its_floor_as_pip_compares_them(installed: str, floor: str, same: bool) -> None:
    assert floors.same_release(installed, floor) is same
