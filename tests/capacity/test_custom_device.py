"""Devices by their numbers: a `gpu` mapping in the config, `--gpu custom` and the figure flags on
`plan`, `calibrate` and `serve`, and the peaks reaching the setup and the online fit's bounds."""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from pathlib import Path

import pytest

from exporter import cli
from exporter.capacity.deployment import build_setup, fit_bounds
from exporter.capacity.presets import DeviceFigures, device, get_gpu, get_model_preset
from exporter.errors import InputError
from exporter.serve.config import ConfigError, Deployment, load_config
from exporter.serve.daemon import build_parser, config_from_args
from exporter.serve.online_calibration import OnlineCalibrator
from exporter.serve.online_fit_types import MIN_RATE_SHARE_OF_PEAK, Bounds
from exporter.units import parse_bandwidth_bytes_per_second, parse_flops_per_second

# Qwen3-8B, bf16, by hand: K and V x 36 layers x 8 KV heads x 128 dims x 2 bytes; 8.19e9 params x 2 bytes.
QWEN3_KV = 2 * 36 * 8 * 128 * 2
QWEN3_WEIGHTS = 8.19e9 * 2
# Attention FLOPs of one decode token per attended token: 4 x 36 layers x 32 heads x 128 dims.
QWEN3_ATTENTION_FLOPS_PER_TOKEN = 4 * 36 * 32 * 128
# NVIDIA A10 datasheet: 24 GB GDDR6, 600 GB/s, BF16 125 TFLOPS dense.
A10_MEMORY, A10_BANDWIDTH, A10_FLOPS = 24e9, 600e9, 125e12
# The defaults the model applies to a device's peaks (defaults.bandwidth_efficiency, compute_efficiency).
BANDWIDTH_EFFICIENCY, COMPUTE_EFFICIENCY = 0.6, 0.5


def write_config(tmp_path: Path, gpu_yaml: str) -> Path:
    """One deployment whose `gpu:` value is `gpu_yaml` (indented under the key, from line 4)."""
    path = tmp_path / "stepbudget.yaml"
    path.write_text("deployments:\n  - name: chat\n    model: qwen3-8b\n    gpu:"
                    + textwrap.indent(textwrap.dedent(gpu_yaml), "      ")
                    + "    targets:\n      static: [http://10.0.0.5:8000/metrics]\n")
    return path


def deployment_of(tmp_path: Path, gpu_yaml: str) -> Deployment:
    [deployment] = load_config(str(write_config(tmp_path, gpu_yaml))).deployments
    return deployment


