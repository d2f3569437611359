"""The simulated engine: KV sizing, blocks, chunked prefill, decode-first budget, preemption,
per-token observations, determinism, scenarios and the `simulate` verb's bad input."""

from __future__ import annotations

import argparse
import ast
import itertools
import math
import os
import re
import signal
import subprocess
import sys

import pytest
import requests

from exporter.capacity.presets import GPUS
from exporter.errors import InputError
from exporter.simulator import ServerSpec, Simulator, load_scenario, scenario_from_dict
from exporter.simulator.scenarios import ClosedLoopGroup
from tests.support.simulator import QWEN, blocks_by_hand, kv_bytes_per_token_by_hand, step
from tests.support.tools import DATA as TESTS_DATA
from tests.support.tools import REPO

DATA = TESTS_DATA / "scenarios"


def test_kv_cache_blocks_follow_vllm_sizing() -> None:
    sim = Simulator(ServerSpec())
    assert kv_bytes_per_token_by_hand() == 147456  # 144 KiB, DESIGN §1
    assert sim.num_gpu_blocks == blocks_by_hand(0.9)
    assert sim.capacity_tokens == sim.num_gpu_blocks * 16


def test_a_sequence_holds_whole_blocks() -> None:
    sim = Simulator(ServerSpec(), record_steps=True)
    sim.submit(1001, 3)
    step(sim)  # the whole prompt fits one step's 2,048-token budget
    assert sim.used_blocks == math.ceil(1001 / 16) == 63
    assert sim.counters.kv_usage_ratio == pytest.approx(63 / (sim.num_gpu_blocks - 1))  # less the null block
    step(sim)  # 1,002 tokens still fit 63 blocks
    assert sim.used_blocks == 63


def test_long_prompt_is_prefilled_in_chunks_then_streams() -> None:
    sim = Simulator(ServerSpec(), record_steps=True)
    request = sim.submit(5000, 4)
    for _ in range(3):
        step(sim)
    assert sim.steps is not None
    assert [s.prefill_tokens for s in sim.steps] == [2048, 2048, 5000 - 2 * 2048]
    assert request.output_tokens == 1  # the step that finishes the prompt samples the first token
    ttft = sim.counters.histograms["ttft"]
    assert ttft.count == 1 and ttft.sum == pytest.approx(sum(s.seconds for s in sim.steps))
    assert sim.counters.prompt_tokens == 5000
    assert sim.counters.histograms["iteration_tokens"].count == 3


def test_decodes_are_scheduled_first_and_prefill_fills_the_rest() -> None:
    sim = Simulator(ServerSpec(), record_steps=True)
    sim.submit(100, 50)
    step(sim)
    sim.submit(5000, 5)  # the next step was already scheduled when this one ended; it joins the one after
    step(sim)
    step(sim)
    assert sim.steps is not None
    last = sim.steps[-1]
    assert (last.decode_tokens, last.prefill_tokens) == (1, 2048 - 1)


def test_each_decoding_request_observes_the_step_time_once() -> None:
    sim = Simulator(ServerSpec(), record_steps=True)
    sim.submit(100, 10)
    sim.submit(120, 10)
    step(sim)  # both prompts: first tokens (TTFT, not ITL)
    itl = sim.counters.histograms["itl"]
    assert itl.count == 0
    step(sim)
    assert sim.steps is not None
    assert itl.count == 2
    assert itl.sum == pytest.approx(2 * sim.steps[-1].seconds)
    assert sim.counters.generation_tokens == 4


