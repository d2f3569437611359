"""pyproject.toml's runtime dependency floors as pip constraints, and whether an environment holds them.

A floor (`lightkube>=1.0`) is a promise that the code works with that release: `make test-floors`
installs every runtime dependency at exactly its floor (`--constraint` with the file this writes)
and runs the unit tests there, so a floor the code outgrew fails instead of shipping. A runtime
dependency without a `>=` floor is refused: it would promise nothing testable.

Stdlib only (tomllib): it runs before the environment it describes exists.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

# name, optional [extras], then the specifiers (PEP 508 without markers, as pyproject's list is written).
REQUIREMENT = re.compile(r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?P<specifiers>[^;]*)")


@dataclass(frozen=True)
class Floor:
    """One runtime dependency at its lowest promised release."""

    name: str
    version: str

    @property
    def constraint(self) -> str:
        return f"{self.name}=={self.version}"


class FloorError(Exception):
    """A requirement with no floor to test, or an environment not at the floors."""


def canonical(name: str) -> str:
    """PEP 503's normal form, so `PyYAML` in metadata is `pyyaml` in pyproject."""
    return re.sub(r"[-_.]+", "-", name).lower()


def floor_of(requirement: str) -> Floor:
    match = REQUIREMENT.match(requirement)
    if match is None:
        raise FloorError(f"cannot read requirement {requirement!r}")
    lower = [spec.strip()[2:].strip() for spec in match["specifiers"].split(",") if spec.strip().startswith(">=")]
    if len(lower) != 1:
        raise FloorError(f"{requirement!r} needs exactly one `>=` floor for make test-floors to install")
    return Floor(canonical(match["name"]), lower[0])


def floors(pyproject: Path) -> list[Floor]:
    """Every runtime dependency of [project].dependencies at its floor, in pyproject's order."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    return [floor_of(requirement) for requirement in project["dependencies"]]


def same_release(installed: str, floor: str) -> bool:
    """Equal as pip's `==` compares releases: `2.8` is `2.8.0` (trailing zeros do not count)."""
    def release(version: str) -> tuple[int, ...] | str:
        parts = version.split(".")
        if not all(part.isdigit() for part in parts):
            return version
        numbers = [int(part) for part in parts]
        while len(numbers) > 1 and numbers[-1] == 0:
            numbers.pop()
        return tuple(numbers)

    return release(installed) == release(floor)


def off_floor(expected: list[Floor]) -> list[str]:
    """The dependencies this Python environment does not hold at their floors: 'name: installed x, floor y'."""
    found: list[str] = []
    for floor in expected:
        try:
            installed = metadata.version(floor.name)
        except metadata.PackageNotFoundError:
            installed = "none"
        if not same_release(installed, floor.version):
            found.append(f"{floor.name}: installed {installed}, floor {floor.version}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="floors", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository (default: here)")
    parser.add_argument("--check", action="store_true",
                        help="check that this interpreter's environment holds every floor (default: print constraints)")
    args = parser.parse_args(argv)
    try:
        expected = floors(args.root / "pyproject.toml")
    except FloorError as error:
        print(f"floors: error: {error}", file=sys.stderr)
        return 1
    if not args.check:
        print("\n".join(floor.constraint for floor in expected))
        return 0
    wrong = off_floor(expected)
    for line in wrong:
        print(f"floors: not at its floor: {line}", file=sys.stderr)
    if not wrong:
        print(f"every runtime dependency at its floor: {', '.join(f.constraint for f in expected)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
