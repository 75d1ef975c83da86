"""Exact resume, kill -9 safety and export round trips for every strategy, through the real CLI:
`accelerate launch --config_file accelerate_configs/X.yaml --num_processes 2 -m finetune ...` on 2
CPU processes (gloo).

For each strategy × method, one uninterrupted run of 4 updates saves at steps 2 and 4; a second
run resumes from the first one's step-2 checkpoint in a fresh process and output dir. Its losses
for steps 3-4 must equal the uninterrupted ones bitwise, and both step-4 checkpoints must export
to identical weights, which reproduce the logits of the model the run saved at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.export import export
from finetune.metrics import read_metrics

pytestmark = pytest.mark.slow  # multi-process runs: CI's second step

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {  # accelerate config per strategy; "single" runs `python -m finetune` without a launcher
    "single": None,
    "ddp": "accelerate_configs/ddp.yaml",
    "fsdp2": "accelerate_configs/fsdp.yaml",
    "zero2": "accelerate_configs/deepspeed_zero2.yaml",
    "zero3": "accelerate_configs/deepspeed_zero3.yaml",
}
STEPS = 4
RUN = ["--model", "tiny", "--max-steps", str(STEPS), "--save-every", "2", "--micro-batch-size", "2",
       "--gradient-accumulation-steps", "2", "--log-every", "1", "--warmup-steps", "1", "--max-seq-len", "64",
       "--max-eval-examples", "8", "--num-samples", "0"]
METHODS = {"full": [], "lora": ["--method", "lora", "--lora-r", "4", "--lora-dropout", "0.1"],
           "qlora": ["--method", "qlora", "--lora-r", "4", "--lora-dropout", "0.1"]}
CASES = [(strategy, method) for strategy in CONFIGS for method in ("full", "lora")] + [("single", "qlora")]
TOKENS = torch.tensor([[1, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3]])


def launch_command(strategy: str, *flags: str) -> list[str]:
    if CONFIGS[strategy] is None:
        return [sys.executable, "-m", "finetune", *RUN, *flags]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / CONFIGS[strategy]),
            "--num_processes", "2", "--main_process_port", "0", "-m", "finetune", *RUN, *flags]


def finetune(strategy: str, *flags: str) -> subprocess.CompletedProcess:
    command = launch_command(strategy, *flags)
    job = subprocess.Popen(command, cwd=REPO, env={**os.environ, "DS_ACCELERATOR": "cpu"}, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = job.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        kill_job(job, flags[flags.index("--output-dir") + 1])
        raise
    assert job.returncode == 0, stdout[-2000:] + stderr[-4000:]
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)


def kill_job(launcher: subprocess.Popen, output_dir: str) -> None:
    """SIGKILL the launcher and its ranks (torch's launcher starts them in sessions of their own)."""
    os.killpg(launcher.pid, signal.SIGKILL)
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


def losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(output_dir / "metrics.jsonl") if "loss" in r}


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

        from finetune.modeling import nf4_config

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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """strategy, method → output dir of its uninterrupted run (run once, shared by the tests)."""
    runs = {}

    def get(strategy: str, method: str) -> Path:
        if (strategy, method) not in runs:
            out = tmp_path_factory.mktemp(f"{strategy}-{method}")
            finetune(strategy, *METHODS[method], "--output-dir", str(out))
            runs[strategy, method] = out
        return runs[strategy, method]

    return get