def config_error(tmp_path: Path, gpu_yaml: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(str(write_config(tmp_path, gpu_yaml)))
    return str(caught.value)


A10_YAML = """
    name: a10
    memory: 24GB
    peak_bandwidth: 600GB/s
    peak_flops: 125TFLOP/s
"""


# --- the config --------------------------------------------------------------------------------


def test_a_device_by_its_numbers_is_resolved_from_the_mapping(tmp_path: Path) -> None:
    deployment = deployment_of(tmp_path, A10_YAML)
    gpu, setup = deployment.resolved.gpu, deployment.resolved.setup
    assert deployment.gpu == gpu.name == "a10"
    assert (gpu.memory_bytes, gpu.peak_bandwidth_bytes_per_second) == (A10_MEMORY, A10_BANDWIDTH)
    # One figure for every precision: bf16 weights (2 bytes) and fp8 weights (1 byte) alike.
    assert gpu.peak_flops_for(2.0) == gpu.peak_flops_for(1.0) == A10_FLOPS
    assert setup.gpu_memory_bytes == A10_MEMORY
    assert setup.effective_bandwidth_bytes_per_second == pytest.approx(BANDWIDTH_EFFICIENCY * A10_BANDWIDTH)
    assert setup.effective_compute_flops_per_second == pytest.approx(COMPUTE_EFFICIENCY * A10_FLOPS)
    assert deployment.resolved.bandwidth_source == "default"


def test_the_figures_take_binary_sizes_bare_numbers_and_yaml_exponents(tmp_path: Path) -> None:
    # A CPU host: 64 GiB, 2.5e11 bytes/s as a bare number, 2e12 FLOP/s (PyYAML reads `2e12` as text).
    deployment = deployment_of(tmp_path, """
        name: epyc
        memory: 64GiB
        peak_bandwidth: 250000000000
        peak_flops: 2e12
    """)
    gpu = deployment.resolved.gpu
    assert (gpu.memory_bytes, gpu.peak_bandwidth_bytes_per_second, gpu.peak_flops_for(2.0)) == (
        64 * 2**30, 2.5e11, 2e12)


def test_a_preset_with_one_figure_replaced_keeps_the_others(tmp_path: Path) -> None:
    h100 = get_gpu("h100-sxm")
    deployment = deployment_of(tmp_path, "\n    preset: h100-sxm\n    peak_bandwidth: 2TB/s\n")
    gpu = deployment.resolved.gpu
    assert deployment.gpu == gpu.name == "h100-sxm"
    assert gpu.peak_bandwidth_bytes_per_second == 2e12
    assert gpu.memory_bytes == h100.memory_bytes
    assert gpu.peak_flops_per_second == h100.peak_flops_per_second  # fp8 peak kept: no FLOP/s given
    assert deployment.resolved.setup.effective_bandwidth_bytes_per_second == pytest.approx(BANDWIDTH_EFFICIENCY * 2e12)


def test_a_preset_given_flops_uses_that_one_figure_for_every_precision(tmp_path: Path) -> None:
    deployment = deployment_of(tmp_path, "\n    preset: h100-sxm\n    name: h100-capped\n    peak_flops: 5e14\n")
    gpu = deployment.resolved.gpu
    assert deployment.gpu == "h100-capped"
    assert gpu.peak_flops_for(1.0) == gpu.peak_flops_for(2.0) == 5e14
    assert gpu.peak_bandwidth_bytes_per_second == get_gpu("h100-sxm").peak_bandwidth_bytes_per_second


def test_gpu_memory_still_overrides_the_devices_memory(tmp_path: Path) -> None:
    path = write_config(tmp_path, A10_YAML)
    path.write_text(path.read_text().replace("    targets:", "    gpu_memory: 12GB\n    targets:"))
    [deployment] = load_config(str(path)).deployments
    assert deployment.resolved.setup.gpu_memory_bytes == 12e9


@pytest.mark.parametrize(("gpu_yaml", "expected"), [
    ("\n    name: a10\n    memory: 24GB\n    peak_bandwidth: 600GB/s\n",
     "stepbudget.yaml:4: deployments[0].gpu: a device without `preset` needs name, memory, peak_bandwidth, "
     "peak_flops; missing peak_flops"),
    ("\n    memory: 24GB\n    peak_flops: 125e12\n",
     "deployments[0].gpu: a device without `preset` needs name, memory, peak_bandwidth, peak_flops; "
     "missing name, peak_bandwidth"),
    ("\n    name: a10\n    memory: 24GB\n    peak_bandwidth: -600\n    peak_flops: 125e12\n",
     "stepbudget.yaml:7: deployments[0].gpu.peak_bandwidth: must be greater than zero, got -600"),
    ("\n    name: a10\n    memory: 0\n    peak_bandwidth: 600GB/s\n    peak_flops: 125e12\n",
     "deployments[0].gpu.memory: must be greater than zero, got 0"),
    ("\n    name: a10\n    memory: 24GB\n    peak_bandwidth: 600GBs\n    peak_flops: 125e12\n",
     "deployments[0].gpu.peak_bandwidth: cannot read '600GBs' as a bandwidth"),
    ("\n    name: a10\n    memory: 24GB\n    peak_bandwidth: 600GB/s\n    peak_flops: 125TB/s\n",
     "deployments[0].gpu.peak_flops: cannot read '125TB/s' as FLOP/s"),
    ("\n    name: a10\n    memory: 24 gigs\n    peak_bandwidth: 600GB/s\n    peak_flops: 125e12\n",
     "deployments[0].gpu.memory: cannot read '24 gigs' as a size"),
    ("\n    name: a10\n    memory: 24GB\n    peak_bandwidth: 600GB/s\n    peak_flop: 125e12\n",
     "stepbudget.yaml:8: deployments[0].gpu.peak_flop: unknown key (did you mean: peak_flops?)"),
    ("\n    preset: h100-sxn\n    peak_bandwidth: 2TB/s\n",
     "stepbudget.yaml:5: deployments[0].gpu.preset: unknown GPU preset 'h100-sxn'"),
    (" [a10, 24GB]\n", "deployments[0].gpu: expected a GPU preset's name or a mapping of name, memory, "
                       "peak_bandwidth, peak_flops"),
])
def test_each_bad_figure_is_refused_naming_its_key(tmp_path: Path, gpu_yaml: str, expected: str) -> None:
    message = config_error(tmp_path, gpu_yaml)
    assert expected in message
    assert message.count("\n") == 0


def test_check_config_accepts_the_mapping_and_refuses_a_bad_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, A10_YAML)
    assert cli.main(["check-config", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"{path}: ok: 1 deployment(s) (chat)")
    write_config(tmp_path, A10_YAML.replace("peak_flops: 125TFLOP/s\n", ""))
    assert cli.main(["check-config", str(path)]) == 2
    assert "deployments[0].gpu: a device without `preset` needs" in capsys.readouterr().err


# --- the units ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "bytes_per_second"), [
    ("600GB/s", 600e9), ("2TB/s", 2e12), ("2TB", 2e12), ("2 tb/S", 2e12), ("1GiB/s", 2**30), ("2.5e11", 2.5e11),
])
def test_bandwidths_read_with_or_without_per_second(text: str, bytes_per_second: float) -> None:
    assert parse_bandwidth_bytes_per_second(text) == bytes_per_second


