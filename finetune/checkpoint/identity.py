"""What must match between a checkpoint and the run resuming it."""

from __future__ import annotations

import sys
from importlib import metadata

from finetune.config.resolve import ResolvedRun

# the stack a run depends on: equal on every rank (preflight), recorded in every checkpoint manifest
PACKAGES = ("torch", "accelerate", "transformers", "peft", "datasets", "bitsandbytes", "deepspeed", "safetensors", "finetune")

# Flags a resumed run may change: they say how long to go on and what to report, not what the saved
# state means. Every other flag must match the checkpoint (a changed --lr, say, would be silently
# overwritten by the restored scheduler state).
CHANGEABLE_ON_RESUME = frozenset({
    "max_steps", "epochs", "output_dir", "log_every", "eval_every", "max_eval_examples", "eval_generate", "report_to",
    "num_samples", "save_final", "save_every", "keep_last", "resume", "gradient_checkpointing",
    "gradient_checkpointing_layers",
    "trust_remote_code", "preflight_timeout", "gpu", "fit_check", "allow_cpu", "verbose",
    "deepspeed",  # a path; the ZeRO stage it selects is compared as `strategy`
})
# Compared in their resolved form (see `resume_identity`), so `--global-batch-size 16` and
# `--gradient-accumulation-steps 2` that resolve to the same shape are the same run, and so are an
# unset --lr and the model's default written out.
RESOLVED_FIELDS = frozenset({"global_batch_size", "gradient_accumulation_steps", "precision", "lr",
                             "lr_scaling", "base_global_batch_size"})


def resume_identity(run: ResolvedRun) -> dict:
    """What must be equal between a checkpoint and the run resuming it: every flag not in
    CHANGEABLE_ON_RESUME, with the batch shape, peak LR, precision and strategy in their resolved form.

    The world size is part of it: each rank's data position, RNG state and (for ZeRO) optimizer
    partition are saved per rank, so resuming on another number of processes is refused.
    """
    identity = {k: v for k, v in run.config.to_dict().items() if k not in CHANGEABLE_ON_RESUME | RESOLVED_FIELDS}
    identity.update(
        world_size=run.batch.world_size,
        gradient_accumulation_steps=run.batch.gradient_accumulation_steps,
        global_batch_size=run.batch.global_batch_size,
        peak_lr=run.peak_lr,
        precision=run.precision.name,
        strategy=run.strategy.name,
    )
    return identity


def identity_differences(saved: dict, current: dict) -> list[str]:
    """Human-readable differences; keys the checkpoint predates are ignored."""
    return [
        f"{key}: checkpoint {saved[key]!r}, this run {current.get(key)!r}"
        for key in saved
        if saved[key] != current.get(key)
    ]


def package_versions() -> dict[str, str]:
    """Python, CUDA and PACKAGES' versions: a resume or a rank on another stack is told apart by them."""
    import torch

    versions = {"python": sys.version.split()[0], "cuda": str(torch.version.cuda)}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions
