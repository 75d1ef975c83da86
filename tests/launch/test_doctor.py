"""`finetune doctor`: the real probe on this CPU machine, every check on synthetic machines, and a
2-process run under torchrun where rank 0 compares the ranks and measures the all-reduce."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from finetune.cli import main as cli_main
from finetune.launch.bandwidth import AllReduceTiming, spawn_all_reduce
from finetune.launch.doctor import checks
from finetune.launch.doctor.command import merge_findings
from finetune.launch.doctor.probe import Machine, parse_topology
from finetune.train.accelerator import free_port

H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.1, "capability": "9.0", "bf16": True}
VERSIONS = {"torch": "2.11.0+cu130", "cuda": "13.0", "datasets": "5.0.0", "bitsandbytes": "0.50.2", "deepspeed": "0.19.8"}

TOPOLOGY_NVLINK = """\x1b[4m\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\tNV18\t0-55\t0\t\tN/A
GPU1\tNV18\t X \tNV18\t0-55\t0\t\tN/A
GPU2\tNV18\tNV18\t X \t0-55\t0\t\tN/A

Legend:
  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""
TOPOLOGY_PCIE = """\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity
GPU0\t X \tSYS\t0-15\t0
GPU1\tSYS\t X \t16-31\t1
"""


def machine(count: int = 2, **overrides) -> Machine:
    fields = dict(host="node0", gpus=[{"index": i, **H100} for i in range(count)], gpus_on_machine=count,
                  driver="580.65", driver_cuda="13.0", nccl="2.27.7",
                  links=[[0, 1, "NV18", True]] if count > 1 else [], interfaces=["eth0", "ib0", "lo"],
                  shm_bytes=64 * 2**30, ram_total_bytes=2048 * 2**30, ram_available_bytes=1900 * 2**30,
                  disk_free_bytes=4000 * 2**30, versions=dict(VERSIONS))
    return Machine(**(fields | overrides))


def statuses(findings, check: str) -> list[str]:
    return [f.status for f in findings if f.check == check]


def test_cpu_machine_says_no_gpu_and_gloo_and_exits_0(capsys):
    assert cli_main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    gpus = next(f for f in report["findings"] if f["check"] == "gpus")
    assert report["ok"] and gpus["status"] == "info"
    assert "no CUDA GPU visible" in gpus["detail"] and "gloo" in gpus["detail"]
    assert report["machines"][0]["versions"]["torch"].startswith("2.")
    assert cli_main(["doctor"]) == 0
    assert "no CUDA GPU visible" in capsys.readouterr().out


def test_healthy_nvlink_node_has_no_warnings():
    findings = checks.check_machine(machine())
    assert [f for f in findings if f.status in ("warn", "fail")] == []
    assert "2× NVIDIA H100 80GB HBM3" in next(f.detail for f in findings if f.check == "gpus")


def test_mixed_gpus_and_hidden_gpus_are_reported():
    mixed = machine(gpus=[{"index": 0, **H100}, {"index": 1, **H100, "name": "NVIDIA A100-SXM4-80GB", "capability": "8.0"}])
    assert statuses(checks.check_gpus(mixed), "gpus") == ["fail"]
    hidden = machine(gpus=[], gpus_on_machine=8, cuda_visible_devices="")
    (finding,) = checks.check_gpus(hidden)
    assert finding.status == "warn" and "hides the 8 GPUs" in finding.detail and "CUDA_VISIBLE_DEVICES" in finding.fix
    v100 = machine(gpus=[{"index": 0, **H100, "name": "Tesla V100-SXM2-32GB", "capability": "7.0", "bf16": False}])
    assert statuses(checks.check_gpus(v100), "bf16") == ["warn"]


@pytest.mark.parametrize("driver_cuda, status", [("13.0", "ok"), ("13.2", "ok"), ("12.8", "fail")])
def test_torch_cuda_newer_than_the_driver_fails(driver_cuda, status):
    assert statuses(checks.check_versions(machine(driver_cuda=driver_cuda)), "versions") == [status]
    assert statuses(checks.check_versions(machine(driver_cuda="12.8", versions=VERSIONS | {"cuda": "12.9"})), "versions") == ["warn"]


def test_topology_is_parsed_from_nvidia_smi():
    assert parse_topology(TOPOLOGY_NVLINK) == {(i, j): "NV18" for i in range(3) for j in range(3) if i != j}
    assert parse_topology(TOPOLOGY_PCIE) == {(0, 1): "SYS", (1, 0): "SYS"}
    pcie = machine(links=[[0, 1, "SYS", False]])
    findings = checks.check_topology(pcie)
    assert statuses(findings, "topology") == ["warn"] and statuses(findings, "peer access") == ["warn"]
    assert statuses(checks.check_topology(machine()), "topology") == ["ok"]


@pytest.mark.parametrize("env, status, words", [
    ({"NCCL_P2P_DISABLE": "1"}, "warn", "host memory"),
    ({"NCCL_IB_DISABLE": "1"}, "warn", "TCP sockets"),
    ({"NCCL_SOCKET_IFNAME": "ens5"}, "fail", "matches no network interface"),
    ({"NCCL_SOCKET_IFNAME": "^lo,docker"}, "ok", "eth0, ib0"),
    ({"NCCL_SOCKET_IFNAME": "=eth0"}, "ok", "→ eth0"),
    ({"NCCL_DEBUG": "TRACE"}, "warn", "slows training"),
])
def test_nccl_variables_get_hints(env, status, words):
    findings = [f for f in checks.check_nccl_env(machine(nccl_env=env | {"NCCL_DEBUG": env.get("NCCL_DEBUG", "INFO")}))
                if f.status == status]
    assert any(words in f.detail for f in findings), findings


def test_small_shm_ram_and_disk_warn():
    findings = checks.check_host(machine(shm_bytes=64 * 2**20, ram_available_bytes=100 * 2**30, disk_free_bytes=20 * 2**30))
    assert [f.status for f in findings] == ["warn", "warn", "warn"]
    assert "--shm-size" in findings[0].fix and "64 MiB" in findings[0].detail


def test_default_accelerate_config_is_described_and_checked():
    too_many = machine(accelerate_config_file="/x/default_config.yaml",
                       accelerate_config={"distributed_type": "MULTI_GPU", "num_processes": 8, "mixed_precision": "bf16"})
    (finding,) = checks.check_launch_config(too_many)
    assert finding.status == "fail" and "start 8 process(es) as MULTI_GPU" in finding.detail and "num_processes to 2" in finding.fix
    (none,) = checks.check_launch_config(machine())
    assert none.status == "info" and "starts one process" in none.detail


def doctor_cli(tmp_path, *args: str, env: dict | None = None) -> tuple[int, dict, str]:
    """`finetune doctor --json` as a subprocess with HF_HOME (and the caches) in tmp_path unless `env` says otherwise."""
    home = {"HF_HOME": str(tmp_path / "hf"), "XDG_CACHE_HOME": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "finetune", "doctor", "--json", "--no-bandwidth", *args],
                          capture_output=True, text=True, timeout=300, env=os.environ | home | (env or {}))
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    return done.returncode, json.loads(done.stdout), done.stderr