@pytest.mark.parametrize(("text", "flops_per_second"), [
    ("125e12", 125e12), ("125T", 125e12), ("125TFLOPS", 125e12), ("1.2TFLOP/s", 1.2e12), ("2.25 PFLOP/s", 2.25e15),
    ("90gflops", 90e9), (5e10, 5e10),
])
def test_flops_read_as_a_number_or_a_rate(text: str | float, flops_per_second: float) -> None:
    assert parse_flops_per_second(text) == pytest.approx(flops_per_second, rel=1e-12)


@pytest.mark.parametrize("text", ["125TB/s", "2TFLOP/s/s", "fast", "-1", "0"])
def test_unreadable_flops_are_refused(text: str) -> None:
    with pytest.raises(InputError, match="--gpu-flops"):
        parse_flops_per_second(text, "--gpu-flops")


# --- the fit's bounds ----------------------------------------------------------------------------


def test_the_fits_bounds_are_the_given_peaks() -> None:
    gpu = device("custom", DeviceFigures(A10_MEMORY, A10_BANDWIDTH, A10_FLOPS), name="a10")
    resolved = build_setup(get_model_preset("qwen3-8b"), gpu)
    limits = fit_bounds(resolved)
    assert (limits.max_bandwidth_bytes_per_second, limits.max_compute_flops_per_second) == (A10_BANDWIDTH, A10_FLOPS)
    bounds = Bounds.of_setup(resolved)
    assert (bounds.max_bandwidth, bounds.max_compute) == (A10_BANDWIDTH, A10_FLOPS)
    assert bounds.min_bandwidth == pytest.approx(MIN_RATE_SHARE_OF_PEAK * A10_BANDWIDTH)


def test_a_custom_device_needs_every_figure() -> None:
    with pytest.raises(InputError, match=r"custom needs memory, peak_bandwidth, peak_flops; missing peak_bandwidth$"):
        device("custom", DeviceFigures(memory_bytes=A10_MEMORY, peak_flops_per_second=A10_FLOPS))


# --- plan and calibrate flags ----------------------------------------------------------------------

A10_FLAGS = ("--gpu", "custom", "--gpu-memory", "24GB", "--gpu-bandwidth", "600GB/s", "--gpu-flops", "125e12")


def test_plan_with_a_custom_device_sizes_from_its_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", *A10_FLAGS, "--model", "qwen3-8b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpu"] == "custom"
    block = QWEN3_KV * 16  # vLLM's 16-token blocks
    assert out["kv_capacity_tokens"] == math.floor((A10_MEMORY * 0.9 - QWEN3_WEIGHTS) / block) * 16
    bandwidth, compute = BANDWIDTH_EFFICIENCY * A10_BANDWIDTH, COMPUTE_EFFICIENCY * A10_FLOPS
    assert out["effective_bandwidth_bytes_per_second"] == pytest.approx(bandwidth)
    assert out["effective_compute_flops_per_second"] == pytest.approx(compute)
    # One user at one token of context: each phase takes the longer of its bytes and its FLOPs, the
    # weights' (2 FLOPs per weight) and the attention's over one token of KV.
    gemm_seconds = max(QWEN3_WEIGHTS / bandwidth, 2 * 8.19e9 / compute)
    attention_seconds = max(QWEN3_KV / bandwidth, QWEN3_ATTENTION_FLOPS_PER_TOKEN / compute)
    step = gemm_seconds + attention_seconds
    assert out["single_user_tokens_per_second"] == pytest.approx(1 / step, rel=1e-9)


