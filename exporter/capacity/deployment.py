"""From what a user names (model preset or config.json, GPU preset, dtypes, efficiencies) to the
ServingSetup the model computes with. Shared by `plan`, `calibrate`, `serve` and the simulator's
defaults, so a flag means the same thing everywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from exporter.capacity import fit, kv_cache, model
from exporter.capacity.architecture import Architecture, check_tensor_parallel, dtype_bytes
from exporter.capacity.model import ServingSetup
from exporter.capacity.model_files import (
    MODEL_CONFIGS_ENV,
    MODEL_HUB_ENV,
    config_file_key,
    find_model_config,
    is_hf_id,
)
from exporter.capacity.presets import Gpu, get_gpu, get_model_preset, is_model_preset, nearest_preset
from exporter.errors import InputError


@dataclass(frozen=True)
class ResolvedSetup:
    setup: ServingSetup
    gpu: Gpu
    # Where the effective bandwidth came from: "configured" (given), "calibrated" (measured by
    # `stepbudget calibrate`), or "default" (efficiency x datasheet peak: an assumption).
    bandwidth_source: str


def is_path_like(model_name_or_path: str) -> bool:
    """A model argument is a path when it says so: it holds a path separator or ends in .json."""
    separators = {separator for separator in ("/", os.path.sep, os.path.altsep) if separator}
    return any(separator in model_name_or_path for separator in separators) or model_name_or_path.endswith(".json")


def load_architecture(model_name_or_path: str, params: float | None = None) -> Architecture:
    """A preset name, a Hugging Face id (`Qwen/Qwen3-8B`), or a path to a config.json or to the model's
    folder; `params` overrides the count.

    What the working directory holds never changes the meaning of a name: a preset name is always the
    preset, and a file is read only when the argument looks like a path (`./name`, `dir/config.json`,
    `name.json`). A bare name that is no preset but names a file here is refused with the spelling
    that reads it. An `owner/name` is a path where one exists (as vLLM reads it), else a Hugging Face
    id looked up where `model_files` says.
    """
    if is_hf_id(model_name_or_path) and not os.path.exists(model_name_or_path):
        architecture = _load_by_hf_id(model_name_or_path)
    elif is_path_like(model_name_or_path):
        from exporter.capacity.hf_config import load_hf_config  # only paid for when a file is given

        # A model directory, as vLLM takes one (`vllm serve /models/qwen3-8b`), holds its config.json.
        path = model_name_or_path
        architecture = load_hf_config(os.path.join(path, "config.json") if os.path.isdir(path) else path)
    elif is_model_preset(model_name_or_path) or not os.path.exists(model_name_or_path):
        architecture = get_model_preset(model_name_or_path)  # an unknown name: the error lists the presets
    else:
        path = os.path.join(".", model_name_or_path)
        suggestion = os.path.join(path, "config.json") if os.path.isdir(model_name_or_path) else path
        raise InputError(f"model {model_name_or_path!r} is not a model preset; to read {model_name_or_path!r} "
                         f"in the working directory, write it as a path: {suggestion}")
    if params is not None:
        if not params > 0:
            raise InputError(f"params must be greater than zero, got {params!r}")
        architecture = _with_params(architecture, params)
    return architecture


def _load_by_hf_id(model_id: str) -> Architecture:
    """A Hugging Face id (`Qwen/Qwen3-8B`, as vLLM takes it) from a config.json already here
    (`model_files`), named by the id; else an error saying where it looked, the nearest preset and
    how to ship the file."""
    found = find_model_config(model_id)
    if found.path is None:
        raise InputError(
            f"model {model_id!r}: no such file or folder, and no config.json for it as a Hugging Face id "
            f"(looked in {', '.join(found.looked_in)})"
            f"{nearest_preset(model_id)}; ship the model's config.json: in the chart, its `models` value "
            f"(`models: {{{model_id}: <the file's JSON>}}`), else as {config_file_key(model_id)} in a folder named "
            f"by {MODEL_CONFIGS_ENV}, or give the file's path; or let it be fetched at start by naming a hub "
            f"in {MODEL_HUB_ENV}")
    from exporter.capacity.hf_config import load_hf_config  # only paid for when a file is given

    return load_hf_config(found.path, name=model_id)


def _with_params(architecture: Architecture, params: float) -> Architecture:
    """Override the total parameter count, keeping an MoE's routed share in proportion."""
    scale = params / architecture.params
    return replace(architecture, params=params, routed_expert_params=architecture.routed_expert_params * scale)


