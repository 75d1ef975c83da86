"""Exact resume, crash safety and export round trips for every strategy the planner can recommend,
through the real CLI: `accelerate launch --config_file accelerate_configs/X.yaml --num_processes 2
-m finetune ...` on 2 CPU processes (gloo); and one optimizer step per update across epoch ends.

Two ways in, sharing their runs with the other tests here:
- `--resume PATH` (RESUME_CASES): an uninterrupted run of 4 updates saves at steps 2 and 4; a second
  run resumes from its step-2 checkpoint in a fresh process and output dir. Its losses for steps 3-4
  must equal the uninterrupted ones bitwise, and both step-4 checkpoints must export to identical
  weights.
- a crash mid-save, then `--resume auto` (INTERRUPTED, full fine-tuning on 2 processes, sequence-parallel
  TP among them): the run is killed with SIGKILL while rank 1 is still inside the save of step 4, or
  rank 1's disk fills up there. It logged steps 1-4 uninterrupted before the save; the rerun in the same output dir must
  pass over the unfinished step-4 folder, resume from step 2 and log the same steps 3-4 bitwise.
Either way the final step-4 checkpoint exports to the model the run saved at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO
from safetensors.torch import load_file

from finetune.config.run_folder import read_metrics
from finetune.export.safetensors import export

pytestmark = pytest.mark.slow  # multi-process runs: CI's second step

CONFIGS = {  # accelerate config per strategy; "single" runs `python -m finetune` without a launcher
    "single": None,
    "ddp": "accelerate_configs/ddp.yaml",
    "fsdp2": "accelerate_configs/fsdp.yaml",
    "fsdp2_tp": "accelerate_configs/fsdp.yaml",  # with LAYOUT_FLAGS: tensor parallel over the 2 processes
    "fsdp2_offload": "accelerate_configs/fsdp_offload.yaml",
    "zero1": "accelerate_configs/deepspeed_zero1.yaml",
    "zero2": "accelerate_configs/deepspeed_zero2.yaml",
    "zero3": "accelerate_configs/deepspeed_zero3.yaml",
    "zero3_offload": "accelerate_configs/deepspeed_zero3_offload.yaml",
}
QLORA_CONFIGS = {"fsdp2": "accelerate_configs/fsdp_qlora.yaml"}  # what the planner recommends for FSDP + QLoRA
STEPS = 4
RUN = ["--model", "tiny", "--max-steps", str(STEPS), "--save-every", "2", "--micro-batch-size", "2",
       "--gradient-accumulation-steps", "2", "--log-every", "1", "--warmup-steps", "1", "--max-seq-len", "64",
       "--max-eval-examples", "0"]
LAUNCH_TIMEOUT = 300  # seconds: the slowest launch here takes about 60
METHODS = {"full": [], "lora": ["--method", "lora", "--lora-r", "4", "--lora-dropout", "0.1"],
           "qlora": ["--method", "qlora", "--lora-r", "4", "--lora-dropout", "0.1"],
           # a mixture of experts, LoRA on its attention and its fused experts (no dropout there)
           "moe-lora": ["--model", "tiny-moe", "--method", "lora", "--lora-r", "4", "--lora-targets", "all-linear+experts"]}
# LoRA under TP adapts the column-parallel linears only (config/parallelism.py says why)
LAYOUT_FLAGS = {"fsdp2_tp": ["--tp", "2", "--lora-targets", "q_proj,k_proj,v_proj,gate_proj,up_proj"]}
RESUME_CASES = [("single", "full"), ("single", "lora"), ("single", "qlora"), ("ddp", "lora"), ("fsdp2", "lora"),
                ("fsdp2", "qlora"), ("zero2", "lora"), ("zero3", "lora"), ("ddp", "moe-lora"), ("fsdp2_tp", "lora")]
INTERRUPTED = {"ddp": "kill -9", "fsdp2": "kill -9", "zero1": "kill -9", "zero2": "kill -9", "zero3": "kill -9",
               "fsdp2_tp": "kill -9", "fsdp2_offload": "disk full", "zero3_offload": "disk full"}
TOKENS = torch.tensor([[1, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3]])


def run_strategy(case: str) -> str:
    """The strategy a run of this case records (names.STRATEGIES: offload is a setting of it)."""
    return case.removesuffix("_offload").removesuffix("_tp").replace("fsdp2", "fsdp")


def launch_command(strategy: str, *flags: str, method: str = "full", program: tuple[str, ...] = ("-m", "finetune")) -> list[str]:
    """The command a user types for `strategy` (and `method`), running `program` with RUN and `flags`."""
    flags = (*RUN, *METHODS[method], *LAYOUT_FLAGS.get(strategy, ()), *flags)
    if CONFIGS[strategy] is None:
        return [sys.executable, *program, *flags]
    config = QLORA_CONFIGS.get(strategy) if method == "qlora" else None
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / (config or CONFIGS[strategy])),
            "--num_processes", "2", "--main_process_port", "0", *program, *flags]


def finetune(strategy: str, *flags: str, method: str = "full", env: dict | None = None,
             program: tuple[str, ...] = ("-m", "finetune"), expect_exit: int = 0) -> subprocess.CompletedProcess:
    command = launch_command(strategy, *flags, method=method, program=program)
    job = subprocess.Popen(command, cwd=REPO, env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONFAULTHANDLER": "1",
                                                   **(env or {})},
                           text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = job.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        stacks = stacks_of_hung_run(job, flags[flags.index("--output-dir") + 1])
        pytest.fail(f"{' '.join(command)} hung for {LAUNCH_TIMEOUT} s; where each process was:\n{stacks}")
    assert job.returncode == expect_exit, stdout[-2000:] + stderr[-4000:]
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)


def stacks_of_hung_run(launcher: subprocess.Popen, output_dir: str) -> str:
    """Kill a hung run after making each of its ranks, then the launcher, print its Python stack
    (PYTHONFAULTHANDLER dumps every thread's on SIGABRT), and return the end of what they printed.
    The launcher is paused meanwhile, so it does not stop the other ranks when the first one dies."""
    processes = processes_of(output_dir)
    ranks = sorted((int(env["RANK"]), pid) for pid, env in processes.items() if "RANK" in env)
    launchers = [pid for pid, env in processes.items() if "RANK" not in env]
    for pid in launchers:
        os.kill(pid, signal.SIGSTOP)
    for pid in [pid for _, pid in ranks] + launchers:
        try:
            os.kill(pid, signal.SIGABRT)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # gone already
        time.sleep(1)  # one dump at a time
    try:
        stdout, stderr = launcher.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        kill_job(launcher, output_dir)
        stdout, stderr = launcher.communicate()
    kill_job(launcher, output_dir)  # whatever outlived the abort
    order = ", ".join(f"rank {rank}" for rank, _ in ranks)
    return f"(stacks in this order: {order}, the launcher)\n{stdout[-2000:]}{stderr[-12000:]}"


def kill_job(launcher: subprocess.Popen, output_dir: str) -> None:
    """SIGKILL the launcher and its ranks (torch's launcher starts them in sessions of their own)."""
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the launcher's session has ended
    for pid in processes_of(output_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # gone already
    launcher.wait(timeout=60)


def processes_of(output_dir: str) -> dict[int, dict[str, str]]:
    """pid → environment of every process whose command line names `output_dir`."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and output_dir in (proc / "cmdline").read_bytes().decode(errors="replace"):
                environ = (proc / "environ").read_bytes().decode(errors="replace").split("\0")
                found[int(proc.name)] = dict(v.split("=", 1) for v in environ if "=" in v)
        except OSError:
            pass  # exited meanwhile
    return found


def logged_losses(output_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) in the order the runs in `output_dir` logged them (a resumed run appends)."""
    return [(r["step"], r["loss"]) for r in read_metrics(output_dir / "metrics.jsonl") if "loss" in r]


def losses(output_dir: Path) -> dict[int, float]:
    return dict(logged_losses(output_dir))


def exported_tensors(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    export(checkpoint, out)
    tensors = {}
    for path in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def logits_of(folder: Path, method: str, base: Path | None = None) -> torch.Tensor:
    """Logits of a saved full model, or of a saved adapter on `base` (4-bit NF4 for QLoRA, as trained)."""
    from transformers import AutoModelForCausalLM

    if method == "full":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        from peft import PeftModel

        from finetune.train.skeleton import nf4_config

        quantization = {"quantization_config": nf4_config(torch.float32)} if method == "qlora" else {}
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **quantization), folder)
    model.eval()
    if method == "qlora":  # 4-bit layers in train mode compute as in training; in eval mode bitsandbytes
        import bitsandbytes as bnb  # switches CPUs with avx512_bf16 to a repacked kernel (~5e-3 apart)

        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                module.train()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def check_export_round_trip(output_dir: Path, method: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Export the run's step-4 checkpoint: it must reproduce the model the run saved at the end
    (and, merged, the same logits up to rounding). Returns the exported tensors."""
    exported = exported_tensors(output_dir / "checkpoints" / "step-000004", tmp_path / "export")
    base = output_dir / "base_model"
    trained = logits_of(output_dir, method, base)
    assert torch.equal(logits_of(tmp_path / "export", method, base), trained)
    if method != "full":  # merged into the (dequantized, for QLoRA) base: W + BA vs Wx + B(Ax), rounding only
        export(output_dir / "checkpoints" / "step-000004", tmp_path / "merged", merge_lora=True)
        torch.testing.assert_close(logits_of(tmp_path / "merged", "full"), trained, atol=1e-4, rtol=1e-4)
    return exported


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """strategy, method → output dir of its uninterrupted run (run once, shared by the tests)."""
    runs = {}

    def get(strategy: str, method: str) -> Path:
        if (strategy, method) not in runs:
            out = tmp_path_factory.mktemp(f"{strategy}-{method}")
            finetune(strategy, "--output-dir", str(out), method=method)
            runs[strategy, method] = out
        return runs[strategy, method]

    return get


@pytest.mark.parametrize(("strategy", "method"), RESUME_CASES, ids=[f"{s}-{m}" for s, m in RESUME_CASES])
def test_resume_is_exact_and_exports_round_trip(tmp_path, uninterrupted, strategy, method):
    reference = uninterrupted(strategy, method)
    step2 = reference / "checkpoints" / "step-000002"
    manifest = json.loads((step2 / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["strategy"], manifest["step"]) == (1 if strategy == "single" else 2, run_strategy(strategy), 2)

    resumed = tmp_path / "resumed"
    finetune(strategy, "--output-dir", str(resumed), "--resume", str(step2), method=method)
    expected = losses(reference)
    assert sorted(expected) == [1, 2, 3, 4] and len(set(expected.values())) == 4
    assert losses(resumed) == {3: expected[3], 4: expected[4]}  # bitwise

    ours = check_export_round_trip(reference, method, tmp_path / "reference")
    theirs = exported_tensors(resumed / "checkpoints" / "step-000004", tmp_path / "export-resumed")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


FAULT_IN_SAVE_OF_STEP_4 = """
import os
if os.environ.get("RANK") == "1":
    import time
    from pathlib import Path

    from accelerate import Accelerator

    save_state = Accelerator.save_state

    def save_state_with_fault(self, output_dir=None, **kwargs):
        if "step-000004" not in str(output_dir):
            return save_state(self, output_dir, **kwargs)
        if os.environ["FINETUNE_TEST_FAULT"] == "disk full":  # a few bytes written, then no space left
            (Path(output_dir) / "partial_rank1").write_bytes(b"x")
            raise OSError(28, "No space left on device")
        result = save_state(self, output_dir, **kwargs)
        time.sleep(600)  # kill -9: rank 1 is "still writing" step 4 when the test kills the job
        return result

    Accelerator.save_state = save_state_with_fault
"""


def crash_mid_save_then_resume(strategy: str, fault: str, workdir: Path) -> tuple[Path, str, str]:
    """Run until rank 1 is inside the save of step 4 and `fault` strikes it there, then rerun the
    same command with --resume auto. Returns the output dir and what the two runs printed."""
    hook = workdir / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAULT_IN_SAVE_OF_STEP_4)
    out = workdir / "run"
    env = {"FINETUNE_TEST_FAULT": fault, "PYTHONPATH": f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if fault == "disk full":  # rank 1 stops with our message; the launcher then stops rank 0
        crashed = finetune(strategy, "--output-dir", str(out), env=env, expect_exit=1)
        printed = crashed.stdout + crashed.stderr
    else:
        job = subprocess.Popen(launch_command(strategy, "--output-dir", str(out)), cwd=REPO,
                               env={**os.environ, "DS_ACCELERATOR": "cpu", **env},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        staging = out / "checkpoints" / "step-000004.incomplete"
        deadline = time.monotonic() + 300
        while not (staging / "random_states_1.pkl").exists():  # every rank has written its files of step 4
            assert job.poll() is None and time.monotonic() < deadline, "the run ended before it was killed"
            time.sleep(0.2)
        kill_job(job, str(out))
        printed = ""
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004.incomplete"]
    shutil.copy(out / "metrics.jsonl", workdir / "metrics-before-resume.jsonl")  # the resume drops records past step 2
    resumed = finetune(strategy, "--output-dir", str(out), "--resume", "auto")
    return out, printed, resumed.stdout + resumed.stderr


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """strategy → (output dir, crashed run's output, resumed run's output), each run once and shared."""
    runs = {}

    def get(strategy: str) -> tuple[Path, str, str]:
        if strategy not in runs:
            runs[strategy] = crash_mid_save_then_resume(strategy, INTERRUPTED[strategy], tmp_path_factory.mktemp(strategy))
        return runs[strategy]

    return get


@pytest.mark.parametrize("strategy", list(INTERRUPTED), ids=[f"{s}-{f.replace(' ', '-')}" for s, f in INTERRUPTED.items()])
def test_crash_mid_save_then_resume_auto_is_exact(tmp_path, interrupted, strategy):
    out, crashed, resumed = interrupted(strategy)
    if INTERRUPTED[strategy] == "disk full":
        assert ("step-000004 failed on rank 1: [Errno 28] No space left on device. "
                "The newest complete checkpoint is still step-000002") in crashed
    assert "ignoring step-000004.incomplete: a save that never finished" in resumed
    assert f"resumed from {out / 'checkpoints' / 'step-000002'} at step 2" in resumed
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    manifest = json.loads((out / "checkpoints" / "step-000004" / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["strategy"]) == (2, run_strategy(strategy))
    before = [(r["step"], r["loss"]) for r in read_metrics(out.parent / "metrics-before-resume.jsonl") if "loss" in r]
    logged = logged_losses(out)  # steps 1-2 kept, 3-4 trained again: the log reads like an uninterrupted run's
    assert [step for step, _ in before] == [step for step, _ in logged] == [1, 2, 3, 4]
    assert logged == before and len({loss for _, loss in logged}) == 4  # bitwise: the resumed 3-4 are the crashed run's
    check_export_round_trip(out, "full", tmp_path)


@pytest.mark.parametrize("strategy", ["fsdp2", "zero3"])
def test_sharded_checkpoints_split_the_model_between_ranks(interrupted, strategy):
    """No rank gathers the full model to save: each rank writes about half of the weights."""
    out = interrupted(strategy)[0]
    files = {f["path"]: f["bytes"] for f in json.loads((out / "checkpoints" / "step-000002" / "manifest.json").read_text())["files"]}
    pattern = "pytorch_model_fsdp_0/__{}_0.distcp" if strategy == "fsdp2" else "pytorch_model/zero_pp_rank_{}_mp_rank_00_optim_states.pt"
    rank0, rank1 = files[pattern.format(0)], files[pattern.format(1)]
    model_bytes = sum(t.numel() * 4 for t in load_file(out / "model.safetensors").values())
    assert abs(rank0 - rank1) < 0.1 * rank0
    assert rank0 < 0.75 * model_bytes * (1 if strategy == "fsdp2" else 3)  # ZeRO-3 also holds 2 Adam moments


def test_resume_on_another_world_size_is_refused(tmp_path, interrupted):
    step2 = interrupted("ddp")[0] / "checkpoints" / "step-000002"
    result = subprocess.run([sys.executable, "-m", "finetune", *RUN, "--output-dir", str(tmp_path), "--resume", str(step2)],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "world_size: checkpoint 2, this run 1" in result.stderr and "strategy: checkpoint 'ddp', this run 'single'" in result.stderr


@pytest.mark.parametrize(("strategy", "signum"), [("single", signal.SIGTERM), ("ddp", signal.SIGUSR1)])
def test_preemption_signal_saves_and_exits_0(tmp_path, strategy, signum):
    """SIGTERM to a single process; SIGUSR1 to rank 1 only of a 2-process run: the ranks agree, finish
    the update, save the same step, print how to resume and exit 0."""
    out = tmp_path / "run"
    command = launch_command(strategy, "--output-dir", str(out), "--max-steps", "500", "--save-every", "1000")
    job = subprocess.Popen(command, cwd=REPO, env={**os.environ, "DS_ACCELERATOR": "cpu"}, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").exists() and losses(out)):  # training has started
            assert job.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
            time.sleep(0.2)
        rank1 = [pid for pid, env in processes_of(str(out)).items() if env.get("RANK") == "1"]
        os.kill(job.pid if strategy == "single" else rank1[0], signum)
        output, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            kill_job(job, str(out))
    assert job.returncode == 0, output[-3000:]
    (checkpoint,) = (out / "checkpoints").iterdir()
    step = json.loads((checkpoint / "manifest.json").read_text())["step"]
    assert checkpoint.name == f"step-{step:06d}" and 1 <= step < 500 and max(losses(out)) == step
    assert "--resume auto" in output


COUNT_OPTIMIZER_STEPS = """
import gc, json, os, sys

import torch

from finetune import cli
from finetune.train import loop

train = loop.train
destroy_process_group = torch.distributed.destroy_process_group
counts = {}


def train_and_count(accelerator, model, optimizer, *args, progress, **kwargs):
    train(accelerator, model, optimizer, *args, progress=progress, **kwargs)
    adamw = optimizer
    while not isinstance(adamw, torch.optim.AdamW):  # Accelerate's wrapper, then DeepSpeed's ZeRO optimizer
        adamw = adamw.optimizer
    counts.update({"updates": progress.step, "epoch": progress.epoch,
                   "adamw": sorted({int(state["step"]) for state in adamw.state.values()}),
                   "deepspeed": getattr(model, "global_steps", None), "rank": accelerator.process_index})


def destroy_and_count(*args, **kwargs):
    gc.collect()
    counts["ddp_modules_alive"] = sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())
    destroy_process_group(*args, **kwargs)


loop.train = train_and_count
torch.distributed.destroy_process_group = destroy_and_count
status = cli.main(sys.argv[1:])
output_dir = sys.argv[sys.argv.index("--output-dir") + 1]
with open(os.path.join(output_dir, f"optimizer_steps_rank{counts['rank']}.json"), "w") as f:
    json.dump(counts, f)
sys.exit(status)
"""


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "zero2", "zero3"])
def test_one_optimizer_step_per_update_across_epoch_ends(tmp_path, strategy):
    """16 training rows at 2 ranks × micro 2 × accumulation 2: 2 updates per epoch, so 5 updates
    pass two epoch ends. The run is the CLI's, with the loop wrapped to read, once it returns, how
    many steps AdamW (and DeepSpeed's engine) took on each rank. The process group is destroyed
    only once no DDP module is left (run.train: else exit could hang in gloo's destructor)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"{i} times 3 is {3 * i}"}) + "\n" for i in range(17)))  # 1 held out
    driver = tmp_path / "count_optimizer_steps.py"
    driver.write_text(COUNT_OPTIMIZER_STEPS)
    out = tmp_path / "out"
    finetune(strategy, "--dataset", str(rows), "--max-steps", "5", "--save-every", "0", "--no-save-final",
             "--output-dir", str(out), program=(str(driver),))
    for rank in (0, 1):
        counts = json.loads((out / f"optimizer_steps_rank{rank}.json").read_text())
        assert (counts["updates"], counts["epoch"], counts["adamw"]) == (5, 2, [5]), rank
        assert counts["deepspeed"] == (5 if strategy.startswith("zero") else None), rank
        assert counts["ddp_modules_alive"] == 0, rank


MEASURE_ZERO_OPTIMIZER = """
import json, os, sys

from finetune import cli
from finetune.train import loop

train = loop.train


def train_and_measure(accelerator, model, optimizer, *args, **kwargs):
    train(accelerator, model, optimizer, *args, **kwargs)
    zero = optimizer.optimizer  # Accelerate's wrapper holds DeepSpeed's ZeRO optimizer
    masters = zero.fp32_partitioned_groups_flat if hasattr(zero, "fp32_partitioned_groups_flat") else zero.single_partition_of_fp32_groups
    states = [t for state in zero.optimizer.state.values() for name, t in state.items() if name != "step"]
    measured = {"master_bytes": sum(t.numel() * t.element_size() for t in masters),
                "state_bytes": sum(t.numel() * t.element_size() for t in states),
                "dtypes": sorted({str(t.dtype) for t in [*masters, *states]})}
    output_dir = sys.argv[sys.argv.index("--output-dir") + 1]
    with open(os.path.join(output_dir, f"zero_optimizer_rank{accelerator.process_index}.json"), "w") as f:
        json.dump(measured, f)


loop.train = train_and_measure
sys.exit(cli.main(sys.argv[1:]))
"""


def planned_zero_optimizer_bytes(strategy: str, precision: str) -> float:
    """The plan's per-GPU DeepSpeed optimizer term for this file's tiny run, less the flat gradient
    copy it counts for the step (n × the master dtype's bytes, sharded): what the engine keeps."""
    from finetune.config.options import TrainConfig
    from finetune.config.resolve import Device, Launch, resolve_run
    from finetune.plan import gpus
    from finetune.plan.memory import estimate
    from finetune.plan.params import count_params
    from finetune.plan.workload import from_run

    config = TrainConfig(model="tiny", precision=precision, micro_batch_size=2, gradient_accumulation_steps=2, max_seq_len=64)
    launch = Launch(world_size=2, deepspeed_config_file=str(REPO / "ds_configs" / f"{strategy}.json"))
    workload = from_run(resolve_run(config, launch, Device()), gpus.get("A100-80GB"))
    master_bytes = 2 if precision == "bf16-true" else 4
    return estimate(workload).optimizer - count_params(workload.model).total * master_bytes / 2


@pytest.mark.parametrize("strategy", ["fsdp2", "zero3"])
def test_pure_bf16_full_fine_tuning_trains_resumes_bitwise_and_stays_bf16(tmp_path, strategy):
    """--precision bf16-true, full fine-tuning on 2 processes: bf16 weights, gradients and AdamW
    states (FSDP2: Accelerate's fp32 upcast off; ZeRO-3: DeepSpeed's bf16 master weights and
    optimizer states, measured on the engine against the plan), a bitwise resume, and a checkpoint
    of bf16 weights."""
    pure = ("--precision", "bf16-true")
    reference = tmp_path / "reference"
    driver = tmp_path / "measure_zero_optimizer.py"
    driver.write_text(MEASURE_ZERO_OPTIMIZER)
    program = (str(driver),) if strategy.startswith("zero") else ("-m", "finetune")
    done = finetune(strategy, *pure, "--output-dir", str(reference), program=program)
    label = {"fsdp2": "FSDP2", "zero3": "ZeRO-3"}[strategy]
    assert f"strategy: {label}" in done.stdout and "precision: bf16-true (weights bfloat16, compute bfloat16)" in done.stdout
    if strategy.startswith("zero"):
        planned = planned_zero_optimizer_bytes(strategy, "bf16-true")
        for rank in (0, 1):
            engine = json.loads((reference / f"zero_optimizer_rank{rank}.json").read_text())
            assert engine["dtypes"] == ["torch.bfloat16"], rank  # no fp32 master weights or Adam states
            assert engine["master_bytes"] + engine["state_bytes"] == pytest.approx(planned, rel=0.02), rank
    resumed = tmp_path / "resumed"
    finetune(strategy, *pure, "--output-dir", str(resumed), "--resume", str(reference / "checkpoints" / "step-000002"))
    expected = losses(reference)
    assert sorted(expected) == [1, 2, 3, 4] and len(set(expected.values())) == 4
    assert losses(resumed) == {3: expected[3], 4: expected[4]}  # bitwise
    ours = exported_tensors(reference / "checkpoints" / "step-000004", tmp_path / "export")
    theirs = exported_tensors(resumed / "checkpoints" / "step-000004", tmp_path / "export-resumed")
    assert ours and {tensor.dtype for tensor in ours.values()} == {torch.bfloat16}  # never upcast to fp32
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
