"""`stepbudget calibrate`: exporter.capacity.calibrate's offline and live calibration, with
`--prometheus` (a deployment's history in the daemon's own series) read through the daemon's side,
exporter.serve.online_seed. The verb lives here, above both, so that exporter.capacity imports
nothing of the daemon (docs/architecture.md).
"""

from __future__ import annotations

import argparse

from exporter.capacity import calibrate
from exporter.serve import online_seed

build_parser = calibrate.build_parser


def run(args: argparse.Namespace) -> int:
    return calibrate.run(args, history_calibration=online_seed.calibration_from_history)
