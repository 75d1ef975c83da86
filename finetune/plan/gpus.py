"""GPU catalog: memory, bf16 and FP8 dense throughput, memory bandwidth, interconnect and a typical
cloud price per GPU; and any other card, given by its memory (`by_memory`).

The planner needs these numbers offline and instantly. Sources: vendor datasheets (memory as
nvidia-smi / rocm-smi report it, dense tensor-core TFLOP/s without sparsity, with fp32
accumulation as PyTorch uses, memory bandwidth of the SXM / PCIe card named; `DATASHEETS` below
names each card's: the comments under `_CATALOG`) and on-demand list prices of common clouds in 2025, which vary by about ±50 %
between providers: treat `usd_per_hour` as an order of magnitude for comparing plans.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, replace

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
    speed_of: str = ""  # a card given by its memory only (`by_memory`): the catalog card whose speed it is planned with


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
    # 2025-26 cards: their sources follow the catalog
    GPUSpec("B200", 179.1, 2250, True, "NVLink", 900, 4.99, 256, ("b200-180gb", "hgx-b200", "dgx-b200"), 8.0, "B200", 4500),
    GPUSpec("B300", 268.6, 2250, True, "NVLink", 900, 6.50, 512, ("b300-288gb", "hgx-b300", "blackwell-ultra"), 8.0, "B300", 4500),
    GPUSpec("GB200", 185.0, 2500, True, "NVLink", 900, 6.00, 240, ("gb200-nvl72", "gb200-186gb"), 8.0, "B200", 5000),
    GPUSpec("H20", 95.6, 148, True, "NVLink", 450, 1.50, 256, ("h20-96gb", "hgx-h20"), 4.0, "H20", 296),
    GPUSpec("H100-NVL", 93.6, 835, True, "PCIe", 64, 2.49, 320, ("h100nvl", "h100-nvl-94gb", "h100-94gb"), 3.9, "H100", 1670),
    GPUSpec("RTX5090", 31.8, 209.5, True, "PCIe", 64, 0.69, 64, ("rtx-5090", "5090", "geforce-rtx-5090"), 1.792, "RTX5090", 419),
    GPUSpec("RTX-PRO-6000", 95.6, 500, True, "PCIe", 64, 1.79, 128,
            ("rtx-pro-6000-blackwell", "rtx-pro-6000", "rtxpro6000", "pro-6000-blackwell"), 1.792, "RTX-PRO-6000", 1000),
    GPUSpec("L40", 45.0, 181, True, "PCIe", 32, 0.99, 128, ("l40-48gb",), 0.864, "L40", 362),
    GPUSpec("A40", 45.0, 150, True, "PCIe", 32, 0.40, 64, ("a40-48gb",), 0.696, "A40"),
    GPUSpec("RTX-A6000", 48.0, 155, True, "PCIe", 32, 0.49, 64, ("rtx-a6000", "a6000", "rtxa6000"), 0.768, "RTX-A6000"),
    GPUSpec("MI325X", 256.0, 1307, True, "Infinity Fabric", 448, 2.50, 256, ("mi325x-256gb", "mi325"), 6.0, "MI300X", 2615),
    GPUSpec("MI355X", 288.0, 2500, True, "Infinity Fabric", 538, 3.00, 256, ("mi355x-288gb", "mi355"), 8.0, "MI355X", 5000),
)

# Where the 2025-26 cards' numbers come from. Memory: the datasheet's capacity less what the driver
# keeps, as nvidia-smi / rocm-smi report it (an H100's 80 GB reads 79.6 GiB); TFLOP/s: dense (half the
# "with sparsity" figures), bf16 and FP8 with fp32 accumulation (GeForce cards accumulate fp32 at half
# their fp16-accumulate rate); link: per direction.
#   B200, B300:   NVIDIA HGX B200 / HGX B300 datasheets (per GPU: 2.25 PF bf16, 4.5 PF FP8 dense; HBM3e 8 TB/s;
#                 NVLink 5 1.8 TB/s both ways); 180 and 288 GB
#   GB200:        NVIDIA GB200 NVL72 datasheet ÷ 72 GPUs (360 PF bf16, 720 PF FP8 with sparsity; 13.4 TB HBM3e: 186 GB)
#   H20:          NVIDIA H20 product brief (96 GB HBM3 4.0 TB/s, 148 TF bf16, 296 TF FP8, NVLink 900 GB/s both ways)
#   H100-NVL:     NVIDIA H100 NVL datasheet (94 GB HBM3 3.9 TB/s, 1,671 / 3,341 TF bf16 / FP8 with sparsity); PCIe Gen5
#                 between cards (the NVLink bridge joins pairs only)
#   RTX5090:      NVIDIA RTX Blackwell GPU architecture whitepaper (32 GB GDDR7 1.79 TB/s; 209.5 TF fp16/bf16 and 419 TF
#                 FP8 with fp32 accumulate, dense)
#   RTX-PRO-6000: NVIDIA RTX PRO 6000 Blackwell datasheet (96 GB GDDR7 1.79 TB/s; 4,000 AI TOPS = FP4 with sparsity,
#                 so bf16 dense is an eighth: 500 TF)
#   L40:          NVIDIA L40 datasheet (48 GB GDDR6 864 GB/s; 181 / 362 TF bf16 / FP8 dense)
#   A40, RTX-A6000: NVIDIA A40 and RTX A6000 datasheets (48 GB GDDR6, 696 / 768 GB/s; 299 / 310 TF fp16 tensor with
#                 sparsity; no FP8); the A40 keeps ECC on, which nvidia-smi counts out (45 GiB)
#   MI325X, MI355X: AMD Instinct MI325X (an MI300X's die with HBM3E) and MI355X datasheets (256 GB HBM3E
#                 6 TB/s, 1.3 PF bf16, 2.6 PF FP8; 288 GB HBM3E 8 TB/s, 2.5 PF bf16, 5.0 PF FP8; Infinity Fabric
#                 7 links of 64 / 76.8 GB/s per direction)
#   Prices: Lambda (B200 4.99, H100-NVL 2.49), RunPod (RTX5090 0.69, RTX-PRO-6000 1.79, L40 0.99, A40 0.40, RTX-A6000
#   0.49); B300, GB200, H20, MI325X, MI355X: few list prices yet, set from their neighbours (an order of magnitude)
GPUS: dict[str, GPUSpec] = {spec.name: spec for spec in _CATALOG}
# GPUs in one host of the usual instance (8 unless listed; the instances are named below, where
# host_gib_per_gpu comes from): a larger --gpus count is several nodes
# (a GB200 NVL72 rack is one NVLink domain of 72 GPUs: the planner treats it as one node)
GPUS_PER_NODE = {"RTX3090": 2, "RTX4090": 2, "RTX5090": 2, "RTX6000-Ada": 4, "RTX-PRO-6000": 4, "RTX-A6000": 4, "T4": 4,
                 "GB200": 72}


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
#   B200: AWS p6-b200.48xlarge, 2048 GiB / 8      B300: AWS p6-b300.48xlarge, 4096 GiB / 8
#   GB200: one Grace CPU's 480 GB LPDDR5X / its 2 GPUs   H20: an 8-GPU HGX server with 2048 GiB
#   H100-NVL: Azure NC80adis_H100_v5, 640 GiB / 2  L40: an 8-GPU PCIe server with 1024 GiB
#   A40: an 8-GPU PCIe server with 512 GiB        MI325X, MI355X: an 8-GPU server with 2048 GiB
#   RTX5090: a 2-GPU workstation with 128 GiB     RTX-PRO-6000, RTX-A6000: a 4-GPU workstation with 512 / 256 GiB

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
    """The catalog entry for a spelling such as 'A100 40GB' or 'rtx-4090', a card given by its memory
    ('48GB': `by_memory`), else None."""
    found = spellings().get(squash(name))
    if found:
        return GPUS[found]
    size = memory_size(name)
    return by_memory(size) if size is not None else None


# A card given by its memory: '48GB', '48 GiB', '48G' (GiB, as nvidia-smi reports it), within these bounds.
MEMORY_ONLY = re.compile(r"(\d+(?:\.\d+)?)gi?b?")
MEMORY_ONLY_GIB = (1.0, 4096.0)


def memory_size(name: str) -> float | None:
    """The GiB of a card named by its memory only ('48GB' → 48.0), else None."""
    found = MEMORY_ONLY.fullmatch(squash_keeping_dots(name))
    size = float(found.group(1)) if found else None
    return size if size is not None and MEMORY_ONLY_GIB[0] <= size <= MEMORY_ONLY_GIB[1] else None


def squash_keeping_dots(text: str) -> str:
    return re.sub(r"[^a-z0-9.]", "", text.lower())


def by_memory(memory_gib: float) -> GPUSpec:
    """A card known only by its memory (`--gpus 2x48GB`): that memory, and everything else (speed,
    links, price, host RAM) from `speed_class`, which `speed_of` names so every plan can say so."""
    like = speed_class(memory_gib)
    return replace(like, name=f"{memory_gib:g}GB", memory_gib=memory_gib, aliases=(), speed_of=like.name)


def speed_class(memory_gib: float) -> GPUSpec:
    """The catalog card a card of `memory_gib` is planned like: the one nearest in memory, and of
    equally near ones the slowest (bf16 TFLOP/s), so hours and cost are not understated."""
    return min(_CATALOG, key=lambda g: (round(abs(g.memory_gib - memory_gib), 1), g.bf16_tflops))


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


def at_least(memory_gib: float) -> list[str]:
    """Catalog GPUs of about `memory_gib` (`same_size`), else those of the smallest catalog size above it."""
    larger = sorted({g.memory_gib for g in _CATALOG if g.memory_gib > memory_gib})
    return same_size(memory_gib) or (same_size(larger[0]) if larger else [])


def same_size(memory_gib: float) -> list[str]:
    """Catalog GPUs with about `memory_gib` of memory."""
    return [g.name for g in _CATALOG if abs(g.memory_gib - memory_gib) <= SAME_SIZE_GIB]
