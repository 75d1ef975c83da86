"""The Checkpointer: save (atomically), rotate, resume, preemption signals, RNG restore."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import numpy as np
import torch
from accelerate.utils import DistributedType

from finetune.checkpoint.identity import identity_differences, package_versions, resume_identity
from finetune.checkpoint.layout import (
    FORMAT_VERSION,
    INCOMPLETE,
    CheckpointError,
    checkpoints_dir,
    complete_checkpoints,
    find_checkpoint,
    incompleteness,
    read_manifest,
    step_dir_name,
    step_of,
    take_inventory,
)
from finetune.checkpoint.safety import unsafe_pickle_globals
from finetune.config.resolve import ResolvedRun
from finetune.config.run_folder import HF_DIR, MANIFEST, RESOLVED, ResolvedRecord

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedTokenizerBase

    from finetune.checkpoint.progress import Progress

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # Slurm sends these before killing a job


class Checkpointer:
    """Saves, rotates and resumes `<output_dir>/checkpoints/step-N/` for one run.

    Every method that takes part in a save is called on all ranks at the same point of the loop.
    """

    def __init__(self, accelerator: Accelerator, run: ResolvedRun, model: torch.nn.Module,
                 resolved: ResolvedRecord | None = None, tokenizer: PreTrainedTokenizerBase | None = None):
        self.accelerator = accelerator
        self.run = run
        self.model = model  # as prepared; save_state/load_state reach it through the accelerator
        self.config = config = run.config
        self.resolved = resolved or ResolvedRecord()  # what the flags resolved to, in every manifest
        self.tokenizer = tokenizer
        self.directory = checkpoints_dir(config.output_dir)
        self.save_every = config.save_every
        self.keep_last = config.keep_last
        self.last_saved_step: int | None = None
        self.resumed_from: Path | None = None
        self.preempted = False
        self._signal_received: int | None = None
        self._rng_to_restore: dict | None = None
        # Python installs signal handlers only from the main thread; Ray Train runs the loop in a worker
        # thread, where a preemption is Ray's to handle (its FailureConfig resumes at the newest checkpoint)
        self._previous_handlers = ({sig: signal.signal(sig, self._on_signal) for sig in PREEMPTION_SIGNALS}
                                   if threading.current_thread() is threading.main_thread() else {})
        # LoRA/QLoRA: only the trainable weights go into single-process/DDP checkpoints (FSDP and
        # DeepSpeed write their own sharded formats and never pass through this hook)
        accelerator.register_save_state_pre_hook(_keep_trainable_weights)

    # -- preemption

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal_received = signum

    def close(self) -> None:
        """Give the preemption signals back to their previous handlers."""
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)

    def should_save(self, step: int) -> bool:
        """True every `save_every` updates, and on every rank once any rank got SIGTERM/SIGUSR1
        (which also sets `self.preempted`). A collective: call it on all ranks after each update."""
        received = self._signal_received is not None
        if self.accelerator.num_processes > 1:
            flag = torch.tensor([int(received)], device=self.accelerator.device)
            received = bool(self.accelerator.gather(flag).max().item())
        self.preempted = received
        return received or (self.save_every > 0 and step % self.save_every == 0)

    def preemption_message(self) -> str:
        return (
            f"Stopped early on a preemption signal after saving {self.directory / step_dir_name(self.last_saved_step)}. "
            f"Resume by rerunning the same command with --resume auto."
        )

    # -- saving

    def save(self, progress: Progress) -> Path:
        """Write a complete checkpoint of the current state (see the module docstring); returns it.

        Raises CheckpointError when writing fails on this rank (a full disk, a lost mount): the
        checkpoints already there are untouched, and the message says which one a resume would use.
        """
        final = self.directory / step_dir_name(progress.step)
        try:
            self._write(progress, final)
        except OSError as e:
            newest = complete_checkpoints(self.directory)
            raise CheckpointError(
                f"Saving {final} failed on rank {self.accelerator.process_index}: {e}. "
                + (f"The newest complete checkpoint is still {newest[-1].name}" if newest else "No checkpoint is complete yet")
                + "; free space (or fix the filesystem), then rerun the same command with --resume auto."
            ) from e
        self.last_saved_step = progress.step
        return final

    def _write(self, progress: Progress, final: Path) -> None:
        """Every rank's part into `final`.incomplete, then (main process) manifest, publish, rotate."""
        accelerator = self.accelerator
        staging = final.with_name(final.name + INCOMPLETE)
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)  # a crashed attempt at this same step
            staging.mkdir(parents=True)
        accelerator.wait_for_everyone()
        deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        kwargs = {"exclude_frozen_parameters": True} if deepspeed and self._trainable_only else {}
        accelerator.save_state(str(staging), **kwargs)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            self._write_hf_files(staging / HF_DIR)
            manifest = self._manifest(progress, staging)
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            _fsync_tree(staging)
            kept = _publish(staging, final)
            if kept is not None:
                accelerator.print(f"{final.name} already existed but was damaged; kept it as {kept.name}")
            self._rotate()
        accelerator.wait_for_everyone()

    @property
    def _trainable_only(self) -> bool:
        """LoRA/QLoRA checkpoints hold only the trainable weights, except under FSDP, whose
        distributed checkpoint always holds the whole (sharded) model."""
        return self.config.method != "full" and self.accelerator.distributed_type != DistributedType.FSDP

    def _write_hf_files(self, directory: Path) -> None:
        model = self.accelerator.unwrap_model(self.model)
        directory.mkdir()
        if hasattr(model, "peft_config"):
            model.peft_config["default"].save_pretrained(directory)
            model = model.get_base_model()
        model.config.save_pretrained(directory)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(directory)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)

    def _base_model(self) -> str | None:
        """Where the pretrained weights came from (absolute if local): LoRA export merges into them."""
        model = self.accelerator.unwrap_model(self.model)
        if hasattr(model, "peft_config"):
            source = model.peft_config["default"].base_model_name_or_path
        else:
            source = getattr(model.config, "_name_or_path", None)
        return str(Path(source).resolve()) if source and Path(source).is_dir() else source or None

    def _manifest(self, progress: Progress, folder: Path) -> dict:
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        return {
            "format_version": FORMAT_VERSION,
            **progress.state_dict(),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "world_size": self.accelerator.num_processes,
            "strategy": self.run.strategy.name,
            "model_weights": "trainable" if self._trainable_only else "all",
            "base_model": self._base_model(),
            "identity": resume_identity(self.run),
            "config": self.config.to_dict(),
            RESOLVED: self.resolved.to_dict(),
            "versions": package_versions(),
            "files": [{"path": str(p.relative_to(folder)), "bytes": p.stat().st_size} for p in files],
        }

    def _rotate(self) -> None:
        """Remove unfinished saves, then all but the newest `keep_last` complete checkpoints. The
        newest complete checkpoint is never removed (keep_last ≥ 1, or 0 = keep all), nor is a
        damaged one: it may be the only copy of its work, so only the user deletes it."""
        found = take_inventory(self.directory)
        for leftover in found.unfinished:
            _remove(leftover)
        if self.keep_last > 0:
            for old in found.complete[: -self.keep_last]:
                _remove(old)

    # -- resuming

    def resume(self) -> Path | None:
        """Load the checkpoint `config.resume` names ('auto': newest complete one in the output dir,
        or a fresh start if there is no checkpoint at all; else a checkpoint or output dir path).
        Returns it, or None. 'auto' names every damaged or unfinished checkpoint it passes over.

        Raises CheckpointError when the checkpoint does not match this run (listing every difference),
        holds unsafe pickles, when 'auto' finds checkpoints but none complete, or when a fresh run
        would mix its checkpoints with an earlier run's.
        """
        source = self._resume_source()
        if source is None:
            return None
        manifest = read_manifest(source)
        differences = identity_differences(manifest["identity"], resume_identity(self.run))
        if differences:
            raise CheckpointError(
                f"Cannot resume from {source}: it was saved by a different run configuration:\n  - "
                + "\n  - ".join(differences)
                + f"\nUse the checkpoint's settings (its {MANIFEST} lists them), or start a new run in another "
                "--output-dir. To continue from its weights with other settings, `finetune export` it and pass "
                "the exported folder as --model."
            )
        unsafe = unsafe_pickle_globals(source)
        if unsafe:
            listing = "; ".join(f"{file}: {', '.join(names)}" for file, names in unsafe.items())
            raise CheckpointError(f"Refusing to load {source}: its pickles name types that are not plain data ({listing}).")
        if manifest["model_weights"] == "trainable":
            self._check_trainable_weights(source)
        self.accelerator.load_state(str(source), **self._load_kwargs(manifest))
        # load_state sets the RNGs too but only logs a failure; read them here so one surfaces
        self._rng_to_restore = _read_rng_states(source, self.accelerator.process_index)
        _set_rng_states(self._rng_to_restore)
        self.last_saved_step = manifest["step"]
        self.resumed_from = source
        return source

    def _resume_source(self) -> Path | None:
        resume = self.config.resume
        if resume not in (None, "auto"):
            return find_checkpoint(resume)
        found = take_inventory(self.directory)
        if resume is None:
            existing = sorted(found.complete + [path for path, _ in found.damaged], key=step_of)
            if existing:
                raise CheckpointError(
                    f"{self.config.output_dir} already holds checkpoints of an earlier run (newest: {existing[-1].name}). "
                    "Continue it with --resume auto, or use another --output-dir."
                )
            return None
        say = self.accelerator.print
        for path in found.unfinished:
            say(f"ignoring {path.name}: a save that never finished (the run stopped while writing it)")
        for path, problem in found.damaged:
            say(f"checkpoint {path.name} is damaged, not resuming from it: {problem}")
        if found.complete:
            newest = found.complete[-1]
            if found.damaged and step_of(found.damaged[-1][0]) > step_of(newest):
                say(f"resuming from {newest.name}, the newest complete checkpoint; the damaged ones stay as they are")
            return newest
        if found.damaged:
            raise CheckpointError(none_complete_message(self.directory, found.damaged))
        return None

    def _load_kwargs(self, manifest: dict) -> dict:
        if manifest["model_weights"] != "trainable":
            return {}
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            return {"load_module_strict": False}
        return {"strict": False}  # the file holds only the adapters; `_check_trainable_weights` ran

    def _check_trainable_weights(self, source: Path) -> None:
        """An adapter-only weights file must hold exactly this model's trainable parameters."""
        from safetensors import safe_open

        path = source / "model.safetensors"
        if not path.is_file():
            return
        with safe_open(str(path), "pt") as f:  # DDP's `module.` prefix or none: the unwrapped model's names
            saved = {key.removeprefix("module.") for key in f.keys()}
        model = self.accelerator.unwrap_model(self.model)
        wanted = {name for name, p in model.named_parameters() if p.requires_grad}
        if saved != wanted:
            missing, extra = sorted(wanted - saved)[:3], sorted(saved - wanted)[:3]
            raise CheckpointError(
                f"{path} does not hold this model's trainable weights (missing e.g. {missing}, unexpected e.g. {extra})."
            )

    def with_rng_restored(self, batches: Iterable) -> Iterable:
        """`batches`, with the checkpoint's RNG state put back once their iterator exists.

        Creating a DataLoader iterator draws from the global torch RNG, which the uninterrupted run
        did at the start of the epoch, before the state that was saved. Wrap the first iterable the
        loop consumes after `resume()`; every later call returns `batches` unchanged.
        """
        if self._rng_to_restore is None:
            return batches
        return self._restoring(batches)

    def _restoring(self, batches: Iterable) -> Iterator:
        iterator = iter(batches)
        end = object()
        first = next(iterator, end)  # DataLoader iterators are created lazily, on the first next()
        _set_rng_states(self._rng_to_restore)
        self._rng_to_restore = None
        if first is not end:
            yield first
            yield from iterator


