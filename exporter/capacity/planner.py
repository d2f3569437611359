"""`stepbudget plan`: offline sizing of one model replica on one GPU type.

Built from small functions that return dataclasses so other verbs can reuse the pieces:
`resolve_from_args` turns the shared model flags into a ResolvedSetup (calibrate uses it too),
`predict_loads` predicts one step for a mix of running requests, `budget_context` says which
context per request the token budget assumes, and `build_plan` assembles the whole answer.
Matplotlib is imported only inside `write_plot`, so the plain plan path stays fast.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from exporter.capacity import kv_cache, model
from exporter.capacity.architecture import check_tensor_parallel, kv_bytes_per_token, weight_bytes
from exporter.capacity.deployment import ResolvedSetup, build_setup, load_architecture
from exporter.capacity.model import RequestGroup, ServingSetup, StepPrediction
from exporter.capacity.pools import add_pools_arguments, loads_text
from exporter.capacity.pools import run_if_asked as run_pools_if_asked
from exporter.capacity.presets import CUSTOM_GPU, GPU_FIGURE_FLAGS, DeviceFigures, Gpu, device
from exporter.errors import InputError
from exporter.units import (
    parse_bandwidth_bytes_per_second,
    parse_flops_per_second,
    parse_overhead_seconds,
    parse_size_bytes,
)

DEFAULT_MODEL = "qwen3-8b"
DEFAULT_GPU = "h100-sxm"
DEFAULT_TARGET_TOKENS_PER_SECOND = 50.0
# Context per request the budget assumes for sliding-window and MoE models when no load or
# --context says otherwise: a typical chat turn.
DEFAULT_BUDGET_CONTEXT_TOKENS = 2000.0
CAPACITY_NOTE = (
    "KV capacity is an upper bound: it counts no memory for activations or CUDA graphs unless "
    "--reserved-memory is given"
)

_LOAD = re.compile(r"^\s*(\d+)\s*[xX]\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*$")
_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*$")
_COUNT_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


# --- argument parsing ------------------------------------------------------------------------


def parse_load(text: str) -> RequestGroup:
    """`40x2000` -> 40 requests of 2,000 tokens each."""
    match = _LOAD.match(text)
    if not match:
        raise InputError(f"--load {text!r}: expected the form COUNTxTOKENS, e.g. 40x2000")
    count, tokens = int(match.group(1)), float(match.group(2))
    if count <= 0 or tokens <= 0:
        raise InputError(f"--load {text!r}: count and tokens must both be greater than zero")
    return RequestGroup(count, tokens)


def parse_param_count(text: str) -> float:
    """`8.19e9`, `8190000000` or `8.19B` (K, M, B, T suffixes) -> a parameter count."""
    match = _COUNT.match(text)
    if not match:
        raise InputError(f"--params {text!r}: expected a number such as 8.19e9 or 8.19B")
    value = float(match.group(1)) * _COUNT_UNITS[match.group(2).lower()]
    if not value > 0:
        raise InputError(f"--params {text!r}: must be greater than zero")
    return value


def parse_positive_float(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{flag} {text!r}: expected a number") from None
    if not value > 0:
        raise InputError(f"{flag} {text!r}: must be greater than zero")
    return value


def parse_reserved_bytes(text: str) -> float:
    """Reserved memory may be 0 (the default); anything else is a positive size."""
    if text.strip() in ("0", "0.0"):
        return 0.0
    return parse_size_bytes(text, "--reserved-memory")


def add_setup_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and serving flags `plan` and `calibrate` share."""
    group = parser.add_argument_group("model and GPU")
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"model preset (default {DEFAULT_MODEL}); a Hugging Face id such as Qwen/Qwen3-8B, its "
                            "config.json found in the model config folder or the Hugging Face cache; or the path "
                            "to a config.json or to a model's folder")
    group.add_argument("--gpu", default=DEFAULT_GPU,
                       help=f"GPU preset (default {DEFAULT_GPU}), or `{CUSTOM_GPU}`: a device given by "
                            "--gpu-memory, --gpu-bandwidth and --gpu-flops (all three then required)")
    group.add_argument("--gpu-memory", help="GPU memory, overrides the preset's (MIG slices): bytes or 80GB, 40GiB")
    group.add_argument("--gpu-bandwidth",
                       help="peak memory bandwidth, overrides the preset's: bytes/s or 600GB/s, 2TB/s")
    group.add_argument("--gpu-flops",
                       help="peak dense FLOP/s, overrides the preset's, one figure for every precision: "
                            "125e12 or 125TFLOP/s")
    group.add_argument("--params",
                       help="total parameter count, overrides the preset's or the computed one (8.19e9, 8.19B)")
    group.add_argument("--tp", default="1", help="tensor-parallel GPUs per replica (default 1)")
    group.add_argument("--kv-cache-dtype", default="auto", help="auto (16-bit), fp8, ... (default auto)")
    group.add_argument("--weight-dtype", default=None,
                       help="bf16, fp16, fp8, int8, int4, awq, gptq "
                            "(default: the config.json's quantization_config, else bf16)")
    group.add_argument("--gpu-memory-utilization", default="0.9",
                       help="share of GPU memory the server may use (default 0.9)")
    group.add_argument("--reserved-memory", default="0",
                       help="memory kept for activations and CUDA graphs, e.g. 4GiB "
                            "(default 0: capacity is an upper bound)")
    rates = parser.add_argument_group("rates")
    rates.add_argument("--bandwidth",
                       help="effective memory bandwidth in bytes/s (e.g. 2.01e12 or 2TB/s); "
                            "overrides --bandwidth-efficiency")
    rates.add_argument("--bandwidth-efficiency", default=str(model.DEFAULT_BANDWIDTH_EFFICIENCY),
                       help="share of the datasheet bandwidth reached (default 0.6)")
    rates.add_argument("--compute-efficiency", default=str(model.DEFAULT_COMPUTE_EFFICIENCY),
                       help="share of the datasheet dense FLOP/s reached (default 0.5)")
    rates.add_argument("--step-overhead", help="fixed per-step cost, seconds or 2ms; 0 allowed (default 0)")
    rates.add_argument("--per-request-cost",
                       help="cost per running request per step (sampling, bookkeeping), seconds or 0.08ms; "
                            "`calibrate` fits it from points at two batch sizes (default 0)")