def test_plan_figure_flags_override_a_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--gpu", "h100-sxm", "--gpu-bandwidth", "2TB/s", "--gpu-memory", "40GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpu"] == "h100-sxm"
    assert out["effective_bandwidth_bytes_per_second"] == pytest.approx(BANDWIDTH_EFFICIENCY * 2e12)
    assert out["kv_capacity_tokens"] == math.floor((40e9 * 0.9 - QWEN3_WEIGHTS) / (QWEN3_KV * 16)) * 16
    # The preset's bf16 peak stays: no --gpu-flops.
    assert out["effective_compute_flops_per_second"] == pytest.approx(COMPUTE_EFFICIENCY * 989.4e12)


@pytest.mark.parametrize(("flags", "expected"), [
    (("--gpu", "custom", "--gpu-memory", "24GB"),
     "--gpu custom needs --gpu-memory, --gpu-bandwidth, --gpu-flops; missing --gpu-bandwidth, --gpu-flops"),
    (("--gpu", "custom"), "missing --gpu-memory, --gpu-bandwidth, --gpu-flops"),
    (("--gpu", "h100-sxm", "--gpu-flops", "lots"), "--gpu-flops: cannot read 'lots' as FLOP/s"),
    (("--gpu", "h100-sxm", "--gpu-bandwidth=-2TB/s"), "--gpu-bandwidth: cannot read '-2TB/s' as a bandwidth"),
])
def test_plan_refuses_an_incomplete_or_unreadable_device(
        capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], expected: str) -> None:
    assert cli.main(["plan", *flags]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1


def test_calibrate_measures_against_the_given_peak(capsys: pytest.CaptureFixture[str]) -> None:
    gap_seconds, context = 0.08, 1000
    assert cli.main(["calibrate", *A10_FLAGS, "--itl", f"{gap_seconds}@{context}", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    measured = (QWEN3_WEIGHTS + QWEN3_KV * context) / gap_seconds
    assert out["gpu"] == "custom"
    assert out["effective_bandwidth_bytes_per_second"] == pytest.approx(measured)
    assert out["bandwidth_efficiency"] == pytest.approx(measured / A10_BANDWIDTH)


# --- serve flags ---------------------------------------------------------------------------------


def parse_serve(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    build_parser(parser)
    return parser.parse_args(argv)


SERVE = ["--target", "http://127.0.0.1:8000/metrics", "--model", "qwen3-8b"]


def test_serve_builds_a_deployment_on_a_custom_device_and_bounds_its_fit_by_it() -> None:
    config = config_from_args(parse_serve([*SERVE, "--gpu", "custom", "--gpu-memory", "24GB",
                                           "--gpu-bandwidth", "600GB/s", "--gpu-flops", "125TFLOP/s"]))
    [deployment] = config.deployments
    gpu = deployment.resolved.gpu
    assert deployment.gpu == "custom"
    assert (gpu.memory_bytes, gpu.peak_bandwidth_bytes_per_second, gpu.peak_flops_for(2.0)) == (
        A10_MEMORY, A10_BANDWIDTH, A10_FLOPS)
    assert deployment.resolved.setup.effective_bandwidth_bytes_per_second == pytest.approx(
        BANDWIDTH_EFFICIENCY * A10_BANDWIDTH)
    bounds = OnlineCalibrator(config.deployments).deployments["default"].bounds
    assert (bounds.max_bandwidth, bounds.max_compute) == (A10_BANDWIDTH, A10_FLOPS)


def test_serve_figure_flags_override_a_preset() -> None:
    config = config_from_args(parse_serve([*SERVE, "--gpu", "a100-80gb", "--gpu-bandwidth", "1.5TB/s"]))
    [deployment] = config.deployments
    a100 = get_gpu("a100-80gb")
    assert deployment.gpu == "a100-80gb"
    assert deployment.resolved.gpu.peak_bandwidth_bytes_per_second == 1.5e12
    assert deployment.resolved.gpu.memory_bytes == a100.memory_bytes
    assert deployment.resolved.gpu.peak_flops_per_second == a100.peak_flops_per_second


def test_serve_refuses_a_custom_device_missing_a_figure() -> None:
    with pytest.raises(InputError, match="--gpu custom needs --gpu-memory, --gpu-bandwidth, --gpu-flops; "
                                         "missing --gpu-flops"):
        config_from_args(parse_serve([*SERVE, "--gpu", "custom", "--gpu-memory", "24GB", "--gpu-bandwidth", "600GB/s"]))
    with pytest.raises(ConfigError, match=r"deployments\[0\]\.gpu\.peak_bandwidth: cannot read '600GBs'"):
        config_from_args(parse_serve([*SERVE, "--gpu", "custom", "--gpu-memory", "24GB", "--gpu-bandwidth", "600GBs",
                                      "--gpu-flops", "1e14"]))
