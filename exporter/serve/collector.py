"""The /metrics export: a custom collector building fresh metric families at every scrape.

Fresh families per scrape (no global gauges) so a target, model or engine that disappears also
disappears from the export, and concurrent scrapes never race on shared state. A Reading value that
is None is left out: a missing number is never exported as 0 or NaN. The values are the poll loop's
latest (cached between polls, see DESIGN §2 for why), which the HELP texts say.

Why the raw `Metric` class here and `*MetricFamily` in exporter/admission/metrics.py: every Reading
puts ~30 samples on one label set, so this collector builds each label dict once per Reading and
hands it to `Metric.add_sample` for each family; `GaugeMetricFamily.add_metric` would zip label
names and values into a new dict for every sample (a tenth of a 1,000-target render,
benchmarks/results/scale.md). Admission exports a handful of samples, where the family classes'
label-name/label-value API reads better and costs nothing that matters.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import CollectorRegistry, Metric
from prometheus_client.registry import Collector

from exporter import __version__
from exporter.capacity.architecture import kv_bytes_per_token, weight_bytes
from exporter.serve.config import Deployment
from exporter.serve.discovery import NotReadyPod
from exporter.serve.online_fit_types import MIX_PARTS, fit_mix, setup_key
from exporter.serve.reading import Reading, page_setup
from exporter.serve.setups_in_use import SetupsInUse, predicting_setup
from exporter.serve.window import MEDIAN_RESOLUTION_RATIO

POLLED = " (from the last poll of the server's /metrics)"


@dataclass(frozen=True)
class PerTarget:
    """One per-target family: its name, type, help, and the Reading field it shows."""

    name: str
    kind: str  # gauge | counter
    help: str
    value: Callable[[Reading], float | None]


def _field(name: str) -> Callable[[Reading], float | None]:
    return lambda reading: getattr(reading, name)


PER_TARGET: tuple[PerTarget, ...] = (
    PerTarget("stepbudget_target_up", "gauge",
              "1 if the last poll of the target's /metrics succeeded and was readable, else 0.",
              lambda r: 1.0 if r.target_up else 0.0),
    PerTarget("stepbudget_target_scrape_duration_seconds", "gauge",
              "Seconds the last poll of the target took (fetch and parse).",
              _field("scrape_duration_seconds")),
    PerTarget("stepbudget_target_last_success_timestamp_seconds", "gauge",
              "Unix time of the last successful poll of the target.",
              _field("last_success_timestamp_seconds")),
    PerTarget("stepbudget_tokens_in_flight", "gauge",
              "Tokens every decode step reads: the sum over the running requests of each one's whole context, a "
              "prefix several requests share counted once for each. Not the memory held (stepbudget_kv_cache_used_"
              "tokens): the step prediction, token budget, utilization, admission and autoscaling follow this"
              + POLLED + ".",
              _field("tokens_in_flight")),
    PerTarget("stepbudget_kv_cache_capacity_tokens", "gauge",
              "Tokens one engine's KV cache holds (vllm:cache_config_info; the model's estimate when the page lacks "
              "it, see stepbudget_estimated_info).",
              _field("kv_cache_capacity_tokens")),
    PerTarget("stepbudget_kv_cache_usage_ratio", "gauge",
              "Share of the KV cache held, 0-1: memory, a block several requests share counted once "
              "(vllm:kv_cache_usage_perc)" + POLLED + ".",
              _field("kv_cache_usage_ratio")),
    PerTarget("stepbudget_kv_cache_used_tokens", "gauge",
              "Tokens of KV the cache holds: usage ratio x capacity, a block several requests share counted once. "
              "Memory, not what a step reads (stepbudget_tokens_in_flight): capacity and StepBudgetKVCacheNearlyFull "
              "follow this" + POLLED + ".",
              _field("kv_cache_used_tokens")),
    PerTarget("stepbudget_kv_cache_shared_ratio", "gauge",
              "Share of the tokens in flight whose KV another running request holds too (prefix caching): "
              "1 - KV used / tokens in flight, 0-1; N requests on one shared prompt approach 1 - 1/N.",
              _field("kv_cache_shared_ratio")),
    PerTarget("stepbudget_requests_running", "gauge",
              "Requests in the running batch (vllm:num_requests_running)" + POLLED + ".",
              _field("requests_running")),
    PerTarget("stepbudget_requests_waiting", "gauge",
              "Requests waiting to be scheduled (vllm:num_requests_waiting)" + POLLED + ".",
              _field("requests_waiting")),
    PerTarget("stepbudget_kv_cache_reserved_tokens", "gauge",
              "Tokens of KV cache the running batch has reserved, where the server reports only that (TGI: each "
              "request's prompt + max_new_tokens, tgi_batch_current_max_tokens), not those held; no usage ratio is "
              "derived from it" + POLLED + ".",
              _field("kv_cache_reserved_tokens")),
    PerTarget("stepbudget_requests_waiting_for_capacity", "gauge",
              "Of the waiting requests, those held back by scheduling capacity (batch slots, token budget, KV blocks), "
              "not deferred for another reason (vllm:num_requests_waiting_by_reason{reason=\"capacity\"})"
              + POLLED + ".",
              _field("requests_waiting_for_capacity")),
    PerTarget("stepbudget_preemptions_total", "counter",
              "The server's own preemption counter (vllm:num_preemptions_total)" + POLLED + ".",
              _field("preemptions_total")),
    PerTarget("stepbudget_prefill_tokens_per_step", "gauge",
              "Prompt tokens computed per engine step over the last poll window (prefix-cache hits excluded).",
              _field("prefill_tokens_per_step")),
    PerTarget("stepbudget_prefill_mean_context_tokens", "gauge",
              "Mean context a prompt token computed in the last poll window attended to (its position in its "
              "prompt): a prefill chunk's attention grows with it (vLLM only; docs/engines.md).",
              _field("prefill_mean_context_tokens")),
    PerTarget("stepbudget_step_read_bytes", "gauge",
              "Predicted bytes one decode step reads per GPU: weights plus the KV cache of every running request.",
              _field("step_read_bytes")),
    PerTarget("stepbudget_server_step_read_bytes", "gauge",
              "The server's own estimate of bytes one step reads per GPU, mean over the last poll window "
              "(vLLM --enable-mfu-metrics: vllm:estimated_read_bytes_per_gpu_total / engine steps).",
              _field("server_step_read_bytes")),
    PerTarget("stepbudget_step_read_bytes_ratio", "gauge",
              "Our predicted bytes read per step over the last poll window / the server's own estimate "
              "(docs/model.md says what each counts).",
              _field("step_read_bytes_ratio")),
    PerTarget("stepbudget_predicted_step_seconds", "gauge",
              "Predicted decode step time: overhead + max(memory step, compute step), the mean over the window's mix "
              "of steps where the page gives it.",
              _field("predicted_step_seconds")),
    PerTarget("stepbudget_predicted_memory_step_seconds", "gauge",
              "Predicted memory-bound step time: bytes read per step / effective bandwidth.",
              _field("predicted_memory_step_seconds")),
    PerTarget("stepbudget_predicted_compute_step_seconds", "gauge",
              "Predicted compute-bound step time: 2 x active params x tokens in step / effective compute.",
              _field("predicted_compute_step_seconds")),
    PerTarget("stepbudget_measured_step_seconds", "gauge",
              "Measured mean step time (inter-token latency) over the last poll window.",
              _field("measured_step_seconds")),
    PerTarget("stepbudget_measured_step_median_seconds", "gauge",
              "Median inter-token latency over the last poll window, interpolated from the ITL bucket deltas; "
              f"left out where its bucket is wider than {MEDIAN_RESOLUTION_RATIO:.0%} of it (a histogram does not "
              "say where inside a bucket its observations lie): see the _lower/_upper bounds.",
              _field("measured_step_median_seconds")),
    PerTarget("stepbudget_measured_step_median_lower_seconds", "gauge",
              "Lower edge of the ITL bucket the window's median lies in (0 for the first bucket): at least half "
              "of the window's inter-token latencies are above it.",
              _field("measured_step_median_lower_seconds")),
    PerTarget("stepbudget_measured_step_median_upper_seconds", "gauge",
              "Upper edge of the ITL bucket the window's median lies in: at least half of the window's "
              "inter-token latencies are at or under it (absent when the median is in the +Inf bucket).",
              _field("measured_step_median_upper_seconds")),
    PerTarget("stepbudget_prediction_error_ratio", "gauge",
              "(predicted - measured) / measured step time over the window (predicted for its load: the mean of "
              "its two ends).",
              _field("prediction_error_ratio")),
    PerTarget("stepbudget_predicted_user_tokens_per_second", "gauge",
              "Predicted decode speed of every stream: tokens per step / predicted step time.",
              _field("predicted_user_tokens_per_second")),
    PerTarget("stepbudget_measured_user_tokens_per_second", "gauge",
              "Measured decode speed of every stream over the last poll window: tokens per step / measured step time.",
              _field("measured_user_tokens_per_second")),
    PerTarget("stepbudget_tokens_per_step", "gauge",
              "Tokens each stream gets per engine step: 1, or under speculative decoding 1 + accepted draft tokens "
              "per request-step over the last poll window (vLLM) or sglang:spec_accept_length (SGLang).",
              _field("tokens_per_step")),
    PerTarget("stepbudget_step_budget_seconds", "gauge",
              "Longest step that meets the speed target: headroom x tokens per step / target tokens per second.",
              _field("step_budget_seconds")),
    PerTarget("stepbudget_token_budget_tokens", "gauge",
              "Most tokens in flight whose predicted step fits the step budget (0: the model alone misses it).",
              _field("token_budget_tokens")),
    PerTarget("stepbudget_token_budget_utilization_ratio", "gauge",
              "Tokens in flight / token budget (over 1: the step is over budget).",
              _field("token_budget_utilization_ratio")),
    PerTarget("stepbudget_engine_sleeping", "gauge",
              "1 if the server says the engine sleeps (vllm:engine_sleep_state): no step is predicted or measured "
              "for it and its KV occupancy is left out; 0 if awake.",
              _field("engine_sleeping")),
    # A prefill-only server (P/D disaggregation, stepbudget_target_role_info{role="prefill"}) has no decode
    # step to predict or page on: its budget is prefill compute, and its users feel it as time to first token.
    PerTarget("stepbudget_prefill_tokens_per_second", "gauge",
              "Prompt tokens a prefill server computed per second over the last poll window (prefix-cache hits "
              "excluded).",
              _field("prefill_tokens_per_second")),
    PerTarget("stepbudget_prefill_capacity_tokens_per_second", "gauge",
              "Prompt tokens per second a prefill server's compute allows: effective compute / (2 x active "
              "parameters).",
              _field("prefill_capacity_tokens_per_second")),
    PerTarget("stepbudget_prefill_utilization_ratio", "gauge",
              "Prefill tokens per second / prefill capacity (over 0.9 for 10m raises StepBudgetPrefillOverCapacity).",
              _field("prefill_utilization_ratio")),
    PerTarget("stepbudget_measured_time_to_first_token_seconds", "gauge",
              "Mean time to first token over the last poll window: delta(sum) / delta(count) of the server's TTFT "
              "histogram.",
              _field("measured_time_to_first_token_seconds")),
    PerTarget("stepbudget_decode_tokens_total", "counter",
              "Tokens the streams got after their first, over the poll windows with a measured step since this "
              "daemon first read the engine: the per-user speed objective's total (docs/runbook.md, "
              "StepBudgetSpeedBudgetBurn).",
              _field("decode_tokens_total")),
    PerTarget("stepbudget_decode_tokens_at_target_total", "counter",
              "Of stepbudget_decode_tokens_total, the tokens of poll windows whose measured per-user speed "
              "(stepbudget_measured_user_tokens_per_second) met the deployment's target_tokens_per_second: the "
              "speed objective's good events.",
              _field("decode_tokens_at_target_total")),
)
BANDWIDTH_METRIC = "stepbudget_effective_bandwidth_bytes_per_second"
DEPLOYMENT_TARGETS_METRIC = "stepbudget_deployment_targets"
SPEED_OBJECTIVE_METRIC = "stepbudget_speed_objective_ratio"
# Discovery's lifecycle and the one-process check (exporter/serve/discovery.py, process_identity.py).
NOT_READY_METRIC = "stepbudget_target_not_ready_since_timestamp_seconds"
STARTUP_ALLOWANCE_METRIC = "stepbudget_target_startup_allowance_seconds"
MIXED_PROCESSES_METRIC = "stepbudget_target_mixed_processes"
BANDWIDTH_HELP = ("Effective memory bandwidth the prediction uses, per GPU; label source: configured, calibrated, "
                  "default (an assumption) or online (fitted from the daemon's own windows).")
# Per deployment, the other fitted terms the prediction uses, with the same source label, and the online fit.
PARAMETER_FAMILIES = (
    ("stepbudget_step_overhead_seconds", "Per-step overhead the prediction uses (scheduling, launches).",
     "step_overhead_seconds"),
    ("stepbudget_per_request_seconds", "Per-running-request cost per step the prediction uses (sampling, bookkeeping).",
     "per_request_seconds"),
    ("stepbudget_effective_compute_flops_per_second", "Effective dense compute the prediction uses, per GPU.",
     "effective_compute_flops_per_second"),
)
# The online fit's name of each exported term (online_fit_types.Parameters), and back.
FIT_PARAMETERS = {"effective_bandwidth_bytes_per_second": "bandwidth_bytes_per_second",
                  "step_overhead_seconds": "step_overhead_seconds", "per_request_seconds": "per_request_seconds",
                  "effective_compute_flops_per_second": "compute_flops_per_second"}
EXPORTED_PARAMETERS = {fitted: exported for exported, fitted in FIT_PARAMETERS.items()}
# What a window's online fit needs beyond the per-target gauges, so that after a restart the fit
# reads its windows back from Prometheus as it had them (exporter/serve/online_seed.py).
MIX_TOKENS_METRIC = "stepbudget_prefill_mix_tokens"
MIX_SHARE_METRIC = "stepbudget_prefill_mix_share_ratio"
WINDOW_SETUP_METRIC = "stepbudget_window_setup"
# Per target metadata (info families: the sample names add `_info`).
ROLE_METRIC = "stepbudget_target_role"
DISAGREEMENT_METRIC = "stepbudget_setup_disagreement"


class StepBudgetCollector(Collector):
    """Builds every stepbudget family from the poller's latest readings and the config."""

    def __init__(self, readings: Callable[[], Sequence[Reading]], deployments: Sequence[Deployment],
                 deployment_targets: Callable[[], Sequence[tuple[str, int]]] = tuple,
                 not_ready: Callable[[], Sequence[NotReadyPod]] = tuple,
                 mixed_targets: Callable[[], Collection[tuple[str, str]]] = frozenset,
                 setups_in_use: SetupsInUse | None = None) -> None:
        self._readings = readings
        self._setups_in_use = SetupsInUse() if setups_in_use is None else setups_in_use  # the online fit's
        self._deployments = tuple(deployments)
        self._deployment_targets = deployment_targets
        self._not_ready = not_ready
        self._mixed_targets = mixed_targets
        self._setup_keys = {deployment.name: setup_key(deployment.resolved) for deployment in self._deployments}
        self._configured_kv = {deployment.name: deployment.kv_cache_dtype for deployment in self._deployments}

    def describe(self) -> Iterable[Metric]:
        return []  # no auto-describe: collecting at registration would be pointless work

    def generation(self) -> tuple[object, ...]:
        """What the families are built from (the readings and the setups the deployments predict with,
        which the online fit swaps): equal from one call to the next exactly when collect() would export
        the same. The poller publishes a new tuple per poll, and a refit a new InUse, so between polls
        these are the same objects and comparing them costs little."""
        return (tuple(self._readings()), tuple(self._setups_in_use.get(d.name) for d in self._deployments),
                tuple(self._deployment_targets()), tuple(self._not_ready()), frozenset(self._mixed_targets()))

    def collect(self) -> Iterator[Metric]:
        readings = list(self._readings())
        # Each reading's label set once per scrape, shared by its ~30 samples (never mutated after):
        # building it per sample was a tenth of a 1,000-target scrape (benchmarks/results/scale.md).
        labelled = [(reading, reading.labels) for reading in readings]
        for spec in PER_TARGET:
            family = Metric(spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name,
                            spec.help, spec.kind)
            add_sample, name, value_of = family.add_sample, spec.name, spec.value
            for reading, labels in labelled:
                value = value_of(reading)
                if value is not None:
                    add_sample(name, labels, float(value))
            yield family
        bandwidth = Metric(BANDWIDTH_METRIC, BANDWIDTH_HELP, "gauge")
        for reading, labels in labelled:
            if reading.effective_bandwidth_bytes_per_second is not None and reading.bandwidth_source:
                bandwidth.add_sample(BANDWIDTH_METRIC, {**labels, "source": reading.bandwidth_source},
                                     reading.effective_bandwidth_bytes_per_second)
        yield bandwidth
        estimated = Metric("stepbudget_estimated", "Marks a value that is an estimate, not read off the page: "
                           "label quantity names the stepbudget_ series, reason why (docs/operations.md).", "info")
        for reading, labels in labelled:
            for quantity, reason in reading.estimated:
                estimated.add_sample("stepbudget_estimated_info",
                                     {**labels, "quantity": quantity, "reason": reason}, 1.0)
        yield estimated
        yield from self._roles_and_disagreements(labelled)
        yield from self._lifecycle(labelled)
        yield from self._fit_windows(labelled)
        yield from self._per_deployment(readings)
        targets = Metric(DEPLOYMENT_TARGETS_METRIC, "Targets the last poll found for the deployment (discovery, or "
                         "its Prometheus query; this shard's share when sharded): 0 means it watches nothing.", "gauge")
        for name, count in self._deployment_targets():
            targets.add_sample(DEPLOYMENT_TARGETS_METRIC, {"deployment": name}, float(count))
        yield targets
        build = Metric("stepbudget_build", "stepbudget build information.", "info")
        build.add_sample("stepbudget_build_info", {"version": __version__}, 1.0)
        yield build

    def _roles_and_disagreements(self, labelled: Sequence[tuple[Reading, dict[str, str]]]) -> Iterator[Metric]:
        """Per target, what the server is in a prefill/decode split (a prefill server has no decode-step
        series, so a dashboard or rule tells "no prediction" from "prefill only" by this), and every figure
        of its page that disagrees with the configured model (the page's wins; logged once)."""
        roles = Metric(ROLE_METRIC, "The target's role in a prefill/decode split: label role is prefill (no decode "
                       "step: a prefill budget instead), decode (prompts arrive by KV transfer) or both; absent "
                       "while unknown.", "info")
        disagreements = Metric(DISAGREEMENT_METRIC, "A figure the target's page gives that disagrees with the "
                               "configured model: label quantity names it, configured and page the two values "
                               "(the page's is used; docs/operations.md).", "info")
        for reading, labels in labelled:
            if reading.role is not None:
                roles.add_sample(ROLE_METRIC + "_info", {**labels, "role": reading.role}, 1.0)
            for quantity, configured, page in reading.setup_disagreements:
                disagreements.add_sample(DISAGREEMENT_METRIC + "_info", {
                    **labels, "quantity": quantity, "configured": configured, "page": page}, 1.0)
        yield roles
        yield disagreements

    def _lifecycle(self, labelled: Sequence[tuple[Reading, dict[str, str]]]) -> Iterator[Metric]:
        """Per answering target, whether its pages come from more than one process; per Kubernetes pod not
        Ready (not polled), since when; per Kubernetes deployment, how long a pod may take to become Ready."""
        mixed_targets = self._mixed_targets()
        mixed = Metric(MIXED_PROCESSES_METRIC, "1 while the target's pages come from more than one process (a "
                       "load-balanced URL: process_start_time_seconds or the counters' _created differ between "
                       "polls): no window is computed from them, so no measured step or prefill; else 0.", "gauge")
        for reading, labels in labelled:
            if reading.target_up:
                mixed.add_sample(MIXED_PROCESSES_METRIC, labels,
                                 1.0 if (reading.deployment, reading.target) in mixed_targets else 0.0)
        yield mixed
        waiting = Metric(NOT_READY_METRIC, "Unix time since which a Kubernetes pod the deployment's selector "
                         "matches has not been Ready (its Ready condition's last transition, or its creation): "
                         "not polled until it is; StepBudgetTargetNotReady past the startup allowance.", "gauge")
        for pod in self._not_ready():
            waiting.add_sample(NOT_READY_METRIC, pod.labels, pod.since_seconds)
        yield waiting
        allowance = Metric(STARTUP_ALLOWANCE_METRIC, "How long a pod of the deployment may stay not Ready before "
                           "StepBudgetTargetNotReady (config targets.kubernetes.startup_allowance).", "gauge")
        for deployment in self._deployments:
            if deployment.kubernetes is not None:
                allowance.add_sample(STARTUP_ALLOWANCE_METRIC, {"deployment": deployment.name},
                                     deployment.kubernetes.startup_allowance_seconds)
        yield allowance

    def _fit_windows(self, labelled: Sequence[tuple[Reading, dict[str, str]]]) -> Iterator[Metric]:
        """Per target, what its window's online fit needs beyond the gauges: the window's steps by
        prefill tokens (at most MIX_PARTS parts, the unused ones 0, so no part lingers from an
        earlier window) and the setup the window ran on."""
        tokens = Metric(MIX_TOKENS_METRIC, "The last poll window's engine steps in parts by prefill tokens "
                        "(vllm:iteration_tokens_total's buckets; label part, 0 the fewest): prompt tokens "
                        "computed per step in the part. What the online fit reads back after a restart.", "gauge")
        shares = Metric(MIX_SHARE_METRIC, "Share of the last poll window's engine steps in the part (0-1; "
                        "the parts sum to 1, unused parts 0).", "gauge")
        setups = Metric(WINDOW_SETUP_METRIC, "The setup a target's windows ran on: setup (the deployment's "
                        "model, device, tensor parallelism and weight bytes, hashed; stepbudget_model_info has "
                        "it too), and the KV cache dtype and block size predicted with. The online fit reads "
                        "back from Prometheus only the windows of the setup it fits.", "info")
        for reading, labels in labelled:
            if not reading.target_up or reading.tokens_in_flight is None:
                continue
            mix = fit_mix(reading.prefill_mix)
            if mix:
                for part in range(MIX_PARTS):
                    part_tokens, part_share = mix[part] if part < len(mix) else (0.0, 0.0)
                    part_labels = {**labels, "part": str(part)}
                    tokens.add_sample(MIX_TOKENS_METRIC, part_labels, part_tokens)
                    shares.add_sample(MIX_SHARE_METRIC, part_labels, part_share)
            setup = self._setup_keys.get(reading.deployment)
            if setup is not None:
                setups.add_sample(WINDOW_SETUP_METRIC + "_info", {
                    **labels, "setup": setup,
                    "kv_cache_dtype": reading.kv_cache_dtype or self._configured_kv[reading.deployment],
                    "block_size": str(reading.block_size_tokens or "")}, 1.0)
        yield tokens
        yield shares
        yield setups

    def _per_deployment(self, readings: Sequence[Reading]) -> Iterator[Metric]:
        kv = Metric("stepbudget_kv_bytes_per_token", "KV cache bytes one token costs per GPU, all layers.", "gauge")
        weights = Metric("stepbudget_weight_bytes", "Model weight bytes resident on each GPU.", "gauge")
        scales = Metric("stepbudget_deployment_scales_to_zero", "1 where the deployment runs no server at times on "
                        "purpose (scales_to_zero): StepBudgetNoTargets stays silent for it; else 0.", "gauge")
        objective = Metric(SPEED_OBJECTIVE_METRIC, "The speed SLO (speed_objective): the share of decode tokens to "
                           "stream at or above target_tokens_per_second, 0-1; the burn-rate rules read it.", "gauge")
        info = Metric("stepbudget_model", "The model and hardware each deployment is predicted with; "
                      "kv_cache_dtype is the servers' own where their pages say it "
                      "(configured_kv_cache_dtype: the config's).",
                      "info")
        page_dtypes: dict[str, set[str]] = {}
        page_bytes: dict[str, set[float]] = {}
        for reading in readings:
            if reading.kv_cache_dtype and reading.target_up:
                page_dtypes.setdefault(reading.deployment, set()).add(reading.kv_cache_dtype)
            if reading.kv_cache_bytes_per_token and reading.target_up:
                page_bytes.setdefault(reading.deployment, set()).add(reading.kv_cache_bytes_per_token)
        for deployment in self._deployments:
            dtypes, allocated = page_dtypes.get(deployment.name, set()), page_bytes.get(deployment.name, set())
            page_dtype = next(iter(dtypes)) if len(dtypes) == 1 else None
            # The servers' own KV bytes per token where they all say the same (a float32 server behind a
            # bfloat16 config.json: KV and weights twice what the config says).
            setup = page_setup(deployment.resolved.setup, page_dtype, None,
                               next(iter(allocated)) if len(allocated) == 1 else None)
            arch = setup.architecture
            labels = {"deployment": deployment.name}
            kv.add_sample(kv.name, labels,
                          kv_bytes_per_token(arch, setup.kv_bytes_per_element, setup.tensor_parallel))
            weights.add_sample(weights.name, labels,
                               weight_bytes(arch, setup.weight_bytes_per_param, setup.tensor_parallel))
            objective.add_sample(objective.name, labels, deployment.speed_objective)
            scales.add_sample(scales.name, labels, 1.0 if deployment.scales_to_zero else 0.0)
            info.add_sample("stepbudget_model_info", {
                "deployment": deployment.name, "model": deployment.model, "gpu": deployment.gpu,
                "tensor_parallel": str(deployment.tensor_parallel),
                "kv_cache_dtype": page_dtype or deployment.kv_cache_dtype,
                "configured_kv_cache_dtype": deployment.kv_cache_dtype,
                "kv_cache_dtype_source": "page" if page_dtype else "config",
                "setup": self._setup_keys[deployment.name],
            }, 1.0)
        yield kv
        yield weights
        yield objective
        yield scales
        yield info
        yield from self._parameters()

    def _parameters(self) -> Iterator[Metric]:
        families = [(Metric(name, help_text + " Label source: configured, calibrated, default or online.", "gauge"),
                     attribute) for name, help_text, attribute in PARAMETER_FAMILIES]
        windows = Metric("stepbudget_online_fit_windows", "Windows in the deployment's online fit (0 while the seed "
                         "is in use).", "gauge")
        residual = Metric("stepbudget_online_fit_residual_ratio", "Median |relative residual| of the windows in the "
                          "deployment's online fit.", "gauge")
        held = Metric("stepbudget_online_fit_held", "A term the deployment's online fit keeps at its seed because "
                      "its windows do not identify it: label parameter names the stepbudget_ series, reason why "
                      "(docs/operations.md).", "info")
        for deployment in self._deployments:
            in_use = self._setups_in_use.get(deployment.name)
            setup, _ = predicting_setup(deployment, in_use)
            labels = {"deployment": deployment.name}
            for family, attribute in families:
                source = (in_use.source_of(FIT_PARAMETERS[attribute]) if in_use is not None
                          else deployment.resolved.bandwidth_source)
                family.add_sample(family.name, {**labels, "source": source}, float(getattr(setup, attribute)))
            if in_use is not None:
                windows.add_sample(windows.name, labels, float(in_use.fit_windows))
                if in_use.fit_residual_ratio is not None:
                    residual.add_sample(residual.name, labels, in_use.fit_residual_ratio)
                for term in in_use.held:
                    held.add_sample("stepbudget_online_fit_held_info", {
                        **labels, "parameter": EXPORTED_PARAMETERS[term.parameter], "reason": term.reason}, 1.0)
        for family, _ in families:
            yield family
        yield windows
        yield residual
        yield held