def test_step_time_grows_with_tokens_in_flight() -> None:
    """A lone stream at 16k tokens of context reads ~2.4 GB more KV than at 256 per step."""
    from exporter.simulator.simulation import single_stream_token_seconds

    short = single_stream_token_seconds(ServerSpec(), 256, 20)
    long = single_stream_token_seconds(ServerSpec(), 16384, 20)

    def gap(times: list[float]) -> float:
        return sorted(b - a for a, b in itertools.pairwise(times))[len(times) // 2 - 1]

    extra_kv_bytes = (16384 - 256) * kv_bytes_per_token_by_hand()
    peak = GPUS["h100-sxm"].peak_bandwidth_bytes_per_second
    # The KV term alone at any efficiency between 0.4 and 1.0 of the peak:
    assert extra_kv_bytes / peak < gap(long) - gap(short) < extra_kv_bytes / (0.4 * peak)


def test_newest_running_request_is_preempted_and_recomputed() -> None:
    # A cache of ~300 blocks: two 2,000-token prompts fit, their 2,000-token answers do not.
    utilization = (QWEN.params * 2 + 3.0e9 + 300 * 16 * kv_bytes_per_token_by_hand()) / GPUS["h100-sxm"].memory_bytes
    spec = ServerSpec(gpu_memory_utilization=utilization, max_model_len=4096)
    sim = Simulator(spec)
    assert sim.num_gpu_blocks == blocks_by_hand(utilization)
    older = sim.submit(2000, 2000)
    newer = sim.submit(2000, 2000)
    while sim.counters.preemptions == 0:
        step(sim)
    assert (older.preemptions, newer.preemptions) == (0, 1)
    assert newer in sim.waiting and newer.blocks == 0 and newer.computed_tokens == 0
    assert sim.used_blocks == older.blocks
    while not older.finished:
        step(sim)
    while not newer.finished:
        step(sim)
    assert newer.output_tokens == 2000
    assert sim.counters.generation_tokens == 4000
    assert sim.counters.prompt_tokens == 4000  # recomputation is not counted as new prompt tokens
    assert sim.free_blocks == sim.num_gpu_blocks - 1  # all but the null block


def test_max_num_seqs_caps_the_batch() -> None:
    sim = Simulator(ServerSpec(max_num_seqs=2))
    for _ in range(3):
        sim.submit(10, 5)
    step(sim)
    assert (sim.counters.running, sim.counters.waiting) == (2, 1)


def test_requests_longer_than_the_context_window_are_refused() -> None:
    sim = Simulator(ServerSpec(max_model_len=4096))
    with pytest.raises(InputError, match="maximum context length is 4096"):
        sim.submit(4000, 200)


def test_max_model_len_larger_than_the_cache_is_refused_like_vllm() -> None:
    with pytest.raises(InputError, match="more than the KV cache holds"):
        Simulator(ServerSpec(gpu="l4", max_model_len=131072))


def test_same_seed_same_run_different_seed_different_run() -> None:
    def run(seed: int) -> tuple[float, float, int]:
        sim = Simulator(ServerSpec(seed=seed), load_scenario("steady-chat"))
        sim.run_until(20.0)
        itl = sim.counters.histograms["itl"]
        return itl.sum, sim.counters.generation_tokens, sim.step_count

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_agent_sessions_leave_at_their_time() -> None:
    scenario = scenario_from_dict({"groups": [{"kind": "scripted", "name": "agent", "at": 1, "count": 2,
                                               "prompt_tokens": 3000, "output_tokens": 100000, "leave_at": 6}]})
    sim = Simulator(ServerSpec(), scenario)
    sim.run_until(5.9)
    assert sim.counters.running == 2
    sim.run_until(6.5)
    assert sim.counters.running == 0 and sim.free_blocks == sim.num_gpu_blocks - 1  # all but the null block
    assert sim.counters.request_success["stop"] == 2


def test_closed_loop_keeps_its_users_in_flight() -> None:
    sim = Simulator(ServerSpec(), load_scenario("steady-chat"))
    group = load_scenario("steady-chat").groups[0]
    assert isinstance(group, ClosedLoopGroup)
    sim.run_until(60.0)
    assert sim.counters.running + sim.counters.waiting == group.users
    assert sim.counters.request_success["stop"] > group.users  # users came back for more


def test_yaml_scenario_loads() -> None:
    scenario = load_scenario(str(DATA / "example.yaml"))
    assert [group.name for group in scenario.groups] == ["chat", "rag", "agent"]
    sim = Simulator(ServerSpec(), scenario)
    sim.run_until(90.0)
    assert sim.counters.running > 24  # chats + RAG prompts + the agent
    assert {request.group for request in sim.running} == {"chat", "rag", "agent"}


@pytest.mark.parametrize("document, message", [
    ({"groups": []}, "'groups' must be a non-empty list"),
    ({"groups": [{"kind": "burst"}]}, r"groups\[0\].kind: must be one of closed, poisson, scripted"),
    ({"groups": [{"kind": "closed", "users": 0, "prompt_tokens": 5, "output_tokens": 5}]},
     r"groups\[0\].users: must be at least 1"),
    ({"groups": [{"kind": "poisson", "rate_per_second": 1, "prompt_tokens": {"mean": 5, "spread": 1.5},
                  "output_tokens": 5}]}, r"prompt_tokens.spread: must be below 1"),
    ({"groups": [{"kind": "scripted", "at": 10, "leave_at": 5, "prompt_tokens": 5, "output_tokens": 5}]},
     r"leave_at: must be after at=10"),
    ({"groups": [{"kind": "closed", "users": 2, "output_tokens": 5}]}, r"prompt_tokens: required"),
])
def test_bad_scenarios_name_what_and_where(document: dict, message: str) -> None:
    with pytest.raises(InputError, match=message):
        scenario_from_dict(document, where="s.yaml")


def test_the_simulate_flags_override_the_scenario_settings_and_the_settings_override_the_spec() -> None:
    from exporter.simulator.cli import build_parser, scenario_from_args, spec_from_args

    def simulator(*argv: str) -> Simulator:
        parser = argparse.ArgumentParser()
        build_parser(parser)
        args = parser.parse_args(["--scenario", "agents-cached", *argv])
        return Simulator(spec_from_args(args), scenario_from_args(args))

    spec = simulator().spec  # agents-cached asks for the 0.33 page and nothing else
    assert (spec.vllm_version, spec.data_parallel_size, spec.kv_cache_dtype, spec.enable_prefix_caching) == (
        "0.33", 1, "auto", True)
    spec = simulator("--vllm-version", "0.23", "--data-parallel-size", "2", "--no-enable-prefix-caching").spec
    assert (spec.vllm_version, spec.data_parallel_size, spec.kv_cache_dtype, spec.enable_prefix_caching) == (
        "0.23", 2, "auto", False)


def _stepbudget(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "exporter.cli", *args], capture_output=True, text=True,
                          timeout=60, **kwargs)  # type: ignore[call-overload]  # kwargs: any subprocess.run keyword


