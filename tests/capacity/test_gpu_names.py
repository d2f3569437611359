"""GPUs by the names they go by on a node: what `nvidia-smi --query-gpu=name` prints, what GPU Feature
Discovery labels a node with (`nvidia.com/gpu.product`: the same name, spaces as dashes, "-SHARED" on a
time-sliced device, "-MIG-<profile>" on a MIG one), AMD's product names and Gaudi's model names. Each
resolves to the preset of that card; a near miss is offered only the presets of the chip it names."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from exporter import cli
from exporter.capacity.presets import DEVICE_NAMES, GPUS, get_gpu
from exporter.errors import InputError
from exporter.serve.config import ConfigError, load_config
from tests.support.tools import REPO

# (the name as a node gives it, the preset it is). The HBM3 H100 is the SXM5 part: the PCIe card carries
# HBM2e and prints "NVIDIA H100 PCIe".
NODE_NAMES = [
    ("NVIDIA-H100-80GB-HBM3", "h100-sxm"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA-H100-80GB-HBM3-SHARED", "h100-sxm"),
    ("NVIDIA-H100-PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA-H200", "h200"),
    ("NVIDIA H200 NVL", "h200-nvl"),
    ("NVIDIA-H20", "h20"),
    ("NVIDIA-A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA-A100-PCIE-40GB", "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
    ("NVIDIA-A10", "a10"),
    ("NVIDIA A10G", "a10g"),
    ("NVIDIA-L4", "l4"),
    ("NVIDIA-L20", "l20"),
    ("NVIDIA L40", "l40"),
    ("NVIDIA-L40S", "l40s"),
    ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada"),
    ("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", "rtx-pro-6000"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "rtx-pro-6000"),
    ("NVIDIA-B200", "b200"),
    ("NVIDIA GB200", "gb200"),
    ("AMD Instinct MI300X", "mi300x"),
    ("AMD_Instinct_MI300X_OAM", "mi300x"),
    ("AMD Instinct MI325X", "mi325x"),
    ("AMD Instinct MI355X", "mi355x"),
    ("HL-325L", "gaudi3"),
]


@pytest.mark.parametrize(("name", "preset"), NODE_NAMES)
def test_a_node_name_is_its_cards_preset(name: str, preset: str) -> None:
    assert get_gpu(name) is GPUS[preset]


def test_every_preset_is_named_by_some_node_name() -> None:
    """A preset no node name reaches would be typed in only by its own name: the table covers every card."""
    assert {preset for _, preset in NODE_NAMES} == set(GPUS)


def test_a_mig_slice_is_refused_naming_its_card_and_the_numbers_it_needs() -> None:
    with pytest.raises(InputError) as caught:
        get_gpu("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb")
    message = str(caught.value)
    assert "MIG slice of a100-40gb" in message
    assert "{preset: a100-40gb, memory: ..., peak_bandwidth: ...}" in message


@pytest.mark.parametrize(("typo", "chip"), [
    ("NVIDIA-H100-SXM6", "h100"), ("h100-sxn", "h100"), ("a100-90gb", "a100"), ("NVIDIA-A100-SXM4-120GB", "a100"),
    ("mi300x-sr", "mi300x"), ("NVIDIA-H100", "h100"), ("rtx-6000-blackwell", "rtx"), ("NVIDIA-L40-48GB", "l40"),
])
def test_a_near_miss_is_offered_only_its_chips_presets(typo: str, chip: str) -> None:
    """The old suggestion for an H100 the table lacked was a100-80gb: the closest spelling, another
    generation. Now every suggestion is of the chip the name names, and all of that chip's are offered."""
    with pytest.raises(InputError) as caught:
        get_gpu(typo)
    message = str(caught.value)
    suggested = message.split("(did you mean: ", 1)[1].split("?)", 1)[0].split(", ")
    assert suggested == [preset for preset in GPUS if preset.split("-", 1)[0] == chip]


def test_a_config_takes_the_node_name_and_the_deployment_carries_the_preset(tmp_path: Path) -> None:
    path = tmp_path / "stepbudget.yaml"
    path.write_text(textwrap.dedent("""\
        deployments:
          - name: chat
            model: qwen3-8b
            gpu: NVIDIA-H100-80GB-HBM3
            targets:
              static: [http://10.0.0.5:8000/metrics]
          - name: batch
            model: qwen3-8b
            gpu: {preset: NVIDIA A100 80GB PCIe, peak_bandwidth: 1.5TB/s}
            targets:
              static: [http://10.0.0.6:8000/metrics]
        """))
    chat, batch = load_config(str(path)).deployments
    assert chat.gpu == "h100-sxm"
    assert chat.resolved.gpu.peak_bandwidth_bytes_per_second == 3.35e12
    assert batch.resolved.gpu.name == "a100-80gb-pcie"
    assert batch.resolved.gpu.peak_bandwidth_bytes_per_second == 1.5e12


def test_a_config_refuses_a_mig_slice_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "stepbudget.yaml"
    path.write_text("deployments:\n  - name: chat\n    model: qwen3-8b\n    gpu: NVIDIA-H100-80GB-HBM3-MIG-1g.10gb\n"
                    "    targets:\n      static: [http://10.0.0.5:8000/metrics]\n")
    with pytest.raises(ConfigError, match=r"yaml:4: deployments\[0\].gpu: GPU .* is a MIG slice of h100-sxm"):
        load_config(str(path))


def test_plan_takes_what_nvidia_smi_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader)"`: the H100's 80 GB, at the
    default 0.9 utilization, less Qwen3-8B's 8.19e9 x 2 bytes of weights, over 2 x 36 x 8 x 128 x 2
    bytes of KV a token, in whole blocks of 16."""
    assert cli.main(["plan", "--model", "qwen3-8b", "--gpu", "NVIDIA H100 80GB HBM3", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    kv_bytes_per_token = 2 * 36 * 8 * 128 * 2
    capacity = (80e9 * 0.9 - 8.19e9 * 2) // kv_bytes_per_token // 16 * 16
    assert plan["kv_capacity_tokens"] == capacity


def test_the_operations_guide_lists_every_preset_with_the_names_it_takes() -> None:
    guide = (REPO / "docs" / "operations.md").read_text()
    table = guide.split("## GPU presets and the names nodes give them", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("`", 2)[1]: line for line in table.splitlines() if line.startswith("| `")}
    assert set(rows) == set(GPUS)
    for name, preset in DEVICE_NAMES.items():
        assert name == preset or f"`{name}`" in rows[preset], (name, preset)
