"""Built-in model and GPU presets, each with its source.

Models carry the architecture fields of their Hugging Face `config.json` and the published total
parameter count. GPUs carry datasheet peaks: memory in decimal bytes as the datasheet prints it
(80 GB = 80e9), bandwidth in bytes/s, dense (non-sparse) tensor FLOP/s per precision.

A device not in the table (a CPU host, an A10, a MIG slice with its own bandwidth) is given by its
numbers instead (`device`): the same Gpu, built from the figures the user gives, so every later step
(the setup, the fit's bounds) cannot tell it from a preset.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from exporter.capacity.architecture import Architecture
from exporter.errors import InputError
from exporter.suggest import close_names, closest_names


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
    # NVIDIA H100 NVL datasheet: 94 GB HBM3 at 3.9 TB/s; BF16 1,671 and FP8 3,341 TFLOPS with sparsity.
    "h100-nvl": Gpu("h100-nvl", 94 * _GB, 3.9 * _TB, {"bf16": 835.5e12, "fp8": 1670.5e12},
                    "NVIDIA H100 datasheet, H100 NVL"),
    # NVIDIA H200 datasheet (NVL): 141 GB HBM3e at 4.8 TB/s; BF16 1,671 and FP8 3,341 TFLOPS with sparsity.
    "h200-nvl": Gpu("h200-nvl", 141 * _GB, 4.8 * _TB, {"bf16": 835.5e12, "fp8": 1670.5e12},
                    "NVIDIA H200 datasheet, H200 NVL"),
    # NVIDIA H20 product brief: 96 GB HBM3 at 4.0 TB/s; FP16/BF16 148 and FP8 296 TFLOPS dense.
    "h20": Gpu("h20", 96 * _GB, 4.0 * _TB, {"bf16": 148e12, "fp8": 296e12}, "NVIDIA H20 product brief"),
    # NVIDIA A100 datasheet (PCIe 80GB): 80 GB HBM2e at 1,935 GB/s; BF16 312 TFLOPS dense.
    "a100-80gb-pcie": Gpu("a100-80gb-pcie", 80 * _GB, 1.935 * _TB, {"bf16": 312e12},
                          "NVIDIA A100 datasheet, PCIe 80GB"),
    # NVIDIA A10 datasheet: 24 GB GDDR6 at 600 GB/s; BF16 125 TFLOPS dense (250 with sparsity).
    "a10": Gpu("a10", 24 * _GB, 0.600 * _TB, {"bf16": 125e12}, "NVIDIA A10 datasheet"),
    # The A10G is AWS's variant (G5 instances), with no NVIDIA datasheet of its own: the A10's 24 GB GDDR6 at
    # 600 GB/s, and fewer tensor FLOP/s, 70 TFLOPS BF16 dense (Baseten, "NVIDIA A10 vs A10G for ML model inference").
    "a10g": Gpu("a10g", 24 * _GB, 0.600 * _TB, {"bf16": 70e12}, "AWS G5 (A10G) and Baseten's A10 vs A10G table"),
    # NVIDIA L40 datasheet: 48 GB GDDR6 at 864 GB/s; BF16 181.05 and FP8 362.1 TFLOPS dense.
    "l40": Gpu("l40", 48 * _GB, 0.864 * _TB, {"bf16": 181.05e12, "fp8": 362.1e12}, "NVIDIA L40 datasheet"),
    # NVIDIA L20 product brief: 48 GB GDDR6 at 864 GB/s; FP16/BF16 119.5 and FP8 239 TFLOPS dense.
    "l20": Gpu("l20", 48 * _GB, 0.864 * _TB, {"bf16": 119.5e12, "fp8": 239e12}, "NVIDIA L20 product brief"),
    # NVIDIA RTX 6000 Ada Generation datasheet: 48 GB GDDR6 at 960 GB/s; BF16 364.2 and FP8 728.5 TFLOPS dense
    # (1,457 FP8 with sparsity).
    "rtx-6000-ada": Gpu("rtx-6000-ada", 48 * _GB, 0.960 * _TB, {"bf16": 364.2e12, "fp8": 728.5e12},
                        "NVIDIA RTX 6000 Ada Generation datasheet"),
    # NVIDIA RTX PRO 6000 Blackwell datasheet: 96 GB GDDR7 at 1,792 GB/s (512-bit at 28 Gbps; the Server
    # Edition's may be clocked lower: give its peak_bandwidth); 4 PFLOPS FP4 with sparsity, so 2 dense, and
    # Blackwell's tensor cores halve that for FP8 and again for BF16.
    "rtx-pro-6000": Gpu("rtx-pro-6000", 96 * _GB, 1.792 * _TB, {"bf16": 500e12, "fp8": 1000e12},
                        "NVIDIA RTX PRO 6000 Blackwell datasheet"),
    # NVIDIA GB200 NVL72 datasheet, per GPU (72 in the rack): 13.4 TB HBM3e / 72 = 186 GB at 576 / 72 = 8 TB/s;
    # FP16/BF16 360 and FP8 720 PFLOPS per rack with sparsity -> 2.5 and 5 PFLOPS dense per GPU.
    "gb200": Gpu("gb200", 186 * _GB, 8.0 * _TB, {"bf16": 2500e12, "fp8": 5000e12},
                 "NVIDIA GB200 NVL72 datasheet, per GPU"),
    # AMD Instinct MI325X datasheet: 256 GB HBM3E at 6 TB/s; the MI300X's compute (BF16 1307.4, FP8 2614.9 dense).
    "mi325x": Gpu("mi325x", 256 * _GB, 6.0 * _TB, {"bf16": 1307.4e12, "fp8": 2614.9e12},
                  "AMD Instinct MI325X datasheet"),
    # AMD Instinct MI355X datasheet: 288 GB HBM3E at 8 TB/s; FP16/BF16 2.5 and FP8 5.0 PFLOPS dense.
    "mi355x": Gpu("mi355x", 288 * _GB, 8.0 * _TB, {"bf16": 2500e12, "fp8": 5000e12},
                  "AMD Instinct MI355X datasheet"),
    # Intel Gaudi 3 AI accelerator white paper: 128 GB HBM2e at 3.7 TB/s; BF16 and FP8 1,835 TFLOPS (MME).
    "gaudi3": Gpu("gaudi3", 128 * _GB, 3.7 * _TB, {"bf16": 1835e12, "fp8": 1835e12},
                  "Intel Gaudi 3 AI accelerator white paper"),
}

# The names devices go by on a node, each the preset it is (keys in `_device_key` form): what `nvidia-smi
# --query-gpu=name` prints and GPU Feature Discovery labels as `nvidia.com/gpu.product` (the same name with
# spaces as dashes: "NVIDIA H100 80GB HBM3" -> NVIDIA-H100-80GB-HBM3), the product names AMD's node labeller
# and `rocm-smi --showproductname` give, and Gaudi's `hl-smi` model names. The HBM3 H100 is the SXM5 part
# (the PCIe card carries HBM2e).
DEVICE_NAMES: dict[str, str] = {
    "h100-80gb-hbm3": "h100-sxm", "h100-sxm5-80gb": "h100-sxm", "h100-sxm": "h100-sxm",
    "h100-pcie": "h100-pcie", "h100-80gb-pcie": "h100-pcie", "h100-nvl": "h100-nvl",
    "h200": "h200", "h200-141gb-hbm3e": "h200", "h200-nvl": "h200-nvl", "h20": "h20",
    "a100-sxm4-40gb": "a100-40gb", "a100-pcie-40gb": "a100-40gb", "a100-40gb-pcie": "a100-40gb",
    "a100-sxm4-80gb": "a100-80gb", "a100-80gb-pcie": "a100-80gb-pcie", "a100-pcie-80gb": "a100-80gb-pcie",
    "a10": "a10", "a10g": "a10g", "l4": "l4", "l20": "l20", "l40": "l40", "l40s": "l40s",
    "rtx-6000-ada-generation": "rtx-6000-ada", "rtx-6000-ada": "rtx-6000-ada",
    "rtx-pro-6000-blackwell-server-edition": "rtx-pro-6000",
    "rtx-pro-6000-blackwell-workstation-edition": "rtx-pro-6000",
    "rtx-pro-6000-blackwell-max-q-workstation-edition": "rtx-pro-6000", "rtx-pro-6000-blackwell": "rtx-pro-6000",
    "b200": "b200", "gb200": "gb200",
    "mi300x": "mi300x", "mi300x-oam": "mi300x", "mi325x": "mi325x", "mi325x-oam": "mi325x",
    "mi355x": "mi355x", "mi355x-oam": "mi355x",
    "gaudi3": "gaudi3", "gaudi-3": "gaudi3", "hl-325l": "gaudi3", "hl-325": "gaudi3", "hl-338": "gaudi3",
}

# deepseek-ai/DeepSeek-V3 config.json: 61 layers, hidden 7168, 128 heads, MLA kv_lora_rank 512,
# qk_rope_head_dim 64, 256 routed experts + 1 shared, 8 per token, moe_intermediate 2048,
# first 3 layers dense; 671B parameters (plus 14B MTP module not used for decoding), 37B active.
# Routed experts: 58 MoE layers x 256 x (3 x 7168 x 2048) = 653.9e9.
_DEEPSEEK_V3 = Architecture("deepseek-v3", layers=61, hidden_size=7168, attention_heads=128, kv_heads=128,
                            head_dim=128, params=671e9, attention_kind="mla", kv_lora_rank=512,
                            qk_rope_head_dim=64, experts=256, experts_per_token=8,
                            routed_expert_params=58 * 256 * 3 * 7168 * 2048,
                            # Block-FP8 weights (quantization_config fp8) but for what stays 16-bit: both
                            # 129280 x 7168 embedding tables, the norms (two a layer, q_a's 1536 and kv_a's 512,
                            # the final one) and the 58 routers of 256 x (7168 + 1) (hf_config._deepseek).
                            input_embedding_params=129280 * 7168,
                            unquantized_params=2 * 129280 * 7168 + 61 * (2 * 7168 + 1536 + 512) + 7168
                            + 58 * 256 * (7168 + 1),
                            checkpoint_weight_dtype="fp8",
                            source="deepseek-ai/DeepSeek-V3 config.json and technical report")

# openai/gpt-oss-120b config.json: 36 layers, hidden 2880, 64 heads, 8 KV heads, head_dim 64, attention_bias
# (q, k, v and o biases) and one sink logit per head, 128 local experts, 4 per token, expert intermediate
# 2880 (gate_up 2880 -> 2 x 2880 and down 2880 -> 2880, each with a bias), router with a bias, vocab 201088,
# untied, sliding_window 128 on the even layers (layer_types alternate sliding/full: 18 of 36); experts in
# MXFP4, the rest in bf16 (quantization_config's modules_to_not_convert). OpenAI's gpt-oss model card,
# Table 1: 116.83B total, 5.13B active (active counts the unembedding, not the input embedding).
# Per layer: attention 2 x 2880 x 4096 + 2 x 2880 x 512 + biases (4096 + 2 x 512 + 2880) + 64 sinks
# + 2 norms + router 128 x (2880 + 1) + 128 experts x (2880 x 5760 + 5760 + 2880 x 2880 + 2880);
# plus 2 x 201088 x 2880 embeddings and the final norm = 116,829,156,672.
# MXFP4 stores 4-bit elements (and one 8-bit scale per 32): counted as int4, half a byte per parameter.
_GPT_OSS_120B = Architecture("gpt-oss-120b", layers=36, hidden_size=2880, attention_heads=64, kv_heads=8,
                             head_dim=64, params=116_829_156_672, sliding_window=128, sliding_window_layers=18,
                             experts=128, experts_per_token=4, routed_expert_params=114_701_598_720,
                             input_embedding_params=201088 * 2880,
                             unquantized_params=116_829_156_672 - 114_701_598_720, checkpoint_weight_dtype="int4",
                             source="openai/gpt-oss-120b config.json and OpenAI's gpt-oss model card")

# meta-llama/Llama-3.1-70B config.json: 80 layers, hidden 8192, 64 heads, 8 KV heads; 70.6B parameters.
_LLAMA_31_70B = Architecture("llama-3.1-70b", layers=80, hidden_size=8192, attention_heads=64, kv_heads=8,
                             head_dim=128, params=70.55e9, source="meta-llama/Llama-3.1-70B config.json")
MODELS: dict[str, Architecture] = {
    # Qwen/Qwen3-8B config.json: 36 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128,
    # intermediate 12288, vocab 151936, untied embeddings; model card: 8.2B parameters.
    "qwen3-8b": Architecture("qwen3-8b", layers=36, hidden_size=4096, attention_heads=32, kv_heads=8,
                             head_dim=128, params=8.19e9, source="Qwen/Qwen3-8B config.json and model card"),
    # meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads, vocab 128256;
    # 8.03B parameters.
    "llama-3.1-8b": Architecture("llama-3.1-8b", layers=32, hidden_size=4096, attention_heads=32, kv_heads=8,
                                 head_dim=128, params=8.03e9, source="meta-llama/Llama-3.1-8B config.json"),
    "llama-3.1-70b": _LLAMA_31_70B,
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
    "deepseek-v3": _DEEPSEEK_V3,
    "gpt-oss-120b": _GPT_OSS_120B,
    # openai/gpt-oss-20b config.json: as gpt-oss-120b but 24 layers (12 sliding) and 32 local experts, 4 per
    # token. OpenAI's gpt-oss model card, Table 1: 20.91B total, 3.61B active. Counted as gpt-oss-120b:
    # 20,914,757,184, of which 24 x 32 experts hold 19,116,933,120.
    "gpt-oss-20b": replace(_GPT_OSS_120B, name="gpt-oss-20b", layers=24, sliding_window_layers=12, experts=32,
                           params=20_914_757_184, routed_expert_params=19_116_933_120,
                           unquantized_params=20_914_757_184 - 19_116_933_120,
                           source="openai/gpt-oss-20b config.json and OpenAI's gpt-oss model card"),
    # meta-llama/Llama-3.3-70B-Instruct config.json: Llama 3.1 70B's architecture, 80 layers, hidden 8192, 64 heads,
    # 8 KV heads of 128, intermediate 28672, vocab 128256, untied; model card: 70B (70.6B as Llama 3.1 70B's).
    # 80 x (2 x 8192 x 8192 + 2 x 8192 x 1024 + 3 x 8192 x 28672 + 2 x 8192) + 2 x 128256 x 8192 + 8192
    # = 70,553,706,496.
    "llama-3.3-70b": replace(_LLAMA_31_70B, name="llama-3.3-70b", params=70_553_706_496,
                             source="meta-llama/Llama-3.3-70B-Instruct config.json and model card"),
    # Qwen/Qwen3-32B config.json: 64 layers, hidden 5120, 64 heads, 8 KV heads, head_dim 128, intermediate 25600,
    # vocab 151936, untied, q_norm and k_norm of head_dim per layer; model card: 32.8B parameters.
    # 64 x (2 x 5120 x 8192 + 2 x 5120 x 1024 + 2 x 128 + 3 x 5120 x 25600 + 2 x 5120) + 2 x 151936 x 5120
    # + 5120 = 32,762,123,264.
    "qwen3-32b": Architecture("qwen3-32b", layers=64, hidden_size=5120, attention_heads=64, kv_heads=8,
                              head_dim=128, params=32_762_123_264, source="Qwen/Qwen3-32B config.json and model card"),
    # mistralai/Mistral-Small-3.1-24B-Instruct-2503 config.json, text_config (model_type mistral): 40 layers,
    # hidden 5120, 32 heads, 8 KV heads, head_dim 128, intermediate 32768, vocab 131072, untied, no sliding
    # window; model card: 24B parameters, which include the Pixtral vision encoder. The language model alone
    # (what decodes): 40 x (2 x 5120 x 4096 + 2 x 5120 x 1024 + 3 x 5120 x 32768 + 2 x 5120)
    # + 2 x 131072 x 5120 + 5120 = 23,572,403,200.
    "mistral-small-3.1-24b": Architecture("mistral-small-3.1-24b", layers=40, hidden_size=5120, attention_heads=32,
                                          kv_heads=8, head_dim=128, params=23_572_403_200,
                                          source="mistralai/Mistral-Small-3.1-24B-Instruct-2503 config.json "
                                                 "(text_config) and model card; the language model only"),
    # Qwen/Qwen3-235B-A22B config.json: 94 layers, hidden 4096, 64 heads, 4 KV heads, head_dim 128, q_norm and
    # k_norm, 128 experts, 8 per token, moe_intermediate 1536 on every layer (decoder_sparse_step 1, no
    # mlp_only_layers), router without bias, vocab 151936, untied; model card: 235B total, 22B activated.
    # 94 x (2 x 4096 x 8192 + 2 x 4096 x 512 + 2 x 128 + 2 x 4096 + 4096 x 128 + 128 x 3 x 4096 x 1536)
    # + 2 x 151936 x 4096 + 4096 = 235,093,634,560; routed experts 94 x 128 x 3 x 4096 x 1536.
    "qwen3-235b-a22b": Architecture("qwen3-235b-a22b", layers=94, hidden_size=4096, attention_heads=64, kv_heads=4,
                                    head_dim=128, params=235_093_634_560, experts=128, experts_per_token=8,
                                    routed_expert_params=94 * 128 * 3 * 4096 * 1536,
                                    source="Qwen/Qwen3-235B-A22B config.json and model card"),
    # meta-llama/Llama-4-Scout-17B-16E-Instruct config.json, text_config (model_type llama4_text): 48 layers,
    # hidden 5120, 40 heads, 8 KV heads, head_dim 128, 16 routed experts, 1 per token, plus a shared expert, all
    # of intermediate_size 8192, on every layer (interleave_moe_layer_step 1, so intermediate_size_mlp 16384 is
    # unused), router without bias, qk norm without weights (L2), vocab 202048, untied; attention_chunk_size
    # 8192 on the RoPE layers, three in four (no_rope_layers), the fourth attends to the whole context. Chunked
    # attention sees at most the 8192 tokens of its chunk, modelled here as a sliding window of 8192 on those
    # 36 layers (an upper bound: a chunk starts empty). Model card: 17B active, 109B total with the vision
    # encoder; the language model: 48 x (2 x 5120 x 5120 + 2 x 5120 x 1024 + 2 x 5120 + 5120 x 16
    # + 17 x 3 x 5120 x 8192) + 2 x 202048 x 5120 + 5120 = 107,769,861,120; routed 48 x 16 x 3 x 5120 x 8192.
    "llama-4-scout": Architecture("llama-4-scout", layers=48, hidden_size=5120, attention_heads=40, kv_heads=8,
                                  head_dim=128, params=107_769_861_120, sliding_window=8192, sliding_window_layers=36,
                                  experts=16, experts_per_token=1, routed_expert_params=48 * 16 * 3 * 5120 * 8192,
                                  source="meta-llama/Llama-4-Scout-17B-16E-Instruct config.json (text_config) and "
                                         "model card; the language model only"),
    # deepseek-ai/DeepSeek-R1 config.json: DeepSeek-V3's architecture (model_type deepseek_v3, the same numbers);
    # model card: 671B total, 37B activated. Per layer: MLA q_a 7168 x 1536 + its norm 1536 + q_b
    # 1536 x 128 x (128 + 64), kv_a 7168 x (512 + 64) + its norm 512, kv_b 512 x 128 x (128 + 128), o 128 x 128
    # x 7168, two norms; 3 dense layers of 3 x 7168 x 18432; 58 MoE layers of 256 routed + 1 shared experts of
    # 3 x 7168 x 2048 and a router 256 x 7168 with its 256 score-correction biases; 2 x 129280 x 7168
    # embeddings and the final norm = 671,026,419,200 (the 14B multi-token-prediction layer excluded).
    "deepseek-r1": replace(_DEEPSEEK_V3, name="deepseek-r1", params=671_026_419_200,
                           source="deepseek-ai/DeepSeek-R1 config.json and model card"),
    # moonshotai/Kimi-K2-Instruct config.json (model_type kimi_k2, DeepSeek-V3's layout): 61 layers, hidden 7168,
    # 64 heads, MLA q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim
    # 128, 384 routed experts + 1 shared, 8 per token, moe_intermediate 2048, first_k_dense_replace 1 (a dense
    # layer of intermediate 18432), vocab 163840, untied; Moonshot's model card and Kimi K2 technical report:
    # 1.04T total, 32B activated. Counted as deepseek-r1 with those numbers: 1,026,408,232,448; routed
    # experts 60 x 384 x 3 x 7168 x 2048.
    "kimi-k2": Architecture("kimi-k2", layers=61, hidden_size=7168, attention_heads=64, kv_heads=64, head_dim=128,
                            params=1_026_408_232_448, attention_kind="mla", kv_lora_rank=512, qk_rope_head_dim=64,
                            experts=384, experts_per_token=8, routed_expert_params=60 * 384 * 3 * 7168 * 2048,
                            # Block FP8 as DeepSeek-V3 (its 16-bit part counted the same way, 60 routers of 384).
                            input_embedding_params=163840 * 7168,
                            unquantized_params=2 * 163840 * 7168 + 61 * (2 * 7168 + 1536 + 512) + 7168
                            + 60 * 384 * (7168 + 1),
                            checkpoint_weight_dtype="fp8",
                            source="moonshotai/Kimi-K2-Instruct config.json and model card"),
}


def get_gpu(name: str) -> Gpu:
    """A preset by its own name or by the name the device goes by on a node (`DEVICE_NAMES`)."""
    key = name.strip().lower()
    if key in GPUS:
        return GPUS[key]
    device_key = _device_key(name)
    if device_key in DEVICE_NAMES:
        return GPUS[DEVICE_NAMES[device_key]]
    if (mig := _MIG_SLICE.search(device_key)) and device_key[:mig.start()] in DEVICE_NAMES:
        preset = DEVICE_NAMES[device_key[:mig.start()]]
        raise InputError(f"GPU {name!r} is a MIG slice of {preset}: a slice has a share of the card's memory and "
                         f"bandwidth, so give it by its numbers, `{{preset: {preset}, memory: ..., "
                         "peak_bandwidth: ...}` (docs/operations.md)")
    raise InputError(f"unknown GPU preset {name!r}{_same_generation(device_key)}; known: {', '.join(sorted(GPUS))} "
                     "(or give the device by its numbers: docs/operations.md)")


# GPU Feature Discovery adds "-MIG-<profile>" to a MIG device's product (e.g. NVIDIA-A100-SXM4-40GB-MIG-1g.5gb)
# and "-SHARED" to a time-sliced one; vendors' names begin with the vendor and a family.
_MIG_SLICE = re.compile(r"-mig-[0-9a-z.+-]+$")
_SHARED = re.compile(r"-shared$")
_VENDOR_PREFIXES = ("nvidia-", "amd-instinct-", "amd-", "instinct-", "intel-", "habana-")


def _device_key(name: str) -> str:
    """A device name as a key: lower case, runs of spaces and underscores as one dash, the vendor's prefix and
    a time-sliced device's "-SHARED" off (the card is the same)."""
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    key = _SHARED.sub("", key)
    for prefix in _VENDOR_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def _generation(device_key: str) -> str | None:
    """The chip a name names (its first dash-separated word: h100, a100, mi300x, rtx), if it is one a
    preset is of."""
    word = device_key.split("-", 1)[0]
    return word if any(preset.split("-", 1)[0] == word for preset in GPUS) else None


def _same_generation(device_key: str) -> str:
    """' (did you mean: ...?)' with only the presets of the chip the name names, where it names one: an
    unknown H100 variant is offered the H100s, never an A100 that happens to spell closer."""
    generation = _generation(device_key)
    if generation is None:
        return close_names(device_key, GPUS)
    same = [preset for preset in GPUS if preset.split("-", 1)[0] == generation]
    return f" (did you mean: {', '.join(same)}?)"


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


def nearest_preset(model_id: str) -> str:
    """'; the nearest preset: qwen3-8b (`model: qwen3-8b`)' for a model id whose name is, or is close to, a
    preset's; '' where none is."""
    key = _preset_key(model_id.rsplit("/", 1)[-1])
    matches = [key] if key in MODELS else closest_names(key, MODELS, count=1, cutoff=0.6)
    return f"; the nearest preset: {matches[0]} (`model: {matches[0]}`)" if matches else ""


def get_model_preset(name: str) -> Architecture:
    key = _preset_key(name)
    if key not in MODELS:
        raise InputError(
            f"unknown model preset {name!r}{close_names(key, MODELS)}; known: {', '.join(MODELS)} "
            "(or give the path to a Hugging Face config.json)"
        )
    return MODELS[key]
