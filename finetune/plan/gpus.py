"""GPU catalog: memory, bf16 dense throughput, memory bandwidth, interconnect and a typical cloud
price per GPU.

The planner needs these numbers offline and instantly. Sources: vendor datasheets (memory as
nvidia-smi / rocm-smi report it, dense tensor-core TFLOP/s without sparsity, with fp32
accumulation as PyTorch uses, memory bandwidth of the SXM / PCIe card named) and on-demand list
prices of common clouds in 2025, which vary by about ±50 % between providers: treat
`usd_per_hour` as an order of magnitude for comparing plans.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from finetune.errors import UnknownGPUError


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator model, as the planner sees it."""

    name: str
    memory_gib: float  # total device memory as nvidia-smi reports it (MiB / 1024)
    bf16_tflops: float  # dense tensor-core peak for bf16 (fp16 on cards without bf16), fp32 accumulate
    bf16: bool  # native bf16 support (Ampere and newer); without it, plans use fp16-mixed
    interconnect: str  # "NVLink", "Infinity Fabric" or "PCIe": what links GPUs inside one node
    link_gb_per_s: float  # GPU-to-GPU bandwidth per direction inside a node, GB/s
    usd_per_hour: float  # typical on-demand price of one GPU, USD
    host_gib_per_gpu: float  # host RAM that comes with each GPU in its usual instance (sources: the comment under GPUS)
    aliases: tuple[str, ...] = ()
    memory_tb_per_s: float = 0.0  # device memory bandwidth, TB/s (datasheet); 0: unknown
    chip: str = ""  # the die: GPUs of one chip share the matmul efficiency the speed model fits (H200 is an H100's)
    fp8_tflops: float = 0.0  # dense tensor-core peak for FP8 (datasheet, without sparsity); 0: no FP8 tensor cores


_CATALOG: tuple[GPUSpec, ...] = (
    GPUSpec("A100-40GB", 40.0, 312, True, "NVLink", 300, 1.29, 144, ("a100-40g", "a100-sxm4-40gb", "a100 40gb"), 1.555, "A100"),
    GPUSpec("A100-80GB", 80.0, 312, True, "NVLink", 300, 1.79, 144, ("a100-80g", "a100-sxm4-80gb", "a100 80gb"), 2.039, "A100"),
    GPUSpec("H100-80GB", 79.6, 989, True, "NVLink", 450, 2.99, 256, ("h100", "h100-sxm", "h100-80g", "h100-sxm5"), 3.35, "H100", 1979),
    GPUSpec("H200", 140.4, 989, True, "NVLink", 450, 3.79, 256, ("h200-141gb", "h200-sxm"), 4.8, "H100", 1979),
    GPUSpec("L40S", 45.0, 362, True, "PCIe", 32, 1.15, 192, ("l40s-48gb",), 0.864, "L40S", 733),
    GPUSpec("A10G", 22.5, 70, True, "PCIe", 16, 1.01, 96, ("a10g-24gb",), 0.6, "A10G"),
    GPUSpec("L4", 22.5, 121, True, "PCIe", 32, 0.80, 96, ("l4-24gb",), 0.3, "L4"),
    GPUSpec("RTX3090", 24.0, 71, True, "PCIe", 16, 0.22, 64, ("rtx-3090", "3090", "geforce-rtx-3090"), 0.936, "RTX3090"),
    GPUSpec("RTX4090", 24.0, 165, True, "PCIe", 16, 0.40, 64, ("rtx-4090", "4090", "geforce-rtx-4090"), 1.008, "RTX4090", 330),
    GPUSpec("RTX6000-Ada", 48.0, 364, True, "PCIe", 32, 0.80, 128, ("rtx-6000-ada", "rtx6000ada", "6000-ada"), 0.96, "RTX6000-Ada", 728),
    GPUSpec("V100-16GB", 15.8, 125, False, "NVLink", 150, 0.60, 61, ("v100-16g", "v100-sxm2-16gb"), 0.9, "V100"),
    GPUSpec("V100-32GB", 31.7, 125, False, "NVLink", 150, 0.80, 96, ("v100-32g", "v100-sxm2-32gb"), 0.9, "V100"),
    GPUSpec("T4", 15.0, 65, False, "PCIe", 8, 0.35, 48, ("t4-16gb", "tesla-t4"), 0.32, "T4"),
    GPUSpec("MI300X", 192.0, 1307, True, "Infinity Fabric", 448, 2.50, 256, ("mi300x-192gb", "mi300"), 5.3, "MI300X", 2615),
)

