"""Crash-safe checkpoints and exact resume, the same for every strategy.

Layout under `<output_dir>/checkpoints/` (the names: config/run_folder.py):

    step-000200/               complete: Accelerate's state + hf/ (model config, tokenizer) + manifest.json
    step-000300.incomplete/    being written, or left by a crash; never resumed from, removed by rotation
    step-000400/               damaged, if it fails the manifest check: named by --resume auto, never removed

A save goes: every rank writes its part of `accelerator.save_state` into `step-N.incomplete/` (under
FSDP/ZeRO each rank writes only its shards) → all ranks done → the main process writes
`manifest.json` (step, resolved config, world size, versions, every file with its size), fsyncs,
renames the folder to `step-N/` → rotation. A checkpoint is complete exactly when its manifest
exists and every listed file has its listed size, so a save killed at any point leaves the previous
checkpoint as the newest complete one.

Resume loads through `accelerator.load_state`, after checking the manifest against this run and
checking that every pickle in the folder names only allowed types (Accelerate, DCP and DeepSpeed
unpickle some files with `weights_only=False`; see `unsafe_pickle_globals`).
"""

from finetune.checkpoint.checkpointer import Checkpointer
from finetune.checkpoint.identity import resume_identity
from finetune.checkpoint.layout import (
    CheckpointError,
    checkpoints_dir,
    complete_checkpoints,
    find_checkpoint,
    incompleteness,
    read_manifest,
    step_dir_name,
)
from finetune.checkpoint.safety import unsafe_pickle_globals

__all__ = [
    "CheckpointError", "Checkpointer", "checkpoints_dir", "complete_checkpoints",
    "find_checkpoint", "incompleteness", "read_manifest", "resume_identity", "step_dir_name",
    "unsafe_pickle_globals",
]