@pytest.mark.parametrize("text, words", [
    ("num_processes: [2\n", "is not valid YAML at line 2"),
    ("num_processes: all\ndistributed_type: MULTI_GPU\n", "num_processes: 'all' is not a whole number"),
    ("- MULTI_GPU\n", "holds a list, not a mapping"),
    ("distributed_type: MULTI_GPU\nnum_processes: 8\n", "start 8 process(es) as MULTI_GPU on 1 machine(s), mixed_precision no, "
     "but no GPU is visible here"),
])
def test_a_default_accelerate_config_that_cannot_run_here_fails_with_its_fix(tmp_path, text, words):
    (tmp_path / "hf" / "accelerate").mkdir(parents=True)
    (tmp_path / "hf" / "accelerate" / "default_config.yaml").write_text(text)
    code, report, _ = doctor_cli(tmp_path, "--output-dir", str(tmp_path / "out"))
    (finding,) = [f for f in report["findings"] if f["check"] == "accelerate config"]
    assert code == 1 and not report["ok"] and finding["status"] == "fail"
    assert words in finding["detail"] and str(tmp_path / "hf") in finding["detail"] and finding["fix"]


def test_directories_a_run_writes_must_be_writable(tmp_path):
    (tmp_path / "a-file").write_text("in the way")
    blocked = tmp_path / "a-file"
    code, report, _ = doctor_cli(tmp_path, "--output-dir", str(blocked / "out"), env={"HF_HOME": str(blocked / "hf")})
    failed = {f["detail"].split(" /")[0]: f for f in report["findings"] if f["check"] == "writable"}
    assert code == 1 and set(failed) == {"--output-dir", "HF_HOME", "datasets cache"}
    assert all(f["status"] == "fail" and f"{blocked} is a file, not a directory" in f["detail"] for f in failed.values())
    assert "point HF_HOME at a directory you can write" in failed["HF_HOME"]["fix"]

    code, report, _ = doctor_cli(tmp_path, "--output-dir", str(tmp_path / "new" / "out"))
    (ok,) = [f for f in report["findings"] if f["check"] == "writable"]
    assert code == 0 and ok["status"] == "ok" and str(tmp_path / "hf") in ok["detail"]
    assert not (tmp_path / "new").exists()  # checked by trying, then cleaned up