class PageRegistry(CollectorRegistry):
    """A registry that can tell whether its page changed since it was last rendered, so /metrics is
    encoded once per poll (or admission change) instead of once per scrape (exporter/serve/server.py).

    Each collector on it says so with `generation()`: a value equal from one call to the next
    exactly when its families would come out the same. One collector without it and `generation()`
    is None: the page is then rendered at every scrape, as prometheus_client does.
    """

    def __init__(self) -> None:
        super().__init__(auto_describe=False)
        self._sources: list[Collector] = []

    def register(self, collector: Collector) -> None:
        super().register(collector)
        with self._lock:
            self._sources.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        with self._lock:
            self._sources.remove(collector)

    def generation(self) -> tuple[object, ...] | None:
        with self._lock:
            sources = list(self._sources)
        parts = []
        for collector in sources:
            generation = getattr(collector, "generation", None)
            if generation is None:
                return None
            parts.append(generation())
        return tuple(parts)


def make_registry(readings: Callable[[], Sequence[Reading]], deployments: Sequence[Deployment],
                  deployment_targets: Callable[[], Sequence[tuple[str, int]]] = tuple,
                  not_ready: Callable[[], Sequence[NotReadyPod]] = tuple,
                  mixed_targets: Callable[[], Collection[tuple[str, str]]] = frozenset,
                  setups_in_use: SetupsInUse | None = None) -> PageRegistry:
    """A private registry (never the global one) holding only the stepbudget collector."""
    registry = PageRegistry()
    registry.register(StepBudgetCollector(readings, deployments, deployment_targets, not_ready, mixed_targets,
                                          setups_in_use))
    return registry
