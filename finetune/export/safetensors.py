"""Export to safetensors: turns a training checkpoint (see checkpoint/checkpointer.py), or the final model a finished run saved in its
output dir, into a folder that `from_pretrained` loads:
- full fine-tuning: safetensors (numbered shards + index above --max-shard-size), config,
  generation config, tokenizer;
- LoRA/QLoRA: the PEFT adapter (adapter_model.safetensors + adapter_config.json), or with
  `--merge-lora` the base model with the adapters merged in (QLoRA: the NF4-quantized base the
  adapters were trained against, dequantized, plus the adapters);
`--format gguf` (gguf.py) exports here first, then converts. Every export also writes a README.md
model card (card.py).

Each strategy's checkpoint is read through its `Weights` reader (checkpoint/weights.py, beside
the checkpointer that writes those formats). Full models are
written one output shard at a time and readers fetch only that shard's tensors, so host memory
stays near one output shard (plus, for ZeRO-3, the slices of every rank that shard needs) rather
than the whole model. Nothing is unpickled before `unsafe_pickle_globals` cleared the folder.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

import torch
from huggingface_hub.serialization import split_state_dict_into_shards_factory
from safetensors.torch import save_file
from transformers.utils.hub import convert_file_size_to_int

from finetune.checkpoint.layout import (
    HF_DIR, MANIFEST, STEP_DIR, CheckpointError, checkpoints_dir, complete_checkpoints, find_checkpoint, read_manifest,
)
from finetune.checkpoint.safety import unsafe_pickle_globals
from finetune.checkpoint.weights import SafetensorsWeights, Weights, open_weights
from finetune.export.card import write_model_card
from finetune.config.names import PRECISIONS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
CONFIG_DTYPES = {v: k for k, v in TORCH_DTYPE_NAMES.items()}
# the largest safetensors file when --max-shard-size is not given
DEFAULT_MAX_SHARD_SIZE = "5GB"
ADAPTER_CONFIG = "adapter_config.json"


# ---------------------------------------------------------------- writing


def parse_size(text: str) -> int:
    """'5GB' → 5_000_000_000, '500MiB', or plain digits (bytes): the units `save_pretrained` takes,
    read with the same transformers function, so --merge-lora's shards follow the same limit."""
    try:
        return int(text) if text.strip().isdigit() else convert_file_size_to_int(text.strip())
    except ValueError:
        raise CheckpointError(f"--max-shard-size {text!r}: expected e.g. 5GB, 500MB, 2GiB or a byte count.") from None


def write_safetensors(weights: Weights, names: dict[str, str], out: Path, dtype: torch.dtype | None,
                      max_shard_bytes: int | None, stem: str = "model") -> int:
    """Write `names` (checkpoint name → output name) as `<stem>.safetensors`, or as numbered shards of
    at most `max_shard_bytes` (None: one file) with a `<stem>.safetensors.index.json`, one shard in
    memory at a time. Floating-point tensors are cast to `dtype` (None: kept). Returns bytes written.

    The shard plan is huggingface_hub's (the one `save_pretrained` uses), made from shapes alone so
    no tensor is read before its shard is written."""

    def out_dtype(name):
        source = weights.specs[name][1]
        return dtype if dtype is not None and source.is_floating_point else source

    sizes = {names[n]: weights.specs[n][0].numel() * out_dtype(n).itemsize for n in names}
    split = split_state_dict_into_shards_factory(
        sizes, get_storage_size=lambda size: size, filename_pattern=stem + "{suffix}.safetensors",
        max_shard_size=max_shard_bytes or sum(sizes.values()) + 1)
    source_name = {names[n]: n for n in names}
    for filename, shard in split.filename_to_tensors.items():
        read = weights.read([source_name[name] for name in shard])
        tensors = {name: read[source_name[name]].to(out_dtype(source_name[name])).contiguous() for name in shard}
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        del tensors, read
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return sum(sizes.values())


def adapter_name(name: str) -> str:
    """PEFT's in-memory name → its saved name: the adapter name `default` is dropped."""
    return re.sub(r"(\.lora_\w+)\.default\b", r"\1", name)


def _copy_hf_files(trained: Trained, out: Path, skip: set[str]) -> None:
    """Config, generation config, tokenizer and adapter config saved with the model, minus `skip`."""
    for path in trained.hf_files:
        if path.name not in skip:
            shutil.copy2(path, out / path.name)


def _rewrite_json(path: Path, **changes) -> None:
    """Set keys of a JSON file; a None value removes the key."""
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- what to export

