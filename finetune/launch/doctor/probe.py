"""What one process sees of its machine: GPUs, driver, NCCL, topology, environment, RAM, disk,
the default accelerate config and package versions, as a JSON-serialisable `Machine`."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
import yaml

from finetune.checkpoint.identity import package_versions

GIB = 2**30


@dataclass
class Machine:
    """What one process sees of its machine; JSON-serialisable so ranks can exchange it."""

    host: str
    rank: int = 0
    local_rank: int = 0
    machine_rank: int = 0
    gpus: list[dict] = field(default_factory=list)  # index, name, memory_gib, capability, bf16
    gpus_on_machine: int | None = None  # nvidia-smi's count, before CUDA_VISIBLE_DEVICES; None without nvidia-smi
    cuda_visible_devices: str | None = None
    driver: str | None = None
    driver_cuda: str | None = None  # newest CUDA the driver supports
    nccl: str | None = None
    links: list[list] = field(default_factory=list)  # [i, j, nvidia-smi topo code, peer access]
    nccl_env: dict[str, str] = field(default_factory=dict)
    interfaces: list[str] = field(default_factory=list)
    shm_bytes: int | None = None
    ram_total_bytes: int = 0
    ram_available_bytes: int = 0
    output_dir: str = "output"
    disk_free_bytes: int = 0
    accelerate_config_file: str | None = None
    accelerate_config: dict | None = None
    accelerate_config_error: str | None = None  # why the default config could not be read as a YAML mapping
    written_dirs: list[list] = field(default_factory=list)  # [what, path, why a run cannot write there, or None]
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def gpu_memory_bytes(self) -> float:
        return sum(gpu["memory_gib"] for gpu in self.gpus) * GIB


def probe(output_dir: str) -> Machine:
    cuda = torch.cuda.is_available()
    gpus = []
    for index in range(torch.cuda.device_count() if cuda else 0):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name, "memory_gib": round(props.total_memory / GIB, 1),
                     "capability": f"{props.major}.{props.minor}", "bf16": props.major >= 8})
    smi_count = nvidia_smi("--query-gpu=index", "--format=csv,noheader")
    header = nvidia_smi() or ""
    driver_cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    memory = psutil.virtual_memory()
    from accelerate.commands.config import default_config_file

    launch_file = Path(default_config_file)
    launch_config, launch_error = read_yaml_mapping(launch_file)
    return Machine(
        host=socket.gethostname(),
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        machine_rank=int(os.environ.get("GROUP_RANK", "0")),
        gpus=gpus,
        gpus_on_machine=len(smi_count.split()) if smi_count is not None else None,
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        driver=(nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader") or "").split("\n")[0].strip() or None,
        driver_cuda=driver_cuda.group(1) if driver_cuda else None,
        nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda and torch.distributed.is_nccl_available() else None,
        links=probe_links(len(gpus)),
        nccl_env={name: value for name, value in os.environ.items() if name.startswith("NCCL_")},
        interfaces=sorted(os.listdir("/sys/class/net")) if Path("/sys/class/net").is_dir() else [],
        shm_bytes=_filesystem_size("/dev/shm"),
        ram_total_bytes=memory.total,
        ram_available_bytes=memory.available,
        output_dir=output_dir,
        disk_free_bytes=shutil.disk_usage(_existing_ancestor(Path(output_dir))).free,
        accelerate_config_file=str(launch_file) if launch_file.exists() else None,
        accelerate_config=launch_config,
        accelerate_config_error=launch_error,
        written_dirs=[[what, str(path), cannot_write(path)] for what, path in written_directories(output_dir)],
        versions=package_versions(),
    )


def read_yaml_mapping(path: Path) -> tuple[dict | None, str | None]:
    """(the file's YAML mapping, None), or (None, why it is not one); (None, None) when it is absent.
    The doctor reads every file defensively: a broken file is a finding, not a traceback."""
    if not path.exists():
        return None, None
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        return None, f"cannot be read ({e.strerror if isinstance(e, OSError) else e})"
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        return None, f"is not valid YAML{where} ({getattr(e, 'problem', None) or e})"
    if data is None:
        return {}, None
    if not isinstance(data, dict):
        return None, f"holds a {type(data).__name__}, not a mapping of settings"
    return data, None


def written_directories(output_dir: str) -> list[tuple[str, Path]]:
    """Every directory a run writes: --output-dir, $HF_HOME (Hub downloads, Accelerate's config),
    the datasets cache, finetune's data cache and its model cache (GGUF conversions)."""
    from finetune.data.cache import cache_root as data_cache
    from finetune.models.gguf_import import cache_root as model_cache

    hf_home = Path(os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface")
    directories = [("--output-dir", Path(output_dir)), ("HF_HOME", hf_home),
                   ("datasets cache", Path(os.environ.get("HF_DATASETS_CACHE") or hf_home / "datasets"))]
    data = data_cache(None)
    if data is not None:
        directories.append(("finetune data cache", data))
    return [*directories, ("finetune model cache", model_cache())]


def cannot_write(path: Path) -> str | None:
    """Why a run cannot create files in `path` (creating it first if missing), or None. Tried for
    real, with a temporary folder removed at once: permission bits do not tell root's story, nor a
    read-only mount's."""
    import tempfile

    path = path.expanduser().absolute()
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    try:
        tempfile.TemporaryDirectory(dir=existing, prefix=".finetune-doctor-").cleanup()
    except OSError as e:
        return f"cannot create files in {existing}: {e.strerror or e}"
    return None


def nvidia_smi(*args: str) -> str | None:
    """nvidia-smi's output, or None when it is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def probe_links(count: int) -> list[list]:
    """[i, j, topology code, peer access] per GPU pair: codes from `nvidia-smi topo -m`
    (NV# = NVLink with # links; PIX, PXB, PHB, NODE, SYS = PCIe paths, from one switch to across sockets)."""
    if count < 2:
        return []
    codes = parse_topology(nvidia_smi("topo", "-m") or "")
    return [[i, j, codes.get((i, j), "?"), torch.cuda.can_device_access_peer(i, j)]
            for i in range(count) for j in range(i + 1, count)]


def parse_topology(text: str) -> dict[tuple[int, int], str]:
    """{(i, j): code} from the GPU rows of `nvidia-smi topo -m` (its header may carry ANSI styling)."""
    lines = [line.split() for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()]
    start = next((k for k, line in enumerate(lines) if line and line[0] == "GPU0"), None)
    if start is None:
        return {}
    columns = len([token for token in lines[start] if re.fullmatch(r"GPU\d+", token)])
    codes = {}
    for line in lines[start + 1:]:
        if line and re.fullmatch(r"GPU\d+", line[0]):
            i = int(line[0][3:])
            codes.update({(i, j): code for j, code in enumerate(line[1:1 + columns]) if i != j})
    return codes


def _filesystem_size(path: str) -> int | None:
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_blocks * stats.f_frsize


def _existing_ancestor(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path
