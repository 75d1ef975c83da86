"""What must match between a checkpoint and the run resuming it."""

from __future__ import annotations

from accelerate.utils import DistributedType

from finetune.config import TrainConfig, resolve_batch_shape, scaled_lr

# Flags a resumed run may change: they say how long to go on and what to report, not what the saved
# state means. Every other flag must match the checkpoint (a changed --lr, say, would be silently
# overwritten by the restored scheduler state).
CHANGEABLE_ON_RESUME = frozenset({
    "max_steps", "epochs", "output_dir", "log_every", "eval_every", "max_eval_examples", "report_to",
    "num_samples", "save_final", "save_every", "keep_last", "resume", "gradient_checkpointing",
    "trust_remote_code", "preflight_timeout",
    "deepspeed",  # a path; the ZeRO stage it selects is compared as `strategy`
})
# Compared in their resolved form (see `resume_identity`), so `--global-batch-size 16` and
# `--gradient-accumulation-steps 2` that resolve to the same shape are the same run, and so are an
# unset --lr and the model's default written out.
RESOLVED_FIELDS = frozenset({"global_batch_size", "gradient_accumulation_steps", "mixed_precision", "lr",
                             "lr_scaling", "base_global_batch_size"})


def strategy_name(accelerator) -> str:
    """single | ddp | fsdp2 | zero2 | ...: what decides the on-disk format of model and optimizer state."""
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return f"zero{accelerator.state.deepspeed_plugin.zero_stage}"
    if kind == DistributedType.FSDP:
        return f"fsdp{accelerator.state.fsdp_plugin.fsdp_version}"
    return "single" if accelerator.num_processes == 1 else "ddp"


def resume_identity(config: TrainConfig, accelerator) -> dict:
    """What must be equal between a checkpoint and the run resuming it: every flag not in
    CHANGEABLE_ON_RESUME, with the batch shape, peak LR, precision and strategy in their resolved form.

    The world size is part of it: each rank's data position, RNG state and (for ZeRO) optimizer
    partition are saved per rank, so resuming on another number of processes is refused.
    """
    identity = {k: v for k, v in config.to_dict().items() if k not in CHANGEABLE_ON_RESUME | RESOLVED_FIELDS}
    batch = resolve_batch_shape(config, accelerator.num_processes)
    identity.update(
        world_size=batch.world_size,
        gradient_accumulation_steps=batch.gradient_accumulation_steps,
        global_batch_size=batch.global_batch_size,
        peak_lr=scaled_lr(config, batch.global_batch_size),
        mixed_precision=accelerator.mixed_precision,
        strategy=strategy_name(accelerator),
    )
    return identity


def identity_differences(saved: dict, current: dict) -> list[str]:
    """Human-readable differences; keys the checkpoint predates are ignored."""
    return [
        f"{key}: checkpoint {saved[key]!r}, this run {current.get(key)!r}"
        for key in saved
        if saved[key] != current.get(key)
    ]
