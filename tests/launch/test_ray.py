"""`finetune ray`: a real local Ray cluster (token authentication on, as Ray 2.60 starts it) trains the
tiny default on two CPU workers exactly as a two-process torchrun DDP run does, and a worker killed
mid-run is replaced by Ray, which resumes the group from the last checkpoint to the same weights.
Mistakes end in one line before Ray starts. One cluster serves the module (`ray start` costs 10-40 s)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import REPO

from finetune.cli import main as cli_main
from finetune.config.flags import parse_command
from finetune.config.resolve import Launch
from finetune.errors import ConfigError, ReportedElsewhere
from finetune.launch import ray_train
from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.choose import Request, plan
from finetune.plan.files import ray_command
from finetune.train.accelerator import free_port

ENV = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
# 24 updates of the tiny default, a checkpoint every 6: long enough to kill a worker after the first
FLAGS = ["--micro-batch-size", "2", "--max-seq-len", "64", "--max-eval-examples", "0", "--num-samples", "0",
         "--log-every", "1", "--save-every", "6", "--max-steps", "24"]


# ---------------------------------------------------------------- before Ray starts (no cluster)

@pytest.mark.parametrize(("args", "message"), [
    (["--workers", "2", "--bogus"], "finetune ray: error: unrecognized arguments: --bogus"),
    (["--workers", "0"], "finetune ray: error: invalid options:\n  - --workers must be ≥ 1, got 0\n"),
    (["--model", "tiny"], "finetune ray: error: the following arguments are required: --workers (see --help)\n"),
    (["--workers", "2", "--micro-batch-size", "0"],
     "finetune ray: error: Invalid configuration:\n  - --micro-batch-size must be ≥ 1, got 0\n"),
    (["--workers", "3", "--global-batch-size", "4", "--micro-batch-size", "2"], "finetune ray: error: --global-batch-size 4"),
])
def test_a_mistake_is_one_line_before_ray_starts(args, message, tmp_path, capsys):
    ray_imported = "ray" in sys.modules
    assert cli_main(["ray", *args, "--output-dir", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and captured.out == ""
    assert ("ray" in sys.modules) == ray_imported  # found before Ray was even imported


def test_a_fresh_run_refuses_an_output_dir_with_checkpoints(tmp_path, capsys):
    (tmp_path / "out" / "checkpoints" / "step-000006").mkdir(parents=True)
    assert cli_main(["ray", "--workers", "2", "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"finetune ray: error: {tmp_path / 'out'} already holds checkpoints of an earlier "
                                       "run (newest: step-000006). Continue it with --resume auto, or use another --output-dir.\n")


def test_the_accelerate_config_reaches_the_workers_as_accelerate_launch_announces_it():
    """The variables Accelerate's launcher code computes for `--config_file X --num_processes 2` are
    read by the workers as the launch the file describes (strategy, FSDP settings, DeepSpeed JSON)."""
    for name in ("ddp", "fsdp", "fsdp_offload", "deepspeed_zero3", "deepspeed_zero3_offload"):
        path = str(REPO / "accelerate_configs" / f"{name}.yaml")
        environment = ray_train.launcher_environment(path, 2)
        assert not set(environment) & ray_train.RAY_OWNED
        assert Launch.from_environment(environment | {"WORLD_SIZE": "2"}) == Launch.from_accelerate_config(path, 2), name
    assert ray_train.launcher_environment(None, 2) == {}


def test_the_plan_writes_a_ray_command_for_its_workers_and_strategy():
    plans, best = plan(Request(model=catalog.get("llama-3.1-8b"), gpu=gpus.get("H100"), gpus_per_node=8, nodes=2,
                               method="full", strategy="fsdp"))
    command = ray_command(plans[best], "plan")
    words = command.split()
    assert words[:2] == ["finetune", "ray"]
    args, train_args = ray_train.split_argv(words[2:])
    assert (args.workers, args.gpus_per_worker, args.accelerate_config) == (16, 1.0, "plan/accelerate.yaml")
    assert args.memory_per_worker == pytest.approx(plans[best].host_gib / 8, abs=1)
    config = parse_command(train_args).config
    w = plans[best].workload
    assert (config.model, config.method) == ("llama-3.1-8b", "full")
    assert (config.micro_batch_size, config.max_seq_len) == (w.micro_batch_size, w.seq_len)


def test_a_replacement_group_resumes_from_this_runs_newest_checkpoint(tmp_path):
    out = tmp_path / "out"
    assert ray_train.resume_point(None, str(out)) == "auto"
    assert ray_train.resume_point("auto", str(out)) == "auto"
    start = tmp_path / "old" / "checkpoints" / "step-000004"
    write_checkpoint(start)
    assert ray_train.resume_point(str(start), str(out)) == str(start)  # nothing saved by this run yet
    write_checkpoint(out / "checkpoints" / "step-000006")
    assert ray_train.resume_point(str(start), str(out)) == "auto"  # a step after the one it started from


def test_a_local_ray_that_cannot_hold_the_workers_says_so():
    ray_train.check_local_resources({"CPU": 1.0, "GPU": 0.0}, 2, {"CPU": 2.0})  # fits: silent
    with pytest.raises(ConfigError) as refused:
        ray_train.check_local_resources({"CPU": 1.0, "GPU": 1.0, "memory": 2**30}, 4, {"CPU": 2.0})
    assert str(refused.value) == ("the local Ray on this machine cannot start 4 workers: 4 × 1 CPU = 4 of 2; 4 × 1 GPU = 4 of 0. "
                                  "Use fewer --workers, a smaller --cpus-per-worker, or --address of a larger cluster.")


def test_a_workers_error_is_reported_as_its_one_line():
    from ray.train import WorkerGroupError

    message = "finetune train: error: --dataset data.jsonl: row 3 has no 'text' field"
    both_ranks = WorkerGroupError("Training failed", {0: ReportedElsewhere(message), 1: ReportedElsewhere(message)})
    assert ray_train.failure_message(both_ranks) == "--dataset data.jsonl: row 3 has no 'text' field"
    one_rank = WorkerGroupError("Training failed", {1: ConfigError("rank 1 only"), 0: RuntimeError("gloo: peer closed")})
    assert ray_train.failure_message(one_rank) == "rank 1 only"
    bug = ray_train.failure_message(WorkerGroupError("Training failed:\n  ZeroDivisionError", {0: ZeroDivisionError()}))
    assert bug.startswith("the Ray worker group failed: ") and bug.endswith("ZeroDivisionError") and "\n" not in bug


def write_checkpoint(path: Path) -> None:
    from finetune.checkpoint.layout import MANIFEST

    path.mkdir(parents=True)
    (path / MANIFEST).write_text(json.dumps({"step": int(path.name.split("-")[1])}))


# ---------------------------------------------------------------- on a real Ray cluster

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A 2-CPU Ray head on loopback for this module (`ray start --block` stops everything it started
    when terminated), with token authentication, as Ray 2.60 enables it by default. FINETUNE_TEST_RAY
    marks its processes, so the test kills one of its own workers and nobody else's."""
    marker = secrets.token_hex(8)
    env = ENV | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), "FINETUNE_TEST_RAY": marker,
                 "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}  # stop at once when the module is done
    port = free_port()
    log = tmp_path_factory.mktemp("ray") / "head.log"
    temp_dir = Path("/tmp") / f"ft-ray-{marker}"  # Ray's socket paths must stay short
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--num-cpus", "2",
                             "--port", str(port), "--ray-client-server-port", str(free_port()), "--temp-dir", str(temp_dir),
                             "--disable-usage-stats", "--include-dashboard", "false"],
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield {"address": f"127.0.0.1:{port}", "env": env, "marker": marker}
    finally:
        head.send_signal(signal.SIGTERM)
        head.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)


