"""Multi-node: the sbatch writer, the preflight, and two "nodes" on 127.0.0.1 training one DDP job
through the generated sbatch script (Slurm's srun and scontrol replaced by stand-ins)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from helpers import REPO

from finetune.config.options import TrainConfig
from finetune.launch import slurm
from finetune.launch.rehearse import write_shrunk_model
from finetune.train import preflight
from finetune.train.accelerator import free_port

ENV = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def test_sbatch_script_content_and_syntax(tmp_path):
    job = slurm.SlurmJob(accelerate_config="accelerate_configs/fsdp.yaml", nodes=4, gpus_per_node=8, partition="gpu",
                         train_args=["--model", "llama-70b", "--method", "qlora", "--dataset", "my data.jsonl", "--packing"])
    text = slurm.sbatch_script(job)
    lines = text.splitlines()
    assert lines[:8] == [
        "#!/bin/bash",
        "#SBATCH --job-name=finetune",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1          # one accelerate launcher per node; it starts one process per GPU",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=24:00:00",
        "#SBATCH --output=%x-%j.out",
        "#SBATCH --partition=gpu",
    ]
    launch = text[text.index("srun "):].splitlines()
    assert launch == [
        "srun --kill-on-bad-exit=1 bash -c 'exec accelerate launch --machine_rank \"$SLURM_NODEID\" \"$@\"' accelerate-launch \\",
        "    --config_file accelerate_configs/fsdp.yaml \\",
        '    --num_machines "$SLURM_NNODES" \\',
        "    --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \\",
        '    --main_process_ip "$MAIN_HOST" \\',
        '    --main_process_port "$MAIN_PORT" \\',
        "    --rdzv_backend c10d \\",
        "    -m finetune \\",
        "    --model llama-70b \\",
        "    --method qlora \\",
        "    --dataset 'my data.jsonl' \\",
        "    --packing",
    ]
    assert "GPUS_PER_NODE=8" in lines and 'MAIN_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_slurm_command_checks_its_flags_and_the_training_flags(tmp_path):
    out = tmp_path / "job.sbatch"
    done = subprocess.run([sys.executable, "-m", "finetune", "slurm", "--config-file", "accelerate_configs/ddp.yaml",
                           "--nodes", "2", "--gpus-per-node", "4", "--output", str(out), "--", "--model", "llama-7b"],
                          cwd=REPO, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote {out}: 2 nodes × 4 GPUs = 8 processes; submit with `sbatch {out}`\n"
    assert "GPUS_PER_NODE=4" in out.read_text()

    bad = subprocess.run([sys.executable, "-m", "finetune", "slurm", "--config-file", "nope.yaml", "--nodes", "0"],
                         cwd=REPO, env=ENV, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr == ("finetune slurm: error: invalid options:\n  - --nodes must be ≥ 1, got 0\n"
                          "  - --config-file nope.yaml: no such file (see accelerate_configs/)\n")


def test_preflight_diagnoses_version_drift_duplicate_ranks_and_unwritable_dirs(tmp_path):
    versions = {"torch": "2.13.0", "finetune": "0.1.0"}
    reports = [
        {"rank": 0, "host": "a", "machine_rank": 0, "local_rank": 0, "versions": versions, "output_dir": None},
        {"rank": 1, "host": "b", "machine_rank": 0, "local_rank": 0, "versions": versions | {"torch": "2.12.1"},
         "output_dir": "PermissionError: Permission denied"},
    ]
    assert preflight.diagnose(reports, "/shared/out") == [
        "ranks 0 and 1 (on b) both run as machine rank 0, local rank 0: two launchers were given the same --machine_rank",
        "rank 1 on b has different packages: torch 2.12.1 (rank 0 has 2.13.0); install the same environment on every machine",
        "rank 1 on b cannot write to /shared/out: PermissionError: Permission denied",
    ]
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert preflight.probe_output_dir(blocker / "out", rank=0) == "NotADirectoryError: Not a directory"
    assert preflight.probe_output_dir(tmp_path / "out", rank=0) is None


def test_a_missing_node_ends_the_run_with_a_diagnosis_not_a_hang(tmp_path):
    """Rank 1 of 2 starts, rank 0 never does: the watchdog stops it after --preflight-timeout."""
    port = free_port()
    env = ENV | {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "finetune", "--preflight-timeout", "3", "--output-dir", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == preflight.TIMEOUT_EXIT_CODE
    assert time.monotonic() - started < 60
    assert f"rank 1 on {os.uname().nodename} is stuck at 'rendezvous' after 3 s (--preflight-timeout)." in done.stderr
    assert f"Could not form the process group of WORLD_SIZE=2 at 127.0.0.1:{port}." in done.stderr


SRUN_STAND_IN = """#!/bin/bash
# Slurm stand-in: run the task once per node of the allocation, all on this machine. Node 0 starts
# first so that it hosts the rendezvous store before the others look for it.
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  SLURM_NODEID=$node "$@" > "$LOG_DIR/node$node.log" 2>&1 &
  pids+=($!)
  if (( node == 0 )); then
    for _ in $(seq 150); do (exec 3<>"/dev/tcp/127.0.0.1/$MAIN_PORT") 2>/dev/null && break; sleep 0.2; done
  fi
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
"""


def test_two_nodes_on_loopback_train_one_ddp_job_through_the_sbatch_script(tmp_path):
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN_STAND_IN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    model = write_shrunk_model(TrainConfig(model="tiny"), tmp_path / "model")  # both "nodes" read one copy
    job = slurm.SlurmJob(accelerate_config="accelerate_configs/multi_node.yaml", nodes=2, gpus_per_node=1,
                         train_args=["--model", str(model), "--max-steps", "2", "--micro-batch-size", "2",
                                     "--max-seq-len", "64", "--max-eval-examples", "8", "--num-samples", "0",
                                     "--log-every", "1", "--output-dir", str(out), "--preflight-timeout", "120"])
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.sbatch_script(job))
    env = ENV | {"PATH": f"{bin_dir}:{ENV['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[0-1]",
                 "MAIN_PORT": str(free_port()), "LOG_DIR": str(tmp_path), "ACCELERATE_USE_CPU": "1"}
    done = subprocess.run(["bash", str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    logs = [(tmp_path / f"node{node}.log").read_text() for node in (0, 1)]
    assert done.returncode == 0, logs[0][-3000:] + logs[1][-3000:]
    for log in logs:
        assert "strategy: DDP on cpu (gloo)" in log and "world size: 2 processes on 2 machines" in log
        assert "preflight: 2 rank(s) on 2 machine(s) joined; all-reduce ok; package versions equal" in log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"lr"' in line]
    assert [s["step"] for s in steps] == [1, 2] and all(0 < s["loss"] < 10 for s in steps)
