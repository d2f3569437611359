"""A Reading: everything the daemon exports and alerts on for one (deployment, target, model_name,
engine), and what it is stated in: its field lists, the setup the server runs (the page's over the
config's: `page_setup`) and the server's role in a prefill/decode split.

Why apart from building one (exporter/serve/derivation.py): the collector, the alert loop, the online
fit and the admission book read Readings and their setup without deriving any, and a field added here
is one the derivation then fills. A value that could not be derived is None, never a valid 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from exporter.capacity import architecture, model
from exporter.capacity.architecture import DTYPE_BYTES, UNQUANTIZED_BYTES_PER_PARAM
from exporter.capacity.kv_cache import hybrid_kv_layout

if TYPE_CHECKING:
    from exporter.serve.snapshot import Snapshot

# The per-target values the collector exports (every stepbudget_<name> but target_up).
VALUE_FIELDS = ("target_scrape_duration_seconds", "target_last_success_timestamp_seconds", "tokens_in_flight",
                "kv_cache_capacity_tokens", "kv_cache_usage_ratio", "kv_cache_used_tokens", "kv_cache_shared_ratio",
                "requests_running", "requests_waiting",
                "kv_cache_reserved_tokens",
                "requests_waiting_for_capacity", "preemptions_total", "prefill_tokens_per_step",
                "prefill_mean_context_tokens", "step_read_bytes",
                "server_step_read_bytes", "step_read_bytes_ratio", "predicted_step_seconds",
                "predicted_memory_step_seconds", "predicted_compute_step_seconds", "measured_step_seconds",
                "measured_step_median_seconds", "measured_step_median_lower_seconds",
                "measured_step_median_upper_seconds", "prediction_error_ratio", "predicted_user_tokens_per_second",
                "measured_user_tokens_per_second", "tokens_per_step", "step_budget_seconds", "token_budget_tokens",
                "token_budget_utilization_ratio", "engine_sleeping", "prefill_tokens_per_second",
                "prefill_capacity_tokens_per_second", "prefill_utilization_ratio",
                "measured_time_to_first_token_seconds", "decode_tokens_total", "decode_tokens_at_target_total")
# Values measured over the window between two polls: absent on a first poll, an idle window or a
# counter reset, which is routine. Absent because the page lacks their source, they are worth a log.
MEDIAN_FIELDS = ("measured_step_median_seconds", "measured_step_median_lower_seconds",
                 "measured_step_median_upper_seconds")
Median = tuple[float | None, float | None, float | None]  # MEDIAN_FIELDS' values
WINDOW_FIELDS = ("measured_step_seconds", *MEDIAN_FIELDS, "prediction_error_ratio", "prefill_tokens_per_step",
                 "measured_user_tokens_per_second")
# Values from families only some releases or server flags give (vLLM 0.32's waiting-by-reason and
# sleep state, --enable-mfu-metrics): their absence is the server's configuration, not worth a log.
# Where the window's prefill tokens stood in their prompts: only vLLM's pages say, and only where the window
# computed some (Window.prefill_mean_context_tokens).
# The share of the context read that is shared only where something is read; the prefill budget only on a
# prefill server (role "prefill"), whose decode-step values are left out by design (PREFILL_SERVER_ABSENT).
OPTIONAL_FIELDS = ("requests_waiting_for_capacity", "server_step_read_bytes", "step_read_bytes_ratio",
                   "prefill_mean_context_tokens",
                   "engine_sleeping", "kv_cache_reserved_tokens", "kv_cache_shared_ratio",
                   "prefill_tokens_per_second", "prefill_capacity_tokens_per_second", "prefill_utilization_ratio",
                   "measured_time_to_first_token_seconds", "decode_tokens_total", "decode_tokens_at_target_total")
PREFILL_SERVER_ABSENT = ("step_read_bytes", "predicted_step_seconds", "predicted_memory_step_seconds",
                         "predicted_compute_step_seconds", "predicted_user_tokens_per_second", "tokens_per_step",
                         "step_budget_seconds", "token_budget_tokens", "token_budget_utilization_ratio")


# Why an exported value is an estimate (the `reason` label of stepbudget_estimated_info).
ESTIMATE_REASONS = {
    "model_capacity": "the page reports no KV capacity: the model's capacity for the configured GPU and memory",
    "hybrid_kv_blocks": "hybrid KV cache (sliding-window and full-attention groups share one block pool): "
                        "derived from block usage, assuming equal contexts",
    "kv_reservation": "the page reports only the KV its batch reserved (TGI: prompt + max_new_tokens per request), "
                      "not the tokens held: an upper bound",
    "kv_memory_held": "the page says only the memory the KV cache holds: a prefix several running requests share "
                      "is counted once though each reads it (low under prefix caching)",
    "aborted_requests": "requests aborted by their clients leave vLLM's counters without a finished record: their "
                        "context is taken out at the mean of the open requests (exact again at the next idle poll)",
}
# The widths a KV element or a weight is stored in (bytes), to tell a page's KV bytes per token as a dtype.
_WIDTH_NAMES = {4.0: "float32", 2.0: "16-bit", 1.0: "8-bit", 0.5: "4-bit"}
_WIDTH_TOLERANCE_RATIO = 0.02
# A server is a P/D decode server where at least this share of its prompt tokens arrived by KV transfer.
_TRANSFERRED_SHARE_FOR_DECODE = 0.5


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
    # What every decode step reads: the sum over the running requests of each one's whole context, a block
    # several requests share counted once for each (docs/model.md, "Two quantities").
    tokens_in_flight: float | None = None
    kv_cache_capacity_tokens: float | None = None
    kv_cache_usage_ratio: float | None = None
    # What the cache holds: a block several requests share counted once (capacity, KVCacheNearlyFull).
    kv_cache_used_tokens: float | None = None
    # The share of the tokens in flight whose KV another running request holds too: 1 - used / in flight.
    kv_cache_shared_ratio: float | None = None
    # The KV the running batch reserved, where the page says only that (TGI): never a usage ratio.
    kv_cache_reserved_tokens: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    # Of the waiting requests, those held back by scheduling capacity (not deferred for other reasons).
    requests_waiting_for_capacity: float | None = None
    preemptions_total: float | None = None
    prefill_tokens_per_step: float | None = None
    # The mean context the window's computed prompt tokens attended to (Window.prefill_mean_context_tokens):
    # what the prediction counts the prefill's attention with.
    prefill_mean_context_tokens: float | None = None
    step_read_bytes: float | None = None
    # The server's own estimate of bytes read per step over the window, and ours over the same window
    # divided by it (docs/model.md says what each counts).
    server_step_read_bytes: float | None = None
    step_read_bytes_ratio: float | None = None
    predicted_step_seconds: float | None = None
    predicted_memory_step_seconds: float | None = None
    predicted_compute_step_seconds: float | None = None
    measured_step_seconds: float | None = None
    # The median ITL only where its bucket resolves it (Window.measured_step_median_point_seconds),
    # and the bounds of that bucket: a coarse histogram says no more.
    measured_step_median_seconds: float | None = None
    measured_step_median_lower_seconds: float | None = None
    measured_step_median_upper_seconds: float | None = None
    prediction_error_ratio: float | None = None
    # The step predicted for the window the measured step covers (not exported): the mean of the
    # predictions at its two ends (derivation's `_window_start_load`). The error sets it beside the measured mean;
    # the exported prediction is the end's, the load the next steps run.
    window_predicted_step_seconds: float | None = None
    predicted_user_tokens_per_second: float | None = None
    # Speculative decoding: tokens each stream gets per engine step (1 without it; Window.tokens_per_step),
    # and the per-user speed the measured step gives: tokens per step / measured step.
    measured_user_tokens_per_second: float | None = None
    tokens_per_step: float | None = None
    # The longest step that meets the per-user target in tokens: headroom x tokens per step / target.
    step_budget_seconds: float | None = None
    token_budget_tokens: float | None = None
    token_budget_utilization_ratio: float | None = None
    effective_bandwidth_bytes_per_second: float | None = None
    bandwidth_source: str | None = None
    kind: str | None = None  # vllm | sglang | tgi
    # The KV cache dtype and block size predicted with: the page's own where it says them.
    kv_cache_dtype: str | None = None
    block_size_tokens: int | None = None
    # Exported values that are estimates, not read off the page: (value name, reason code), see
    # ESTIMATE_REASONS; exported as stepbudget_estimated_info.
    estimated: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    notes: tuple[str, ...] = field(default_factory=tuple)
    # The window's mix of steps by prefill tokens ((tokens, share) pairs; not exported): what the
    # online calibration fits the mean step with, as the prediction does.
    prefill_mix: tuple[tuple[float, float], ...] | None = None
    # Exported values left out for a lasting reason (the page lacks them, or gives unusable numbers).
    lacking: tuple[str, ...] = field(default_factory=tuple)
    # The server's word on the engine's sleep (Snapshot.sleep_state); None where the page does not say.
    sleep_state: str | None = None
    # A server-wide reading's engines (not exported: each has its own series), each with its share of
    # the server-wide measured step (server_wide_reading): what the online fit learns from, per engine.
    ranks: tuple[Reading, ...] = field(default_factory=tuple)
    # What the server does in a prefill/decode split: "prefill" (only prefills: no decode step to page on,
    # a prefill budget instead), "decode" (prompts arrive by KV transfer) or "both"; None before it is known.
    role: str | None = None
    # A prefill server's budget: computed prompt tokens per second over the window, the rate its compute
    # allows (effective compute / 2 x active parameters), their ratio, and the mean time to first token.
    prefill_tokens_per_second: float | None = None
    prefill_capacity_tokens_per_second: float | None = None
    prefill_utilization_ratio: float | None = None
    measured_time_to_first_token_seconds: float | None = None
    # Where the page's own figures disagree with the configured model: (quantity, configured, page),
    # exported as stepbudget_setup_disagreement_info.
    setup_disagreements: tuple[tuple[str, str, str], ...] = field(default_factory=tuple)
    # The KV bytes per token the server allocated, where its page says (Snapshot.kv_cache_bytes_per_token;
    # not exported itself): the fit predicts each window with the setup the reading did (page_setup).
    kv_cache_bytes_per_token: float | None = None
    # The per-user speed objective's evidence (count_decode_tokens): the window's tokens after each stream's
    # first (Window.decode_tokens; not exported), and two counters from this daemon's first window of the
    # engine on: those tokens, and the ones of windows whose measured per-user speed met the target.
    window_decode_tokens: float | None = None
    decode_tokens_total: float | None = None
    decode_tokens_at_target_total: float | None = None

    @property
    def engine_sleeping(self) -> float | None:
        """1 when the server says the engine sleeps, 0 when awake, None when its page does not say."""
        if self.sleep_state is None:
            return None
        return 0.0 if self.sleep_state == "awake" else 1.0

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

    def down(self, *, scrape_duration_seconds: float, keep_values: bool) -> Reading:
        """This reading after a failed poll: up 0; values kept only while not yet stale."""
        if keep_values:
            return replace_reading(self, target_up=False, scrape_duration_seconds=scrape_duration_seconds,
                                   window_decode_tokens=None)
        # The counters stay: a counter that vanished and came back from 0 would read as a reset.
        return Reading(deployment=self.deployment, target=self.target, model_name=self.model_name,
                       engine=self.engine, namespace=self.namespace, pod=self.pod, target_up=False,
                       scrape_duration_seconds=scrape_duration_seconds,
                       last_success_timestamp_seconds=self.last_success_timestamp_seconds,
                       decode_tokens_total=self.decode_tokens_total,
                       decode_tokens_at_target_total=self.decode_tokens_at_target_total)


_READING_FIELDS = frozenset(item.name for item in fields(Reading))


def replace_reading(reading: Reading, **changes: object) -> Reading:
    """`dataclasses.replace(reading, **changes)` for a Reading, without replace's per-field work
    (20 us a call, and each reading of each poll took two). Reading's fields are all init fields
    and it has no __post_init__ (tests/serve/test_reading.py holds it to that), so a copy of its fields
    with the changes is the very object replace would build."""
    if not changes.keys() <= _READING_FIELDS:
        raise TypeError(f"Reading has no field(s) {sorted(changes.keys() - _READING_FIELDS)}")
    new = object.__new__(Reading)
    state = new.__dict__
    state.update(reading.__dict__)
    state.update(changes)
    return new


@lru_cache(maxsize=256)
def page_setup(setup: model.ServingSetup, kv_cache_dtype: str | None, block_size_tokens: int | None,
               kv_bytes_per_token: float | None = None) -> model.ServingSetup:
    """The deployment's setup with the KV dtype and block size the server itself reports, and the KV bytes
    per token it allocated where the page says them: the page knows what the server runs with, the config
    only what someone wrote down. With cache_dtype "auto" the KV cache is in the model's own dtype (0.32.0
    vllm/utils/torch_utils.py l. 438-445), so an unquantized model's weights are in that width too (a
    config.json saying bfloat16 served with --dtype float32: every byte twice what the config says)."""
    changes: dict[str, object] = {}
    page_bytes = _page_kv_bytes(kv_cache_dtype, setup) if kv_cache_dtype is not None else None
    allocated = _allocated_kv_width(setup, kv_bytes_per_token, block_size_tokens)
    if allocated is not None:
        page_bytes = allocated
        auto = (kv_cache_dtype or "auto").lower() == "auto"
        if auto and setup.weight_bytes_per_param >= UNQUANTIZED_BYTES_PER_PARAM \
                and allocated >= UNQUANTIZED_BYTES_PER_PARAM and allocated != setup.weight_bytes_per_param:
            changes["weight_bytes_per_param"] = allocated
    if page_bytes is not None and page_bytes != setup.kv_bytes_per_element:
        changes["kv_bytes_per_element"] = page_bytes
    if block_size_tokens is not None and block_size_tokens != setup.block_size_tokens:
        changes["block_size_tokens"] = block_size_tokens
    return replace(setup, **changes) if changes else setup  # type: ignore[arg-type]  # changes: only numeric fields, mypy sees object


def _allocated_kv_width(setup: model.ServingSetup, kv_bytes_per_token: float | None, block_size_tokens: int | None
                        ) -> float | None:
    """Bytes per KV element from the bytes per token the server allocated, where they are one of the
    widths elements come in; None where the page does not say, or the model's layout is one whose tokens
    do not all hold every layer (sliding-window groups: the page's tokens are group-aware)."""
    if kv_bytes_per_token is None or kv_bytes_per_token <= 0:
        return None
    if hybrid_kv_layout(setup.architecture, block_size_tokens or setup.block_size_tokens) is not None:
        return None
    per_element = architecture.kv_bytes_per_token(setup.architecture, 1.0, setup.tensor_parallel)
    if per_element <= 0:
        return None
    width = kv_bytes_per_token / per_element
    nearest = min(_WIDTH_NAMES, key=lambda known: abs(known - width))
    return nearest if abs(nearest - width) <= _WIDTH_TOLERANCE_RATIO * nearest else None


def setup_disagreements(configured: model.ServingSetup, page: model.ServingSetup) -> tuple[tuple[str, str, str], ...]:
    """Where the page's setup differs from the configured one: (quantity, configured, page), for
    stepbudget_setup_disagreement_info and a log line that says what to change."""
    found: list[tuple[str, str, str]] = []
    arch, tp = configured.architecture, configured.tensor_parallel
    if page.kv_bytes_per_element != configured.kv_bytes_per_element:
        found.append(("kv_bytes_per_token",
                      f"{architecture.kv_bytes_per_token(arch, configured.kv_bytes_per_element, tp):.0f}",
                      f"{architecture.kv_bytes_per_token(arch, page.kv_bytes_per_element, tp):.0f}"))
    if page.weight_bytes_per_param != configured.weight_bytes_per_param:
        found.append(("weight_dtype", _width_name(configured.weight_bytes_per_param),
                      _width_name(page.weight_bytes_per_param)))
    return tuple(found)


def _width_name(bytes_per_element: float) -> str:
    return _WIDTH_NAMES.get(bytes_per_element, f"{bytes_per_element:g} bytes")


def _page_kv_bytes(kv_cache_dtype: str, setup: model.ServingSetup) -> float | None:
    """Bytes per KV element of a page's cache_dtype. vLLM's "auto" is the model's own dtype (0.32.0
    vllm/utils/torch_utils.py l. 438-445): the weights' width where they are unquantized (a float32
    model keeps a float32 cache), else the 16-bit activations a quantized model runs in."""
    name = kv_cache_dtype.lower()
    if name == "auto":
        return max(setup.weight_bytes_per_param, UNQUANTIZED_BYTES_PER_PARAM)
    return DTYPE_BYTES.get(name)


def server_role(configured: str, snapshot: Snapshot) -> str:
    """What the server does in a prefill/decode split: the configured role, or where that is `auto`, the page's.

    A P/D proxy sends the prefill server each request with max_tokens=1 (llm-d, vLLM's NixlConnector proxy):
    every request ends at its first token, so the server samples tokens (generation_tokens_total grows)
    while its ITL histogram, observed only from a request's second token on (0.32.0 vllm/v1/metrics/stats.py
    l. 548-552), stays empty for its whole life. A decode server gets most of its prompt tokens by KV
    transfer (prompt_tokens_by_source_total{source="external_kv_transfer"})."""
    if configured != "auto":
        return configured
    itl, generated = snapshot.inter_token_latency, snapshot.generation_tokens_total
    if itl is not None and itl.count == 0 and generated:
        return "prefill"
    transferred, prompt = snapshot.prompt_tokens_transferred_total, snapshot.prompt_tokens_total
    if transferred and prompt and transferred >= _TRANSFERRED_SHARE_FOR_DECODE * prompt:
        return "decode"
    return "both"


def count_decode_tokens(reading: Reading, prior: Reading | None, target_tokens_per_second: float) -> Reading:
    """The reading with the speed objective's two counters carried on from the engine's prior reading: the
    window's tokens after each stream's first, and those same tokens again where the window's measured
    per-user speed (tokens per step / measured step) met the target. A window is judged as a whole: the
    histogram's mean says how fast the streams went together, not which token came late. No window (a first
    poll, an idle one, a counter reset) adds nothing; a prefill server has no decode speed to judge."""
    if reading.role == "prefill" or not reading.target_up:
        return reading
    total = prior.decode_tokens_total if prior is not None and prior.decode_tokens_total is not None else 0.0
    at_target = (prior.decode_tokens_at_target_total
                 if prior is not None and prior.decode_tokens_at_target_total is not None else 0.0)
    tokens, speed = reading.window_decode_tokens, reading.measured_user_tokens_per_second
    if tokens and tokens > 0 and speed is not None:
        total += tokens
        if speed >= target_tokens_per_second:
            at_target += tokens
    return replace_reading(reading, decode_tokens_total=total, decode_tokens_at_target_total=at_target)
