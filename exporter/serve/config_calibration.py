"""A deployment's `calibration` file: what `stepbudget calibrate --json` writes, read and checked for the daemon.

Why a module of its own: the file is another program's output with its own keys and its own refusals
(a calibration `calibrate` rejected, or one edited by hand), one job apart from reading the YAML.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from exporter.capacity.fit import AGREEMENT_ON_BANDWIDTHS, AGREEMENT_ON_FIT_RESIDUALS, AGREEMENT_ON_WINDOW_RESIDUALS
from exporter.config_validators import ConfigError, Invalid, Parser, Where, non_negative, positive

# What `stepbudget calibrate --json` always writes and the daemon reads, with how each is checked.
CALIBRATION_NUMBERS: dict[str, Parser] = {
    "effective_bandwidth_bytes_per_second": positive,
    "step_overhead_seconds": non_negative,
    "spread_ratio": non_negative,
    "tolerance_ratio": positive,
}
CALIBRATION_REQUIRED_KEYS = (*CALIBRATION_NUMBERS, "agrees")
# Written by calibrations that fit them; absent or null: not fitted (0 per-request cost, compute from efficiency).
CALIBRATION_OPTIONAL_NUMBERS: dict[str, Parser] = {
    "per_request_seconds": non_negative,
    "effective_compute_flops_per_second": positive,
}

# What a refused file's spread_ratio measured, by its agreement_basis (files from before the key: bandwidths).
_REJECTION_MEASURES = {
    AGREEMENT_ON_BANDWIDTHS: "its points' bandwidths spread",
    AGREEMENT_ON_FIT_RESIDUALS: "its fitted terms miss a point by",
    AGREEMENT_ON_WINDOW_RESIDUALS: "its fit misses 10% of its windows by more than",
}


@dataclass(frozen=True)
class CalibrationValues:
    bandwidth_bytes_per_second: float
    step_overhead_seconds: float
    per_request_seconds: float = 0.0
    compute_flops_per_second: float | None = None


def calibration_values(path: str, deployment: str, where: Where) -> CalibrationValues:
    """The fitted terms from `stepbudget calibrate --json` output that calibrate itself accepted."""

    def refuse(problem: str) -> ConfigError:
        return where.error(f"deployment {deployment!r}: calibration file {path!r} {problem}")

    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, ValueError) as error:
        raise refuse(f"cannot be read: {error}") from None
    if not isinstance(document, dict):
        raise refuse("is not `stepbudget calibrate --json` output: "
                     f"expected a JSON object, got {type(document).__name__}")
    missing = [key for key in CALIBRATION_REQUIRED_KEYS if key not in document]
    if missing:
        raise refuse(f"is not `stepbudget calibrate --json` output: it lacks {', '.join(missing)}")
    numbers: dict[str, float] = {}
    for key, parse in CALIBRATION_NUMBERS.items():
        try:
            numbers[key] = parse(document[key], where)
        except Invalid as bad:
            raise refuse(f"has an unusable {key}: {bad}") from None
    optional: dict[str, float | None] = {}
    for key, parse in CALIBRATION_OPTIONAL_NUMBERS.items():
        try:
            optional[key] = None if document.get(key) is None else parse(document[key], where)
        except Invalid as bad:
            raise refuse(f"has an unusable {key}: {bad} (null when not fitted)") from None
    agrees, spread, tolerance = document["agrees"], numbers["spread_ratio"], numbers["tolerance_ratio"]
    if not isinstance(agrees, bool):
        raise refuse(f"has an unusable agrees: expected true or false, got {agrees!r}")
    if agrees != (spread <= tolerance):
        raise refuse(f"says agrees: {str(agrees).lower()} but its spread_ratio {spread:g} and tolerance_ratio "
                     f"{tolerance:g} say otherwise (edited by hand?); re-run `stepbudget calibrate --json`")
    if not agrees:
        measure = _REJECTION_MEASURES.get(str(document.get("agreement_basis")),
                                          _REJECTION_MEASURES[AGREEMENT_ON_BANDWIDTHS])
        raise refuse(f"was rejected by `stepbudget calibrate` (agrees: false): {measure} {spread:.1%}, more than "
                     f"the {tolerance:.0%} tolerance, so the model does not describe that server; re-run "
                     "`stepbudget calibrate` (its notes name likely causes) and use a file it accepts")
    return CalibrationValues(numbers["effective_bandwidth_bytes_per_second"], numbers["step_overhead_seconds"],
                             optional["per_request_seconds"] or 0.0, optional["effective_compute_flops_per_second"])
