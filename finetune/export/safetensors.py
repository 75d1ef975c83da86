"""Export to safetensors: turns what trained.py finds (a training checkpoint, or the final model a
finished run saved in its output dir) into a folder that `from_pretrained` loads:
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
from pathlib import Path

import torch
from huggingface_hub.serialization import split_state_dict_into_shards_factory
from safetensors.torch import save_file
from transformers.utils.hub import convert_file_size_to_int

from finetune.checkpoint.layout import CheckpointError
from finetune.checkpoint.safety import unsafe_pickle_globals
from finetune.checkpoint.weights import Weights
from finetune.config.names import PRECISIONS
from finetune.export.card import write_model_card
from finetune.export.trained import ADAPTER_CONFIG, Trained, find_trained

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
CONFIG_DTYPES = {v: k for k, v in TORCH_DTYPE_NAMES.items()}
# the largest safetensors file when --max-shard-size is not given
DEFAULT_MAX_SHARD_SIZE = "5GB"


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
        from finetune.train.skeleton import nf4_config  # the exact quantization training used

        compute = getattr(torch, PRECISIONS[trained.precision].compute)
        base = AutoModelForCausalLM.from_pretrained(base_source, dtype=torch.float32, quantization_config=nf4_config(compute))
        base = base.dequantize(dtype=torch.float32)
    else:
        base = AutoModelForCausalLM.from_pretrained(base_source, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.to(DTYPES[dtype]).save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
