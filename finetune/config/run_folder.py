"""A run's output folder (`--output-dir`): the contract between the run that writes it and everything
that reads it afterwards (export, the model card, the rehearsal's outcome, the scaling bench).

    <output-dir>/
      run.yaml                 the options (loads back with --config) + the ResolvedRecord under `resolved:`
      metrics.jsonl            one row per logged update and per evaluation (read_metrics)
      summary.json             steps, tokens and the numbers before and after training
      loss_curve.png           training and eval loss against optimizer steps
      deepspeed_config.json    the DeepSpeed JSON as resolved for this run (DeepSpeed runs only)
      checkpoints/step-N/      manifest.json (with the ResolvedRecord under "resolved") + hf/ + Accelerate's state
      config.json, *.safetensors, tokenizer files ...   the final model, as save_pretrained writes it

Every file name of the folder is defined here and nowhere else. It lives in config/, the lowest
torch-free folder, because its writers (train/, and checkpoint/ for the manifest) and its readers
(export/, launch/, and plan/ beside checkpoint/) all sit above config/ in the import order
(tests/test_layers.py); checkpoint/layout.py keeps what only checkpoints have (step-N naming,
completeness, finding the newest) and takes its names from here. Nothing here imports torch, so
reading a finished run (the model card, a rehearsal's report) never loads it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from finetune.errors import FinetuneError

if TYPE_CHECKING:
    from finetune.config.options import TrainConfig

RUN_YAML = "run.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
LOSS_CURVE = "loss_curve.png"
DEEPSPEED_CONFIG = "deepspeed_config.json"
MODEL_CARD = "README.md"  # export's card, in the folder it exports to (which may be the output dir itself)
CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "manifest.json"  # in each checkpoint folder
HF_DIR = "hf"  # in each checkpoint folder: model config, generation config, tokenizer (and adapter config)
# what a run writes into its output dir besides the final model
RUN_FILES = frozenset({RUN_YAML, METRICS, SUMMARY, LOSS_CURVE, DEEPSPEED_CONFIG, MODEL_CARD})

RESOLVED = "resolved"  # the ResolvedRecord's key, in run.yaml and in every manifest
FORMER_MANIFEST_KEY = "run"  # where manifests of format_version 1 kept the same record


@dataclass(frozen=True)
class ResolvedRecord:
    """What the flags resolved to on the launch that trained: the numbers a reader of the folder cannot
    re-derive without the data, the model and the launcher. Every field is None where a folder written
    by another version lacks it."""

    world_size: int | None = None
    gradient_accumulation_steps: int | None = None
    global_batch_size: int | None = None
    max_steps: int | None = None
    peak_lr: float | None = None
    precision: str | None = None  # a config.names.PRECISIONS name
    strategy: str | None = None  # a config.names.STRATEGIES name
    format: str | None = None  # the data's format (chat, instruction, ...), detected or given
    train_examples: int | None = None
    eval_examples: int | None = None
    trainable_parameters: int | None = None
    total_parameters: int | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> ResolvedRecord:
        """The record in `data`; keys this version does not know (a newer finetune's) are left out."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in (data or {}).items() if key in known})

    @classmethod
    def of_manifest(cls, manifest: dict) -> ResolvedRecord:
        """The record a checkpoint's manifest holds, under either key a manifest has used."""
        return cls.from_dict(manifest.get(RESOLVED, manifest.get(FORMER_MANIFEST_KEY)))


class RunFolder:
    """A run's output dir, by what it holds; reads return what is there (see each method when it is not)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def of_checkpoint(cls, checkpoint: str | Path) -> RunFolder:
        """The output dir a `<output-dir>/checkpoints/step-N` folder belongs to."""
        return cls(Path(checkpoint).parent.parent)

    @property
    def run_yaml(self) -> Path:
        return self.path / RUN_YAML

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY

    @property
    def loss_curve(self) -> Path:
        return self.path / LOSS_CURVE

    @property
    def deepspeed_config(self) -> Path:
        return self.path / DEEPSPEED_CONFIG

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    def write_run_yaml(self, config: TrainConfig, resolved: ResolvedRecord) -> Path:
        """run.yaml: the options as `--config` loads them back (config.flags.load_yaml leaves `resolved:` out)."""
        data = {**config.to_dict(), RESOLVED: resolved.to_dict()}
        self.run_yaml.write_text(yaml.safe_dump(data, sort_keys=False))
        return self.run_yaml

    def read_run_yaml(self) -> tuple[dict, ResolvedRecord]:
        """The options run.yaml holds (as written, unvalidated) and its record. Raises OSError when
        there is none and yaml.YAMLError or TypeError when it is no mapping."""
        data = dict(yaml.safe_load(self.run_yaml.read_text()))
        return data, ResolvedRecord.from_dict(data.pop(RESOLVED, None))

    def write_summary(self, summary: dict) -> Path:
        self.summary.write_text(json.dumps(summary, indent=2) + "\n")
        return self.summary

    def read_summary(self) -> dict:
        """summary.json, or {} when the run has not finished (or was preempted) and wrote none."""
        return json.loads(self.summary.read_text()) if self.summary.is_file() else {}

    def read_metrics(self) -> list[dict]:
        """metrics.jsonl's rows, or [] when the run logged none."""
        return read_metrics(self.metrics) if self.metrics.is_file() else []


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl file, oldest first: `step` in each, `loss`, `lr`, ... in a training
    update's, `eval_loss`, ... in an evaluation's (train/metrics.py writes them). A last line without
    its newline (the run was killed while writing it) is left out; any other unreadable line raises
    FinetuneError naming it."""
    path = Path(path)
    lines = path.read_text().split("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):
                break
            raise FinetuneError(f"{path}, line {number}: not a JSON row ({e}). Delete or fix that line.") from e
    return rows