def build_setup(
    architecture: Architecture,
    gpu: str | Gpu,
    *,
    gpu_memory_bytes: float | None = None,
    tensor_parallel: int = 1,
    weight_dtype: str | None = None,
    kv_cache_dtype: str = "auto",
    gpu_memory_utilization: float = 0.9,
    reserved_memory_bytes: float = 0.0,
    bandwidth_bytes_per_second: float | None = None,
    bandwidth_is_calibrated: bool = False,
    bandwidth_efficiency: float = model.DEFAULT_BANDWIDTH_EFFICIENCY,
    compute_efficiency: float = model.DEFAULT_COMPUTE_EFFICIENCY,
    step_overhead_seconds: float = 0.0,
    per_request_seconds: float = 0.0,
    compute_flops_per_second: float | None = None,
    block_size_tokens: int = kv_cache.DEFAULT_BLOCK_SIZE_TOKENS,
) -> ResolvedSetup:
    """Resolve presets and defaults. kv_cache_dtype "auto" follows the weights' activation dtype
    (16-bit), as vLLM's does; weight quantization never changes the KV term and vice versa.
    `compute_flops_per_second` (a calibrated effective compute rate) replaces efficiency x peak.
    `gpu` is a preset name or a Gpu already resolved (a device given by its numbers: presets.device)."""
    gpu_preset = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise InputError(f"tensor parallel must be a whole number of GPUs >= 1, got {tensor_parallel!r}")
    check_tensor_parallel(architecture, tensor_parallel)
    for name, value in (("bandwidth efficiency", bandwidth_efficiency), ("compute efficiency", compute_efficiency)):
        if not 0 < value <= 1:
            raise InputError(f"{name} must be in (0, 1], got {value!r}")
    # None follows the checkpoint (quantization_config), else 16-bit.
    weight_dtype = weight_dtype or architecture.checkpoint_weight_dtype or "bf16"
    weight_bytes_per_param = dtype_bytes(weight_dtype, "weight dtype")
    kv_bytes = dtype_bytes(kv_cache_dtype, "kv cache dtype")  # DTYPE_BYTES has "auto": 16-bit
    if bandwidth_bytes_per_second is None:
        bandwidth = bandwidth_efficiency * gpu_preset.peak_bandwidth_bytes_per_second
        source = "default"
    else:
        if not bandwidth_bytes_per_second > 0:
            raise InputError(f"effective bandwidth must be greater than zero, got {bandwidth_bytes_per_second!r}")
        bandwidth = bandwidth_bytes_per_second
        source = "calibrated" if bandwidth_is_calibrated else "configured"
    if compute_flops_per_second is not None and not compute_flops_per_second > 0:
        raise InputError(f"effective compute must be greater than zero, got {compute_flops_per_second!r}")
    compute = compute_flops_per_second or compute_efficiency * gpu_preset.peak_flops_for(weight_bytes_per_param)
    setup = ServingSetup(
        architecture=architecture,
        gpu_memory_bytes=gpu_memory_bytes if gpu_memory_bytes is not None else gpu_preset.memory_bytes,
        effective_bandwidth_bytes_per_second=bandwidth,
        effective_compute_flops_per_second=compute,
        tensor_parallel=tensor_parallel,
        weight_bytes_per_param=weight_bytes_per_param,
        kv_bytes_per_element=kv_bytes,
        step_overhead_seconds=step_overhead_seconds,
        per_request_seconds=per_request_seconds,
        gpu_memory_utilization=gpu_memory_utilization,
        reserved_memory_bytes=reserved_memory_bytes,
        block_size_tokens=block_size_tokens,
    )
    return ResolvedSetup(setup=setup, gpu=gpu_preset, bandwidth_source=source)


def fit_bounds(resolved: ResolvedSetup) -> fit.FitBounds:
    """What a calibration of this setup may fit: bandwidth and compute up to the GPU's peaks (its
    datasheet's, or those given for a device by its numbers)."""
    return fit.FitBounds(
        max_bandwidth_bytes_per_second=resolved.gpu.peak_bandwidth_bytes_per_second,
        max_compute_flops_per_second=resolved.gpu.peak_flops_for(resolved.setup.weight_bytes_per_param))
