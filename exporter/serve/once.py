"""`stepbudget serve --once`: poll every target as `serve` would, print each one's reading, and exit.

Why: before a rollout an SRE wants to know, from the config the daemon will run, that every target is
found and read, and what the daemon will make of it, without starting a daemon (no HTTP server, no
alert loop, no online calibration). The measured step is a difference of the server's counters
between two polls (exporter/serve/window.py), so the targets are polled twice, `interval_seconds`
apart (default: `poll_interval`, the window the daemon measures over); 0 polls once, and the
measured step is then left out. Exit 1 when any target is down or unreadable, or a deployment finds
no target (one that `scales_to_zero` excepted), each named with why on stderr.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from exporter.serve.config import Config
from exporter.serve.poller import PollResult, TargetState
from exporter.serve.polling import build_polling
from exporter.serve.reading import Reading

# What each reading shows in --json, in this order (None: the page or the window did not give it).
JSON_FIELDS = ("model_name", "engine", "role", "tokens_in_flight", "kv_cache_capacity_tokens", "kv_cache_usage_ratio",
               "kv_cache_used_tokens", "requests_running", "requests_waiting", "predicted_step_seconds",
               "step_budget_seconds", "token_budget_tokens", "predicted_user_tokens_per_second",
               "measured_step_seconds", "measured_step_median_seconds", "prediction_error_ratio",
               "effective_bandwidth_bytes_per_second", "bandwidth_source", "kv_cache_dtype", "lacking", "notes")


@dataclass(frozen=True)
class TargetCheck:
    """One target's outcome, or a deployment's lack of any (`target` None)."""

    deployment: str
    target: str | None
    url: str | None
    up: bool
    error: str | None = None
    kind: str | None = None  # the page format read off the page: vllm | sglang | tgi
    readings: tuple[Reading, ...] = field(default_factory=tuple)

    @property
    def name(self) -> str:
        return f"{self.deployment}/{self.target}" if self.target is not None else f"deployment {self.deployment}"


def run_once(config: Config, interval_seconds: float | None, as_json: bool) -> int:
    """Poll (twice, `interval_seconds` apart; once at 0), print, and return the exit code."""
    interval = config.poll_interval_seconds if interval_seconds is None else interval_seconds
    polling = build_polling(config)
    try:
        result = polling.poller.poll_once()
        polls = 1
        # Nothing up at the first poll: no window to wait for, the check has failed already.
        if interval > 0 and any(state.last_error is None for state in polling.poller.target_states()):
            time.sleep(interval)
            result = polling.poller.poll_once()
            polls = 2
        checks = target_checks(config, result, polling.poller.target_states())
    finally:
        polling.close()
    if as_json:
        print(json.dumps([check_json(check) for check in checks], indent=2))
    else:
        print(f"{polls} poll(s){f', {interval:g}s apart' if polls == 2 else ''}; {len(checks)} target(s)")
        for check in checks:
            print("\n".join(check_lines(check, polls)))
    failed = [check for check in checks if not check.up]
    for check in failed:
        print(f"stepbudget serve --once: {check.name}: {check.error}", file=sys.stderr)
    return 1 if failed else 0


def target_checks(config: Config, result: PollResult, states: Sequence[TargetState]) -> list[TargetCheck]:
    """Each polled target's outcome at the last poll, and a failure for each deployment that found none."""
    checks = []
    for state in sorted(states, key=lambda s: (s.target.deployment, s.target.target)):
        up = state.last_error is None and state.last_success_seconds is not None
        checks.append(TargetCheck(state.target.deployment, state.target.target, state.target.url, up,
                                  None if up else (state.last_error or "not polled"), state.kind,
                                  tuple(r for r in state.readings if r.target_up) if up else ()))
    empty = {name for name, count in result.deployment_targets if count == 0}
    for deployment in config.deployments:
        if deployment.name in empty and not deployment.scales_to_zero:
            checks.append(TargetCheck(deployment.name, None, None, False,
                                      "no targets discovered (see the warnings above for why)"))
    return checks


def check_json(check: TargetCheck) -> dict[str, Any]:
    return {"deployment": check.deployment, "target": check.target, "url": check.url, "up": check.up,
            "error": check.error, "kind": check.kind,
            "readings": [{name: _json_value(getattr(reading, name)) for name in JSON_FIELDS}
                         for reading in check.readings]}


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return list(value) if isinstance(value, tuple) else value


def check_lines(check: TargetCheck, polls: int) -> list[str]:
    """A target's block: its state, then two lines per engine (load, then step times)."""
    if not check.up:
        return [f"{check.name}: DOWN: {check.error}"]
    lines = [f"{check.name}: up, {check.kind or 'unknown'} page, {len(check.readings)} engine reading(s)"]
    for reading in check.readings:
        capacity = reading.kv_cache_capacity_tokens
        share = (f" ({reading.tokens_in_flight / capacity:.1%})"
                 if reading.tokens_in_flight is not None and capacity else "")
        lines.append(f"  {reading.model_name or '?'} engine {reading.engine or '0'}: "
                     f"{_tokens(reading.tokens_in_flight)} tokens in flight of {_tokens(capacity)} capacity{share}; "
                     f"{_count(reading.requests_running)} running, {_count(reading.requests_waiting)} waiting")
        measured = (_ms(reading.measured_step_seconds) + " mean between the polls"
                    if reading.measured_step_seconds is not None
                    else "n/a (needs two polls with tokens generated between them)" if polls == 2
                    else "n/a (one poll: no window)")
        lines.append(f"    predicted step {_ms(reading.predicted_step_seconds)} "
                     f"(budget {_ms(reading.step_budget_seconds)}, token budget "
                     f"{_tokens(reading.token_budget_tokens)}, bandwidth {reading.bandwidth_source or '?'}); "
                     f"measured step {measured}")
    return lines


def _tokens(value: float | None) -> str:
    return "?" if value is None else f"{value:,.0f}"


def _count(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.2f} ms"
