"""Building a Reading: one Snapshot, its Window and the deployment's capacity model -> one Reading per
(deployment, target, model_name, engine), and a server-wide Reading where one ITL histogram covers
several engines.

Why its own module: `derive_reading` is the only place where a Snapshot, its Window and the deployment's
model meet. What a Reading holds, and the setup and role it is stated in, are exporter/serve/reading.py's;
how the numbers are derived, changing with the model and the engines' pages, is this module's.
A value that cannot be derived (the page lacks it, or it is NaN, infinite or negative) is None and
its reason goes into `notes`: the collector leaves None out of the export, so a missing number is
never shown as a valid 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from exporter.capacity import model
from exporter.capacity.kv_cache import context_from_blocks, hybrid_kv_layout, kv_capacity_tokens
from exporter.serve.engines.vllm_prefill import part_way_done_tokens
from exporter.serve.reading import (
    MEDIAN_FIELDS,
    OPTIONAL_FIELDS,
    PREFILL_SERVER_ABSENT,
    VALUE_FIELDS,
    WINDOW_FIELDS,
    Median,
    Reading,
    page_setup,
    replace_reading,
    server_role,
    setup_disagreements,
)
from exporter.serve.setups_in_use import predicting_setup
from exporter.serve.window import tokens_per_step

if TYPE_CHECKING:
    from exporter.serve.config import Deployment
    from exporter.serve.discovery import Target
    from exporter.serve.open_context import OpenContext
    from exporter.serve.snapshot import Snapshot
    from exporter.serve.window import Window

# Token budget of a sliding-window or MoE model depends on the context per request; an idle
# server has none, so the budget is quoted for this typical chat context.
IDLE_CONTEXT_TOKENS = 2000.0

# A window with token gaps whose two ends found nothing running: no prediction is set beside its step.
WINDOW_LOAD_UNSEEN = ("prediction_error_ratio: requests came and went between two polls that found none running; "
                      "the window's load is not known, so it is not scored")
# The prompt tokens per step a prefill server's capacity is quoted at where its window says none (vLLM's
# default max_num_batched_tokens on most setups).
PREFILL_CAPACITY_CHUNK_TOKENS = 2048.0


def _valid(value: float | None, name: str, notes: list[str], *, upper: float | None = None) -> float | None:
    """None for a value no one can trust (NaN, infinite, negative, or over `upper`), with a note."""
    if value is None:
        return None
    if not math.isfinite(value) or value < 0 or (upper is not None and value > upper):
        notes.append(f"{name}: unusable value {value!r} left out")
        return None
    return float(value)


def _configured_setup(deployment: Deployment, predicting: model.ServingSetup) -> model.ServingSetup:
    """The setup as the config means it: a kv_cache_dtype of "auto" is the model's own width, as vLLM's is."""
    return page_setup(predicting, "auto", None) if deployment.kv_cache_dtype.lower() == "auto" else predicting


@dataclass(frozen=True)
class _Occupancy:
    tokens_in_flight: float | None  # context read: each request's whole context
    capacity_tokens: float
    usage_ratio: float | None  # memory held, 0-1
    estimated: tuple[tuple[str, str], ...]
    used_tokens: float | None = None  # memory held, in tokens

    @property
    def shared_ratio(self) -> float | None:
        """The share of the context read whose KV another running request holds too."""
        if self.tokens_in_flight is None or self.used_tokens is None or self.tokens_in_flight <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - self.used_tokens / self.tokens_in_flight))


def _occupancy(setup: model.ServingSetup, snapshot: Snapshot, running: float | None, notes: list[str],
               context: OpenContext | None = None) -> _Occupancy:
    """Two quantities, never one for the other (DESIGN §2): the context the running requests read
    (tokens in flight) and the memory the cache holds (KV used, capacity and usage)."""
    usage = _valid(snapshot.kv_cache_usage_ratio, "kv_cache_usage_ratio", notes, upper=1.0)
    capacity = _valid(snapshot.kv_cache_capacity_tokens, "kv_cache_capacity_tokens", notes)
    estimated: list[tuple[str, str]] = []
    if capacity is None or capacity == 0:
        # The page does not say: the model's own capacity for this GPU and memory utilization.
        capacity = float(kv_capacity_tokens(setup))
        estimated.append(("kv_cache_capacity_tokens", "model_capacity"))
        notes.append("kv_cache_capacity_tokens: from the model (the page does not report it)")
    read = _valid(snapshot.tokens_in_flight, "tokens_in_flight", notes)
    used = _valid(snapshot.kv_cache_used_tokens, "kv_cache_used_tokens", notes)
    reserved = _valid(snapshot.kv_cache_reserved_tokens, "kv_cache_reserved_tokens", notes)
    if read is None and used is None and usage is None and reserved is not None:
        # Only the reservation (TGI): the prediction's upper bound, and no usage ratio, which would near
        # 1 whenever the router packs a batch while the cache holds far fewer tokens.
        estimated.append(("tokens_in_flight", "kv_reservation"))
        return _Occupancy(reserved, capacity, None, tuple(estimated))
    if used is not None and capacity > 0:
        usage = min(1.0, used / capacity)  # SGLang's token_usage is rounded to 2 decimals
    elif used is None and usage is not None:
        used, capacity, hybrid = _used_from_usage(setup, snapshot, usage, capacity, running)
        if hybrid:
            estimated += [("kv_cache_used_tokens", "hybrid_kv_blocks"),
                          ("kv_cache_capacity_tokens", "hybrid_kv_blocks")]
        elif estimated:
            estimated.append(("kv_cache_used_tokens", "model_capacity"))
    if read is None and snapshot.kind == "vllm" and context is not None:
        # Each open request counted whole, and the chunks of a prompt part-way through its prefill.
        read = context.context_tokens + part_way_done_tokens(snapshot)
        if context.estimated:
            estimated.append(("tokens_in_flight", "aborted_requests"))
    elif read is None and used is not None:
        read = used
        estimated.append(("tokens_in_flight", "kv_memory_held"))
        estimated += [("tokens_in_flight", reason) for name, reason in estimated if name == "kv_cache_used_tokens"]
    if usage is None and used is not None and capacity > 0:
        usage = min(1.0, used / capacity)
    return _Occupancy(read, capacity, usage, tuple(dict.fromkeys(estimated)), used)


def _used_from_usage(setup: model.ServingSetup, snapshot: Snapshot, usage: float, capacity: float,
                     running: float | None) -> tuple[float, float, bool]:
    """(tokens held, capacity, whether converted from a hybrid model's blocks) from a usage ratio."""
    layout = hybrid_kv_layout(setup.architecture, setup.block_size_tokens)
    if layout is not None and snapshot.kind == "vllm" and snapshot.kv_cache_blocks and running:
        # vLLM's usage is 1 - free/(blocks - 1) over one pool shared by every KV group
        # (0.33.0 vllm/v1/core/block_pool.py l. 921-932): not a share of context tokens.
        used_blocks = usage * (snapshot.kv_cache_blocks - 1)
        context = context_from_blocks(layout, used_blocks / running, setup.block_size_tokens)
        held = context * running
        return held, held / usage if usage > 0 else capacity, True
    from_blocks = _vllm_context_tokens(snapshot, capacity, running)
    return (usage * capacity if from_blocks is None else from_blocks), capacity, False


def _vllm_context_tokens(snapshot: Snapshot, capacity: float, running: float | None) -> float | None:
    """The context the running requests hold, from the blocks a vLLM page says are in use.

    Usage x capacity counts one block in num_gpu_blocks too many (`Snapshot.used_block_tokens`: the
    null block is never handed out). Each request holds whole blocks (vllm/v1/core/kv_cache_manager.py
    `allocate_slots`), its last one partly filled: (block - 1) / 2 tokens of it empty on average. On a
    GPU's 16-token blocks that is 7.5 tokens per request; on the CPU backend's 128-token blocks 63.5, an
    eighth of a 500-token chat, which the KV term (attention reads the context, not the empty slots)
    must not count. None where the page does not give the blocks of one full-attention pool.
    """
    blocks, block, block_tokens = snapshot.kv_cache_blocks, snapshot.block_size_tokens, snapshot.used_block_tokens
    if snapshot.kind != "vllm" or not blocks or not block or block_tokens is None:
        return None
    if abs(blocks * block - capacity) >= block:
        return None
    return max(0.0, block_tokens - (block - 1) / 2 * (running or 0.0))


@dataclass(frozen=True)
class OpenContexts:
    """The vLLM request ledger (exporter/serve/open_context.py) at a window's two ends: what the requests
    open at each end read. The poller keeps it across polls; None at an end where the page cannot say."""

    start: OpenContext | None = None
    end: OpenContext | None = None


def derive_reading(deployment: Deployment, target: Target, snapshot: Snapshot, window: Window | None, *,
                   now_seconds: float, scrape_duration_seconds: float, contexts: OpenContexts | None = None,
                   window_seconds: float | None = None,
                   predicting: tuple[model.ServingSetup, str] | None = None) -> Reading:
    """Everything derivable from one snapshot, its window over the previous one, and the model.

    `window_seconds`: the time between the window's two polls, for the rates a prefill server is read by.
    `predicting`: the setup to predict with and its bandwidth's source (SetupsInUse.predicting_setup: the
    online fit's once it replaced the seed); None: the deployment's seed."""
    notes: list[str] = list(snapshot.missing)
    contexts = contexts or OpenContexts()
    predicting_with, rates_source = predicting or predicting_setup(deployment, None)
    setup = page_setup(predicting_with, snapshot.kv_cache_dtype, snapshot.block_size_tokens,
                       snapshot.kv_cache_bytes_per_token)
    running = _valid(snapshot.requests_running, "requests_running", notes)
    waiting = _valid(snapshot.requests_waiting, "requests_waiting", notes)
    waiting_for_capacity = _valid(snapshot.requests_waiting_for_capacity, "requests_waiting_for_capacity", notes)
    occupancy = _occupancy(setup, snapshot, running, notes, contexts.end)
    tokens = occupancy.tokens_in_flight
    role = server_role(deployment.role, snapshot)

    measured_mean = prefill = prefill_context = server_bytes = None
    median: Median = (None, None, None)
    prefill_mix = None
    server_wide = "inter_token_latency" in snapshot.server_wide
    if window is not None:
        if not server_wide:
            measured_mean = _valid(window.measured_step_mean_seconds, "measured_step_seconds", notes)
            point, lower, upper = _median(window)
            median = (_valid(point, MEDIAN_FIELDS[0], notes), _valid(lower, MEDIAN_FIELDS[1], notes),
                      _valid(upper, MEDIAN_FIELDS[2], notes))
        prefill = _valid(window.prefill_tokens_per_step, "prefill_tokens_per_step", notes)
        prefill_mix = window.prefill_mix
        prefill_context = _valid(window.prefill_mean_context_tokens, "prefill_mean_context_tokens", [])
        server_bytes = _valid(window.server_read_bytes_per_step, "server_step_read_bytes", notes)
        notes.extend(window.notes)
        if window.admission_rejections:
            notes.append(f"the server refused {window.admission_rejections:.0f} requests at its queue limits in "
                         "the window: demand beyond what its tokens in flight show")
    if server_wide:
        notes.append("measured step: the page's ITL histogram is server-wide (no engine label): "
                     "exported on the server-wide series, against a server-wide prediction")
    if measured_mean == 0:
        measured_mean = None  # a zero step time is no measurement
    if prefill is None:
        notes.append("prefill_tokens_per_step: unknown, predicting decode only")

    per_step = _tokens_per_step(snapshot, window)
    if per_step != 1.0:
        notes.append(f"speculative decoding: {per_step:.2f} tokens per stream per step; the step budget and the "
                     "per-user speed are in tokens")
    # The target is per user in tokens: a step yielding k tokens per stream may last k times as long.
    budget_seconds = deployment.step_budget_seconds * per_step
    reading = Reading(
        deployment=deployment.name, target=target.target, model_name=snapshot.model_name,
        engine=snapshot.engine, namespace=target.namespace, pod=target.pod, target_up=True,
        scrape_duration_seconds=scrape_duration_seconds, last_success_timestamp_seconds=now_seconds,
        tokens_in_flight=tokens, kv_cache_capacity_tokens=occupancy.capacity_tokens,
        kv_cache_usage_ratio=occupancy.usage_ratio, kv_cache_used_tokens=occupancy.used_tokens,
        kv_cache_shared_ratio=occupancy.shared_ratio, role=role,
        kv_cache_bytes_per_token=snapshot.kv_cache_bytes_per_token,
        setup_disagreements=setup_disagreements(_configured_setup(deployment, predicting_with), setup),
        kv_cache_reserved_tokens=_valid(snapshot.kv_cache_reserved_tokens, "kv_cache_reserved_tokens", []),
        requests_running=running, requests_waiting=waiting, requests_waiting_for_capacity=waiting_for_capacity,
        preemptions_total=_valid(snapshot.preemptions_total, "preemptions_total", notes),
        prefill_tokens_per_step=prefill, prefill_mean_context_tokens=prefill_context if prefill else None,
        server_step_read_bytes=server_bytes,
        measured_step_seconds=measured_mean, measured_step_median_seconds=median[0],
        measured_step_median_lower_seconds=median[1], measured_step_median_upper_seconds=median[2],
        measured_user_tokens_per_second=per_step / measured_mean if measured_mean else None,
        window_decode_tokens=window.decode_tokens if window is not None and measured_mean else None,
        tokens_per_step=per_step, step_budget_seconds=budget_seconds,
        effective_bandwidth_bytes_per_second=setup.effective_bandwidth_bytes_per_second,
        bandwidth_source=rates_source, kind=snapshot.kind,
        kv_cache_dtype=snapshot.kv_cache_dtype, block_size_tokens=setup.block_size_tokens,
        estimated=occupancy.estimated, sleep_state=snapshot.sleep_state,
    )
    if reading.engine_sleeping:
        return _asleep(reading, snapshot, notes)
    if role == "prefill":
        return _prefill_server(reading, setup, snapshot, window, window_seconds, notes)
    if tokens is None or running is None:
        notes.append("predicted_step_seconds: needs tokens in flight and running requests")
        reading = replace_reading(reading, token_budget_tokens=_token_budget(setup, budget_seconds, tokens, running),
                                  notes=tuple(notes))
        return replace_reading(reading, lacking=_lacking(reading, snapshot))
    # Draft tokens are verified in the step: query tokens beside one per request, in its GEMMs (on a
    # memory-bound step they add little; attention reads the same KV once for all of a request's queries).
    drafts = (window.draft_tokens_per_step or 0.0) if window is not None else 0.0
    prefill_load = _PrefillLoad(prefill or 0.0, reading.prefill_mean_context_tokens, drafts, prefill_mix)
    prediction, predicted = _predicted_load(setup, tokens, running, prefill_load)
    token_budget = _token_budget(setup, budget_seconds, tokens, running)
    # The window's start, only where a measurement is set beside it (this runs on every poll of every
    # target): this engine's measured step, the server-wide one its prediction is combined into
    # (server_wide_reading), or the server's bytes.
    scored = measured_mean or server_bytes or (server_wide and window is not None and window.measured_step_mean_seconds)
    start = _window_start_load(setup, window, contexts.start) if scored else None
    window_predicted: float | None = predicted
    window_bytes = None
    if start is not None and start[1] == 0 and running == 0 and measured_mean:
        # Requests came and went between two polls that each found none running: the window's steps ran a
        # load neither end saw, and predicting them at an empty batch reads as a slow model (a real vLLM,
        # tests/data/vllm-0.32.0-cpu: one 240-token request between two idle polls, 42 token gaps).
        window_predicted = None
        notes.append(WINDOW_LOAD_UNSEEN)
    elif start is not None:
        first, at_start = _predicted_load(setup, *start, prefill_load)
        window_predicted = (at_start + predicted) / 2.0
        # Exact where bytes grow linearly with the tokens in flight, as they do while every request adds
        # one token a step.
        window_bytes = (first.read_bytes + prediction.read_bytes) / 2.0
    reading = replace_reading(
        reading,
        step_read_bytes=prediction.read_bytes,
        # Our bytes per step over the window beside the server's sum over the same steps.
        step_read_bytes_ratio=window_bytes / server_bytes if window_bytes is not None and server_bytes else None,
        predicted_step_seconds=predicted,
        predicted_memory_step_seconds=prediction.memory_seconds,
        predicted_compute_step_seconds=prediction.compute_seconds,
        predicted_user_tokens_per_second=per_step / predicted,
        window_predicted_step_seconds=window_predicted,
        prediction_error_ratio=((window_predicted - measured_mean) / measured_mean
                                if measured_mean and window_predicted is not None else None),
        token_budget_tokens=token_budget,
        token_budget_utilization_ratio=tokens / token_budget if token_budget else None,
        notes=tuple(notes),
        prefill_mix=tuple(prefill_mix) if prefill_mix else None,
    )
    return replace_reading(reading, lacking=_lacking(reading, snapshot))


def _prefill_server(reading: Reading, setup: model.ServingSetup, snapshot: Snapshot, window: Window | None,
                    window_seconds: float | None, notes: list[str]) -> Reading:
    """A prefill-only server's reading: no decode step to predict or page on (no stream waits on its steps,
    and the KV it holds for the decode side to pull is no context being decoded), a prefill budget instead:
    the prompt tokens it computes a second against what its compute allows at the window's chunks."""
    notes.append("role prefill: no decode step predicted or paged on; prefill budget = computed prompt tokens a "
                 "second against what the device computes")
    computed = window.prompt_tokens_computed if window is not None else None
    rate = computed / window_seconds if computed is not None and window_seconds and window_seconds > 0 else None
    per_step = reading.prefill_tokens_per_step or PREFILL_CAPACITY_CHUNK_TOKENS
    capacity = model.prefill_tokens_per_second(setup, per_step, reading.prefill_mean_context_tokens)
    ttft = window.time_to_first_token_mean_seconds if window is not None else None
    prefill = replace_reading(
        reading, step_budget_seconds=None, measured_step_seconds=None, measured_step_median_seconds=None,
        measured_step_median_lower_seconds=None, measured_step_median_upper_seconds=None,
        measured_user_tokens_per_second=None, tokens_per_step=None,
        prefill_tokens_per_second=rate, prefill_capacity_tokens_per_second=capacity,
        prefill_utilization_ratio=rate / capacity if rate is not None and capacity > 0 else None,
        measured_time_to_first_token_seconds=_valid(ttft, "measured_time_to_first_token_seconds", notes),
        notes=tuple(notes))
    return replace_reading(prefill, lacking=_lacking(prefill, snapshot))


def _asleep(reading: Reading, snapshot: Snapshot, notes: list[str]) -> Reading:
    """A sleeping engine's reading: no batch to predict, no steps to measure, no KV cache to fill.

    Its zero running requests, empty cache and still ITL would otherwise read as an idle engine with
    its whole token budget free, while it serves nothing until woken (and sleep released its KV
    memory). Those values are left out, so no step alert looks at it, and the sleep is exported.
    """
    notes.append(f"engine asleep (vllm:engine_sleep_state: {snapshot.sleep_state}): no prediction, no measured "
                 "step, no KV occupancy until it wakes")
    asleep = replace_reading(reading, tokens_in_flight=None, kv_cache_capacity_tokens=None, kv_cache_usage_ratio=None,
                     kv_cache_used_tokens=None, kv_cache_shared_ratio=None,
                     prefill_tokens_per_step=None, measured_step_seconds=None, measured_step_median_seconds=None,
                     measured_user_tokens_per_second=None,
                     measured_step_median_lower_seconds=None, measured_step_median_upper_seconds=None,
                     server_step_read_bytes=None, estimated=(), notes=tuple(notes))
    return replace_reading(asleep, lacking=_lacking(asleep, snapshot))


@dataclass(frozen=True)
class _PrefillLoad:
    """What a window's steps computed beside one token per running request: prefill tokens per step, the
    mean context they attended to (None: not known, their attention not counted), the draft tokens
    speculative decoding verifies per step, and the steps' mix by prefill tokens."""

    tokens_per_step: float
    mean_context_tokens: float | None = None
    draft_tokens_per_step: float = 0.0
    mix: Sequence[tuple[float, float]] | None = None

    @property
    def gemm_mean_context_tokens(self) -> float | None:
        """The mean context spread over the prefill and draft tokens the GEMMs count, so that the prefill
        tokens alone carry the attention: a draft token's attention reads its request's KV with the
        request's own query, which the KV term counts."""
        if self.mean_context_tokens is None or self.tokens_per_step <= 0:
            return None
        return self.mean_context_tokens * self.tokens_per_step / (self.tokens_per_step + self.draft_tokens_per_step)


def _predicted_load(setup: model.ServingSetup, tokens: float, running: float, prefill: _PrefillLoad
                    ) -> tuple[model.StepPrediction, float]:
    """A load's step at the window's mean prefill, and the mean of the window's steps: with its
    prefill mix, the mean over the mix, not the step at the mean prefill (DESIGN §2)."""
    drafts, context = prefill.draft_tokens_per_step, prefill.gemm_mean_context_tokens
    step = model.predict_step(setup, model.groups_from_total(tokens, running), prefill.tokens_per_step + drafts,
                              prefill_mean_context_tokens=context)
    if not prefill.mix:
        return step, step.step_seconds
    return step, model.mean_step_over_mix(setup, step, [(part + drafts, share) for part, share in prefill.mix],
                                          context)


def _window_start_load(setup: model.ServingSetup, window: Window | None, context: OpenContext | None = None
                       ) -> tuple[float, float] | None:
    """(tokens in flight, running requests) at the window's first snapshot; None where unknown.

    The measured step is the mean over the window's tokens, while the end's load is what the poll
    reads: when long sessions finish mid-window, the end holds a third fewer tokens than most of the
    window's steps ran with (a real vLLM, benchmarks/results/real_vllm_online.md at commit 54bfaa1: a 97 ms window
    predicted at the end's 15,200 tokens, -37%, where its start held 21,300). The mean of the two ends
    is exact while the load changes at a steady rate, and much closer than either end when it jumps."""
    start = window.start if window is not None else None
    if start is None:
        return None
    unused: list[str] = []  # the start's notes were said when it was the current poll
    running = _valid(start.requests_running, "requests_running", unused)
    tokens = _occupancy(setup, start, running, unused, context).tokens_in_flight
    return None if tokens is None or running is None else (tokens, running)


def server_wide_reading(readings: list[Reading], window: Window | None) -> Reading | None:
    """One series for a server whose ITL histogram covers all its engines (SGLang under --dp-size):
    the measured step next to the prediction of the same thing, the engines' predictions weighted by
    the tokens each generates (running / step), never one engine's prediction against it.

    Every token of engine i is one observation of its step t_i, and it yields running_i / t_i tokens a
    second, so the histogram's mean is R / sum(running_i / t_i), R the running requests of all engines.
    No engine's page says its own t_i (the scheduler-side families of SGLang 0.5.23 count passes and
    tokens per dp_rank, not time: observability/metrics_collector.py l. 737-741 and 1032-1039;
    forward_execution_seconds_total, l. 1054-1061, grows only under SGLANG_ENABLE_METRICS_DEVICE_TIMER,
    managers/scheduler_components/metrics_reporter.py l. 68 and 326-339, and counts GPU time, not the
    step a stream waits for; scheduler_idle_seconds_total, l. 1062-1068, is idle wall time). So each
    engine is given the share of the measured mean its own prediction says: measured x p_i / P, P the
    combined prediction. The shares combine back to the measured mean exactly, and are the engines'
    true steps wherever the model ranks the engines right; they follow the prediction, which follows
    the fit, so they converge as it does (tests/serve/test_sglang_dp_calibration.py). The engines' windows,
    with their own tokens and running requests, are what the online fit learns from (`ranks`;
    online_calibration.windows_from_readings): the server-wide sums cannot be fitted, each engine
    reading the weights itself, not once for all."""
    if not readings:
        return None
    first = readings[0]
    measured = None
    median: Median = (None, None, None)
    if window is not None:
        measured = window.measured_step_mean_seconds or None
        median = _median(window)
    predicted = _server_wide_step([(r.requests_running, r.predicted_step_seconds) for r in readings])
    # The error sets the measured mean beside the engines' predictions for the window's load.
    window_predicted = _server_wide_step([(r.requests_running, r.window_predicted_step_seconds) for r in readings])
    shares: tuple[Reading, ...] = ()
    # Only when every engine that generates tokens has a prediction: another engine's tokens are in the
    # measured mean too, and no share could be told for it. Shared by the end's predictions, as the
    # engines' fit windows carry the end's load (online_calibration.windows_from_readings).
    generating = [r for r in readings if r.requests_running]
    if predicted and measured and all(r.predicted_step_seconds for r in generating):
        shares = tuple(replace_reading(r, measured_step_seconds=measured * r.predicted_step_seconds / predicted)
                       for r in generating if r.predicted_step_seconds)
    return Reading(
        deployment=first.deployment, target=first.target, model_name=first.model_name, engine="",
        namespace=first.namespace, pod=first.pod, target_up=True,
        scrape_duration_seconds=first.scrape_duration_seconds,
        last_success_timestamp_seconds=first.last_success_timestamp_seconds,
        predicted_step_seconds=predicted, measured_step_seconds=measured, measured_step_median_seconds=median[0],
        measured_step_median_lower_seconds=median[1], measured_step_median_upper_seconds=median[2],
        window_predicted_step_seconds=window_predicted,
        prediction_error_ratio=(window_predicted - measured) / measured if window_predicted and measured else None,
        predicted_user_tokens_per_second=(first.tokens_per_step or 1.0) / predicted if predicted else None,
        tokens_per_step=first.tokens_per_step,
        step_budget_seconds=first.step_budget_seconds, kind=first.kind,
        notes=("server-wide: the ITL histogram has no engine label; prediction weighted by each engine's token rate",),
        ranks=shares,
    )


def _server_wide_step(ranks: Sequence[tuple[float | None, float | None]]) -> float | None:
    """The mean step a server-wide ITL histogram shows for engines of (running, step): R / sum(n_i / t_i)."""
    known = [(running, step) for running, step in ranks if running and step]
    if not known:
        return None
    return sum(running for running, _ in known) / sum(running / step for running, step in known)


def _tokens_per_step(snapshot: Snapshot, window: Window | None) -> float:
    """Tokens per stream per step: the window's under speculative decoding; where the window cannot
    tell (a first poll, an idle window), the server's lifetime figure; 1 on a page that shows none."""
    if window is not None and window.tokens_per_step is not None:
        return window.tokens_per_step
    itl = snapshot.inter_token_latency
    lifetime = tokens_per_step(snapshot, snapshot.spec_decode_accepted_tokens_total, itl.count if itl else None)
    return lifetime if lifetime is not None else 1.0


def _median(window: Window) -> Median:
    """The window's median ITL as MEDIAN_FIELDS export it: the point only where its bucket resolves it."""
    return (window.measured_step_median_point_seconds, window.measured_step_median_lower_seconds,
            window.measured_step_median_upper_seconds)


def _lacking(reading: Reading, snapshot: Snapshot) -> tuple[str, ...]:
    """Exported values absent for a reason that lasts: not the routine gaps of a window."""
    absent = [name for name in VALUE_FIELDS if _value_of(reading, name) is None]
    routine = set(WINDOW_FIELDS) | set(OPTIONAL_FIELDS)
    if reading.role == "prefill":
        routine |= set(PREFILL_SERVER_ABSENT)
    if snapshot.inter_token_latency is None:
        routine -= {"measured_step_seconds", *MEDIAN_FIELDS, "prediction_error_ratio"}
    if snapshot.prompt_tokens_total is None or snapshot.engine_steps_total is None:
        routine.discard("prefill_tokens_per_step")
    return tuple(name for name in absent if name not in routine)


def _value_of(reading: Reading, name: str) -> float | None:
    value: float | None = getattr(reading, name.removeprefix("target_"))
    return value


def _token_budget(setup: model.ServingSetup, budget_seconds: float, tokens: float | None,
                  running: float | None) -> float:
    if model.budget_has_closed_form(setup):
        return model.token_budget_tokens(setup, budget_seconds)
    # Non-linear (sliding windows, MoE, a per-request cost): the budget depends on the context per request.
    context = tokens / running if tokens and running else IDLE_CONTEXT_TOKENS
    return model.token_budget_tokens(setup, budget_seconds, context)
