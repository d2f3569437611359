"""`make release VERSION=x.y.z`: one version written everywhere a release carries it, and the changelog's
Unreleased entries filed under it.

Sets pyproject.toml's `version`, exporter.__version__ (what `stepbudget --version` prints), and
helm/stepbudget/Chart.yaml's `appVersion` and `version`; records the chart's digest for that version
(scripts/chart_digest.py); moves CHANGELOG.md's `## [Unreleased]` entries under `## [x.y.z] - <date>`
and leaves an empty Unreleased above them.

The chart's version is always set to the release's. The new appVersion changes the chart's content,
so a release is always a chart change and needs a bump anyway; making it the release's own number
means chart X ships app X. Between releases a chart change bumps the chart on its own
(tests/deploy/test_chart_version.py), towards the next release: so the release may equal the chart's
version (that version was never published) but not be below it.

Every check runs before any file is written: a malformed or non-increasing version, a chart already
past it, an empty Unreleased section or a file not in the expected shape changes nothing.
Stdlib only: it runs without the venv.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from scripts import chart_digest

# x.y.z with no leading zeros (SemVer's release numbers; no pre-release or build suffix).
VERSION = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")
UNRELEASED = "## [Unreleased]"
_PROJECT_VERSION = re.compile(r'(?m)^version = "(?P<version>[^"]*)"$')
_PACKAGE_VERSION = re.compile(r'(?m)^__version__ = "(?P<version>[^"]*)"$')
_CHART_VERSION = chart_digest.CHART_VERSION_LINE  # the line the chart's record reads its version from
_APP_VERSION = re.compile(r'(?m)^appVersion: "(?P<version>[^"]*)"$')
_NEXT_HEADING = re.compile(r"(?m)^## \[")
_UNRELEASED_LINK = re.compile(r"(?m)^\[Unreleased\]: (?P<base>\S+/compare/)v(?P<previous>\S+)\.\.\.HEAD$")


class ReleaseError(Exception):
    """Why the release was refused; nothing was written."""


@dataclass(frozen=True)
class Paths:
    """The files a release writes, under one repository root (a temporary copy in the tests)."""

    root: Path

    @property
    def pyproject(self) -> Path:
        return self.root / "pyproject.toml"

    @property
    def package(self) -> Path:
        return self.root / "exporter" / "__init__.py"

    @property
    def chart(self) -> Path:
        return self.root / chart_digest.CHART

    @property
    def changelog(self) -> Path:
        return self.root / "CHANGELOG.md"


def parse_version(text: str) -> tuple[int, int, int]:
    match = VERSION.match(text)
    if match is None:
        raise ReleaseError(f"{text!r} is not a release version: expected x.y.z (e.g. 1.4.0), "
                           f"numbers without leading zeros, no prefix or suffix")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def _replace_one(text: str, pattern: re.Pattern[str], new_line: str, where: str) -> tuple[str, str]:
    """`text` with the one line `pattern` matches replaced, and the version that line had."""
    matches = list(pattern.finditer(text))
    if len(matches) != 1:
        raise ReleaseError(f"{where}: expected one line matching {pattern.pattern!r}, found {len(matches)}")
    match = matches[0]
    return text[:match.start()] + new_line + text[match.end():], match["version"]


def _project_table(text: str) -> tuple[int, int]:
    """Where pyproject's [project] table starts and ends: only its `version` is the package's."""
    start = text.find("\n[project]\n")
    start = 0 if text.startswith("[project]\n") else start
    if start < 0:
        raise ReleaseError("pyproject.toml has no [project] table")
    following = re.compile(r"(?m)^\[").search(text, start + len("\n[project]\n"))
    return start, following.start() if following else len(text)


def set_pyproject_version(text: str, version: str) -> tuple[str, str]:
    start, end = _project_table(text)
    table, old = _replace_one(text[start:end], _PROJECT_VERSION, f'version = "{version}"', "pyproject.toml [project]")
    return text[:start] + table + text[end:], old


def move_unreleased(changelog: str, version: str, date: str) -> str:
    """The Unreleased entries under `## [version] - date`, an empty Unreleased above; the compare links
    at the bottom follow when the file has them."""
    head, found, rest = changelog.partition(UNRELEASED + "\n")
    if not found:
        raise ReleaseError(f"CHANGELOG.md has no '{UNRELEASED}' heading")
    following = _NEXT_HEADING.search(rest)
    entries = rest[:following.start()] if following else rest
    entries_end = len(entries)
    link = _UNRELEASED_LINK.search(entries)  # a file with no release yet: its links follow Unreleased
    if link is not None:
        entries_end = link.start()
    if not entries[:entries_end].strip():
        raise ReleaseError(f"CHANGELOG.md's {UNRELEASED} section is empty: say what {version} changes first")
    released = f"{UNRELEASED}\n\n## [{version}] - {date}\n\n{entries[:entries_end].strip()}\n\n"
    text = head + released + rest[entries_end:]
    link = _UNRELEASED_LINK.search(text)
    if link is None:
        return text
    base, previous = link["base"], link["previous"]
    links = f"[Unreleased]: {base}v{version}...HEAD\n[{version}]: {base}v{previous}...v{version}"
    return text[:link.start()] + links + text[link.end():]


@dataclass(frozen=True)
class Release:
    """Every file's new text, worked out before any is written."""

    version: str
    previous: str
    texts: dict[Path, str]


