"""`make release VERSION=x.y.z` (scripts/release.py), run on a temporary copy of the files it writes:
one version everywhere, the chart recorded at it, the changelog's Unreleased entries filed under it;
and every refusal leaves every file as it was."""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

import pytest
import yaml

from scripts import chart_digest, release
from tests.support.tools import REPO

DATE = "2031-02-03"
ENTRY = "### Fixed\n\n- A thing that was broken.\n"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The files a release reads and writes, copied; the changelog's Unreleased holding one entry, whatever
    the repository's own holds now."""
    for name in ("pyproject.toml", "CHANGELOG.md", "exporter/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    shutil.copytree(REPO / chart_digest.CHART, tmp_path / chart_digest.CHART)
    changelog = tmp_path / "CHANGELOG.md"
    text = changelog.read_text(encoding="utf-8")
    head, rest = text.split("## [Unreleased]\n", 1)
    released = rest[rest.index("\n## ["):]  # from the newest release's heading on
    changelog.write_text(f"{head}## [Unreleased]\n\n{ENTRY}{released}", encoding="utf-8")
    return tmp_path


def _version(root: Path) -> str:
    return str(tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"])


def _next_minor(version: str) -> str:
    major, minor, _ = version.split(".")
    return f"{major}.{int(minor) + 1}.0"


def _snapshot(root: Path) -> dict[str, bytes]:
    return {path.relative_to(root).as_posix(): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_a_release_sets_one_version_everywhere_and_records_the_chart(root: Path) -> None:
    previous = _version(root)
    new = _next_minor(previous)
    assert release.main([new, "--root", str(root), "--date", DATE]) == 0
    chart = yaml.safe_load((root / chart_digest.CHART / "Chart.yaml").read_text(encoding="utf-8"))
    package = (root / "exporter" / "__init__.py").read_text(encoding="utf-8")
    assert (_version(root), chart["version"], chart["appVersion"]) == (new, new, new)
    assert f'__version__ = "{new}"' in package
    assert chart_digest.stale_reason(root / chart_digest.CHART) is None
    assert chart_digest.read_record(root / chart_digest.CHART).version == new


def test_the_unreleased_entries_move_under_the_new_version(root: Path) -> None:
    before = (root / "CHANGELOG.md").read_text(encoding="utf-8")
    previous = _version(root)
    new = _next_minor(previous)
    assert release.main([new, "--root", str(root), "--date", DATE]) == 0
    text = (root / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## [Unreleased]\n\n## [{new}] - {DATE}\n\n{ENTRY}\n## [{previous}]" in text
    assert text.count("## [Unreleased]") == 1 and text.count(ENTRY) == 1
    base = re.search(r"^\[Unreleased\]: (\S+/compare/)", before, re.MULTILINE)
    assert base is not None
    assert f"[Unreleased]: {base[1]}v{new}...HEAD\n[{new}]: {base[1]}v{previous}...v{new}\n" in text
    # What came before the first release heading and every older release stay as they were.
    assert text.split("## [Unreleased]")[0] == before.split("## [Unreleased]")[0]
    assert before[before.index(f"## [{previous}]"):before.index("[Unreleased]: ")] in text


def test_a_second_release_starts_from_the_first(root: Path) -> None:
    first = _next_minor(_version(root))
    assert release.main([first, "--root", str(root), "--date", DATE]) == 0
    changelog = root / "CHANGELOG.md"
    changelog.write_text(changelog.read_text(encoding="utf-8").replace(
        "## [Unreleased]\n", f"## [Unreleased]\n\n{ENTRY}", 1), encoding="utf-8")
    second = _next_minor(first)
    assert release.main([second, "--root", str(root), "--date", DATE]) == 0
    assert _version(root) == second
    assert f"[{second}]: " in changelog.read_text(encoding="utf-8")


def test_the_chart_bumped_ahead_to_the_release_is_released_at_it(root: Path) -> None:
    """A chart change after the last release bumped the chart to the next version: releasing that
    version is allowed (it was never published) and records the chart with its new appVersion."""
    new = _next_minor(_version(root))
    chart = root / chart_digest.CHART
    chart_yaml = chart / "Chart.yaml"
    chart_yaml.write_text(re.sub(r"(?m)^version: .*$", f"version: {new}", chart_yaml.read_text(encoding="utf-8")),
                          encoding="utf-8")
    chart_digest.record(chart)
    assert release.main([new, "--root", str(root), "--date", DATE]) == 0
    assert chart_digest.stale_reason(chart) is None
    assert yaml.safe_load(chart_yaml.read_text(encoding="utf-8"))["appVersion"] == new


def _refusals(current: str) -> list[tuple[str, str]]:
    major, minor, patch = (int(part) for part in current.split("."))
    return [
        (current, "not greater than the current version"),
        (f"{major}.{minor - 1}.{patch}" if minor else f"{major - 1}.9.0", "not greater than the current version"),
        (f"{major}.{minor + 1}", "not a release version"),
        (f"v{major}.{minor + 1}.0", "not a release version"),
        (f"{major}.0{minor + 1}.0", "not a release version"),
        (f"{major}.{minor + 1}.0-rc1", "not a release version"),
        ("", "not a release version"),
    ]


@pytest.mark.parametrize("case", range(len(_refusals("0.2.0"))))
def test_a_bad_version_is_refused_and_changes_nothing(root: Path, case: int,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    version, message = _refusals(_version(root))[case]
    before = _snapshot(root)
    assert release.main([version, "--root", str(root), "--date", DATE]) == 2
    error = capsys.readouterr().err
    assert message in error and "nothing was changed" in error
    assert _snapshot(root) == before


def test_an_empty_unreleased_section_is_refused_and_changes_nothing(root: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    changelog = root / "CHANGELOG.md"
    changelog.write_text(changelog.read_text(encoding="utf-8").replace(ENTRY, "", 1), encoding="utf-8")
    before = _snapshot(root)
    assert release.main([_next_minor(_version(root)), "--root", str(root), "--date", DATE]) == 2
    assert "Unreleased] section is empty" in capsys.readouterr().err
    assert _snapshot(root) == before


def test_a_chart_already_past_the_version_is_refused_and_changes_nothing(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    new = _next_minor(_version(root))
    ahead = _next_minor(new)
    chart_yaml = root / chart_digest.CHART / "Chart.yaml"
    chart_yaml.write_text(re.sub(r"(?m)^version: .*$", f"version: {ahead}", chart_yaml.read_text(encoding="utf-8")),
                          encoding="utf-8")
    before = _snapshot(root)
    assert release.main([new, "--root", str(root), "--date", DATE]) == 2
    assert f"already at {ahead}, past {new}" in capsys.readouterr().err
    assert _snapshot(root) == before