GPUS: dict[str, GPUSpec] = {spec.name: spec for spec in _CATALOG}
# GPUs in one host of the instance HOST_RAM_SOURCES names (8 unless listed): a larger --gpus count is
# several nodes
GPUS_PER_NODE = {"RTX3090": 2, "RTX4090": 2, "RTX6000-Ada": 4, "T4": 4}


def usual_gpus_per_node(name: str) -> int:
    return GPUS_PER_NODE.get(name, 8)
# Where `host_gib_per_gpu` comes from: host RAM ÷ GPUs of the usual 8-GPU (or largest) cloud instance,
# or of a typical workstation for desktop cards. Real hosts vary; `finetune plan --host-memory` overrides.
#   A100-40GB: AWS p4d.24xlarge, 1152 GiB / 8     A100-80GB: AWS p4de.24xlarge, 1152 GiB / 8
#   H100-80GB: AWS p5.48xlarge, 2048 GiB / 8      H200: AWS p5e.48xlarge, 2048 GiB / 8
#   L40S: AWS g6e.48xlarge, 1536 GiB / 8          A10G: AWS g5.48xlarge, 768 GiB / 8
#   L4: AWS g6.48xlarge, 768 GiB / 8              V100-16GB: AWS p3.16xlarge, 488 GiB / 8
#   V100-32GB: AWS p3dn.24xlarge, 768 GiB / 8     T4: AWS g4dn.12xlarge, 192 GiB / 4
#   MI300X: Azure ND MI300X v5, 2048 GiB / 8      RTX3090, RTX4090: a 2-GPU workstation with 128 GiB
#   RTX6000-Ada: a 4-GPU workstation with 512 GiB

# Bare names that cover more than one catalog entry: the user must say which memory size.
AMBIGUOUS: dict[str, tuple[str, ...]] = {"a100": ("A100-40GB", "A100-80GB"), "v100": ("V100-16GB", "V100-32GB")}


# a size a user writes ('24GB') and what the card reports (22.5 GiB for an L4) differ by this much
SAME_SIZE_GIB = 1.5



def squash(text: str) -> str:
    """Lower-case alphanumerics only: 'A100 40GB', 'a100-40gb' and 'A100_40GB' all give 'a10040gb'."""
    return re.sub(r"[^a-z0-9]", "", text.lower().replace("nvidia", "").replace("geforce", ""))


def spellings() -> dict[str, str]:
    """Every squashed spelling (name, aliases, and memory without the 'gb') → catalog name."""
    table = {}
    for spec in _CATALOG:
        for spelling in (spec.name, *spec.aliases):
            key = squash(spelling)
            table[key] = spec.name
            if key.endswith("gb"):
                table[key[:-2]] = spec.name
                table[key[:-1]] = spec.name  # '40g'
    return table


def lookup(name: str) -> GPUSpec | None:
    """The catalog entry for a spelling such as 'A100 40GB' or 'rtx-4090', else None."""
    found = spellings().get(squash(name))
    return GPUS[found] if found else None


def get(name: str, memory_gib: float | None = None) -> GPUSpec:
    """Like `lookup`, but raises UnknownGPUError naming close catalog entries (those with about
    `memory_gib` of memory first, when the user gave a size)."""
    spec = lookup(name)
    if spec is not None:
        return spec
    key = squash(name)
    if key in AMBIGUOUS:
        raise UnknownGPUError(f"'{name}' comes in several sizes: say which, e.g. {' or '.join(AMBIGUOUS[key])}.")
    close = difflib.get_close_matches(key, list(spellings()), n=6, cutoff=0.5)
    names = sorted({spellings()[c] for c in close})
    if memory_gib is not None:
        names = sorted(names, key=lambda n: abs(GPUS[n].memory_gib - memory_gib) > SAME_SIZE_GIB)
    hint = f" Did you mean: {', '.join(names)}?" if names else ""
    raise UnknownGPUError(f"Unknown GPU '{name}'.{hint} Catalog: {', '.join(GPUS)}.")


def identify(device_name: str, memory_gib: float) -> GPUSpec | None:
    """The catalog entry for a device as CUDA reports it ('NVIDIA H100 80GB HBM3',
    'NVIDIA A100-SXM4-40GB', 'Tesla T4'): the longest catalog spelling inside the name, the memory
    size closest to `memory_gib` among entries spelled alike; None for GPUs not in the catalog."""
    device = squash(device_name)
    found = [(len(key), -abs(GPUS[name].memory_gib - memory_gib), name)
             for key, name in spellings().items() if len(key) > 1 and key in device]
    return GPUS[max(found)[2]] if found else None


def same_size(memory_gib: float) -> list[str]:
    """Catalog GPUs with about `memory_gib` of memory."""
    return [g.name for g in _CATALOG if abs(g.memory_gib - memory_gib) <= SAME_SIZE_GIB]
