"""What an export reads: a complete training checkpoint, or the final model a finished run saved in its
output dir (safetensors beside run.yaml), whichever is newer; found, described (`Trained`), and
read through the checkpoint's own `Weights` reader (checkpoint/weights.py). The run's folder is read
through config/run_folder.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from finetune.checkpoint.layout import (
    STEP_DIR,
    CheckpointError,
    checkpoints_dir,
    complete_checkpoints,
    find_checkpoint,
    read_manifest,
)
from finetune.checkpoint.weights import SafetensorsWeights, Weights, open_weights
from finetune.config.run_folder import HF_DIR, MANIFEST, RUN_FILES, RUN_YAML, RunFolder

ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class Trained:
    """What an export reads: a complete checkpoint, or the final model a finished run saved in its
    output dir (safetensors beside run.yaml)."""

    path: Path
    method: str  # full, lora or qlora
    base_model: str | None  # the pretrained weights LoRA adapters merge into
    precision: str  # the run's --precision; QLoRA's 4-bit base computed in its compute dtype
    hf_files: tuple[Path, ...]  # model config, generation config, tokenizer, adapter config
    weight_files: tuple[Path, ...] = ()  # the final model's safetensors; empty for a checkpoint

    @property
    def is_checkpoint(self) -> bool:
        return not self.weight_files

    def weights(self) -> Weights:
        return open_weights(self.path) if self.is_checkpoint else SafetensorsWeights(list(self.weight_files))

    def hf_config(self) -> dict:
        """The model's config.json (none beside a LoRA run's final adapter)."""
        config = next((p for p in self.hf_files if p.name == "config.json"), None)
        return json.loads(config.read_text()) if config is not None else {}


def find_trained(source: str | Path) -> Trained:
    """The checkpoint folder `source`; for an output dir, its final model unless a complete checkpoint
    is newer (a run preempted after resuming), else its newest complete checkpoint.

    Raises CheckpointError for an incomplete checkpoint, or a folder holding neither.
    """
    path = Path(source)
    final = _final_model(path)
    checkpoints = complete_checkpoints(checkpoints_dir(path))
    if final is not None and (not checkpoints or _final_step(path) >= read_manifest(checkpoints[-1])["step"]):
        return final
    if final is None and not checkpoints and not (path / MANIFEST).exists() and not STEP_DIR.match(path.name):
        raise CheckpointError(
            f"Nothing to export in {path}: no complete checkpoint ({checkpoints_dir(path)}/step-NNNNNN/{MANIFEST}) "
            f"and no final model (model.safetensors or adapter_model.safetensors beside {RUN_YAML}, as a finished "
            "run saves them). Pass a run's output dir or one of its checkpoint folders."
        )
    checkpoint = find_checkpoint(path)
    manifest = read_manifest(checkpoint)
    return Trained(path=checkpoint, method=manifest["config"]["method"], base_model=manifest["base_model"],
                   precision=manifest["identity"]["precision"],
                   hf_files=tuple(sorted((checkpoint / HF_DIR).iterdir())))


def _final_model(output_dir: Path) -> Trained | None:
    """The model `run.py` saved at the end of training in `output_dir`, or None."""
    try:
        config, resolved = RunFolder(output_dir).read_run_yaml()
        method = config["method"]
        weight_files = _saved_weight_files(output_dir, "model" if method == "full" else "adapter_model")
        base_model = None
        if weight_files and method != "full":
            base_model = json.loads((output_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError, AttributeError):  # no finished run here
        return None
    if not weight_files or resolved.precision is None:  # a run.yaml no run wrote (it records the precision)
        return None
    hf_files = tuple(p for p in sorted(output_dir.iterdir()) if p.is_file() and p.name not in RUN_FILES
                     and not p.name.endswith((".safetensors", ".safetensors.index.json")))
    return Trained(path=output_dir, method=method, base_model=base_model,
                   precision=resolved.precision, hf_files=hf_files,
                   weight_files=tuple(weight_files))


def _saved_weight_files(folder: Path, stem: str) -> list[Path]:
    """`<stem>.safetensors`, or the shards `<stem>.safetensors.index.json` lists, as save_pretrained writes them."""
    if (folder / f"{stem}.safetensors").is_file():
        return [folder / f"{stem}.safetensors"]
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return []


def _final_step(output_dir: Path) -> int:
    """The step the final model was saved at (the run's summary), -1 when unknown."""
    try:
        return int(RunFolder(output_dir).read_summary()["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1