# ---------------------------------------------------------------- helpers


def none_complete_message(directory: Path, damaged: list[tuple[Path, str]]) -> str:
    listing = "\n".join(f"  - {path.name}: {problem}" for path, problem in damaged)
    return (
        f"--resume auto: {directory} holds checkpoints, but none is complete:\n{listing}\n"
        "Nothing was changed, and the run did not start from scratch over them. Choose one:\n"
        f"  - fix: put back the files that differ from each folder's {MANIFEST} (from a backup or copy), then rerun;\n"
        f"  - delete: `rm -r {' '.join(str(path) for path, _ in damaged)}`, then rerun (it starts from step 0);\n"
        "  - start over explicitly in another --output-dir, leaving these folders as they are."
    )


def _keep_trainable_weights(models: list[torch.nn.Module], weights: list[dict], output_dir: str) -> None:
    """Save-state hook: drop frozen parameters (the base model under LoRA) from each state dict."""
    for i, (model, state) in enumerate(zip(models, weights)):
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        if len(trainable) < sum(1 for _ in model.parameters()):
            weights[i] = OrderedDict((k, v) for k, v in state.items() if k in trainable)


def _read_rng_states(checkpoint: Path, rank: int) -> dict:
    from accelerate.utils import load  # torch.load(weights_only=True) that also admits NumPy RNG arrays

    path = checkpoint / f"random_states_{rank}.pkl"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint has no RNG state for rank {rank}.")
    return load(path)