@pytest.mark.parametrize(("strategy", "method"), CASES, ids=[f"{s}-{m}" for s, m in CASES])
def test_resume_is_exact_and_exports_round_trip(tmp_path, uninterrupted, strategy, method):
    reference = uninterrupted(strategy, method)
    step2, step4 = (reference / "checkpoints" / f"step-00000{s}" for s in (2, 4))
    manifest = json.loads((step2 / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["strategy"], manifest["step"]) == (1 if strategy == "single" else 2, strategy, 2)

    resumed = tmp_path / "resumed"
    finetune(strategy, *METHODS[method], "--output-dir", str(resumed), "--resume", str(step2))
    expected = losses(reference)
    assert sorted(expected) == [1, 2, 3, 4] and len(set(expected.values())) == 4
    assert losses(resumed) == {3: expected[3], 4: expected[4]}  # bitwise

    ours = exported_tensors(step4, tmp_path / "export-reference")
    theirs = exported_tensors(resumed / "checkpoints" / "step-000004", tmp_path / "export-resumed")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # the export reproduces the model the run itself saved at the end
    base = reference / "base_model"
    trained = logits_of(reference, method, base)
    assert torch.equal(logits_of(tmp_path / "export-reference", method, base), trained)
    if method != "full":  # merged into the (dequantized, for QLoRA) base: W + BA vs Wx + B(Ax), rounding only
        export(step4, tmp_path / "merged", merge_lora=True)
        torch.testing.assert_close(logits_of(tmp_path / "merged", "full"), trained, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("strategy", ["fsdp2", "zero3"])
def test_sharded_checkpoints_split_the_model_between_ranks(uninterrupted, strategy):
    """No rank gathers the full model to save: each rank writes about half of the weights."""
    step2 = uninterrupted(strategy, "full") / "checkpoints" / "step-000002"
    files = {f["path"]: f["bytes"] for f in json.loads((step2 / "manifest.json").read_text())["files"]}
    pattern = "pytorch_model_fsdp_0/__{}_0.distcp" if strategy == "fsdp2" else "pytorch_model/zero_pp_rank_{}_mp_rank_00_optim_states.pt"
    rank0, rank1 = files[pattern.format(0)], files[pattern.format(1)]
    model_bytes = sum(t.numel() * 4 for t in load_file(uninterrupted(strategy, "full") / "model.safetensors").values())
    assert abs(rank0 - rank1) < 0.1 * rank0
    assert rank0 < 0.75 * model_bytes * (1 if strategy == "fsdp2" else 3)  # ZeRO-3 also holds 2 Adam moments


def test_resume_on_another_world_size_is_refused(tmp_path, uninterrupted):
    step2 = uninterrupted("ddp", "full") / "checkpoints" / "step-000002"
    result = subprocess.run([sys.executable, "-m", "finetune", *RUN, "--output-dir", str(tmp_path), "--resume", str(step2)],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "world_size: checkpoint 2, this run 1" in result.stderr and "strategy: checkpoint 'ddp', this run 'single'" in result.stderr


SLOW_SAVE = """
import os
if os.environ.get("RANK") == "1":
    import time
    from accelerate import Accelerator

    save_state = Accelerator.save_state

    def save_state_then_hang(self, output_dir=None, **kwargs):
        result = save_state(self, output_dir, **kwargs)
        if "step-000004" in str(output_dir):
            time.sleep(600)  # rank 1 is "still writing" step 4 when the test kills the job
        return result

    Accelerator.save_state = save_state_then_hang
"""


def test_kill_9_mid_save_then_resume_auto_completes_exactly(tmp_path, uninterrupted):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_SAVE)
    out = tmp_path / "run"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    job = subprocess.Popen(launch_command("ddp", "--output-dir", str(out)), cwd=REPO, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    staging = out / "checkpoints" / "step-000004.incomplete"
    deadline = time.monotonic() + 300
    while not (staging / "random_states_1.pkl").exists():  # every rank has written its files of step 4
        assert job.poll() is None and time.monotonic() < deadline, "the run ended before it was killed"
        time.sleep(0.2)
    kill_job(job, str(out))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004.incomplete"]

    result = finetune("ddp", "--output-dir", str(out), "--resume", "auto")
    assert "step-000002" in result.stdout + result.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    expected = losses(uninterrupted("ddp", "full"))
    assert losses(out) == expected  # steps 1-2 from before the kill, 3-4 after the resume: all bitwise


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
