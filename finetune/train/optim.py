"""Optimizer and learning-rate schedule.

The schedule is a LambdaLR that the loop steps exactly once per optimizer update. It is never
passed to `accelerator.prepare`: Accelerate's prepared scheduler steps `num_processes` times per
update under DDP/FSDP but once under DeepSpeed, which would make the LR depend on the strategy.

The LambdaLR's function is an `LRSchedule` object, not a lambda: LambdaLR saves the attributes of
callable objects with its state, so a checkpoint carries the schedule it was trained under and a
resume restores it before `continue_schedule` adapts it to a new `--max-steps`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from finetune.config.options import TrainConfig
from finetune.errors import FinetuneError


@dataclass
class LRSchedule:
    """Factor on the peak LR for the update that follows `step` completed updates.

    Linear warmup from 1/(warmup+1) to 1 over `warmup_steps` updates, then cosine or linear decay
    to `min_lr_ratio` at `max_steps`, or constant. The decay runs along `decay_done(step)`, the
    fraction of the curve behind: 0 at `anchor_step` plus `anchor_done`, 1 at `max_steps`. A fresh
    schedule anchors at the end of warmup with nothing done; `continue_to` re-anchors at a resume.
    """

    warmup_steps: int
    max_steps: int
    schedule: str  # cosine | linear | constant
    min_lr_ratio: float
    anchor_step: int | None = None  # None: the end of warmup
    anchor_done: float = 0.0

    def __post_init__(self) -> None:
        if self.anchor_step is None:
            self.anchor_step = self.warmup_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.schedule == "constant":
            return 1.0
        done = self.decay_done(step)
        shape = 0.5 * (1.0 + math.cos(math.pi * done)) if self.schedule == "cosine" else 1.0 - done
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape

    def decay_done(self, step: int) -> float:
        remaining_steps = max(1, self.max_steps - self.anchor_step)
        return min(1.0, self.anchor_done + (1.0 - self.anchor_done) * max(0, step - self.anchor_step) / remaining_steps)

    def continue_to(self, max_steps: int, step: int) -> None:
        """End the decay at `max_steps` instead, going on smoothly from `step`: the factor at `step`
        stays what it was, and the rest of the curve is stretched (or squeezed) over the updates left.
        Warmup is kept; a schedule that already reached its floor stays there."""
        if step > self.warmup_steps:
            self.anchor_done, self.anchor_step = self.decay_done(step), step
        self.max_steps = max_steps


def lr_multiplier(step: int, *, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """The factor of a fresh schedule (see `LRSchedule`)."""
    return LRSchedule(warmup_steps, max_steps, schedule, min_lr_ratio)(step)


def build_optimizer(config: TrainConfig, model: torch.nn.Module, lr: float, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (betas, eps and weight decay from the config, where a
    DeepSpeed JSON's optimizer section may have put them); 8-bit variants come from bitsandbytes.
    `fused`: torch's one-kernel AdamW, where config.switches.fused_adamw says the run has it (on a
    GPU: no foreach temporaries at the step); else torch's default for the parameters' device."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise FinetuneError("The model has no trainable parameters; check --method and --lora-targets.")
    kwargs = {"lr": lr, "weight_decay": config.weight_decay, "betas": (config.adam_beta1, config.adam_beta2),
              "eps": config.adam_epsilon}
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, **kwargs, fused=fused or None)
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise FinetuneError(f"--optimizer {config.optimizer} needs bitsandbytes: pip install bitsandbytes") from e
    optimizer_class = bnb.optim.AdamW8bit if config.optimizer == "adamw-8bit" else bnb.optim.PagedAdamW8bit
    return optimizer_class(params, **kwargs)


def build_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + decay as a LambdaLR; step it once per optimizer update."""
    warmup = min(config.warmup_steps, max_steps // 2)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, LRSchedule(warmup, max_steps, config.lr_schedule, config.min_lr_ratio))


def continue_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, max_steps: int, step: int) -> str | None:
    """After a resume at `step`, make the restored schedule end at this run's `max_steps` (see
    `LRSchedule.continue_to`); returns what the rest of the run will do, for the log, or None if
    nothing changed.

    Raises FinetuneError when the checkpoint is already past `max_steps`: training would do nothing,
    and exiting 0 would read as a finished run of the length asked for.
    """
    if step > max_steps:
        raise FinetuneError(
            f"Nothing is left to train: the checkpoint is at step {step}, past --max-steps {max_steps}. "
            f"Raise --max-steps to train on, or pass another --output-dir to start over."
        )
    if step == max_steps:
        return f"nothing is left to train: the checkpoint is at step {step} = --max-steps"
    schedule = scheduler.lr_lambdas[0]
    if schedule.max_steps == max_steps:
        return None
    before = schedule.max_steps
    schedule.continue_to(max_steps, step)
    return f"LR schedule: --max-steps {before} → {max_steps}; " + _rest_of_schedule(schedule, scheduler, step)


def _rest_of_schedule(schedule: LRSchedule, scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> str:
    """What the LR does from `step` to `schedule.max_steps`, in the order it does it."""
    lr, peak, end = scheduler.get_last_lr()[0], scheduler.base_lrs[0], schedule.max_steps
    decay = ("the LR stays at peak" if schedule.schedule == "constant" else
             f"the {schedule.schedule} decay goes on to {schedule.min_lr_ratio:g} × peak at step {end}")
    if step >= schedule.warmup_steps:
        return f"from step {step} (lr {lr:.3e}, unchanged) {decay}"
    warmup = f"warmup continues from step {step} (lr {lr:.3e}, still rising)"
    if end <= schedule.warmup_steps:
        return (f"{warmup}; the run ends at step {end}, inside the {schedule.warmup_steps}-step warmup, "
                f"at lr {peak * schedule(end - 1):.3e}, before any decay")
    return f"{warmup} to the peak {peak:.3e} at step {schedule.warmup_steps}; then {decay}"