def plan(paths: Paths, version: str, date: str) -> Release:
    new = parse_version(version)
    pyproject, previous = set_pyproject_version(paths.pyproject.read_text(encoding="utf-8"), version)
    if new <= parse_version(previous):
        raise ReleaseError(f"{version} is not greater than the current version {previous}")
    package, _ = _replace_one(paths.package.read_text(encoding="utf-8"), _PACKAGE_VERSION,
                              f'__version__ = "{version}"', "exporter/__init__.py")
    chart_yaml_path = paths.chart / "Chart.yaml"
    chart_yaml, chart_was = _replace_one(chart_yaml_path.read_text(encoding="utf-8"), _CHART_VERSION,
                                         f"version: {version}", "Chart.yaml")
    if new < parse_version(chart_was):
        raise ReleaseError(f"the chart is already at {chart_was}, past {version}: release {chart_was} or later")
    chart_yaml, _ = _replace_one(chart_yaml, _APP_VERSION, f'appVersion: "{version}"', "Chart.yaml")
    changelog = move_unreleased(paths.changelog.read_text(encoding="utf-8"), version, date)
    texts = {paths.pyproject: pyproject, paths.package: package, chart_yaml_path: chart_yaml,
             paths.changelog: changelog}
    return Release(version, previous, texts)


def apply(paths: Paths, release: Release) -> chart_digest.DigestRecord:
    """Write every file, then the chart's record for its new content and version."""
    for path, text in release.texts.items():
        path.write_text(text, encoding="utf-8")
    return chart_digest.write_record(paths.chart, chart_digest.current(paths.chart))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="release", description=__doc__.splitlines()[0])
    parser.add_argument("version", help="the new version, x.y.z, greater than the current one")
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository (default: here)")
    parser.add_argument("--date", default=datetime.date.today().isoformat(),
                        type=lambda text: datetime.date.fromisoformat(text).isoformat(),
                        help="the release date in CHANGELOG.md (default: today)")
    args = parser.parse_args(argv)
    paths = Paths(args.root)
    try:
        release = plan(paths, args.version, args.date)
    except (ReleaseError, chart_digest.ChartRecordError, OSError) as error:
        print(f"release: error: {error}; nothing was changed", file=sys.stderr)
        return 2
    recorded = apply(paths, release)
    print(f"released {release.previous} -> {release.version}: pyproject.toml, exporter/__init__.py, "
          f"Chart.yaml version and appVersion, CHANGELOG.md; chart digest {recorded.sha256[:12]} recorded.\n"
          f"Next: review `git diff`, commit, and tag v{release.version}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
