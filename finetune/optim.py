"""Optimizer and learning-rate schedule.

The schedule is a plain LambdaLR that the loop steps exactly once per optimizer update. It is never
passed to `accelerator.prepare`: Accelerate's prepared scheduler steps `num_processes` times per
update under DDP/FSDP but once under DeepSpeed, which would make the LR depend on the strategy.
"""

from __future__ import annotations

import math

import torch

from finetune.config import TrainConfig
from finetune.errors import FinetuneError


def lr_multiplier(step: int, *, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Factor on the peak LR for the update that follows `step` completed updates.

    Linear warmup from 1/(warmup+1) to 1 over `warmup_steps` updates, then cosine or linear decay
    to `min_lr_ratio` at `max_steps`, or constant.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_optimizer(config: TrainConfig, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; 8-bit variants come from bitsandbytes."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise FinetuneError("The model has no trainable parameters; check --method and --lora-targets.")
    kwargs = {"lr": lr, "weight_decay": config.weight_decay, "betas": (0.9, 0.95)}
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, **kwargs)
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise FinetuneError(f"--optimizer {config.optimizer} needs bitsandbytes: pip install bitsandbytes") from e
    optimizer_class = bnb.optim.AdamW8bit if config.optimizer == "adamw-8bit" else bnb.optim.PagedAdamW8bit
    return optimizer_class(params, **kwargs)


def build_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + decay as a LambdaLR; step it once per optimizer update."""
    warmup = min(config.warmup_steps, max_steps // 2)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(step, warmup_steps=warmup, max_steps=max_steps,
                                   schedule=config.lr_schedule, min_lr_ratio=config.min_lr_ratio),
    )