def _parse_tp(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise InputError(f"--tp {text!r}: expected a whole number of GPUs >= 1")
    return int(text)


def _parse_fraction(text: str, flag: str) -> float:
    value = parse_positive_float(text, flag)
    if value > 1:
        raise InputError(f"{flag} {text!r}: must be in (0, 1]")
    return value


def gpu_from_args(args: argparse.Namespace) -> Gpu:
    """`--gpu` with the figure flags: a preset with the given figures replacing its own, or `custom`."""
    memory_flag, bandwidth_flag, flops_flag = GPU_FIGURE_FLAGS
    figures = DeviceFigures(
        memory_bytes=parse_size_bytes(args.gpu_memory, memory_flag) if args.gpu_memory else None,
        peak_bandwidth_bytes_per_second=(parse_bandwidth_bytes_per_second(args.gpu_bandwidth, bandwidth_flag)
                                         if args.gpu_bandwidth else None),
        peak_flops_per_second=parse_flops_per_second(args.gpu_flops, flops_flag) if args.gpu_flops else None,
        names=GPU_FIGURE_FLAGS,
    )
    return device(args.gpu, figures, custom_what=f"--gpu {CUSTOM_GPU}")


def resolve_from_args(args: argparse.Namespace, *, bandwidth_is_calibrated: bool = False) -> ResolvedSetup:
    """Turn the shared flags into a ResolvedSetup; every bad value raises InputError naming its flag."""
    params = parse_param_count(args.params) if args.params else None
    architecture = load_architecture(args.model, params)
    tensor_parallel = _parse_tp(args.tp)
    check_tensor_parallel(architecture, tensor_parallel, "--tp")  # build_setup checks it too, without the flag
    return build_setup(
        architecture,
        gpu_from_args(args),
        tensor_parallel=tensor_parallel,
        weight_dtype=args.weight_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=_parse_fraction(args.gpu_memory_utilization, "--gpu-memory-utilization"),
        reserved_memory_bytes=parse_reserved_bytes(args.reserved_memory),
        bandwidth_bytes_per_second=(parse_bandwidth_bytes_per_second(args.bandwidth, "--bandwidth")
                                    if args.bandwidth else None),
        bandwidth_is_calibrated=bandwidth_is_calibrated,
        bandwidth_efficiency=_parse_fraction(args.bandwidth_efficiency, "--bandwidth-efficiency"),
        compute_efficiency=_parse_fraction(args.compute_efficiency, "--compute-efficiency"),
        step_overhead_seconds=(parse_overhead_seconds(args.step_overhead, "--step-overhead")
                               if args.step_overhead else 0.0),
        per_request_seconds=(parse_overhead_seconds(args.per_request_cost, "--per-request-cost")
                             if args.per_request_cost else 0.0),
    )


def build_parser(parser: argparse.ArgumentParser) -> None:
    add_setup_arguments(parser)
    goal = parser.add_argument_group("speed target and workload")
    goal.add_argument("--target-tps", default=str(DEFAULT_TARGET_TOKENS_PER_SECOND),
                      help="per-user tokens per second to hold (default 50)")
    goal.add_argument("--headroom", default=str(model.DEFAULT_HEADROOM),
                      help="share of each step for decoding; the rest is kept for prompt chunks (default 0.9)")
    goal.add_argument("--load", action="append", default=[], metavar="COUNTxTOKENS",
                      help="running requests, e.g. 40x2000 (repeatable; all loads share one step)")
    goal.add_argument("--prefill-chunk", default="0", metavar="TOKENS",
                      help="prompt tokens processed in every step alongside the loads (default 0)")
    goal.add_argument("--context", action="append", default=[], metavar="TOKENS",
                      help="report how many sequences of this context the cache holds (repeatable)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--plot", metavar="FILE.png", help="write per-user tok/s vs tokens in flight to a PNG")
    add_pools_arguments(parser)  # --pools, --split: exporter/capacity/pools.py


# --- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadPrediction:
    """One decode step with all the given loads running together (plus a prefill chunk)."""

    loads: tuple[RequestGroup, ...]
    prefill_tokens_per_step: float
    step: StepPrediction

    @property
    def tokens_in_flight(self) -> float:
        return self.step.tokens_in_flight

    @property
    def user_tokens_per_second(self) -> float:
        return self.step.user_tokens_per_second


@dataclass(frozen=True)
class BudgetContext:
    """The context per request the token budget assumes (None: closed form, no assumption needed)."""

    context_tokens: float | None
    reason: str


@dataclass(frozen=True)
class ConcurrencyAtContext:
    context_tokens: float
    sequences: int


@dataclass(frozen=True)
class Plan:
    resolved: ResolvedSetup
    target_tokens_per_second: float
    headroom: float
    step_budget_seconds: float
    token_budget_tokens: float
    budget_context: BudgetContext
    kv_bytes_per_token: float
    weight_bytes: float
    kv_cache_bytes: float
    kv_capacity_tokens: int
    single_user_tokens_per_second: float
    load_prediction: LoadPrediction | None
    concurrency: tuple[ConcurrencyAtContext, ...]

    @property
    def setup(self) -> ServingSetup:
        return self.resolved.setup


def predict_loads(setup: ServingSetup, loads: Sequence[RequestGroup],
                  prefill_tokens_per_step: float = 0.0) -> LoadPrediction:
    """All loads decode in the same step: bytes add up, so does compute."""
    step = model.predict_step(setup, list(loads), prefill_tokens_per_step)
    return LoadPrediction(loads=tuple(loads), prefill_tokens_per_step=prefill_tokens_per_step, step=step)


def budget_context(setup: ServingSetup, loads: Sequence[RequestGroup], contexts: Sequence[float]) -> BudgetContext:
    """Plain models need no context (bytes are linear in tokens); sliding windows, MoE and a per-request
    cost do (the step then depends on how the tokens split into requests)."""
    if model.budget_has_closed_form(setup):
        return BudgetContext(None, "closed form: bytes read grow linearly with tokens in flight")
    count = sum(group.count for group in loads)
    if count:
        mean = sum(group.tokens for group in loads) / count
        return BudgetContext(mean, f"mean context of the --load requests ({mean:,.0f} tokens)")
    if contexts:
        return BudgetContext(contexts[0], f"the first --context ({contexts[0]:,.0f} tokens)")
    return BudgetContext(DEFAULT_BUDGET_CONTEXT_TOKENS,
                         f"default {DEFAULT_BUDGET_CONTEXT_TOKENS:,.0f} tokens per request (give --load or --context)")


def build_plan(
    resolved: ResolvedSetup,
    *,
    target_tokens_per_second: float = DEFAULT_TARGET_TOKENS_PER_SECOND,
    headroom: float = model.DEFAULT_HEADROOM,
    loads: Sequence[RequestGroup] = (),
    prefill_tokens_per_step: float = 0.0,
    contexts: Sequence[float] = (),
) -> Plan:
    setup = resolved.setup
    arch, tp = setup.architecture, setup.tensor_parallel
    step_budget = model.step_budget_seconds(target_tokens_per_second, headroom)
    context = budget_context(setup, loads, contexts)
    return Plan(
        resolved=resolved,
        target_tokens_per_second=target_tokens_per_second,
        headroom=headroom,
        step_budget_seconds=step_budget,
        token_budget_tokens=model.token_budget_tokens(setup, step_budget, context.context_tokens),
        budget_context=context,
        kv_bytes_per_token=kv_bytes_per_token(arch, setup.kv_bytes_per_element, tp),
        weight_bytes=weight_bytes(arch, setup.weight_bytes_per_param, tp),
        kv_cache_bytes=kv_cache.kv_cache_bytes(setup),
        kv_capacity_tokens=kv_cache.kv_capacity_tokens(setup),
        single_user_tokens_per_second=model.predict_step(setup, [RequestGroup(1, 1.0)]).user_tokens_per_second,
        load_prediction=predict_loads(setup, loads, prefill_tokens_per_step) if loads else None,
        concurrency=tuple(ConcurrencyAtContext(c, kv_cache.max_concurrency(setup, c)) for c in contexts),
    )


# --- output ----------------------------------------------------------------------------------


def plan_to_json(plan: Plan) -> dict[str, object]:
    setup = plan.setup
    out: dict[str, object] = {
        "model": setup.architecture.name,
        "gpu": plan.resolved.gpu.name,
        "tensor_parallel": setup.tensor_parallel,
        "params": setup.architecture.params,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "weight_bytes": plan.weight_bytes,
        "kv_cache_bytes": plan.kv_cache_bytes,
        "kv_capacity_tokens": plan.kv_capacity_tokens,
        "kv_capacity_note": CAPACITY_NOTE,
        "weights_fit": weights_fit(plan),
        "effective_bandwidth_bytes_per_second": setup.effective_bandwidth_bytes_per_second,
        "bandwidth_source": plan.resolved.bandwidth_source,
        "effective_compute_flops_per_second": setup.effective_compute_flops_per_second,
        "step_overhead_seconds": setup.step_overhead_seconds,
        "per_request_seconds": setup.per_request_seconds,
        "target_tokens_per_second": plan.target_tokens_per_second,
        "headroom": plan.headroom,
        "step_budget_seconds": plan.step_budget_seconds,
        "token_budget_tokens": plan.token_budget_tokens,
        "budget_context_tokens": plan.budget_context.context_tokens,
        "budget_context_reason": plan.budget_context.reason,
        "single_user_tokens_per_second": plan.single_user_tokens_per_second,
    }
    prediction = plan.load_prediction
    if prediction is not None:
        step = prediction.step
        out.update({
            "loads": [asdict(group) for group in prediction.loads],
            "prefill_tokens_per_step": prediction.prefill_tokens_per_step,
            "tokens_in_flight": step.tokens_in_flight,
            "step_read_bytes": step.read_bytes,
            "predicted_memory_step_seconds": step.memory_seconds,
            "predicted_compute_step_seconds": step.compute_seconds,
            "predicted_step_seconds": step.step_seconds,
            "predicted_tokens_per_second_per_user": step.user_tokens_per_second,
            "meets_target": step.step_seconds <= plan.step_budget_seconds,
        })
    if plan.concurrency:
        out["max_concurrency"] = [{"context_tokens": c.context_tokens, "sequences": c.sequences}
                                  for c in plan.concurrency]
    return out


def weights_fit(plan: Plan) -> bool:
    setup = plan.setup
    return plan.weight_bytes + setup.reserved_memory_bytes < setup.gpu_memory_bytes * setup.gpu_memory_utilization


def _gb(value: float) -> str:
    return f"{value / 1e9:,.2f} GB ({value / 2**30:,.2f} GiB)"


def format_plan(plan: Plan) -> str:
    setup, arch = plan.setup, plan.setup.architecture
    rows: list[tuple[str, str]] = [
        ("model", f"{arch.name} ({arch.params / 1e9:,.2f}B params) "
                  f"on {plan.resolved.gpu.name} x{setup.tensor_parallel}"),
        ("KV bytes per token", f"{plan.kv_bytes_per_token:,.0f} B ({plan.kv_bytes_per_token / 1024:,.1f} KiB)"),
        ("weights per GPU", _gb(plan.weight_bytes)),
        ("KV cache memory", _gb(plan.kv_cache_bytes)),
        ("KV capacity", f"{plan.kv_capacity_tokens:,} tokens "
                        "(upper bound: no activations/CUDA graphs unless --reserved-memory)"),
        *([] if weights_fit(plan) else [("WARNING", "the weights do not fit in the usable GPU memory: raise --tp, "
                                                     "use a smaller --weight-dtype or a larger GPU")]),
        ("effective bandwidth", f"{setup.effective_bandwidth_bytes_per_second / 1e12:,.3f} TB/s "
                                f"({plan.resolved.bandwidth_source})"),
        ("one user alone", f"{plan.single_user_tokens_per_second:,.1f} tok/s"),
        ("step budget", f"{plan.step_budget_seconds * 1e3:,.2f} ms "
                        f"({plan.target_tokens_per_second:g} tok/s per user, headroom {plan.headroom:g})"),
        ("token budget", f"{plan.token_budget_tokens:,.0f} tokens in flight"),
        ("budget assumes", plan.budget_context.reason),
    ]
    prediction = plan.load_prediction
    if prediction is not None:
        step = prediction.step
        verdict = "meets" if step.step_seconds <= plan.step_budget_seconds else "MISSES"
        rows += [
            ("loads", loads_text(prediction.loads)
             + (f" + {prediction.prefill_tokens_per_step:,.0f}-token prefill chunk per step"
                if prediction.prefill_tokens_per_step else "")),
            ("tokens in flight", f"{step.tokens_in_flight:,.0f} "
                                 f"({step.tokens_in_flight / plan.kv_capacity_tokens:.0%} of capacity)"
             if plan.kv_capacity_tokens else f"{step.tokens_in_flight:,.0f}"),
            ("predicted step", f"{step.step_seconds * 1e3:,.2f} ms (memory {step.memory_seconds * 1e3:,.2f} ms, "
                               f"compute {step.compute_seconds * 1e3:,.2f} ms, "
                               f"overhead {step.overhead_seconds * 1e3:,.2f} ms"
                               + (f", per-request {step.per_request_seconds * 1e3:,.2f} ms"
                                  if step.per_request_seconds else "") + ")"),
            ("per-user speed", f"{step.user_tokens_per_second:,.1f} tok/s "
                               f"({verdict} the {plan.target_tokens_per_second:g} tok/s target)"),
        ]
    rows += [(f"fits at {c.context_tokens:,.0f} tokens", f"{c.sequences:,} sequences") for c in plan.concurrency]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in rows)