@pytest.mark.parametrize("args, message", [
    (["--scenario", "stedy-chat"], "unknown scenario 'stedy-chat' (did you mean"),
    (["--scenario", str(DATA / "bad_unknown_key.yaml")], "unknown key 'thinktime'"),
    (["--vllm-version", "0.3"], "--vllm-version: unknown version '0.3'"),
    (["--speed", "0"], "--speed must be greater than 0"),
    (["--model", "qwen9"], "unknown model preset 'qwen9'"),
])
def test_simulate_bad_input_exits_2_with_one_line(args: list[str], message: str) -> None:
    result = _stepbudget("simulate", "--port", "0", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_simulate_serves_until_sigterm() -> None:
    process = subprocess.Popen([sys.executable, "-m", "exporter.cli", "simulate", "--port", "0", "--speed", "30"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        first_line = process.stdout.readline()
        url = re.search(r"on (http://127\.0\.0\.1:\d+)", first_line)
        assert url, first_line
        page = requests.get(url.group(1) + "/metrics", timeout=5).text
        assert "vllm:kv_cache_usage_perc{" in page
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


EXPORTER = REPO / "exporter"
# Of the capacity package the simulator may share only the presets' architecture and GPU data.
SHARED_WITH_THE_MODEL = "exporter.capacity.presets"


def _is_exporter_module(name: str) -> bool:
    path = EXPORTER.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def capacity_imports(source: str, package: str = "exporter.simulator") -> list[str]:
    """The exporter.capacity modules a module of `package` imports (at any depth: function-level
    imports run too), except the shared presets. `from exporter.capacity import model` names
    exporter.capacity.model; relative imports are resolved against `package`."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names = [f"{module}.{alias.name}" if _is_exporter_module(f"{module}.{alias.name}") else module
                     for alias in node.names]
        else:
            continue
        found += [name for name in names if (name == "exporter.capacity" or name.startswith("exporter.capacity."))
                  and name != SHARED_WITH_THE_MODEL]
    return found


def test_simulator_physics_is_written_apart_from_the_model() -> None:
    """Agreement between prediction and simulation is only a test if they share no code (DESIGN §5)."""
    sources = list((EXPORTER / "simulator").glob("*.py"))
    assert len(sources) >= 6
    for source in sources:
        assert capacity_imports(source.read_text()) == [], source.name
    # The check sees every way of writing such an import.
    assert capacity_imports("from exporter.capacity import model, presets") == ["exporter.capacity.model"]
    assert capacity_imports("def f():\n    import exporter.capacity.deployment") == ["exporter.capacity.deployment"]
    assert capacity_imports("from ..capacity.model import predict_step") == ["exporter.capacity.model"]
    assert capacity_imports("from exporter.capacity.presets import Gpu") == []
