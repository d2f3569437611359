"""`stepbudget simulate`: a simulated vLLM server on loopback, driven by a workload scenario."""

from __future__ import annotations

import argparse
import signal
import threading
from dataclasses import replace
from types import FrameType

from exporter.errors import InputError
from exporter.simulator.scenarios import Scenario, ScenarioSettings, builtin_scenarios, load_scenario
from exporter.simulator.server import start_server
from exporter.simulator.spec import ServerSpec
from exporter.simulator.vllm_metrics import DEFAULT_VERSION, VERSIONS


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", default="steady-chat",
                        help=f"built-in workload ({', '.join(builtin_scenarios())}) or a YAML file "
                             "(format: docs/simulator.md); default steady-chat")
    parser.add_argument("--model", default="qwen3-8b", help="model preset (default qwen3-8b)")
    parser.add_argument("--gpu", default="h100-sxm", help="GPU preset (default h100-sxm)")
    parser.add_argument("--model-name", default=None, help="served model name (default: the preset name)")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="listen port (default 8000, vLLM's; 0 = any free)")
    parser.add_argument("--speed", type=float, default=1.0,
                        help="simulated seconds per wall second (default 1 = real time; 60 = a minute per second)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (arrivals, token counts, step noise)")
    parser.add_argument("--vllm-version", default=None,
                        help=f"the /metrics page of this vLLM release line: {', '.join(VERSIONS)} "
                             f"(default: the scenario's, else {DEFAULT_VERSION})")
    parser.add_argument("--data-parallel-size", type=int, default=None,
                        help="engines behind the one page (engine label 0..N-1; default: the scenario's, else 1)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="look requests' cached prefixes up at admission (default: the scenario's, else on)")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (default 16)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--kv-cache-dtype", default=None,
                        help="auto (16-bit) or fp8 (default: the scenario's, else auto)")
    parser.add_argument("--enable-mfu-metrics", action="store_true",
                        help="count each step's FLOPs and bytes read and written in vllm:estimated_*_per_gpu_total "
                             "(vLLM's flag; without it those counters stay at 0, as on vLLM)")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request to stderr")


def spec_from_args(args: argparse.Namespace) -> ServerSpec:
    return ServerSpec(model=args.model, gpu=args.gpu, served_model_name=args.model_name, seed=args.seed,
                      gpu_memory_utilization=args.gpu_memory_utilization, block_size_tokens=args.block_size,
                      max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                      max_model_len=args.max_model_len, enable_mfu_metrics=args.enable_mfu_metrics)


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """The scenario, its server settings overridden by the flags given."""
    scenario = load_scenario(args.scenario)
    flags = ScenarioSettings(vllm_version=args.vllm_version, data_parallel_size=args.data_parallel_size,
                             kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.enable_prefix_caching)
    return replace(scenario, settings=scenario.settings.overridden_by(flags))


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be 0-65535, got {args.port}")
    scenario = scenario_from_args(args)
    handle = start_server(args.host, args.port, scenario, args.speed, spec_from_args(args), access_log=args.access_log)
    simulator = handle.simulator
    print(f"simulated vLLM ({simulator.spec.model} on {simulator.spec.gpu}, served as {simulator.spec.model_name!r}) "
          f"on {handle.url}", flush=True)
    print(f"  scenario {scenario.name}: {scenario.description}; speed x{args.speed:g}", flush=True)
    for at_seconds, what in scenario.timeline:
        print(f"    t={at_seconds:>5.0f} s simulated ({at_seconds / args.speed:.0f} s wall): {what}", flush=True)
    spec = simulator.spec
    print(f"  vLLM {spec.vllm_version} page; {spec.data_parallel_size} engine(s), each with a KV cache of "
          f"{simulator.num_gpu_blocks} blocks of {spec.block_size_tokens} = {simulator.capacity_tokens:,} tokens "
          f"({spec.kv_cache_dtype}); prefix caching {'on' if spec.enable_prefix_caching else 'off'}", flush=True)
    print(f"  {handle.url}/metrics  {handle.url}/v1/completions  {handle.url}/v1/models  (Ctrl-C stops)", flush=True)
    stopped = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stopped.set()

    previous = signal.signal(signal.SIGTERM, request_stop)
    try:
        while not stopped.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        handle.stop()
    print("simulator stopped", flush=True)
    return 0