# what a run writes into its output dir besides the final model (run.py, metrics.py, strategies.py)
RUN_FILES = {"run.yaml", "summary.json", "metrics.jsonl", "loss_curve.png", "deepspeed_config.json", "README.md"}


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
            "and no final model (model.safetensors or adapter_model.safetensors beside run.yaml, as a finished "
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
        run = yaml.safe_load((output_dir / "run.yaml").read_text())
        method, resolved = run["method"], run.get("resolved") or {}
        weight_files = _saved_weight_files(output_dir, "model" if method == "full" else "adapter_model")
        base_model = None
        if weight_files and method != "full":
            base_model = json.loads((output_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError, AttributeError):  # no finished run here
        return None
    if not weight_files:
        return None
    hf_files = tuple(p for p in sorted(output_dir.iterdir()) if p.is_file() and p.name not in RUN_FILES
                     and not p.name.endswith((".safetensors", ".safetensors.index.json")))
    return Trained(path=output_dir, method=method, base_model=base_model,
                   precision=resolved["precision"], hf_files=hf_files,
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
    """The step the final model was saved at (summary.json), -1 when unknown."""
    try:
        return int(json.loads((output_dir / "summary.json").read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


# ---------------------------------------------------------------- export


def new_out_dir(out: str | Path) -> Path:
    """`out` as a Path; raises CheckpointError when it holds anything (an export never overwrites)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"--out {out} is not empty; choose a new folder.")
    return out


def export(source: str | Path, out: str | Path, merge_lora: bool = False, dtype: str | None = None,
           max_shard_size: str | None = None) -> Path:
    """Export what `find_trained(source)` finds to `out` (`max_shard_size` None: DEFAULT_MAX_SHARD_SIZE).

    Returns `out`. Raises CheckpointError for incomplete/unsafe checkpoints, a non-empty `out`,
    `--merge-lora` on full fine-tuning, or --dtype / --max-shard-size on an adapter export (which
    writes the adapter as trained, in one file).
    """
    trained = find_trained(source)
    out = new_out_dir(out)
    if merge_lora and trained.method == "full":
        raise CheckpointError(f"--merge-lora: {trained.path} is full fine-tuning; there is no adapter to merge.")
    unused = [flag for flag, value in (("--dtype", dtype), ("--max-shard-size", max_shard_size)) if value is not None]
    if trained.method != "full" and not merge_lora and unused:
        raise CheckpointError(f"{', '.join(unused)}: not used for a {trained.method} adapter export, which writes the "
                              "adapter as trained in one file; add --merge-lora to write a merged model with them.")
    max_shard_size = max_shard_size or DEFAULT_MAX_SHARD_SIZE
    if trained.is_checkpoint:
        unsafe = unsafe_pickle_globals(trained.path)
        if unsafe:
            raise CheckpointError(f"Refusing to read {trained.path}: unsafe pickles {unsafe}.")
    hf_config = trained.hf_config()
    dtype = dtype or CONFIG_DTYPES.get(hf_config.get("dtype") or hf_config.get("torch_dtype"), "fp32")
    max_bytes = parse_size(max_shard_size)
    weights = trained.weights()
    out.mkdir(parents=True, exist_ok=True)

    if trained.method == "full":
        names = {n: n for n in weights.specs}
        if hf_config.get("tie_word_embeddings") and "lm_head.weight" in names:
            del names["lm_head.weight"]  # the same tensor as the input embedding
        write_safetensors(weights, names, out, DTYPES[dtype], max_bytes)
        _copy_hf_files(trained, out, skip={ADAPTER_CONFIG})
        _rewrite_json(out / "config.json", dtype=TORCH_DTYPE_NAMES[dtype], torch_dtype=None)
        write_model_card(trained, out, export_format=f"safetensors ({dtype})")
        return out

    adapter_dir = out if not merge_lora else Path(tempfile.mkdtemp(prefix="adapter-", dir=out.parent))
    try:
        names = {n: adapter_name(n) for n in weights.specs if ".lora_" in n}
        write_safetensors(weights, names, adapter_dir, None, max_shard_bytes=None, stem="adapter_model")
        _copy_hf_files(trained, adapter_dir, skip={"config.json"})
        _rewrite_json(adapter_dir / ADAPTER_CONFIG, base_model_name_or_path=trained.base_model)
        if merge_lora:
            _merge(trained, adapter_dir, out, dtype, max_shard_size)
            _copy_hf_files(trained, out, skip={"config.json", "generation_config.json", ADAPTER_CONFIG})
            _rewrite_json(out / "config.json", quantization_config=None)
    finally:
        if merge_lora:
            shutil.rmtree(adapter_dir)
    write_model_card(trained, out, export_format=f"safetensors ({dtype}, adapters merged)" if merge_lora else "PEFT adapter")
    return out


def _merge(trained: Trained, adapter_dir: Path, out: Path, dtype: str, max_shard_size: str) -> None:
    """Base + adapters merged with PEFT's merge_and_unload, saved in `dtype`.

    QLoRA adapters were trained against the NF4-quantized base, so that is what they are merged
    into: the base is quantized exactly as in training (same BitsAndBytesConfig) and dequantized.
    The merged weights thus equal the trained model's effective weights, rounded once to `dtype`.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_source = trained.base_model
    if trained.method == "qlora":
        from finetune.train.loading import nf4_config  # the exact quantization training used

        compute = getattr(torch, PRECISIONS[trained.precision].compute)
        base = AutoModelForCausalLM.from_pretrained(base_source, dtype=torch.float32, quantization_config=nf4_config(compute))
        base = base.dequantize(dtype=torch.float32)
    else:
        base = AutoModelForCausalLM.from_pretrained(base_source, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.to(DTYPES[dtype]).save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
