"""Reads the alert rules file the package ships (exporter/serve/rules/stepbudget.alerts.yaml) into records
the in-process alert loop evaluates: each alert's name, `for`, labels and annotation templates.

Why read the file instead of writing the rules again in Python: Prometheus and the daemon must raise
the same alert (same name, `for`, labels and text) so that Alertmanager shows one; with one file
there is nothing to keep equal. Only the conditions stay in Python (exporter/serve/alerting.py), because
the daemon evaluates readings, not PromQL.

The annotations are Go templates. Prometheus's template language is large; this module renders
exactly the constructs the file uses ({{ $labels.NAME }}, {{ $value }} and {{ $value | humanize }},
`humanizeDuration`, `humanizePercentage`) and refuses any other at load time, naming it, so a new
construct in the file fails the daemon's start (and the tests) instead of rendering wrong text.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from exporter.errors import InputError
from exporter.units import parse_overhead_seconds

PACKAGED_RULES = "serve/rules/stepbudget.alerts.yaml"
# Every runbook_url of the packaged rules starts with this; `alerting.runbook_base_url` (the daemon) and
# the chart's `prometheusRule.runbookBaseUrl` (the rules it renders) replace it with a site's own copy.
PACKAGED_RUNBOOK_BASE = "https://github.com/stepbudget/stepbudget/blob/main/docs/runbook.md"
# The keys of an alerting rule the loop honours; another (keep_firing_for, ...) would change what
# Prometheus does without changing what the daemon does, so loading refuses it.
_RULE_KEYS = frozenset({"alert", "expr", "for", "labels", "annotations"})

Part = Callable[[Mapping[str, str], float], str]
# The alerts whose threshold a site may set (alerting.rules.<alert>.threshold), with the packaged one: the
# rule's expression compares with it once (`> 0.15`) and its description says it once, as a percentage
# (`(over 15%)`). The chart's PrometheusRule template rewrites both the same way
# (tests/serve/test_alert_settings.py).
TUNABLE_THRESHOLDS: dict[str, float] = {
    "StepBudgetPredictionDrift": 0.15,
    "StepBudgetPrefillOverCapacity": 0.9,
    "StepBudgetKVCacheNearlyFull": 0.95,
}
SEVERITIES = ("critical", "warning", "info")


# --- Prometheus's number formatting --------------------------------------------------------------


def humanize(value: float) -> str:
    """Prometheus's `humanize`: SI prefixes, 4 significant digits."""
    if value == 0 or not math.isfinite(value):
        return f"{value:.4g}"
    for factor, prefix in ((1e24, "Y"), (1e21, "Z"), (1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"),
                           (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.4g}{prefix}"
    for factor, prefix in ((1e-3, "m"), (1e-6, "u"), (1e-9, "n"), (1e-12, "p"), (1e-15, "f"), (1e-18, "a")):
        if abs(value) >= factor:
            return f"{value / factor:.4g}{prefix}"
    return f"{value:.4g}"


def humanize_duration(seconds: float) -> str:
    """Prometheus's `humanizeDuration`: `1m 5s`, and SI-prefixed seconds under one second."""
    if not math.isfinite(seconds):
        return f"{seconds:.4g}"
    if abs(seconds) < 1:
        return humanize(seconds) + "s" if seconds else "0s"
    whole = int(abs(seconds))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{days}d"] if days else []
    parts += [f"{hours}h"] if hours else []
    parts += [f"{minutes}m"] if minutes else []
    parts.append(f"{secs}s" if parts else f"{abs(seconds):.4g}s")
    return ("-" if seconds < 0 else "") + " ".join(parts)


def humanize_percentage(ratio: float) -> str:
    """Prometheus's `humanizePercentage`: the ratio times 100, 4 significant digits."""
    return f"{ratio * 100:.4g}%"


def _plain_value(value: float) -> str:
    """`{{ $value }}` with no function: the number as Go prints a float64 in a template."""
    return f"{value:g}"


FILTERS: dict[str, Callable[[float], str]] = {
    "humanize": humanize,
    "humanizeDuration": humanize_duration,
    "humanizePercentage": humanize_percentage,
}


# --- templates -------------------------------------------------------------------------------------


_ACTION = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_LABEL = re.compile(r"\s*\$labels\.([A-Za-z_]\w*)\s*")
_VALUE = re.compile(r"\s*\$value\s*(?:\|\s*(\w+)\s*)?")


class TemplateError(InputError):
    """A template uses a construct the loop cannot render; the message names it."""


@dataclass(frozen=True)
class Template:
    """An annotation, compiled once at load so that rendering per alert cannot fail."""

    source: str
    parts: tuple[Part, ...]

    def render(self, labels: Mapping[str, str], value: float) -> str:
        """The text Prometheus would give for these series labels and this value."""
        return "".join(part(labels, value) for part in self.parts)


def _literal(text: str) -> Part:
    return lambda labels, value: text


def _label(name: str) -> Part:
    # Prometheus renders a missing label as "" (missingkey=zero), e.g. a never-read target's model_name.
    return lambda labels, value: labels.get(name, "")


def _value(format_value: Callable[[float], str]) -> Part:
    return lambda labels, value: format_value(value)


def _action(inner: str) -> Part:
    """One {{ ... }}: a label, or the value through at most one supported function."""
    label = _LABEL.fullmatch(inner)
    if label:
        return _label(label.group(1))
    value = _VALUE.fullmatch(inner)
    if value and (value.group(1) is None or value.group(1) in FILTERS):
        return _value(FILTERS[value.group(1)] if value.group(1) else _plain_value)
    raise TemplateError(f"unsupported template construct {{{{{inner}}}}}: the in-process alert loop renders "
                        f"only {{{{ $labels.NAME }}}}, {{{{ $value }}}} and {{{{ $value | F }}}} with F one of "
                        f"{', '.join(FILTERS)} (exporter/serve/alert_rules.py)")


def compile_template(source: str) -> Template:
    """Split a template into literal text and actions; raise TemplateError on anything else."""
    parts: list[Part] = []
    position = 0
    for match in _ACTION.finditer(source):
        parts += [_literal(_checked_text(source[position:match.start()])), _action(match.group(1))]
        position = match.end()
    parts.append(_literal(_checked_text(source[position:])))
    return Template(source, tuple(parts))


def _checked_text(text: str) -> str:
    if "{{" in text:
        raise TemplateError(f"unterminated template action in {text!r}")
    return text


def render(template: str, labels: Mapping[str, str], value: float) -> str:
    """Render a template once (tests, one-off use); the loop renders templates compiled at load."""
    return compile_template(template).render(labels, value)


# --- the rules file --------------------------------------------------------------------------------


@dataclass(frozen=True)
class AlertRule:
    """One alerting rule as the daemon raises it: everything but the condition, from the file."""

    name: str
    for_seconds: float
    labels: Mapping[str, str]
    annotations: Mapping[str, Template]

    @property
    def severity(self) -> str:
        return self.labels["severity"]


# --- a site's settings --------------------------------------------------------------------------------


@dataclass(frozen=True)
class AlertSettings:
    """One alert as a site sets it (config `alerting.rules.<alert>`); None keeps the packaged rule's.
    The chart renders the rules Prometheus evaluates from the same keys, so both raise one alert."""

    enabled: bool = True
    for_text: str | None = None  # a Prometheus duration, as the rule writes it
    severity: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    threshold: float | None = None


def go_float_text(value: float) -> str:
    """A number as Go's `printf "%g"` writes it (the shortest text that reads back the same), which is
    what the chart's template writes into the expression: the same text on both sides. Both switch to an
    exponent outside 1e-4 to 1e21 at different points; thresholds are validated well inside it."""
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def percent_text(ratio: float) -> str:
    """A ratio as a description's percentage, 4 significant digits (Go's `printf "%.4g"` of ratio x 100)."""
    return f"{ratio * 100.0:.4g}"


def tune_rules_document(document: Mapping[str, Any], settings: Mapping[str, AlertSettings],
                        origin: str = f"exporter/{PACKAGED_RULES}") -> dict[str, Any]:
    """The rules document with each alert as `settings` set it: dropped where disabled; its `for` (and
    the description's `for 5m`), severity, extra labels and threshold (the expression's `> 0.15` and the
    description's `(over 15%)`) replaced. Raises InputError for an alert the document does not have, or
    a threshold on one whose rule does not compare with the packaged threshold once."""
    tuned = copy.deepcopy(dict(document))
    seen = set()
    for group in tuned["groups"]:
        kept = []
        for rule in group["rules"]:
            name = rule.get("alert")
            if name not in settings:
                kept.append(rule)
                continue
            seen.add(name)
            if settings[name].enabled:
                kept.append(_tuned_rule(rule, settings[name], f"{origin}: alert {name}"))
        group["rules"] = kept
    missing = sorted(set(settings) - seen)
    if missing:
        raise InputError(f"{origin}: no alert {', '.join(missing)}")
    return tuned


def _tuned_rule(rule: dict[str, Any], settings: AlertSettings, where: str) -> dict[str, Any]:
    annotations = rule.setdefault("annotations", {})
    if settings.for_text is not None:
        old = f"for {rule.get('for', '0s')}"
        rule["for"] = settings.for_text
        for key, text in annotations.items():
            annotations[key] = str(text).replace(old, f"for {settings.for_text}")
    labels = rule.setdefault("labels", {})
    labels.update(settings.labels)
    if settings.severity is not None:
        labels["severity"] = settings.severity
    if settings.threshold is not None:
        default = TUNABLE_THRESHOLDS.get(rule["alert"], math.nan)
        compared = f"> {go_float_text(default)}"
        if math.isnan(default) or str(rule["expr"]).count(compared) != 1:
            raise InputError(f"{where}: its threshold cannot be set (its expression does not compare with "
                             f"the packaged threshold once)")
        rule["expr"] = str(rule["expr"]).replace(compared, f"> {go_float_text(settings.threshold)}")
        for key, text in annotations.items():
            annotations[key] = str(text).replace(f"(over {percent_text(default)}%)",
                                                 f"(over {percent_text(settings.threshold)}%)")
    return rule


def packaged_rules_text() -> str:
    return resources.files("exporter").joinpath(PACKAGED_RULES).read_text(encoding="utf-8")


def tuned_rules_text(settings: Mapping[str, AlertSettings], runbook_base_url: str | None = None) -> str:
    """The packaged alerts file as a site's settings make it (`stepbudget rules`): what its Prometheus
    must evaluate for its alerts to be the daemon's."""
    text = packaged_rules_text()
    if runbook_base_url:
        text = text.replace(PACKAGED_RUNBOOK_BASE, runbook_base_url)
    document = tune_rules_document(yaml.safe_load(text), settings)
    return yaml.dump(document, Dumper=_BlockDumper, sort_keys=False, width=1000, allow_unicode=True)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the expressions) as `|` blocks, as the packaged file writes them."""


def _represent_text(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_BlockDumper.add_representer(str, _represent_text)


def packaged_alert_names() -> tuple[str, ...]:
    """Every alert of the packaged rules file, in file order."""
    return tuple(rule["alert"] for group in yaml.safe_load(packaged_rules_text())["groups"]
                 for rule in group["rules"] if "alert" in rule)


def packaged_for_seconds(alert: str) -> float:
    """One alert's `for` in the packaged rules file (what config validation holds other durations to)."""
    for group in yaml.safe_load(packaged_rules_text())["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                return parse_overhead_seconds(str(rule.get("for", "0s")), f"exporter/{PACKAGED_RULES}: {alert}: for")
    raise InputError(f"exporter/{PACKAGED_RULES}: no alert {alert}")


def load_alert_rules(path: Path | None = None, *, skip: Collection[str] = (),
                     settings: Mapping[str, AlertSettings] | None = None) -> tuple[AlertRule, ...]:
    """Every alert of the rules file (the packaged one when `path` is None) but those in `skip`
    (alerts only Prometheus can raise), in file order, as `settings` set them (`tune_rules_document`);
    raise InputError naming any part it cannot honour."""
    if path is None:
        origin, text = f"exporter/{PACKAGED_RULES}", packaged_rules_text()
    else:
        origin, text = str(path), path.read_text(encoding="utf-8")
    document = yaml.safe_load(text)
    if settings:
        document = tune_rules_document(document, settings, origin)
    rules = [rule for group in document["groups"] for rule in group["rules"] if "alert" in rule]
    return tuple(_alert_rule(rule, origin) for rule in rules if rule["alert"] not in skip)


def _alert_rule(rule: dict[str, Any], origin: str) -> AlertRule:
    where = f"{origin}: alert {rule['alert']}"
    unknown = sorted(set(rule) - _RULE_KEYS)
    if unknown:
        raise InputError(f"{where}: the in-process alert loop does not implement {', '.join(unknown)}")
    labels = {str(key): str(value) for key, value in (rule.get("labels") or {}).items()}
    if "severity" not in labels:
        raise InputError(f"{where}: no `severity` label")
    templated = [key for key, value in labels.items() if "{{" in value]
    if templated:
        raise InputError(f"{where}: label {templated[0]} is a template; the loop needs fixed labels to keep one "
                         f"alert per series")
    for_text = str(rule.get("for", "0s"))
    return AlertRule(name=rule["alert"], for_seconds=parse_overhead_seconds(for_text, f"{where}: for"),
                     labels=labels, annotations=_annotations(rule.get("annotations") or {}, where))


def _annotations(annotations: dict[str, Any], where: str) -> dict[str, Template]:
    compiled = {}
    for key, source in annotations.items():
        try:
            compiled[str(key)] = compile_template(str(source))
        except TemplateError as error:
            raise TemplateError(f"{where}: annotation {key}: {error}") from None
    return compiled
