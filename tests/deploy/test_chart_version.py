"""Every chart change bumps the chart's version: helm/stepbudget/.chart-digest records a sha256 over
the packaged files with the Chart.yaml version it was taken at (scripts/chart_digest.py).

The repository's chart must match its record; and the check itself is tried on a copy of the chart:
a changed template without a bump fails, the bump alone asks for the record, the bump recorded passes,
and recording a change without a bump is refused."""

from __future__ import annotations

import re
import shutil
import tarfile
from pathlib import Path

import pytest

from scripts import chart_digest
from tests.support.chart import CHART, helm


def test_the_chart_matches_the_digest_recorded_for_its_version() -> None:
    reason = chart_digest.stale_reason(CHART)
    assert reason is None, reason


@pytest.fixture
def chart_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "stepbudget"
    shutil.copytree(CHART, copy)
    return copy


def _bump_minor(chart: Path) -> str:
    """Raise Chart.yaml's version by one minor step; the new version, computed from the copy's own."""
    major, minor, _patch = chart_digest.chart_version(chart).split(".")
    bumped = f"{major}.{int(minor) + 1}.0"
    chart_yaml = chart / "Chart.yaml"
    text, count = re.subn(r"(?m)^version: .*$", f"version: {bumped}", chart_yaml.read_text(encoding="utf-8"))
    assert count == 1
    chart_yaml.write_text(text, encoding="utf-8")
    return bumped


def _change_a_template(chart: Path) -> None:
    service = chart / "templates" / "service.yaml"
    service.write_text(service.read_text(encoding="utf-8") + "# a change\n", encoding="utf-8")


def test_a_template_changed_without_a_bump_fails_naming_the_fix(chart_copy: Path) -> None:
    assert chart_digest.stale_reason(chart_copy) is None
    _change_a_template(chart_copy)
    reason = chart_digest.stale_reason(chart_copy)
    assert reason is not None
    assert "bump helm/stepbudget/Chart.yaml version (and record it with `make chart-version-record`)" in reason


def test_a_bumped_version_passes_once_recorded(chart_copy: Path) -> None:
    recorded = chart_digest.read_record(chart_copy)
    _change_a_template(chart_copy)
    bumped = _bump_minor(chart_copy)
    reason = chart_digest.stale_reason(chart_copy)
    assert reason is not None and f"version is {bumped} but the record is for {recorded.version}" in reason
    chart_digest.record(chart_copy)
    assert chart_digest.stale_reason(chart_copy) is None
    assert chart_digest.read_record(chart_copy) == chart_digest.DigestRecord(
        bumped, chart_digest.chart_digest(chart_copy))


def test_recording_a_change_without_a_bump_is_refused_and_writes_nothing(chart_copy: Path) -> None:
    before = (chart_copy / chart_digest.RECORD_NAME).read_text(encoding="utf-8")
    _change_a_template(chart_copy)
    with pytest.raises(chart_digest.ChartRecordError, match="bump"):
        chart_digest.record(chart_copy)
    assert (chart_copy / chart_digest.RECORD_NAME).read_text(encoding="utf-8") == before


@pytest.mark.parametrize("name", ["ci/extra-values.yaml", "templates/notes.swp"])
def test_files_helm_does_not_package_do_not_count(chart_copy: Path, name: str) -> None:
    (chart_copy / name).write_text("x: 1\n", encoding="utf-8")
    assert chart_digest.stale_reason(chart_copy) is None


def test_a_new_file_counts(chart_copy: Path) -> None:
    (chart_copy / "templates" / "extra.yaml").write_text("", encoding="utf-8")
    assert chart_digest.stale_reason(chart_copy) is not None


def test_the_digest_covers_exactly_what_helm_package_ships(tmp_path: Path) -> None:
    result = helm("package", str(CHART), "--destination", str(tmp_path))
    assert result.returncode == 0, result.stderr
    (archive,) = tmp_path.glob("*.tgz")
    with tarfile.open(archive) as packaged:
        shipped = sorted(member.name.split("/", 1)[1] for member in packaged.getmembers() if member.isfile())
    assert chart_digest.packaged_files(CHART) == shipped
