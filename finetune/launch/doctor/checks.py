"""Facts → findings: each check reads a `Machine` (or every rank's) and says what is fine, what is
suspicious and what will fail, with the fix. Pure functions: the tests feed them synthetic machines."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from finetune.launch.bandwidth import AllReduceTiming
from finetune.launch.doctor.probe import GIB, Machine
from finetune.plan import gpus as gpu_catalog
from finetune.plan.speed import INTER_NODE_GB_PER_S
from finetune.train import preflight

# Docker gives containers 64 MB of /dev/shm; NCCL's shared-memory transport and DataLoader workers
# need far more and die with "Bus error" (the classic container failure).
MIN_SHM_BYTES = 1 * GIB
# A full fine-tuning checkpoint holds fp32 weights + two Adam moments: ~16 bytes per parameter
# (110 GB for 7B); below this, even one 7B checkpoint does not fit.
MIN_DISK_BYTES = 50 * GIB
# Bus bandwidth below this share of the link's rated bandwidth means NCCL is not using the link.
MIN_BANDWIDTH_SHARE = 0.5
NCCL_VARIABLES = ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG")


@dataclass(frozen=True)
class Finding:
    check: str
    status: str  # ok, info, warn or fail
    detail: str
    fix: str = ""


def check_machine(m: Machine) -> list[Finding]:
    """Every finding about one machine, worst first within each check."""
    return [*check_gpus(m), *check_versions(m), *check_topology(m), *check_nccl_env(m), *check_host(m),
            *check_written_dirs(m), *check_launch_config(m), *check_packages(m)]


def check_gpus(m: Machine) -> list[Finding]:
    visible = m.cuda_visible_devices
    if not m.gpus:
        hidden = m.gpus_on_machine and visible is not None
        why = f" (CUDA_VISIBLE_DEVICES={visible!r} hides the {m.gpus_on_machine} GPUs nvidia-smi shows)" if hidden else ""
        return [Finding("gpus", "warn" if hidden else "info",
                        f"no CUDA GPU visible{why}: "
                        "`python -m finetune` trains on the CPU in fp32, and several processes (torchrun, accelerate launch) "
                        "talk over gloo instead of NCCL; fine for `finetune rehearse`, far too slow for a 7B run",
                        "unset CUDA_VISIBLE_DEVICES" if hidden else "")]
    names = {(g["name"], g["memory_gib"], g["capability"]) for g in m.gpus}
    listing = ", ".join(f"{name} ({memory:g} GiB, sm {capability})" for name, memory, capability in sorted(names))
    findings = []
    if len(names) > 1:
        findings.append(Finding("gpus", "fail", f"{len(m.gpus)} GPUs but not identical: {listing}",
                                "the slowest/smallest GPU sets the pace and memory of every rank; set CUDA_VISIBLE_DEVICES "
                                "to identical GPUs"))
    else:
        findings.append(Finding("gpus", "ok", f"{len(m.gpus)}× {listing}"))
    if visible is not None:
        findings.append(Finding("gpus", "info", f"CUDA_VISIBLE_DEVICES={visible!r}: {len(m.gpus)} of "
                                f"{m.gpus_on_machine if m.gpus_on_machine is not None else '?'} GPUs on this machine visible"))
    no_bf16 = [g["index"] for g in m.gpus if not g["bf16"]]
    if no_bf16:
        findings.append(Finding("bf16", "warn", f"GPU {', '.join(map(str, no_bf16))} has no bf16 (compute capability < 8.0)",
                                "train with --precision fp16-mixed (or fp32); bf16 plans and configs will not run here"))
    else:
        findings.append(Finding("bf16", "ok", "bf16 supported (--precision auto picks bf16-mixed / bf16-true)"))
    return findings


def check_versions(m: Machine) -> list[Finding]:
    torch_cuda = m.versions.get("cuda")
    if not m.gpus:
        build = "a CPU-only build" if torch_cuda in (None, "None") else f"built for CUDA {torch_cuda}"
        return [Finding("versions", "info", f"torch {m.versions.get('torch')} ({build}), no GPU in use")]
    detail = (f"driver {m.driver} (supports CUDA ≤ {m.driver_cuda}), torch {m.versions.get('torch')} built for CUDA {torch_cuda}, "
              f"NCCL {m.nccl}")
    if m.driver_cuda and torch_cuda and torch_cuda != "None":
        built, supported = _major_minor(torch_cuda), _major_minor(m.driver_cuda)
        if built[0] > supported[0]:
            return [Finding("versions", "fail", detail, f"the driver is too old for this torch: update the driver to one "
                            f"supporting CUDA {torch_cuda}, or install the torch build for CUDA {m.driver_cuda}")]
        if built > supported:
            return [Finding("versions", "warn", detail + " (newer than the driver: runs through CUDA minor-version "
                            "compatibility, but JIT-compiled kernels such as DeepSpeed's ops may fail)",
                            "update the driver, or use the torch build matching the driver's CUDA")]
    return [Finding("versions", "ok", detail)]


def _major_minor(version: str) -> tuple[int, int]:
    parts = [int(p) for p in re.findall(r"\d+", version)[:2]] + [0, 0]
    return parts[0], parts[1]


def check_topology(m: Machine) -> list[Finding]:
    if len(m.gpus) < 2:
        return []
    codes = sorted({link[2] for link in m.links})
    nvlink = all(code.startswith("NV") for code in codes)
    kind = "NVLink between every pair" if nvlink else f"PCIe paths ({', '.join(codes)})"
    findings = [Finding("topology", "ok" if nvlink or "SYS" not in codes else "warn", f"{kind} (`nvidia-smi topo -m`)",
                        "" if nvlink or "SYS" not in codes else
                        "SYS pairs cross CPU sockets, the slowest path: keep a job's GPUs on one socket (CUDA_VISIBLE_DEVICES)")]
    no_peer = [f"{i}-{j}" for i, j, _, peer in m.links if not peer]
    if no_peer:
        findings.append(Finding("peer access", "warn", f"no peer-to-peer access between GPU pairs {', '.join(no_peer)}: "
                                "NCCL copies through host memory", "enable ACS/IOMMU pass-through for P2P in BIOS/VM settings, "
                                "or expect slower all-reduce (measure it below)"))
    else:
        findings.append(Finding("peer access", "ok", "every GPU pair can access peer memory"))
    return findings


def check_nccl_env(m: Machine) -> list[Finding]:
    env = m.nccl_env
    if not m.gpus:  # gloo does not read them
        return [Finding("nccl env", "info", f"{', '.join(sorted(env))} set but unused without GPUs")] if env else []
    findings = []
    if env.get("NCCL_P2P_DISABLE", "0") not in ("", "0"):
        findings.append(Finding("nccl env", "warn", "NCCL_P2P_DISABLE=1: NCCL stages every transfer through host memory "
                                "and leaves NVLink unused (all-reduce several times slower)",
                                "unset NCCL_P2P_DISABLE; it is a workaround for broken P2P (fix IOMMU/ACS instead)"))
    if env.get("NCCL_IB_DISABLE", "0") not in ("", "0"):
        findings.append(Finding("nccl env", "warn", "NCCL_IB_DISABLE=1: across machines NCCL uses TCP sockets instead of "
                                "InfiniBand/RoCE (10-25 Gb/s instead of 200-400)",
                                "unset NCCL_IB_DISABLE on clusters with InfiniBand; keep it only where IB is broken"))
    if "NCCL_SOCKET_IFNAME" in env:
        wanted = env["NCCL_SOCKET_IFNAME"]
        if not matching_interfaces(wanted, m.interfaces):
            findings.append(Finding("nccl env", "fail", f"NCCL_SOCKET_IFNAME={wanted} matches no network interface here "
                                    f"(have: {', '.join(m.interfaces) or 'none'}): NCCL cannot bootstrap and the job hangs",
                                    "set NCCL_SOCKET_IFNAME to the interface on the cluster network (`ip -br addr`), or unset it"))
        else:
            interfaces = ", ".join(matching_interfaces(wanted, m.interfaces))
            findings.append(Finding("nccl env", "ok", f"NCCL_SOCKET_IFNAME={wanted} → {interfaces}"))
    debug = env.get("NCCL_DEBUG", "").upper()
    if debug == "TRACE":
        findings.append(Finding("nccl env", "warn", "NCCL_DEBUG=TRACE logs every call and slows training",
                                "use NCCL_DEBUG=INFO to see the transports chosen, WARN for training"))
    elif not debug:
        findings.append(Finding("nccl env", "info", "NCCL_DEBUG unset",
                                "when a run hangs or is slow, rerun with NCCL_DEBUG=INFO to see the transport NCCL picks "
                                "(NVLink, P2P, SHM, NET)"))
    others = sorted(set(env) - set(NCCL_VARIABLES))
    if others:
        findings.append(Finding("nccl env", "info", "also set: " + ", ".join(f"{name}={env[name]}" for name in others)))
    if not findings or all(f.status in ("ok", "info") for f in findings):
        findings.insert(0, Finding("nccl env", "ok", "no NCCL variable that disables a transport"))
    return findings


def matching_interfaces(spec: str, interfaces: list[str]) -> list[str]:
    """Interfaces NCCL_SOCKET_IFNAME selects: comma-separated prefixes, `=name` exact, `^...` excludes."""
    exclude = spec.startswith("^")
    patterns = spec.lstrip("^").split(",")

    def selected(name: str) -> bool:
        return any(name == p[1:] if p.startswith("=") else name.startswith(p) for p in patterns if p)

    return [name for name in interfaces if selected(name) != exclude]


def check_host(m: Machine) -> list[Finding]:
    findings = []
    if m.shm_bytes is None or m.shm_bytes < MIN_SHM_BYTES:
        size = "missing" if m.shm_bytes is None else f"{m.shm_bytes / 2**20:.0f} MiB"
        findings.append(Finding("/dev/shm", "warn", f"/dev/shm is {size}: NCCL's shared-memory transport and DataLoader "
                                "workers fail with 'Bus error'", "start the container with --ipc=host or --shm-size=16g"))
    else:
        findings.append(Finding("/dev/shm", "ok", f"/dev/shm {m.shm_bytes / GIB:.1f} GiB"))
    ram = f"host RAM {m.ram_total_bytes / GIB:.0f} GiB, {m.ram_available_bytes / GIB:.0f} GiB available"
    if m.gpus and m.ram_available_bytes < m.gpu_memory_bytes:
        findings.append(Finding("host RAM", "warn", f"{ram}, less than the {m.gpu_memory_bytes / GIB:.0f} GiB of GPU memory",
                                "loading stages weights through host RAM on every rank and offload keeps ~16 B/parameter "
                                "there: check `finetune plan`'s host column, prefer fsdp_cpu_ram_efficient_loading"))
    else:
        findings.append(Finding("host RAM", "ok", ram))
    disk = f"{m.disk_free_bytes / GIB:.0f} GiB free for --output-dir {m.output_dir}"
    if m.disk_free_bytes < MIN_DISK_BYTES:
        findings.append(Finding("disk", "warn", disk, "a full fine-tuning checkpoint needs ~16 bytes per parameter "
                                "(110 GB for 7B; LoRA: megabytes): point --output-dir at a larger disk or use --keep-last 1"))
    else:
        findings.append(Finding("disk", "ok", disk))
    return findings


def check_written_dirs(m: Machine) -> list[Finding]:
    """Every directory a run writes must take files: an unwritable cache fails a run late, under
    another name (a built-in dataset that "cannot be prepared")."""
    problems = [Finding("writable", "fail", f"{what} {path}: {why}", f"point {_setting_of(what)} at a directory you can write")
                for what, path, why in m.written_dirs if why]
    if problems or not m.written_dirs:
        return problems
    return [Finding("writable", "ok", "a run can write " + ", ".join(f"{what} ({path})" for what, path, _ in m.written_dirs))]


def _setting_of(what: str) -> str:
    """The flag or variable that moves a written directory."""
    return {"--output-dir": "--output-dir", "HF_HOME": "HF_HOME", "datasets cache": "HF_DATASETS_CACHE",
            "finetune data cache": "FINETUNE_DATA_CACHE",
            "finetune model cache": "FINETUNE_MODEL_CACHE"}[what]


def _whole_number(settings: dict, key: str) -> int | None:
    """settings[key] (default 1) when it is a whole number ≥ 1, else None."""
    value = settings.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit() or int(value) < 1:
        return None
    return int(value)


def check_launch_config(m: Machine) -> list[Finding]:
    """What a bare `accelerate launch -m finetune` would start, from the default accelerate config,
    judged against this machine; a file that cannot be read or holds impossible values fails."""
    unusable = "fix it, delete it (`accelerate config` writes a new one), or pass --config_file to every launch"
    if m.accelerate_config_error is not None:
        return [Finding("accelerate config", "fail", f"{m.accelerate_config_file} {m.accelerate_config_error}: "
                        "`accelerate launch` stops on it before finetune starts", unusable)]
    if m.accelerate_config is None:
        return [Finding("accelerate config", "info", "no default accelerate config: `accelerate launch -m finetune` starts "
                        "one process", "pass --config_file accelerate_configs/ddp.yaml (or fsdp.yaml, ...), or run "
                        "`finetune plan` for the one that fits")]
    c = m.accelerate_config
    processes, machines = _whole_number(c, "num_processes"), _whole_number(c, "num_machines")
    if processes is None or machines is None:
        key = "num_processes" if processes is None else "num_machines"
        return [Finding("accelerate config", "fail", f"{m.accelerate_config_file}: {key}: {c.get(key)!r} is not a whole "
                        "number ≥ 1, so `accelerate launch` fails", unusable)]
    kind, precision = str(c.get("distributed_type", "NO")).upper(), c.get("mixed_precision", "no")
    would = (f"{m.accelerate_config_file}: `accelerate launch -m finetune` would start {processes} process(es) "
             f"as {kind} on {machines} machine(s), mixed_precision {precision}")
    local = processes // machines
    if not m.gpus and kind in ("MULTI_GPU", "FSDP", "DEEPSPEED") and not c.get("use_cpu"):
        return [Finding("accelerate config", "fail", f"{would}, but no GPU is visible here",
                        "on a CPU machine set `use_cpu: true` and distributed_type MULTI_CPU, pass --config_file, "
                        "or rehearse with `finetune rehearse`")]
    if m.gpus and local > len(m.gpus):
        return [Finding("accelerate config", "fail", f"{would}, but only {len(m.gpus)} GPU(s) are visible",
                        f"set num_processes to {len(m.gpus) * machines} (`accelerate config`) or pass --config_file")]
    if precision == "bf16" and m.gpus and not all(g["bf16"] for g in m.gpus):
        return [Finding("accelerate config", "warn", f"{would}, but these GPUs have no bf16",
                        "delete mixed_precision from the default config: finetune's --precision auto picks fp16 on "
                        "GPUs without bf16 (or set mixed_precision: fp16)")]
    if m.gpus and local < len(m.gpus):
        return [Finding("accelerate config", "info", f"{would}; {len(m.gpus)} GPUs are visible, so {len(m.gpus) - local} stay idle")]
    return [Finding("accelerate config", "ok", would)]


def check_packages(m: Machine) -> list[Finding]:
    listing = ", ".join(f"{name} {version}" for name, version in m.versions.items())
    findings = [Finding("packages", "ok", listing)]
    if m.versions.get("datasets") == "not installed":
        findings.append(Finding("packages", "fail", "datasets is not installed: training cannot load data", "pip install datasets"))
    if m.versions.get("bitsandbytes") == "not installed":
        findings.append(Finding("packages", "warn", "bitsandbytes is not installed: --method qlora and 8-bit optimizers fail",
                                "pip install bitsandbytes"))
    if m.versions.get("deepspeed") == "not installed":
        findings.append(Finding("packages", "info", "deepspeed is not installed: ZeRO configs (deepspeed_*.yaml, ds_configs/) fail",
                                "pip install 'finetune[deepspeed]'"))
    return findings


def check_ranks(machines: list[Machine]) -> list[Finding]:
    """What must agree across the ranks of one job: placements and packages (preflight's checks),
    driver, NCCL and GPU models."""
    reports = [{"rank": m.rank, "host": m.host, "machine_rank": m.machine_rank, "local_rank": m.local_rank,
                "versions": m.versions | {"nccl": str(m.nccl), "driver": str(m.driver)}, "output_dir": None}
               for m in machines]
    problems = preflight.diagnose(reports, machines[0].output_dir)
    models = {m.rank: sorted({(g["name"], g["memory_gib"]) for g in m.gpus}) for m in machines}
    if len({json.dumps(v) for v in models.values()}) > 1:
        listing = "; ".join(f"rank {rank}: {', '.join(f'{n} {g:g} GiB' for n, g in gpus) or 'no GPU'}" for rank, gpus in models.items())
        problems.append(f"GPU models differ between ranks ({listing}): the slowest GPU sets every rank's pace")
    hosts = len({m.host for m in machines})
    if problems:
        return [Finding("ranks", "fail", problem, "give every machine the same GPUs, driver and environment") for problem in problems]
    return [Finding("ranks", "ok", f"{len(machines)} ranks on {hosts} machine(s) agree on packages, driver, NCCL and GPU model")]


def check_bandwidth(timings: list[AllReduceTiming], m: Machine, nodes: int) -> Finding:
    """Bus bandwidth of the largest all-reduce against the link's rated bandwidth (GPU catalog)."""
    best = max(timings, key=lambda t: t.busbw_gb_per_s)
    measured = (f"all-reduce over {best.processes} {best.backend} processes: bus bandwidth {best.busbw_gb_per_s:.1f} GB/s "
                f"({best.bytes / 2**20:.0f} MiB, {best.seconds * 1e3:.2f} ms)")
    spec = gpu_catalog.identify(m.gpus[0]["name"], m.gpus[0]["memory_gib"]) if m.gpus else None
    if spec is None:
        return Finding("bandwidth", "info", measured + ("; GPU not in the catalog, nothing to compare with" if m.gpus else ""))
    expected = min(spec.link_gb_per_s, INTER_NODE_GB_PER_S) if nodes > 1 else spec.link_gb_per_s
    link = "the network between nodes" if nodes > 1 else f"{spec.interconnect}"
    detail = f"{measured}; {link} of a {spec.name} should give ~{expected:g} GB/s"
    if best.busbw_gb_per_s < MIN_BANDWIDTH_SHARE * expected:
        return Finding("bandwidth", "warn", detail, "check the topology and NCCL findings above, rerun with NCCL_DEBUG=INFO "
                       "to see the transport; the planner's speed assumes the rated link")
    return Finding("bandwidth", "ok", detail)
