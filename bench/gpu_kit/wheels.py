"""The wheels a GPU machine without network needs for the kit, small enough to travel with the working tree.

    python bench/gpu_kit/wheels.py download      # where there is network (bench/gpu_kit/wheels.sh)
    python bench/gpu_kit/wheels.py budget        # what will travel: tree + wheels against 64 MiB
    python bench/gpu_kit/wheels.py install       # on the GPU machine, offline (bench/gpu_kit/run.sh)

They are for a machine that has Python 3.12, torch with CUDA, accelerate, transformers, peft,
safetensors, tokenizers, pyyaml, tqdm, matplotlib and pytest (the lent H100/H200 images: torch 2.11 +
CUDA 13, accelerate 1.15, transformers 5.17) but no datasets, bitsandbytes, deepspeed, trl or
liger-kernel. Where the transfer is capped (those machines take the working tree plus 8 ignored paths,
64 MiB in all) the published ~120 MB (pyarrow 55, bitsandbytes 43, pandas 12, deepspeed and the small
ones 10) is too much, so three are slimmed by dropping files that training never loads: pyarrow's
Flight RPC, S3 filesystem, C++ headers, Cython sources and tests; pandas' tests; bitsandbytes' kernels
for CUDA 11.8-12.8, ROCm and XPU (the CUDA 13 and CPU libraries stay). Nothing else is dropped.
`install` installs each wheel whose distribution the machine lacks and keeps what it has.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEELS_DIR = REPO / "bench/gpu_kit/wheels"
BUDGET_BYTES = 64 * 2**20  # what a lent machine's command carries: working tree + ignored paths
PYTHON = "3.12"  # the lent GPU images'
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "linux_x86_64", "any")


@dataclass(frozen=True)
class Wheel:
    requirement: str
    why: str
    drop: tuple[str, ...] = ()  # fnmatch patterns of archive members left out


WHEELS = (
    # the data layer imports datasets; 5.0.0 is the newest that accepts huggingface-hub < 2.0, which
    # transformers 5.17 pins (datasets 5.2 wants hub ≥ 1.31, newer than the image may have)
    Wheel("datasets==5.0.0", "data loading (finetune/data)"),
    Wheel("pyarrow==26.0.1", "datasets' storage", drop=(
        "pyarrow/include/*", "pyarrow/includes/*", "pyarrow/src/*", "pyarrow/tests/*", "pyarrow/*.pyx", "pyarrow/*.pxd",
        "pyarrow/*.pxi", "pyarrow/*flight*", "pyarrow/_s3fs.*", "pyarrow/libarrow_s3.so*", "pyarrow/_pyarrow_cpp_tests*")),
    Wheel("pandas==3.1.1", "imported by datasets", drop=("pandas/tests/*",)),
    Wheel("dill==0.4.1", "datasets' fingerprints"),
    Wheel("multiprocess==0.70.19", "datasets' map workers"),
    Wheel("xxhash==3.6.0", "datasets' hashing"),
    Wheel("requests==2.32.5", "imported by datasets"),
    Wheel("urllib3==2.5.0", "requests"),
    Wheel("idna==3.10", "requests"),
    Wheel("charset-normalizer==3.4.3", "requests"),
    Wheel("certifi==2025.8.3", "requests"),
    # QLoRA and 8-bit optimizers: torch 2.11 + CUDA 13 loads libbitsandbytes_cuda130
    Wheel("bitsandbytes==0.50.2", "QLoRA's 4-bit kernels", drop=(
        "bitsandbytes/libbitsandbytes_cuda11*", "bitsandbytes/libbitsandbytes_cuda12*",
        "bitsandbytes/libbitsandbytes_rocm*", "bitsandbytes/libbitsandbytes_xpu*")),
    # ZeRO; PyPI has only DeepSpeed's source, built here into a pure-Python wheel (ops JIT-compile on the GPU machine)
    Wheel("deepspeed==0.19.8", "ZeRO strategies"),
    Wheel("hjson==3.1.0", "deepspeed"),
    Wheel("msgpack==1.1.1", "deepspeed"),
    Wheel("ninja==1.13.0", "deepspeed's JIT build of CPU Adam"),
    Wheel("py-cpuinfo==9.0.0", "deepspeed"),
    Wheel("einops==0.8.1", "deepspeed"),
    Wheel("pydantic==2.11.9", "deepspeed's config"),
    Wheel("pydantic-core==2.33.2", "pydantic"),
    Wheel("annotated-types==0.7.0", "pydantic"),
    Wheel("typing-inspection==0.4.1", "pydantic"),
    # bench/gpu_kit/throughput.py's other rows; pure Python, their dependencies are the image's or above. Both
    # checked against transformers 5.17 on CPU: SFTTrainer trains a tiny Llama on pre-tokenized rows, and
    # Liger patches a tiny Mistral (its kernels need triton, which CUDA torch brings)
    Wheel("trl==1.16.0", "throughput.py's TRL SFTTrainer rows"),
    Wheel("liger-kernel==0.8.5", "--liger rows: finetune's and TRL's use_liger_kernel"),
    # `pip install --no-build-isolation -e .` of the project needs setuptools (Python 3.12 venvs lack it)
    Wheel("setuptools==80.9.0", "building the project offline"),
)


def distribution(path: Path) -> str:
    """Normalised distribution name of a wheel file (PEP 503)."""
    return re.sub(r"[-_.]+", "-", path.name.split("-")[0]).lower()


def download(dest: Path, python: str = PYTHON) -> list[Path]:
    """Fetch every wheel in WHEELS for `python` on manylinux x86_64 into `dest`, slimmed."""
    dest.mkdir(parents=True, exist_ok=True)
    target = ["--python-version", python, "--implementation", "cp", "--abi", f"cp{python.replace('.', '')}",
              "--abi", "abi3", "--abi", "none", *(arg for p in PLATFORMS for arg in ("--platform", p))]
    for wheel in WHEELS:
        name = wheel.requirement.split("==")[0]
        if any(distribution(p) == re.sub(r"[-_.]+", "-", name).lower() for p in dest.glob("*.whl")):
            continue
        if name == "deepspeed":  # sdist only: build the pure-Python wheel without compiling ops
            command = ["pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-binary", "deepspeed",
                       wheel.requirement, "-w", str(dest)]
            env = os.environ | {"DS_BUILD_OPS": "0"}
        else:
            command = ["pip", "download", "-q", "--no-deps", "--only-binary=:all:", *target, wheel.requirement, "-d", str(dest)]
            env = os.environ
        subprocess.run([sys.executable, "-m", *command], check=True, env=env)
    for wheel in WHEELS:
        if wheel.drop:
            (path,) = [p for p in dest.glob("*.whl") if distribution(p) == re.sub(r"[-_.]+", "-", wheel.requirement.split("==")[0]).lower()]
            slim(path, wheel.drop)
    return sorted(dest.glob("*.whl"))


def slim(path: Path, drop: tuple[str, ...]) -> int:
    """Rewrite the wheel without the members matching `drop` (and their RECORD lines); returns bytes saved."""
    before = path.stat().st_size
    with zipfile.ZipFile(path) as source:
        kept = [info for info in source.infolist() if not any(fnmatch.fnmatch(info.filename, p) for p in drop)]
        if len(kept) == len(source.infolist()):
            return 0
        names = {info.filename for info in kept}
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".whl", delete=False) as handle:
            temporary = Path(handle.name)
        with zipfile.ZipFile(temporary, "w", zipfile.ZIP_DEFLATED) as target:
            for info in kept:
                data = source.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    data = "".join(line for line in data.decode().splitlines(keepends=True)
                                   if line.split(",")[0] in names or line.split(",")[0].endswith("RECORD")).encode()
                target.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    temporary.replace(path)
    return before - path.stat().st_size


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes of what travels besides carried paths: tracked files and untracked files git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sum((repo / name).stat().st_size for name in listed if name and (repo / name).is_file())


def budget(dest: Path, repo: Path = REPO) -> tuple[int, int]:
    """(bytes that travel, budget): the working tree plus the wheels folder."""
    wheels = sum(p.stat().st_size for p in dest.glob("*") if p.is_file())
    return tree_bytes(repo) + wheels, BUDGET_BYTES


def install(dest: Path) -> list[str]:
    """pip-install (offline, without dependencies) the wheels whose distribution is missing here;
    an installed distribution is never replaced. Returns the distributions installed."""
    if not list(dest.glob("*.whl")):
        print(f"no wheels in {dest}: run `bash bench/gpu_kit/wheels.sh` on the CPU machine and carry the folder", file=sys.stderr)
    installed = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in metadata.distributions() if d.metadata["Name"]}
    missing = [p for p in sorted(dest.glob("*.whl")) if distribution(p) not in installed]
    for p in sorted(dest.glob("*.whl")):
        if p not in missing:
            print(f"already installed, kept: {distribution(p)} {metadata.version(distribution(p))} (shipped {p.name.split('-')[1]})")
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
                        *map(str, missing)], check=True)
    return [distribution(p) for p in missing]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("download", "budget", "install"))
    parser.add_argument("--dest", type=Path, default=WHEELS_DIR, help="the wheels folder (default bench/gpu_kit/wheels)")
    parser.add_argument("--python", default=PYTHON, help="target Python of download (default: the lent GPU images' 3.12)")
    args = parser.parse_args(argv)
    if args.action == "install":
        names = install(args.dest)
        print(f"installed {len(names)} wheel(s): {', '.join(names) or 'none needed'}")
        return 0
    if args.action == "download":
        for path in download(args.dest, args.python):
            print(f"{path.stat().st_size / 2**20:8.2f} MiB  {path.name}")
    used, limit = budget(args.dest)
    print(f"travels: {used / 2**20:.1f} MiB of {limit / 2**20:.0f} MiB (tree {tree_bytes() / 2**20:.1f} MiB + wheels)")
    if used > limit:
        print("over budget: drop a wheel or slim it further (see WHEELS in bench/gpu_kit/wheels.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
