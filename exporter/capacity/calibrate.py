"""`stepbudget calibrate`: measure a server's effective bandwidth (and per-step overhead).

One stream alone reads the weights plus its own KV cache every step, so its inter-token gap gives
bandwidth = bytes read / gap. Two contexts (short and long) let the fit separate a fixed per-step
overhead from the bytes term, and their agreement tells whether a bandwidth model fits the server
at all (DESIGN §1). Offline the gaps come from `--itl SECONDS@TOKENS`; live from streaming one
request at a time to an OpenAI-compatible `/v1/completions`.

Library entry points for other verbs (`stepbudget demo`): `measure_stream` and `calibrate_live`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from exporter.capacity import fit, model
from exporter.capacity.deployment import ResolvedSetup, fit_bounds
from exporter.capacity.fit import Calibration, CalibrationPoint
from exporter.capacity.model import ServingSetup
from exporter.capacity.planner import add_setup_arguments, parse_positive_float, resolve_from_args
from exporter.errors import InputError
from exporter.units import parse_duration_seconds

DEFAULT_SHORT_CONTEXT_TOKENS = 256
DEFAULT_LONG_CONTEXT_TOKENS = 16384
DEFAULT_OUTPUT_TOKENS = 64
DEFAULT_TIMEOUT_SECONDS = 30.0
# One stream before the points, not measured: a server's first requests after it starts step slower.
# On vLLM 0.32.0's CPU backend here a first 3,000-token stream stepped ~10% slower than the next four on
# one host, and 40% slower in one of three starts on another, where calibrate then refused the points
# (spread 45.6%; `make demo-vllm`, calibrating a server it had just started, 24.7%); after 16 tokens at
# the short context first, the first calibration of three fresh starts agreed (spread 1.1-6.1%).
WARMUP_OUTPUT_TOKENS = 16
# Token ids for synthetic prompts: low ids exist in every tokenizer's vocabulary, and a fixed seed
# makes the prompt (and so the context) the same on every run. Under 1,000: vLLM refuses an id past
# the model's vocabulary ("Token id 9985 is out of vocabulary", 400, from the real vLLM 0.32.0 serving
# an 8,192-token vocabulary), and no real tokenizer has fewer than 1,000 tokens.
_PROMPT_TOKEN_ID_RANGE = (100, 1000)
_PROMPT_SEED = 20240601

Clock = Callable[[], float]
Progress = Callable[[int, int, int], None]  # (context_tokens, tokens_received, tokens_wanted)


class ServerError(Exception):
    """The server could not be reached or answered something other than a completion stream."""


@dataclass(frozen=True)
class StreamMeasurement:
    """One request streamed alone: when its chunks arrived, relative to sending it."""

    context_tokens: int
    requested_tokens: int
    first_chunk_seconds: float
    gaps_seconds: tuple[float, ...]  # between successive chunks, starting after the first

    @property
    def chunks(self) -> int:
        return len(self.gaps_seconds) + 1

    @property
    def decode_gaps_seconds(self) -> tuple[float, ...]:
        """Drop the first gap after the first token: it can still carry prefill and scheduling work."""
        return self.gaps_seconds[1:]

    @property
    def itl_seconds(self) -> float:
        """The median is robust to the odd slow step (a scheduling hiccup, a GC pause)."""
        return statistics.median(self.decode_gaps_seconds)


# --- live measurement ------------------------------------------------------------------------


def synthetic_prompt(context_tokens: int) -> list[int]:
    """A prompt given as token ids, so the server's context is exactly `context_tokens`."""
    generator = random.Random(_PROMPT_SEED + context_tokens)
    low, high = _PROMPT_TOKEN_ID_RANGE
    return [generator.randrange(low, high) for _ in range(context_tokens)]


def discover_model_name(url: str, timeout_seconds: float) -> str:
    """The first model the server lists at GET /v1/models."""
    endpoint = f"{url.rstrip('/')}/v1/models"
    try:
        with urllib.request.urlopen(endpoint, timeout=timeout_seconds) as response:
            body = json.loads(response.read())
        return str(body["data"][0]["id"])
    except (urllib.error.URLError, OSError) as error:
        raise ServerError(f"GET {endpoint}: {_reason(error)}") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerError(f"GET {endpoint}: no model listed "
                          '(expected {"data": [{"id": ...}]}); give --model-name') from None


