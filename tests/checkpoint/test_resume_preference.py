"""Exact resume of preference runs in one process, through setup() and fit() as a user's run: stopped by
SIGUSR1 mid-epoch and resumed with `--resume auto`, a DPO run (LoRA with dropout, so the RNG matters;
its reference the base with adapters off), a DPO run of full fine-tuning (its reference precomputed
before the checkpoint loads) and a KTO run (its KL estimate per window) reproduce the uninterrupted
run's losses and trained weights bitwise."""

from __future__ import annotations

import pytest
import torch
from helpers import preempt_after, reset_accelerate, tiny_model_dir, write_jsonl

from finetune.config.options import TrainConfig
from finetune.config.run_folder import read_metrics
from finetune.train.run import fit, resolve, setup

STEPS = 5  # 12 pairs / (micro 2 × accumulation 2) = 3 updates per epoch: a stop at 2 is mid-epoch
PAIRS = [{"prompt": " ".join(f"w{(i * k) % 60 + 1}" for k in range(1, 3 + i % 3)), "chosen": f"w{i + 2} w{i + 40}",
          "rejected": f"w{i + 20}"} for i in range(14)]
RUNS = {"dpo-lora": {"method": "lora", "lora_dropout": 0.1}, "dpo-full-precomputed": {"method": "full"},
        "kto-lora": {"method": "lora", "objective": "kto", "lora_dropout": 0.1}}


def train(output_dir, flags: dict, stop_at: int | None = None, resume: str | None = None) -> tuple[list[float], dict]:
    reset_accelerate()
    rows = write_jsonl(output_dir.with_name(output_dir.name + "-pairs.jsonl"), PAIRS)
    config = TrainConfig(**{"model": str(tiny_model_dir(output_dir.parent / "base")), "dataset": str(rows),
                            "output_dir": str(output_dir), "objective": "dpo", "micro_batch_size": 2,
                            "gradient_accumulation_steps": 2, "max_steps": STEPS, "warmup_steps": 2, "log_every": 1,
                            "save_every": 100, "resume": resume, "eval_split": "0.1", "save_final": False, "lora_r": 4} | flags)
    with setup(*resolve(config)) as session:
        if stop_at is not None:
            preempt_after(session.optimizer, stop_at)
        fit(session)
        weights = {n: p.detach().clone() for n, p in session.model.named_parameters() if p.requires_grad}
    losses = {r["step"]: r["loss"] for r in read_metrics(output_dir / "metrics.jsonl") if "loss" in r}
    return [losses[s] for s in sorted(losses)], weights


@pytest.mark.parametrize("name", RUNS)
def test_a_preempted_preference_run_resumes_bitwise(tmp_path, name):
    expected_losses, expected_weights = train(tmp_path / "uninterrupted", RUNS[name])
    assert len(expected_losses) == STEPS and len(set(expected_losses)) == STEPS
    first, _ = train(tmp_path / "interrupted", RUNS[name], stop_at=2)
    losses, weights = train(tmp_path / "interrupted", RUNS[name], resume="auto")
    assert first == expected_losses[:2] and losses == expected_losses
    for key, value in weights.items():
        assert torch.equal(value, expected_weights[key]), key
