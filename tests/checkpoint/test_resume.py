"""Exact resume in one process through the run's own setup() and fit(): its Accelerator, optimiser,
LR schedule, collator, loader, loop and Checkpointer.

A run stopped by SIGUSR1 at step k (the preemption path) and resumed with `--resume auto` must
reproduce the uninterrupted run's losses and final weights bitwise, with LoRA dropout on (so the
RNG state matters) and shuffled data over several epochs (so the data position matters), for a
stop in the middle of an epoch and one at an epoch boundary. A resume that changes --max-steps
(through the CLI, as a user's run) continues the LR schedule from the LR it stopped at.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO, preempt_after, reset_accelerate, tiny_model_dir, word_rows, write_jsonl

from finetune import cli
from finetune.config.options import TrainConfig
from finetune.config.run_folder import read_metrics
from finetune.train.optim import LRSchedule
from finetune.train.run import fit, resolve, setup

STEPS = 7  # 12 examples / (micro 2 × accumulation 2) = 3 updates per epoch: stops at 2 and 3, end in epoch 3


def train(output_dir, stop_at: int | None = None, resume: str | None = None) -> tuple[list[float], dict]:
    """One run of STEPS updates built by `train.setup` and run by `train.fit` (or until SIGUSR1 sent
    after update `stop_at`); returns the losses it logged and the final trainable weights."""
    reset_accelerate()
    rows = write_jsonl(output_dir.with_name(output_dir.name + "-rows.jsonl"), word_rows([6 + i % 5 for i in range(12)], seed=1))
    config = TrainConfig(model=str(tiny_model_dir(output_dir / "base_model")), dataset=str(rows), output_dir=str(output_dir),
                         method="lora", lora_dropout=0.1, micro_batch_size=2, gradient_accumulation_steps=2,
                         max_steps=STEPS, warmup_steps=2, log_every=1, save_every=100, resume=resume,
                         max_eval_examples=0, save_final=False)
    with setup(*resolve(config)) as session:
        if stop_at is not None:
            preempt_after(session.optimizer, stop_at)
        fit(session)
        assert session.progress.step == (stop_at or STEPS)
        weights = {n: p.detach().clone() for n, p in session.model.named_parameters() if p.requires_grad}
    losses = {r["step"]: r["loss"] for r in read_metrics(output_dir / "metrics.jsonl") if "loss" in r}
    return [losses[s] for s in sorted(losses)], weights


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    losses, weights = train(tmp_path_factory.mktemp("uninterrupted"))
    assert len(losses) == STEPS and len(set(losses)) == STEPS
    return losses, weights


@pytest.mark.parametrize("stop_at", [2, 3], ids=["mid-epoch", "epoch-boundary"])
def test_preempted_and_resumed_run_equals_uninterrupted_run(tmp_path, reference, stop_at):
    reference_losses, reference_weights = reference

    interrupted = tmp_path / "interrupted"
    first_losses, _ = train(interrupted, stop_at=stop_at)
    assert (interrupted / "checkpoints" / f"step-{stop_at:06d}" / "manifest.json").is_file()
    all_losses, weights = train(interrupted, resume="auto")
    assert first_losses == reference_losses[:stop_at]
    assert all_losses == reference_losses  # bitwise
    for name, value in weights.items():
        assert torch.equal(value, reference_weights[name]), name


def test_resume_with_more_steps_continues_the_lr_schedule_from_where_it_stopped(tmp_path, capsys):
    """4 updates saved at 2, resumed for 8: update 3 keeps the original schedule's LR, and the decay
    then runs smoothly down to the floor (0.1 × peak) at the new end."""
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"text": f"{i} plus {i % 5} is {i + i % 5}"} for i in range(24)])
    flags = ["--dataset", str(rows), "--micro-batch-size", "2", "--warmup-steps", "1", "--log-every", "1",
             "--max-eval-examples", "0", "--save-every", "2", "--no-save-final"]
    assert cli.main([*flags, "--max-steps", "4", "--output-dir", str(tmp_path / "first")]) == 0
    reset_accelerate()
    assert cli.main([*flags, "--max-steps", "8", "--output-dir", str(tmp_path / "longer"),
                     "--resume", str(tmp_path / "first" / "checkpoints" / "step-000002")]) == 0

    def lrs(output_dir) -> dict[int, float]:
        return {r["step"]: r["lr"] for r in read_metrics(output_dir / "metrics.jsonl")}

    original, longer = lrs(tmp_path / "first"), lrs(tmp_path / "longer")
    peak = original[2]  # the first update after 1 warmup update
    assert sorted(longer) == list(range(3, 9))
    assert longer[3] == original[3] < peak
    continued = LRSchedule(warmup_steps=1, max_steps=4, schedule="cosine", min_lr_ratio=0.1)
    continued.continue_to(8, step=2)
    for step, lr in longer.items():  # update k runs at the factor after k - 1 updates
        assert lr == pytest.approx(peak * continued(step - 1), rel=1e-12), step
    assert continued(8) == pytest.approx(0.1) and all(a > b for a, b in zip(list(longer.values()), list(longer.values())[1:]))
    assert "LR schedule: --max-steps 4 → 8; from step 2 (lr " in capsys.readouterr().out


def test_resume_messages_say_what_the_run_will_do(tmp_path):
    """Resumed inside a warmup longer than the run, the LR keeps rising and the log says so (not
    "the decay continues"); a checkpoint past --max-steps is an error, not an exit 0 "continuing"."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"{i} plus {i % 5} is {i + i % 5}"}) + "\n" for i in range(24)))
    flags = ["--dataset", str(rows), "--micro-batch-size", "2", "--warmup-steps", "8", "--log-every", "1",
             "--max-eval-examples", "0", "--save-every", "2", "--no-save-final"]

    def finetune(output_dir: str, *more: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "finetune", *flags, "--output-dir", str(tmp_path / output_dir), *more],
                              capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})

    assert finetune("first", "--max-steps", "16").returncode == 0  # 8 warmup updates of 16
    checkpoint = str(tmp_path / "first" / "checkpoints" / "step-000004")
    resumed = finetune("resumed", "--max-steps", "7", "--resume", checkpoint)
    assert resumed.returncode == 0, resumed.stderr
    assert "decay" not in resumed.stdout.replace("before any decay", "")
    assert "warmup continues from step 4" in resumed.stdout and "the run ends at step 7, inside the 8-step warmup" in resumed.stdout
    lrs = [r["lr"] for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl") if "lr" in r]
    assert len(lrs) == 3 and lrs == sorted(lrs) and len(set(lrs)) == 3  # still rising
    past = finetune("past", "--max-steps", "3", "--resume", checkpoint)
    assert past.returncode == 2 and "Traceback" not in past.stderr
    assert "Nothing is left to train: the checkpoint is at step 4, past --max-steps 3" in past.stderr