def test_ranks_must_agree_on_packages_and_gpus():
    same = [machine(rank=r, local_rank=r) for r in range(2)]
    assert statuses(checks.check_ranks(same), "ranks") == ["ok"]
    drift = [machine(), machine(rank=1, machine_rank=1, host="node1", versions=VERSIONS | {"torch": "2.10.0"},
                                gpus=[{"index": 0, **H100, "name": "NVIDIA A100-SXM4-80GB"}])]
    problems = [f.detail for f in checks.check_ranks(drift)]
    assert any("torch 2.10.0 (rank 0 has 2.11.0+cu130)" in p for p in problems)
    assert any("GPU models differ" in p for p in problems)
    merged = merge_findings({0: checks.check_gpus(drift[0]), 1: checks.check_gpus(drift[1])})
    assert any(f.detail.startswith("rank 1: ") for f in merged) and any(f.detail.startswith("rank 0: ") for f in merged)


def test_bandwidth_is_compared_with_the_link():
    slow = AllReduceTiming(processes=8, backend="nccl", bytes=256 * 2**20, seconds=256 * 2**20 / 50e9)
    fast = dataclasses.replace(slow, seconds=256 * 2**20 / 250e9)
    assert fast.busbw_gb_per_s == pytest.approx(250 * 2 * 7 / 8 / 1e0, rel=1e-9)
    assert checks.check_bandwidth([slow], machine(), nodes=1).status == "warn"
    assert checks.check_bandwidth([slow, fast], machine(), nodes=1).status == "ok"
    assert "should give ~450 GB/s" in checks.check_bandwidth([fast], machine(), nodes=1).detail
    assert "~25 GB/s" in checks.check_bandwidth([slow], machine(), nodes=2).detail


@pytest.mark.slow
def test_two_ranks_under_torchrun_report_and_rank0_compares(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-port", str(free_port()),
               "-m", "finetune", "doctor", "--json", "--all-reduce-bytes", str(2**20), "--output-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)  # only rank 0 printed
    assert [m["rank"] for m in report["machines"]] == [0, 1]
    assert [m["local_rank"] for m in report["machines"]] == [0, 1]
    assert any(f["check"] == "ranks" and f["status"] == "ok" and "2 ranks" in f["detail"] for f in report["findings"])
    (timing,) = report["all_reduce"]
    assert timing["processes"] == 2 and timing["backend"] == "gloo" and timing["bytes"] == 2**20 and timing["busbw_gb_per_s"] > 0


@pytest.mark.slow
def test_spawned_all_reduce_times_every_size():
    timings = spawn_all_reduce(2, [2**16, 2**20], "gloo")
    assert [t.bytes for t in timings] == [2**16, 2**20]
    assert all(t.processes == 2 and t.seconds > 0 for t in timings)


@pytest.mark.parametrize("device_name, memory_gib, entry", [
    ("NVIDIA H100 80GB HBM3", 79.1, "H100-80GB"), ("NVIDIA A100-SXM4-40GB", 39.4, "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", 79.2, "A100-80GB"), ("NVIDIA L40S", 44.4, "L40S"), ("NVIDIA L4", 22.0, "L4"),
    ("Tesla T4", 14.7, "T4"), ("NVIDIA GeForce RTX 4090", 23.6, "RTX4090"), ("NVIDIA H200", 139.8, "H200"),
    ("Tesla V100-SXM2-32GB", 31.7, "V100-32GB"), ("NVIDIA B200", 179.1, "B200"), ("Acme Tensor X9", 64.0, None),
])
def test_cuda_device_names_map_to_the_gpu_catalog(device_name, memory_gib, entry):
    from finetune.plan.gpus import identify

    spec = identify(device_name, memory_gib)
    assert (spec.name if spec else None) == entry