def curve_points(plan: Plan, points: int = 200) -> tuple[list[float], list[float]]:
    """Per-user tok/s against tokens in flight, with requests of the budget's context."""
    context = plan.budget_context.context_tokens or DEFAULT_BUDGET_CONTEXT_TOKENS
    top = max(float(plan.kv_capacity_tokens), plan.token_budget_tokens * 1.5, 4 * context)
    if plan.load_prediction is not None:
        top = max(top, plan.load_prediction.tokens_in_flight * 1.2)
    xs = [top * i / (points - 1) for i in range(points)]
    # The step the model's budget solver checks: tokens split into requests of one context.
    ys = [1.0 / model.step_seconds_at(plan.setup, x, context) for x in xs]
    return xs, ys


def write_plot(plan: Plan, path: str) -> None:
    """Matplotlib is imported here only: the plain plan path must stay fast."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys = curve_points(plan)
    figure, axes = plt.subplots(figsize=(8, 5))
    axes.plot(xs, ys, label="predicted per-user speed")
    axes.axhline(plan.target_tokens_per_second, color="tab:red", linestyle="--",
                 label=f"target {plan.target_tokens_per_second:g} tok/s")
    # The budget holds the target with headroom: it is where the curve crosses 1 / step budget.
    axes.axhline(1 / plan.step_budget_seconds, color="tab:green", linestyle=":", linewidth=0.8,
                 label=f"1 / step budget ({1 / plan.step_budget_seconds:,.1f} tok/s, headroom {plan.headroom:g})")
    axes.axvline(plan.token_budget_tokens, color="tab:green", linestyle=":",
                 label=f"token budget {plan.token_budget_tokens:,.0f}")
    axes.axvline(plan.kv_capacity_tokens, color="tab:gray", linestyle="-.",
                 label=f"KV capacity {plan.kv_capacity_tokens:,}")
    prediction = plan.load_prediction
    if prediction is not None:
        for group in prediction.loads:
            alone = predict_loads(plan.setup, [group], prediction.prefill_tokens_per_step)
            axes.scatter([alone.tokens_in_flight], [alone.user_tokens_per_second], zorder=3,
                         label=f"{group.count}x{group.context_tokens:,.0f} alone")
        if len(prediction.loads) > 1:
            axes.scatter([prediction.tokens_in_flight], [prediction.user_tokens_per_second], marker="*", s=150,
                         zorder=4, color="black", label="all loads together")
    axes.set_xlabel("tokens in flight")
    axes.set_ylabel("tokens per second per user")
    axes.set_title(f"{plan.setup.architecture.name} on {plan.resolved.gpu.name} x{plan.setup.tensor_parallel}")
    axes.set_ylim(bottom=0)
    axes.legend(fontsize="small")
    figure.tight_layout()
    try:
        figure.savefig(path)
    except OSError as error:
        raise InputError(f"--plot {path!r}: cannot write the file: {error.strerror or error}") from None
    finally:
        plt.close(figure)


def run(args: argparse.Namespace) -> int:
    resolved = resolve_from_args(args)
    plan = build_plan(
        resolved,
        target_tokens_per_second=parse_positive_float(args.target_tps, "--target-tps"),
        headroom=_parse_fraction(args.headroom, "--headroom"),
        loads=[parse_load(text) for text in args.load],
        prefill_tokens_per_step=_parse_prefill(args.prefill_chunk),
        contexts=[parse_positive_float(text, "--context") for text in args.context],
    )
    if args.plot:
        write_plot(plan, args.plot)
    pools_exit_code = run_pools_if_asked(plan, args)
    if pools_exit_code is not None:
        return pools_exit_code
    if args.json:
        print(json.dumps(plan_to_json(plan), indent=2))
    else:
        print(format_plan(plan))
        if args.plot:
            print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _parse_prefill(text: str) -> float:
    if text.strip() in ("0", "0.0"):
        return 0.0
    return parse_positive_float(text, "--prefill-chunk")