def _set_rng_states(states: dict) -> None:
    """Python, NumPy and torch (CPU and CUDA) RNGs as Accelerate saved them for one rank."""
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


def _fsync_tree(folder: Path) -> None:
    """Flush every file and folder under `folder` (the manifest included) to disk, so the rename
    below never publishes a checkpoint whose data is still only in the page cache."""
    for path in sorted(folder.rglob("*"), reverse=True) + [folder]:
        _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(staging: Path, final: Path) -> Path | None:
    """Rename `staging` to `final` atomically. An existing `final` is moved aside first: if complete,
    to `*.replaced.incomplete` (rotation removes it); if damaged, to `*.damaged-<time>`, which nothing
    removes (it may hold the only copy of some work). Returns where a damaged one went, else None."""
    kept = None
    if final.exists():
        if incompleteness(final) is None:
            final.rename(final.with_name(final.name + ".replaced" + INCOMPLETE))
        else:
            kept = final.with_name(f"{final.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
            final.rename(kept)
    staging.rename(final)
    _fsync(final.parent)  # the rename itself
    return kept


def _remove(path: Path) -> None:
    """Delete a checkpoint folder: renamed to *.incomplete first, so a crash mid-delete never
    leaves something that looks complete."""
    doomed = path if path.name.endswith(INCOMPLETE) else path.with_name(path.name + ".deleting" + INCOMPLETE)
    if doomed != path:
        path.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)
