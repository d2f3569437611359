"""The Helm chart's content digest, recorded with the chart version it was computed for.

A chart published twice under one version with different content breaks every install that
pinned it, and nothing in helm notices. So the repository keeps, beside the chart, a sha256
over the files `helm package` would ship and the Chart.yaml `version` they shipped as
(helm/stepbudget/.chart-digest). tests/deploy/test_chart_version.py recomputes it: content that
changed while `version` stayed the recorded one fails. Recording refuses the same thing, so
`make chart-version-record` cannot be used to skip the bump.

Stdlib only: `make chart-version-record` and `make release` run without the venv.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

CHART = Path("helm") / "stepbudget"
RECORD_NAME = ".chart-digest"
BUMP_HINT = "bump helm/stepbudget/Chart.yaml version (and record it with `make chart-version-record`)"
# A top-level `version:` line of Chart.yaml (appVersion, kubeVersion and nested keys do not match).
CHART_VERSION_LINE = re.compile(r'^version:[ \t]*["\']?(?P<version>[^"\'\s#]+)["\']?[ \t]*(?:#.*)?$', re.MULTILINE)


@dataclass(frozen=True)
class DigestRecord:
    """What the record file holds: the chart version and the digest of its content at that version."""

    version: str
    sha256: str

    def text(self) -> str:
        return (f"# sha256 over the files `helm package` ships from this chart (.helmignore applied, this file\n"
                f"# left out), for Chart.yaml version {self.version}. Written by `make chart-version-record`,\n"
                f"# checked by tests/deploy/test_chart_version.py: change the chart, bump its version.\n"
                f"version: {self.version}\nsha256: {self.sha256}\n")


class ChartRecordError(Exception):
    """The record cannot be read, or cannot be written without hiding an unbumped change."""


def chart_version(chart: Path) -> str:
    """Chart.yaml's own `version` (read as text: the release script edits the same line)."""
    match = CHART_VERSION_LINE.search((chart / "Chart.yaml").read_text(encoding="utf-8"))
    if match is None:
        raise ChartRecordError(f"{chart / 'Chart.yaml'} has no top-level version line")
    return match["version"]


def _ignore_patterns(chart: Path) -> list[str]:
    ignore = chart / ".helmignore"
    if not ignore.exists():
        return []
    lines = (line.strip() for line in ignore.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _ignored(relative: str, patterns: list[str]) -> bool:
    """The subset of .helmignore's rules the chart uses: `dir/` drops a folder at any depth, any other
    pattern matches a file's path or its name (helm's own matcher also has `!` negation, unused here)."""
    parts = relative.split("/")
    for pattern in patterns:
        if pattern.endswith("/"):
            if any(fnmatch.fnmatchcase(part, pattern.rstrip("/")) for part in parts[:-1]):
                return True
        elif fnmatch.fnmatchcase(relative, pattern) or fnmatch.fnmatchcase(parts[-1], pattern):
            return True
    return False


def packaged_files(chart: Path) -> list[str]:
    """The chart's files as `helm package` would ship them, by relative path, sorted; the record left out."""
    patterns = _ignore_patterns(chart)
    found = (path.relative_to(chart).as_posix() for path in chart.rglob("*") if path.is_file())
    return sorted(name for name in found if name != RECORD_NAME and not _ignored(name, patterns))


def chart_digest(chart: Path) -> str:
    """sha256 over every packaged file's path and content: a renamed, added or removed file counts too."""
    digest = hashlib.sha256()
    for name in packaged_files(chart):
        content = hashlib.sha256((chart / name).read_bytes()).hexdigest()
        digest.update(f"{name}\0{content}\n".encode())
    return digest.hexdigest()


def read_record(chart: Path) -> DigestRecord:
    path = chart / RECORD_NAME
    if not path.exists():
        raise ChartRecordError(f"{path} is missing: run `make chart-version-record`")
    fields = dict(line.split(":", 1) for line in path.read_text(encoding="utf-8").splitlines()
                  if line.strip() and not line.startswith("#") and ":" in line)
    try:
        return DigestRecord(version=fields["version"].strip(), sha256=fields["sha256"].strip())
    except KeyError as missing:
        raise ChartRecordError(f"{path} has no {missing.args[0]} line: run `make chart-version-record`") from None


def current(chart: Path) -> DigestRecord:
    """The chart as it is now: its version and its digest."""
    return DigestRecord(version=chart_version(chart), sha256=chart_digest(chart))


def stale_reason(chart: Path) -> str | None:
    """Why the record does not vouch for the chart as it is, or None when it does.

    Content changed under the recorded version: the bump is missing. A version other than the
    recorded one: the bump is there but unrecorded, so a later change under it would go unseen.
    """
    recorded, now = read_record(chart), current(chart)
    if now == recorded:
        return None
    if now.version == recorded.version:
        return (f"the chart's files changed since version {recorded.version} was recorded "
                f"(sha256 {recorded.sha256[:12]} -> {now.sha256[:12]}): {BUMP_HINT}")
    return (f"Chart.yaml version is {now.version} but the record is for {recorded.version}: "
            f"record it with `make chart-version-record`")


def record(chart: Path) -> DigestRecord:
    """Write the record for the chart as it is; refused when that would hide a change without a bump."""
    now = current(chart)
    if (chart / RECORD_NAME).exists():
        recorded = read_record(chart)
        if now.version == recorded.version and now.sha256 != recorded.sha256:
            raise ChartRecordError(f"the chart changed but its version is still {now.version}: "
                                   f"bump helm/stepbudget/Chart.yaml version first")
    return write_record(chart, now)


def write_record(chart: Path, recorded: DigestRecord) -> DigestRecord:
    """Write the record as given, unchecked: `record` checks first, a release sets the version itself."""
    (chart / RECORD_NAME).write_text(recorded.text(), encoding="utf-8")
    return recorded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chart_digest", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository (default: here)")
    parser.add_argument("--record", action="store_true", help="write the record (default: check it)")
    args = parser.parse_args(argv)
    chart = args.root / CHART
    try:
        if args.record:
            written = record(chart)
            print(f"recorded chart version {written.version}, sha256 {written.sha256}")
            return 0
        reason = stale_reason(chart)
    except ChartRecordError as error:
        print(f"chart_digest: error: {error}", file=sys.stderr)
        return 1
    if reason:
        print(f"chart_digest: {reason}", file=sys.stderr)
        return 1
    print(f"chart version {chart_version(chart)} matches its recorded digest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