def _reason(error: Exception) -> str:
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code} {error.reason}"
    if isinstance(error, urllib.error.URLError):
        return str(error.reason)
    return str(error) or type(error).__name__


def measure_stream(
    url: str,
    model_name: str,
    context_tokens: int,
    output_tokens: int,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    *,
    clock: Clock = time.perf_counter,
    progress: Progress | None = None,
) -> StreamMeasurement:
    """Stream one completion alone and time every chunk.

    `timeout_seconds` bounds the connect and every read of the stream (urllib sets it on the socket).
    """
    if context_tokens < 1 or output_tokens < 3:
        raise InputError("a measured stream needs a context of at least 1 token and at least 3 output tokens "
                         "(the first gap is dropped, the median is taken over the rest)")
    endpoint = f"{url.rstrip('/')}/v1/completions"
    body = json.dumps({
        "model": model_name, "prompt": synthetic_prompt(context_tokens), "max_tokens": output_tokens,
        "stream": True, "ignore_eos": True, "temperature": 0,
    }).encode()
    request = urllib.request.Request(endpoint, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    arrivals: list[float] = []
    started = clock()
    try:
        with urllib.request.urlopen(request, timeout=timeout_seconds) as response:
            for payload in sse_payloads(response):
                if payload == "[DONE]":
                    break
                if _is_token_chunk(payload, endpoint):
                    arrivals.append(clock())
                    if progress is not None:
                        progress(context_tokens, len(arrivals), output_tokens)
    except (urllib.error.URLError, OSError) as error:
        raise ServerError(f"POST {endpoint}: {_reason(error)}") from None
    if len(arrivals) < 3:
        raise ServerError(f"POST {endpoint}: the stream ended after {len(arrivals)} chunks; at least 3 are needed")
    gaps = tuple(later - earlier for earlier, later in itertools.pairwise(arrivals))
    return StreamMeasurement(context_tokens, output_tokens, arrivals[0] - started, gaps)


def sse_payloads(lines: Iterable[bytes]) -> Iterable[str]:
    """Server-sent events: `data: {...}` lines separated by blank lines; other fields are ignored."""
    for raw in lines:
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("data:"):
            yield line[len("data:"):].strip()


def _is_token_chunk(payload: str, endpoint: str) -> bool:
    try:
        chunk = json.loads(payload)
    except ValueError:
        raise ServerError(f"POST {endpoint}: a streamed event is not JSON: {payload[:80]!r}") from None
    if isinstance(chunk, dict) and "error" in chunk:
        raise ServerError(f"POST {endpoint}: the server streamed an error: {str(chunk['error'])[:200]}")
    return isinstance(chunk, dict) and bool(chunk.get("choices"))


def points_from_measurements(setup: ServingSetup, measurements: Sequence[StreamMeasurement]) -> list[CalibrationPoint]:
    """One stream's tokens in flight is its context; the model says what a step read at it."""
    return [model.calibration_point(setup, m.itl_seconds, float(m.context_tokens)) for m in measurements]


def measure_contexts(
    url: str, model_name: str, contexts: Sequence[int], output_tokens: int,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS, *, progress: Progress | None = None,
) -> list[StreamMeasurement]:
    """One request at a time, so each is alone on the server, after one at the shortest context that is
    not measured (WARMUP_OUTPUT_TOKENS)."""
    if contexts:
        measure_stream(url, model_name, min(contexts), WARMUP_OUTPUT_TOKENS, timeout_seconds)
    return [measure_stream(url, model_name, context, output_tokens, timeout_seconds, progress=progress)
            for context in contexts]


def calibrate_live(
    url: str,
    setup: ServingSetup,
    *,
    model_name: str | None = None,
    short_context_tokens: int = DEFAULT_SHORT_CONTEXT_TOKENS,
    long_context_tokens: int = DEFAULT_LONG_CONTEXT_TOKENS,
    output_tokens: int = DEFAULT_OUTPUT_TOKENS,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    progress: Progress | None = None,
) -> Calibration:
    """Measure a short and a long stream alone and fit bandwidth and per-step overhead."""
    name = model_name or discover_model_name(url, timeout_seconds)
    measurements = measure_contexts(url, name, [short_context_tokens, long_context_tokens], output_tokens,
                                    timeout_seconds, progress=progress)
    return fit.calibrate(points_from_measurements(setup, measurements))


# --- offline points --------------------------------------------------------------------------


def parse_itl_point(text: str) -> tuple[float, float, float]:
    """`0.0082@2000` or `8.2ms@2000` -> (seconds, tokens in flight, 1 request); `0.012@32000x16`:
    16 requests sharing 32,000 tokens in flight."""
    seconds_text, at, load_text = text.partition("@")
    if not at:
        raise InputError(f"--itl {text!r}: expected the form SECONDS@TOKENS[xREQUESTS], "
                         "e.g. 0.0082@2000 or 0.012@32000x16")
    seconds = parse_duration_seconds(seconds_text, f"--itl {text!r}")
    tokens_text, times, requests_text = load_text.partition("x")
    requests = parse_positive_float(requests_text, f"--itl {text!r} requests") if times else 1.0
    if requests != int(requests):
        raise InputError(f"--itl {text!r}: requests must be a whole number, got {requests_text!r}")
    return seconds, parse_positive_float(tokens_text, f"--itl {text!r} tokens"), requests


def offline_points(setup: ServingSetup, texts: Sequence[str]) -> list[CalibrationPoint]:
    return [model.calibration_point(setup, *parse_itl_point(text)) for text in texts]


# --- output ----------------------------------------------------------------------------------


def calibration_to_json(resolved: ResolvedSetup, calibration: Calibration,
                        measurements: Sequence[StreamMeasurement] = ()) -> dict[str, object]:
    peak = resolved.gpu.peak_bandwidth_bytes_per_second
    points = []
    for index, (point, fitted, residual) in enumerate(
            zip(calibration.points, calibration.fitted_seconds, calibration.residual_ratios, strict=True)):
        entry: dict[str, object] = {
            "itl_seconds": point.itl_seconds, "tokens_in_flight": point.tokens_in_flight,
            "running_requests": point.running_requests,
            "read_bytes": point.read_bytes, "bandwidth_bytes_per_second": point.bandwidth_bytes_per_second,
            "fitted_seconds": fitted, "residual_ratio": residual,
        }
        if index < len(measurements):
            entry["first_chunk_seconds"] = measurements[index].first_chunk_seconds
            entry["chunks"] = measurements[index].chunks
        points.append(entry)
    return {
        "model": resolved.setup.architecture.name,
        "gpu": resolved.gpu.name,
        "effective_bandwidth_bytes_per_second": calibration.effective_bandwidth_bytes_per_second,
        "bandwidth_efficiency": calibration.effective_bandwidth_bytes_per_second / peak,
        "step_overhead_seconds": calibration.step_overhead_seconds,
        "overhead_fitted": calibration.overhead_fitted,
        "per_request_seconds": calibration.per_request_seconds if calibration.per_request_fitted else None,
        "effective_compute_flops_per_second": calibration.effective_compute_flops_per_second,
        "residual_rms_seconds": calibration.residual_rms_seconds,
        "points": points,
        "agrees": calibration.agrees,
        "spread_ratio": calibration.spread_ratio,
        "agreement_basis": calibration.agreement_basis,
        "tolerance_ratio": calibration.tolerance,
        "notes": list(calibration.notes),
    }


def verdict_line(calibration: Calibration) -> str:
    count = len(calibration.points)
    if count == 1:
        return (f"agreement: one point only (spread {calibration.spread_ratio:.1%}, within the "
                f"{calibration.tolerance:.0%} tolerance by default); measure a second context to check the model fits")
    state = "within" if calibration.agrees else "OUTSIDE"
    return f"agreement: {_agreement_text(calibration)}, {state} the {calibration.tolerance:.0%} tolerance"


def _agreement_text(calibration: Calibration) -> str:
    if calibration.agreement_basis == fit.AGREEMENT_ON_WINDOW_RESIDUALS:
        return f"the fit misses 90% of its windows by at most {calibration.spread_ratio:.1%}"
    if calibration.agreement_basis == fit.AGREEMENT_ON_FIT_RESIDUALS:
        return (f"the fitted terms miss the points by at most {calibration.spread_ratio:.1%} "
                "(points at several batch sizes)")
    return f"the points' bandwidths spread {calibration.spread_ratio:.1%}"


def format_calibration(resolved: ResolvedSetup, calibration: Calibration) -> str:
    peak = resolved.gpu.peak_bandwidth_bytes_per_second
    bandwidth = calibration.effective_bandwidth_bytes_per_second
    lines = [
        f"model {resolved.setup.architecture.name} on {resolved.gpu.name} x{resolved.setup.tensor_parallel}",
        f"effective bandwidth  {bandwidth / 1e12:,.3f} TB/s per GPU ({bandwidth / peak:.0%} of the "
        f"{peak / 1e12:,.2f} TB/s datasheet peak)",
    ]
    if calibration.overhead_fitted:
        lines.append(f"per-step overhead    {calibration.step_overhead_seconds * 1e3:,.3f} ms (least-squares fit)")
    else:
        lines.append("per-step overhead    not fitted (needs points at two or more contexts); taken as 0")
    if calibration.per_request_fitted:
        lines.append(f"per-request cost     {calibration.per_request_seconds * 1e6:,.2f} us per running request (fit)")
    if calibration.effective_compute_flops_per_second is not None:
        compute = calibration.effective_compute_flops_per_second
        lines.append(f"effective compute    {compute / 1e12:,.1f} TFLOP/s per GPU (fit)")
    lines.append(f"residuals            {calibration.residual_rms_seconds * 1e3:,.3f} ms root mean square")
    lines.append("points:")
    for point, fitted, residual in zip(calibration.points, calibration.fitted_seconds, calibration.residual_ratios,
                                       strict=True):
        lines.append(
            f"  {point.tokens_in_flight:>10,.0f} tokens x{point.running_requests:<4.0f} "
            f"itl {point.itl_seconds * 1e3:8.3f} ms  "
            f"reads {point.read_bytes / 1e9:8.3f} GB  -> {point.bandwidth_bytes_per_second / 1e12:6.3f} TB/s  "
            f"fit {fitted * 1e3:8.3f} ms  residual {residual:+.1%}"
        )
    lines += [f"note: {note}" for note in calibration.notes]
    lines.append(verdict_line(calibration))
    if calibration.agrees:
        flags = f"--bandwidth {bandwidth:.4g}"
        if calibration.overhead_fitted:
            flags += f" --step-overhead {calibration.step_overhead_seconds:.4g}"
        if calibration.per_request_fitted:
            flags += f" --per-request-cost {calibration.per_request_seconds:.4g}"
        lines.append(f"use: stepbudget plan {flags} (or, for the daemon, this command's --json output as a "
                     "deployment's calibration file)")
    return "\n".join(lines)


def disagreement_message(calibration: Calibration) -> str:
    return (
        f"the bandwidth model does not fit this server: {_agreement_text(calibration)}, more than "
        f"{calibration.tolerance:.0%}; likely causes: prefix caching, a KV-cache or weight dtype other than the "
        "flags say, MoE routing, large per-step overheads, or (at several batch sizes) a point out of line"
    )


# --- the verb --------------------------------------------------------------------------------


class _TerminalProgress:
    """A one-line progress display on stderr, only when stderr is a terminal."""

    def __init__(self) -> None:
        self.enabled = sys.stderr.isatty()

    def __call__(self, context_tokens: int, received: int, wanted: int) -> None:
        if self.enabled:
            end = "\n" if received >= wanted else ""
            print(f"\rcalibrate: context {context_tokens:,} tokens: {received}/{wanted} tokens streamed",
                  end=end, file=sys.stderr, flush=True)


def build_parser(parser: argparse.ArgumentParser) -> None:
    add_setup_arguments(parser)
    source = parser.add_argument_group("measurements (give --itl or --url)")
    source.add_argument("--itl", action="append", default=[], metavar="SECONDS@TOKENS[xREQUESTS]",
                        help="a measured inter-token latency at TOKENS in flight, e.g. 0.0082@2000 (a lone stream at "
                             "its context) or 0.012@32000x16 (16 running requests sharing 32,000 tokens); "
                             "repeatable. Points at several batch sizes also fit a per-request cost, and with more "
                             "points an overhead and a compute rate")
    source.add_argument("--url", help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    source.add_argument("--prometheus", metavar="URL",
                        help="fit from the daemon's own series in this Prometheus (the online calibration's fit, "
                             "offline); needs --deployment")
    source.add_argument("--deployment", help="with --prometheus: the deployment label of the series")
    source.add_argument("--since", default="24h", metavar="DURATION",
                        help="with --prometheus: how far back to read (default 24h)")
    source.add_argument("--short-context", default=str(DEFAULT_SHORT_CONTEXT_TOKENS), metavar="TOKENS",
                        help=f"context of the short request (default {DEFAULT_SHORT_CONTEXT_TOKENS})")
    source.add_argument("--long-context", default=str(DEFAULT_LONG_CONTEXT_TOKENS), metavar="TOKENS",
                        help=f"context of the long request (default {DEFAULT_LONG_CONTEXT_TOKENS}; keep it under the "
                             "server's max model length)")
    source.add_argument("--tokens", default=str(DEFAULT_OUTPUT_TOKENS), metavar="N",
                        help=f"output tokens per request (default {DEFAULT_OUTPUT_TOKENS})")
    source.add_argument("--model-name", help="the request's model field (default: the first of GET /v1/models)")
    source.add_argument("--timeout", default=str(DEFAULT_TIMEOUT_SECONDS), metavar="SECONDS",
                        help=f"connect and read timeout per request (default {DEFAULT_TIMEOUT_SECONDS:g})")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _whole_tokens(text: str, flag: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise InputError(f"{flag} {text!r}: expected a whole number of tokens >= 1")
    return int(text)


def _live_measurements(args: argparse.Namespace) -> list[StreamMeasurement]:
    timeout_seconds = parse_duration_seconds(args.timeout, "--timeout")
    contexts = [_whole_tokens(args.short_context, "--short-context"),
                _whole_tokens(args.long_context, "--long-context")]
    output_tokens = _whole_tokens(args.tokens, "--tokens")
    if output_tokens < 3:
        raise InputError(f"--tokens {args.tokens!r}: at least 3 are needed (the first gap is dropped)")
    name = args.model_name or discover_model_name(args.url, timeout_seconds)
    return measure_contexts(args.url, name, contexts, output_tokens, timeout_seconds, progress=_TerminalProgress())


# Reads a deployment's history from the daemon's own series (`--prometheus`): that is the daemon's
# side (exporter/serve/online_seed.py), which `stepbudget calibrate` hands in (exporter/calibrate_verb.py),
# so this module, like all of exporter.capacity, imports nothing of the daemon.
HistoryCalibration = Callable[[argparse.Namespace, ResolvedSetup], Calibration]


def run(args: argparse.Namespace, *, history_calibration: HistoryCalibration | None = None) -> int:
    if sum(bool(source) for source in (args.itl, args.url, args.prometheus)) != 1:
        raise InputError("give one of --itl SECONDS@TOKENS (offline, repeatable), --url BASE (live) or "
                         "--prometheus URL --deployment NAME (the daemon's own history)")
    resolved = resolve_from_args(args)
    measurements: list[StreamMeasurement] = []
    if args.prometheus:
        if history_calibration is None:
            raise InputError("--prometheus reads the daemon's history: run it as `stepbudget calibrate`")
        try:
            calibration = history_calibration(args, resolved)
        except OSError as error:
            print(f"stepbudget calibrate: error: {error}", file=sys.stderr)
            return 1
        return report(args, resolved, calibration, measurements)
    if args.url:
        try:
            measurements = _live_measurements(args)
        except ServerError as error:
            print(f"stepbudget calibrate: error: {error}", file=sys.stderr)
            return 1
        points = points_from_measurements(resolved.setup, measurements)
    else:
        points = offline_points(resolved.setup, args.itl)
    calibration = fit.calibrate(points, bounds=fit_bounds(resolved))
    return report(args, resolved, calibration, measurements)


def report(args: argparse.Namespace, resolved: ResolvedSetup, calibration: Calibration,
            measurements: Sequence[StreamMeasurement]) -> int:
    if args.json:
        print(json.dumps(calibration_to_json(resolved, calibration, measurements), indent=2))
    else:
        print(format_calibration(resolved, calibration))
    if not calibration.agrees:
        raise InputError(disagreement_message(calibration))
    return 0