def losses(output_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every update metrics.jsonl holds; whole lines only, as it may be read mid-write."""
    path = output_dir / "metrics.jsonl"
    text = path.read_text() if path.is_file() else ""
    records = [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def final_weights(output_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(output_dir / "model.safetensors")


def train_workers(marker: str) -> list[psutil.Process]:
    """This module's cluster's Ray Train workers."""
    found = []
    for process in psutil.process_iter(["name"]):
        try:
            if "RayTrainWorker" in process.info["name"] and process.environ().get("FINETUNE_TEST_RAY") == marker:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.slow
def test_ray_workers_train_as_torchrun_ddp_and_a_killed_worker_resumes_to_the_same_weights(cluster, tmp_path):
    """Uninterrupted two-process torchrun DDP is the reference. On Ray, one of the two workers is
    killed after the step-6 checkpoint: every loss logged before the kill (the first group's) and
    after it (the replacement group's, resumed from the newest checkpoint) equals the reference's,
    each step logged once, and the final weights are the reference's, bit for bit."""
    reference = tmp_path / "ddp"
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(free_port()), "-m", "finetune", *FLAGS, "--output-dir", str(reference)],
                              env=ENV, capture_output=True, text=True, timeout=600)
    assert torchrun.returncode == 0, torchrun.stderr[-4000:]
    assert [step for step, _ in losses(reference)] == list(range(1, 25))

    out, log = tmp_path / "ray", tmp_path / "ray.log"
    with open(log, "w") as sink:
        run = subprocess.Popen([sys.executable, "-m", "finetune", "ray", "--address", cluster["address"], "--workers", "2",
                                *FLAGS, "--output-dir", str(out)], env=cluster["env"], stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 400
    while True:  # kill once the step-6 checkpoint is complete and step 8 is logged
        first_group = losses(out)
        if (out / "checkpoints" / "step-000006").is_dir() and first_group and first_group[-1][0] >= 8:
            break
        assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.1)
    workers = train_workers(cluster["marker"])
    assert len(workers) == 2
    workers[-1].send_signal(signal.SIGKILL)
    run.wait(timeout=600)
    output = log.read_text()
    assert run.returncode == 0, output[-4000:]
    assert "strategy: DDP on cpu (gloo)" in output and "world size: 2 processes" in output
    assert first_group == losses(reference)[: len(first_group)] and first_group[-1][0] < 24
    resumed = [line for line in output.splitlines() if line.startswith("resumed from ")]
    assert len(resumed) == 1 and "/checkpoints/step-0000" in resumed[0], output[-4000:]
    assert losses(out) == losses(reference)
    expected, got = final_weights(reference), final_weights(out)
    assert expected.keys() == got.keys() and all((expected[name] == got[name]).all() for name in expected)
