"""Built-in model and GPU presets, each with its source.

Models carry the architecture fields of their Hugging Face `config.json` and the published total
parameter count. GPUs carry datasheet peaks: memory in decimal bytes as the datasheet prints it
(80 GB = 80e9), bandwidth in bytes/s, dense (non-sparse) tensor FLOP/s per precision.

A device not in the table (a CPU host, an A10, a MIG slice with its own bandwidth) is given by its
numbers instead (`device`): the same Gpu, built from the figures the user gives, so every later step
(the setup, the fit's bounds) cannot tell it from a preset.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from exporter.capacity.model import Architecture
from exporter.errors import InputError
from exporter.suggest import close_names


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: float
    peak_bandwidth_bytes_per_second: float
    # Dense tensor-core peak by compute precision ("bf16" covers fp16; "fp8" where the chip has it).
    peak_flops_per_second: dict[str, float]
    source: str

    def peak_flops_for(self, weight_dtype_bytes: float) -> float:
        """Peak for the precision the matmuls run in: fp8 weights use fp8 tensor cores where the
        chip has them; int4 weights (AWQ/GPTQ) are dequantized and multiply in 16-bit.

        A device given by its numbers (or a preset whose FLOP/s was given) holds one figure, under
        "bf16" alone, so that figure is the peak for every precision: the user gave one number, and
        guessing an fp8 multiple for an unknown chip would be inventing a datasheet."""
        if weight_dtype_bytes == 1.0 and "fp8" in self.peak_flops_per_second:
            return self.peak_flops_per_second["fp8"]
        return self.peak_flops_per_second["bf16"]


_TB = 1e12
_GB = 1e9

GPUS: dict[str, Gpu] = {
    # NVIDIA H100 datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, BF16 989.4 TFLOPS dense (1979 sparse), FP8 1978.9 dense.
    "h100-sxm": Gpu("h100-sxm", 80 * _GB, 3.35 * _TB, {"bf16": 989.4e12, "fp8": 1978.9e12},
                    "NVIDIA H100 datasheet, SXM5 80GB"),
    # NVIDIA H100 datasheet (PCIe): 80 GB HBM2e, 2.0 TB/s, BF16 756 dense, FP8 1513 dense.
    "h100-pcie": Gpu("h100-pcie", 80 * _GB, 2.0 * _TB, {"bf16": 756e12, "fp8": 1513e12},
                     "NVIDIA H100 datasheet, PCIe 80GB"),
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s; same tensor cores as H100 SXM.
    "h200": Gpu("h200", 141 * _GB, 4.8 * _TB, {"bf16": 989.4e12, "fp8": 1978.9e12},
                "NVIDIA H200 datasheet, SXM 141GB"),
    # NVIDIA A100 datasheet: 40 GB HBM2 at 1,555 GB/s; BF16 312 TFLOPS dense; no FP8.
    "a100-40gb": Gpu("a100-40gb", 40 * _GB, 1.555 * _TB, {"bf16": 312e12}, "NVIDIA A100 datasheet, SXM4 40GB"),
    # NVIDIA A100 datasheet: 80 GB HBM2e at 2,039 GB/s; BF16 312 TFLOPS dense.
    "a100-80gb": Gpu("a100-80gb", 80 * _GB, 2.039 * _TB, {"bf16": 312e12}, "NVIDIA A100 datasheet, SXM4 80GB"),
    # NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s; BF16 362 dense (733 sparse), FP8 733 dense.
    "l40s": Gpu("l40s", 48 * _GB, 0.864 * _TB, {"bf16": 362e12, "fp8": 733e12}, "NVIDIA L40S datasheet"),
    # NVIDIA L4 datasheet: 24 GB GDDR6 at 300 GB/s; BF16 242 and FP8 485 TFLOPS with sparsity -> halves dense.
    "l4": Gpu("l4", 24 * _GB, 0.300 * _TB, {"bf16": 121e12, "fp8": 242.5e12}, "NVIDIA L4 datasheet"),
    # NVIDIA HGX B200 datasheet: 180 GB HBM3e per GPU at 8 TB/s; BF16 2.25 PFLOPS dense, FP8 4.5 dense.
    "b200": Gpu("b200", 180 * _GB, 8.0 * _TB, {"bf16": 2250e12, "fp8": 4500e12}, "NVIDIA HGX B200 datasheet"),
    # AMD Instinct MI300X datasheet: 192 GB HBM3 at 5.3 TB/s; BF16 1307.4 TFLOPS dense, FP8 2614.9 dense.
    "mi300x": Gpu("mi300x", 192 * _GB, 5.3 * _TB, {"bf16": 1307.4e12, "fp8": 2614.9e12},
                  "AMD Instinct MI300X datasheet"),
}

MODELS: dict[str, Architecture] = {
    # Qwen/Qwen3-8B config.json: 36 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128,
    # intermediate 12288, vocab 151936, untied embeddings; model card: 8.2B parameters.
    "qwen3-8b": Architecture("qwen3-8b", layers=36, hidden_size=4096, attention_heads=32, kv_heads=8,
                             head_dim=128, params=8.19e9, source="Qwen/Qwen3-8B config.json and model card"),
    # meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads, vocab 128256;
    # 8.03B parameters.
    "llama-3.1-8b": Architecture("llama-3.1-8b", layers=32, hidden_size=4096, attention_heads=32, kv_heads=8,
                                 head_dim=128, params=8.03e9, source="meta-llama/Llama-3.1-8B config.json"),
    # meta-llama/Llama-3.1-70B config.json: 80 layers, hidden 8192, 64 heads, 8 KV heads; 70.6B parameters.
    "llama-3.1-70b": Architecture("llama-3.1-70b", layers=80, hidden_size=8192, attention_heads=64, kv_heads=8,
                                  head_dim=128, params=70.55e9, source="meta-llama/Llama-3.1-70B config.json"),
    # mosaicml/mpt-7b config.json: n_layers 32, d_model 4096, n_heads 32 (MHA), expansion 4,
    # vocab 50432, tied; 6.65B parameters.
    "mpt-7b": Architecture("mpt-7b", layers=32, hidden_size=4096, attention_heads=32, kv_heads=32,
                           head_dim=128, params=6.65e9, source="mosaicml/mpt-7b config.json"),
    # meta-llama/Llama-2-7b-hf config.json: 32 layers, hidden 4096, 32 heads (MHA), vocab 32000; 6.74B.
    "llama-2-7b": Architecture("llama-2-7b", layers=32, hidden_size=4096, attention_heads=32, kv_heads=32,
                               head_dim=128, params=6.74e9, source="meta-llama/Llama-2-7b-hf config.json"),
    # mistralai/Mistral-7B-v0.1 config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads,
    # sliding_window 4096 on every layer; 7.24B parameters.
    "mistral-7b": Architecture("mistral-7b", layers=32, hidden_size=4096, attention_heads=32, kv_heads=8,
                               head_dim=128, params=7.24e9, sliding_window=4096, sliding_window_layers=32,
                               source="mistralai/Mistral-7B-v0.1 config.json"),
    # Qwen/Qwen3-30B-A3B config.json: 48 layers, hidden 2048, 32 heads, 4 KV heads, head_dim 128,
    # 128 experts, 8 per token, moe_intermediate 768; 30.5B total, 3.3B active.
    # Routed experts: 48 layers x 128 x (3 x 2048 x 768) = 28.99e9.
    "qwen3-30b-a3b": Architecture("qwen3-30b-a3b", layers=48, hidden_size=2048, attention_heads=32, kv_heads=4,
                                  head_dim=128, params=30.53e9, experts=128, experts_per_token=8,
                                  routed_expert_params=48 * 128 * 3 * 2048 * 768,
                                  source="Qwen/Qwen3-30B-A3B config.json and model card"),
    # google/gemma-3-27b-it config.json (text_config): 62 layers, hidden 5376, 32 heads, 16 KV heads,
    # head_dim 128, sliding_window 1024, one global layer in six -> 52 sliding + 10 full;
    # 27.4B parameters with the vision tower (0.4B), 27.0B for the language model.
    "gemma-3-27b": Architecture("gemma-3-27b", layers=62, hidden_size=5376, attention_heads=32, kv_heads=16,
                                head_dim=128, params=27.0e9, sliding_window=1024, sliding_window_layers=52,
                                source="google/gemma-3-27b-it config.json and model card"),
    # deepseek-ai/DeepSeek-V3 config.json: 61 layers, hidden 7168, 128 heads, MLA kv_lora_rank 512,
    # qk_rope_head_dim 64, 256 routed experts + 1 shared, 8 per token, moe_intermediate 2048,
    # first 3 layers dense; 671B parameters (plus 14B MTP module not used for decoding), 37B active.
    # Routed experts: 58 MoE layers x 256 x (3 x 7168 x 2048) = 653.9e9.
    "deepseek-v3": Architecture("deepseek-v3", layers=61, hidden_size=7168, attention_heads=128, kv_heads=128,
                                head_dim=128, params=671e9, attention_kind="mla", kv_lora_rank=512,
                                qk_rope_head_dim=64, experts=256, experts_per_token=8,
                                routed_expert_params=58 * 256 * 3 * 7168 * 2048,
                                source="deepseek-ai/DeepSeek-V3 config.json and technical report"),
}


def get_gpu(name: str) -> Gpu:
    key = name.strip().lower()
    if key not in GPUS:
        raise InputError(f"unknown GPU preset {name!r}{close_names(key, GPUS)}; known: {', '.join(GPUS)} "
                         "(or give the device by its numbers: docs/operations.md)")
    return GPUS[key]


# `--gpu custom`: the device is wholly the figures given with it (and its name, this, unless one is given).
CUSTOM_GPU = "custom"
# The config keys that give a device's figures (`gpu: {memory, peak_bandwidth, peak_flops}`), and the flags
# that do (`plan`, `calibrate`, `serve`), both in DeviceFigures' order.
FIGURE_KEYS = ("memory", "peak_bandwidth", "peak_flops")
GPU_FIGURE_FLAGS = ("--gpu-memory", "--gpu-bandwidth", "--gpu-flops")
# The precision key a one-figure device keeps its FLOP/s under; peak_flops_for falls back to it.
_ONE_FIGURE_PRECISION = "bf16"


def is_custom_gpu(name: str) -> bool:
    return _preset_key(name) == CUSTOM_GPU


def require_figures(given: Mapping[str, object | None], what: str) -> None:
    """Every figure a device by numbers needs is given; else one message naming all that are missing,
    spelled as the user writes them (config keys or flags)."""
    if any(value is None for value in given.values()):
        raise _missing_figures(given, what)


def _missing_figures(given: Mapping[str, object | None], what: str) -> InputError:
    missing = [name for name, value in given.items() if value is None]
    return InputError(f"{what} needs {', '.join(given)}; missing {', '.join(missing)}")


@dataclass(frozen=True)
class DeviceFigures:
    """A device's peaks given by number (None: not given), with the names they were given by, so a
    missing one is named as the user knows it: config keys by default, or the flags."""

    memory_bytes: float | None = None
    peak_bandwidth_bytes_per_second: float | None = None
    peak_flops_per_second: float | None = None
    names: tuple[str, str, str] = FIGURE_KEYS

    def by_name(self) -> dict[str, float | None]:
        values = (self.memory_bytes, self.peak_bandwidth_bytes_per_second, self.peak_flops_per_second)
        return dict(zip(self.names, values, strict=True))

    def complete(self, what: str) -> tuple[float, float, float]:
        """Memory, bandwidth and FLOP/s, each required: the InputError names every one missing."""
        memory, bandwidth, flops = self.memory_bytes, self.peak_bandwidth_bytes_per_second, self.peak_flops_per_second
        if memory is None or bandwidth is None or flops is None:
            raise _missing_figures(self.by_name(), what)
        return memory, bandwidth, flops


def device(preset: str, figures: DeviceFigures, *, name: str | None = None,
           custom_what: str = CUSTOM_GPU) -> Gpu:
    """`preset` with each given figure replacing its own (a MIG slice, a clocked-down part), or, for
    `custom`, a device wholly by its figures, every one of them then required (`custom_what` says in
    the message what asked for them). A FLOP/s figure is one number for every precision
    (Gpu.peak_flops_for)."""
    if is_custom_gpu(preset):
        memory_bytes, bandwidth_bytes_per_second, flops_per_second = figures.complete(custom_what)
        return Gpu(name or CUSTOM_GPU, memory_bytes, bandwidth_bytes_per_second,
                   {_ONE_FIGURE_PRECISION: flops_per_second}, "given by its numbers")
    base = get_gpu(preset)
    flops = (None if figures.peak_flops_per_second is None
             else {_ONE_FIGURE_PRECISION: figures.peak_flops_per_second})
    given = [key for key, value in figures.by_name().items() if value is not None]
    return Gpu(
        name=name or base.name,
        memory_bytes=figures.memory_bytes or base.memory_bytes,
        peak_bandwidth_bytes_per_second=figures.peak_bandwidth_bytes_per_second or base.peak_bandwidth_bytes_per_second,
        peak_flops_per_second=flops or base.peak_flops_per_second,
        source=base.source + (f"; {', '.join(given)} given" if given else ""),
    )


def _preset_key(name: str) -> str:
    return name.strip().lower()


def is_model_preset(name: str) -> bool:
    return _preset_key(name) in MODELS


def get_model_preset(name: str) -> Architecture:
    key = _preset_key(name)
    if key not in MODELS:
        raise InputError(
            f"unknown model preset {name!r}{close_names(key, MODELS)}; known: {', '.join(MODELS)} "
            "(or give the path to a Hugging Face config.json)"
        )
    return MODELS[key]
