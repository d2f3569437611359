"""One Reading per (deployment, target, model_name, engine): everything the daemon exports and alerts on.

`derive_reading` is the only place where a Snapshot, its Window and the deployment's model meet.
A value that cannot be derived (the page lacks it, or it is NaN, infinite or negative) is None and
its reason goes into `notes`: the collector leaves None out of the export, so a missing number is
never shown as a valid 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from exporter import model

if TYPE_CHECKING:
    from exporter.config import Deployment
    from exporter.discovery import Target
    from exporter.snapshot import Snapshot
    from exporter.window import Window

# Token budget of a sliding-window or MoE model depends on the context per request; an idle
# server has none, so the budget is quoted for this typical chat context.
IDLE_CONTEXT_TOKENS = 2000.0

# The per-target values the collector exports (every stepbudget_<name> but target_up).
VALUE_FIELDS = ("target_scrape_duration_seconds", "target_last_success_timestamp_seconds", "tokens_in_flight",
                "kv_cache_capacity_tokens", "kv_cache_usage_ratio", "requests_running", "requests_waiting",
                "preemptions_total", "prefill_tokens_per_step", "step_read_bytes", "predicted_step_seconds",
                "predicted_memory_step_seconds", "predicted_compute_step_seconds", "measured_step_seconds",
                "measured_step_median_seconds", "prediction_error_ratio", "predicted_user_tokens_per_second",
                "step_budget_seconds", "token_budget_tokens", "token_budget_utilization_ratio")
# Values measured over the window between two polls: absent on a first poll, an idle window or a
# counter reset, which is routine. Absent because the page lacks their source, they are worth a log.
WINDOW_FIELDS = ("measured_step_seconds", "measured_step_median_seconds", "prediction_error_ratio",
                 "prefill_tokens_per_step")


@dataclass(frozen=True)
class Reading:
    deployment: str
    target: str
    model_name: str = ""
    engine: str = ""
    namespace: str | None = None
    pod: str | None = None
    target_up: bool = False
    scrape_duration_seconds: float | None = None
    last_success_timestamp_seconds: float | None = None
    tokens_in_flight: float | None = None
    kv_cache_capacity_tokens: float | None = None
    kv_cache_usage_ratio: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    preemptions_total: float | None = None
    prefill_tokens_per_step: float | None = None
    step_read_bytes: float | None = None
    predicted_step_seconds: float | None = None
    predicted_memory_step_seconds: float | None = None
    predicted_compute_step_seconds: float | None = None
    measured_step_seconds: float | None = None
    measured_step_median_seconds: float | None = None
    prediction_error_ratio: float | None = None
    predicted_user_tokens_per_second: float | None = None
    step_budget_seconds: float | None = None
    token_budget_tokens: float | None = None
    token_budget_utilization_ratio: float | None = None
    effective_bandwidth_bytes_per_second: float | None = None
    bandwidth_source: str | None = None
    kind: str | None = None  # vllm | sglang | tgi
    notes: tuple[str, ...] = field(default_factory=tuple)
    # Exported values left out for a lasting reason (the page lacks them, or gives unusable numbers).
    lacking: tuple[str, ...] = field(default_factory=tuple)

    @property
    def labels(self) -> dict[str, str]:
        """The series labels. Empty values are left out: Prometheus drops empty labels on ingest,
        and the alert loop must send exactly the label set the rules produce."""
        labels = {"deployment": self.deployment, "target": self.target,
                  "model_name": self.model_name, "engine": self.engine,
                  "namespace": self.namespace or "", "pod": self.pod or ""}
        return {name: value for name, value in labels.items() if value}

    @property
    def identity(self) -> tuple[str, str, str, str]:
        return (self.deployment, self.target, self.model_name, self.engine)

    def down(self, *, scrape_duration_seconds: float, keep_values: bool) -> "Reading":
        """This reading after a failed poll: up 0; values kept only while not yet stale."""
        if keep_values:
            return replace(self, target_up=False, scrape_duration_seconds=scrape_duration_seconds)
        return Reading(deployment=self.deployment, target=self.target, model_name=self.model_name,
                       engine=self.engine, namespace=self.namespace, pod=self.pod, target_up=False,
                       scrape_duration_seconds=scrape_duration_seconds,
                       last_success_timestamp_seconds=self.last_success_timestamp_seconds)


def _valid(value: float | None, name: str, notes: list[str], *, upper: float | None = None) -> float | None:
    """None for a value no one can trust (NaN, infinite, negative, or over `upper`), with a note."""
    if value is None:
        return None
    if not math.isfinite(value) or value < 0 or (upper is not None and value > upper):
        notes.append(f"{name}: unusable value {value!r} left out")
        return None
    return float(value)


def derive_reading(deployment: "Deployment", target: "Target", snapshot: "Snapshot", window: "Window | None", *,
                   now_seconds: float, scrape_duration_seconds: float) -> Reading:
    """Everything derivable from one snapshot, its window over the previous one, and the model."""
    notes: list[str] = list(snapshot.missing)
    setup = deployment.resolved.setup
    running = _valid(snapshot.requests_running, "requests_running", notes)
    waiting = _valid(snapshot.requests_waiting, "requests_waiting", notes)
    usage = _valid(snapshot.kv_cache_usage_ratio, "kv_cache_usage_ratio", notes, upper=1.0)
    capacity = _valid(snapshot.kv_cache_capacity_tokens, "kv_cache_capacity_tokens", notes)
    if capacity is None or capacity == 0:
        # The page does not say: the model's own capacity for this GPU and memory utilization.
        capacity = float(model.kv_capacity_tokens(setup))
        notes.append("kv_cache_capacity_tokens: from the model (the page does not report it)")
    tokens = _valid(snapshot.tokens_in_flight, "tokens_in_flight", notes)
    if tokens is None and usage is not None:
        tokens = usage * capacity
    if usage is None and tokens is not None and capacity > 0:
        usage = min(1.0, tokens / capacity)

    measured_mean = measured_median = prefill = None
    if window is not None:
        measured_mean = _valid(window.measured_step_mean_seconds, "measured_step_seconds", notes)
        measured_median = _valid(window.measured_step_median_seconds, "measured_step_median_seconds", notes)
        prefill = _valid(window.prefill_tokens_per_step, "prefill_tokens_per_step", notes)
        notes.extend(window.notes)
    if measured_mean == 0:
        measured_mean = None  # a zero step time is no measurement
    if prefill is None:
        notes.append("prefill_tokens_per_step: unknown, predicting decode only")

    budget_seconds = deployment.step_budget_seconds
    reading = Reading(
        deployment=deployment.name, target=target.target, model_name=snapshot.model_name,
        engine=snapshot.engine, namespace=target.namespace, pod=target.pod, target_up=True,
        scrape_duration_seconds=scrape_duration_seconds, last_success_timestamp_seconds=now_seconds,
        tokens_in_flight=tokens, kv_cache_capacity_tokens=capacity, kv_cache_usage_ratio=usage,
        requests_running=running, requests_waiting=waiting,
        preemptions_total=_valid(snapshot.preemptions_total, "preemptions_total", notes),
        prefill_tokens_per_step=prefill,
        measured_step_seconds=measured_mean, measured_step_median_seconds=measured_median,
        step_budget_seconds=budget_seconds,
        effective_bandwidth_bytes_per_second=setup.effective_bandwidth_bytes_per_second,
        bandwidth_source=deployment.resolved.bandwidth_source, kind=snapshot.kind,
    )
    if tokens is None or running is None:
        notes.append("predicted_step_seconds: needs tokens in flight and running requests")
        reading = replace(reading, token_budget_tokens=_token_budget(setup, budget_seconds, tokens, running),
                          notes=tuple(notes))
        return replace(reading, lacking=_lacking(reading, snapshot))
    prediction = model.predict_step(setup, model.groups_from_total(tokens, running), prefill or 0.0)
    predicted = prediction.step_seconds
    token_budget = _token_budget(setup, budget_seconds, tokens, running)
    reading = replace(
        reading,
        step_read_bytes=prediction.read_bytes,
        predicted_step_seconds=predicted,
        predicted_memory_step_seconds=prediction.memory_seconds,
        predicted_compute_step_seconds=prediction.compute_seconds,
        predicted_user_tokens_per_second=prediction.user_tokens_per_second,
        prediction_error_ratio=(predicted - measured_mean) / measured_mean if measured_mean else None,
        token_budget_tokens=token_budget,
        token_budget_utilization_ratio=tokens / token_budget if token_budget else None,
        notes=tuple(notes),
    )
    return replace(reading, lacking=_lacking(reading, snapshot))


def _lacking(reading: Reading, snapshot: "Snapshot") -> tuple[str, ...]:
    """Exported values absent for a reason that lasts: not the routine gaps of a window."""
    absent = [name for name in VALUE_FIELDS if _value_of(reading, name) is None]
    routine = set(WINDOW_FIELDS)
    if snapshot.inter_token_latency is None:
        routine -= {"measured_step_seconds", "measured_step_median_seconds", "prediction_error_ratio"}
    if snapshot.prompt_tokens_total is None or snapshot.engine_steps_total is None:
        routine.discard("prefill_tokens_per_step")
    return tuple(name for name in absent if name not in routine)


def _value_of(reading: Reading, name: str) -> float | None:
    return getattr(reading, name.removeprefix("target_"))


def _token_budget(setup: model.ServingSetup, budget_seconds: float, tokens: float | None,
                  running: float | None) -> float:
    if setup.architecture.is_linear:
        return model.token_budget_tokens(setup, budget_seconds)
    # Non-linear (sliding windows, MoE): the budget depends on the context per request.
    context = tokens / running if tokens and running else IDLE_CONTEXT_TOKENS
    return model.token_budget_tokens(setup, budget_seconds, context)
