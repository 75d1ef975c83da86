"""The Checkpointer: save (atomically), rotate, resume, preemption signals, RNG restore."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from collections import OrderedDict
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import DistributedType

from finetune.checkpointing.identity import identity_differences, resume_identity, strategy_name
from finetune.checkpointing.layout import (
    FORMAT_VERSION, HF_DIR, INCOMPLETE, MANIFEST, STEP_DIR, CheckpointError, checkpoints_dir, complete_checkpoints,
    find_checkpoint, incompleteness, read_manifest, step_dir_name,
)
from finetune.checkpointing.safety import unsafe_pickle_globals
from finetune.config import TrainConfig

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # Slurm sends these before killing a job
PACKAGES = ("finetune", "torch", "accelerate", "transformers", "peft", "bitsandbytes", "deepspeed", "safetensors")


class Checkpointer:
    """Saves, rotates and resumes `<output_dir>/checkpoints/step-N/` for one run.

    Every method that takes part in a save is called on all ranks at the same point of the loop.
    """

    def __init__(self, accelerator, config: TrainConfig, manifest_extra: dict | None = None, tokenizer=None):
        self.accelerator = accelerator
        self.config = config
        self.manifest_extra = manifest_extra or {}
        self.tokenizer = tokenizer
        self.directory = checkpoints_dir(config.output_dir)
        self.save_every = config.save_every
        self.keep_last = config.keep_last
        self.last_saved_step: int | None = None
        self.resumed_from: Path | None = None
        self.preempted = False
        self._signal_received: int | None = None
        self._rng_to_restore: dict | None = None
        self._previous_handlers = {sig: signal.signal(sig, self._on_signal) for sig in PREEMPTION_SIGNALS}
        # LoRA/QLoRA: only the trainable weights go into single-process/DDP checkpoints (FSDP and
        # DeepSpeed write their own sharded formats and never pass through this hook)
        accelerator.register_save_state_pre_hook(_keep_trainable_weights)

    # -- preemption

    def _on_signal(self, signum, frame) -> None:
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

    def save(self, progress) -> Path:
        """Write a complete checkpoint of the current state (see the module docstring); returns it."""
        accelerator = self.accelerator
        final = self.directory / step_dir_name(progress.step)
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
            _write_durably(staging / MANIFEST, json.dumps(manifest, indent=2) + "\n")
            _fsync_tree(staging)
            _publish(staging, final)
            self._rotate()
        accelerator.wait_for_everyone()
        self.last_saved_step = progress.step
        return final

    @property
    def _trainable_only(self) -> bool:
        """LoRA/QLoRA checkpoints hold only the trainable weights, except under FSDP, whose
        distributed checkpoint always holds the whole (sharded) model."""
        return self.config.method != "full" and self.accelerator.distributed_type != DistributedType.FSDP

    def _write_hf_files(self, directory: Path) -> None:
        model = self.accelerator.unwrap_model(self.accelerator._models[0])
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
        model = self.accelerator.unwrap_model(self.accelerator._models[0])
        if hasattr(model, "peft_config"):
            source = model.peft_config["default"].base_model_name_or_path
        else:
            source = getattr(model.config, "_name_or_path", None)
        return str(Path(source).resolve()) if source and Path(source).is_dir() else source or None

    def _manifest(self, progress, folder: Path) -> dict:
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        return {
            "format_version": FORMAT_VERSION,
            **progress.state_dict(),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "world_size": self.accelerator.num_processes,
            "strategy": strategy_name(self.accelerator),
            "model_weights": "trainable" if self._trainable_only else "all",
            "base_model": self._base_model(),
            "identity": resume_identity(self.config, self.accelerator),
            "config": self.config.to_dict(),
            "run": self.manifest_extra,
            "versions": _package_versions(),
            "files": [{"path": str(p.relative_to(folder)), "bytes": p.stat().st_size} for p in files],
        }

    def _rotate(self) -> None:
        """Remove incomplete leftovers, then all but the newest `keep_last` complete checkpoints.
        The newest complete checkpoint is never removed (keep_last ≥ 1, or 0 = keep all)."""
        for leftover in self.directory.iterdir():
            match = STEP_DIR.match(leftover.name)
            if leftover.name.endswith(INCOMPLETE) or (match and incompleteness(leftover)):
                _remove(leftover)
        if self.keep_last > 0:
            for old in complete_checkpoints(self.directory)[: -self.keep_last]:
                _remove(old)

    # -- resuming

    def resume(self) -> Path | None:
        """Load the checkpoint `config.resume` names ('auto': newest complete one in the output dir,
        or a fresh start if there is none; else a checkpoint or output dir path). Returns it, or None.

        Raises CheckpointError when the checkpoint does not match this run (listing every difference),
        holds unsafe pickles, or when a fresh run would mix its checkpoints with an earlier run's.
        """
        source = self._resume_source()
        if source is None:
            return None
        manifest = read_manifest(source)
        differences = identity_differences(manifest["identity"], resume_identity(self.config, self.accelerator))
        if differences:
            raise CheckpointError(
                f"Cannot resume from {source}: it was saved by a different run configuration:\n  - "
                + "\n  - ".join(differences)
                + "\nUse the checkpoint's settings (its manifest.json lists them), or start a new run in another "
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
        if resume is None:
            existing = complete_checkpoints(self.directory)
            if existing:
                raise CheckpointError(
                    f"{self.config.output_dir} already holds checkpoints of an earlier run (newest: {existing[-1].name}). "
                    "Continue it with --resume auto, or use another --output-dir."
                )
            return None
        if resume == "auto":
            candidates = complete_checkpoints(self.directory)
            return candidates[-1] if candidates else None
        return find_checkpoint(resume)

    def _load_kwargs(self, manifest: dict) -> dict:
        if manifest["model_weights"] != "trainable":
            return {}
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            return {"load_module_strict": False}
        return {"strict": False}  # the file holds only the adapters; `_check_trainable_weights` ran

    def _check_trainable_weights(self, source: Path) -> None:
        """An adapter-only weights file must hold exactly this model's trainable parameters."""
        from safetensors import safe_open

        for i, model in enumerate(self.accelerator._models):
            path = source / ("model.safetensors" if i == 0 else f"model_{i}.safetensors")
            if not path.is_file():
                continue
            with safe_open(str(path), "pt") as f:
                saved = set(f.keys())
            wanted = {name for name, p in model.named_parameters() if p.requires_grad}
            if saved != wanted:
                missing, extra = sorted(wanted - saved)[:3], sorted(saved - wanted)[:3]
                raise CheckpointError(
                    f"{path} does not hold this model's trainable weights (missing e.g. {missing}, unexpected e.g. {extra})."
                )

    def with_rng_restored(self, batches):
        """`batches`, with the checkpoint's RNG state put back once their iterator exists.

        Creating a DataLoader iterator draws from the global torch RNG, which the uninterrupted run
        did at the start of the epoch, before the state that was saved. Wrap the first iterable the
        loop consumes after `resume()`; every later call returns `batches` unchanged.
        """
        if self._rng_to_restore is None:
            return batches
        return self._restoring(batches)

    def _restoring(self, batches):
        iterator = iter(batches)
        end = object()
        first = next(iterator, end)  # DataLoader iterators are created lazily, on the first next()
        _set_rng_states(self._rng_to_restore)
        self._rng_to_restore = None
        if first is not end:
            yield first
            yield from iterator


# ---------------------------------------------------------------- helpers


def _keep_trainable_weights(models, weights, output_dir) -> None:
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


def _package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(folder: Path) -> None:
    """Flush every file and folder under `folder` to disk, so the rename below never publishes a
    checkpoint whose data is still only in the page cache."""
    for path in sorted(folder.rglob("*"), reverse=True) + [folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _publish(staging: Path, final: Path) -> None:
    """Rename `staging` to `final` atomically; an existing `final` is moved aside first."""
    if final.exists():
        final.rename(final.with_name(final.name + ".replaced" + INCOMPLETE))
    staging.rename(final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Delete a checkpoint folder: renamed to *.incomplete first, so a crash mid-delete never
    leaves something that looks complete."""
    doomed = path if path.name.endswith(INCOMPLETE) else path.with_name(path.name + ".deleting" + INCOMPLETE)
    if doomed != path:
        path.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)
