"""`finetune export CHECKPOINT_OR_OUTPUT_DIR --out DIR [--merge-lora] [--dtype bf16|fp16|fp32]`.

Turns a training checkpoint (see checkpointing.py), or the final model a finished run saved in its
output dir, into a folder that `from_pretrained` loads:
- full fine-tuning: safetensors (numbered shards + index above --max-shard-size), config,
  generation config, tokenizer;
- LoRA/QLoRA: the PEFT adapter (adapter_model.safetensors + adapter_config.json), or with
  `--merge-lora` the base model with the adapters merged in (QLoRA: the NF4-quantized base the
  adapters were trained against, dequantized, plus the adapters).

Each strategy's checkpoint is read through one `Weights` reader: model.safetensors (single process,
DDP), DCP shards (FSDP) or ZeRO partitions (DeepSpeed; the fp32 master weights). Full models are
written one output shard at a time and readers fetch only that shard's tensors, so host memory
stays near one output shard (plus, for ZeRO-3, the slices of every rank that shard needs) rather
than the whole model. Nothing is unpickled before `unsafe_pickle_globals` cleared the folder.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from finetune import hub
from finetune.checkpointing import (
    HF_DIR, MANIFEST, CheckpointError, checkpoints_dir, complete_checkpoints, find_checkpoint, read_manifest,
    unsafe_pickle_globals,
)
from finetune.checkpointing.layout import STEP_DIR
from finetune.gguf_export import GGUF_TYPES, export_gguf
from finetune.library_logs import quiet_libraries
from finetune.model_card import write_model_card
from finetune.vocabulary import PRECISIONS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
CONFIG_DTYPES = {v: k for k, v in TORCH_DTYPE_NAMES.items()}
ADAPTER_CONFIG = "adapter_config.json"


# ---------------------------------------------------------------- readers: one per checkpoint format


class Weights:
    """A checkpoint's model tensors under the unwrapped model's state-dict names.

    `specs` maps name → (shape, dtype) in checkpoint order without reading any data; `read(names)`
    loads just those tensors.
    """

    specs: dict[str, tuple[torch.Size, torch.dtype]]

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class SafetensorsWeights(Weights):
    """`model.safetensors` from single-process and DDP checkpoints (DDP names start with `module.`),
    or the safetensors files of a saved model (one file, or the shards its index lists)."""

    def __init__(self, paths: list[Path]):
        self.keys, self.specs = {}, {}  # name → (file, key in it); name → (shape, dtype)
        for path in paths:
            with safe_open(str(path), "pt") as f:
                for key in f.keys():
                    name = key.removeprefix("module.")
                    piece = f.get_slice(key)
                    self.keys[name] = (path, key)
                    self.specs[name] = (torch.Size(piece.get_shape()), _safetensors_dtype(piece.get_dtype()))

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for path in dict.fromkeys(self.keys[n][0] for n in names):
            with safe_open(str(path), "pt") as f:
                out.update({n: f.get_tensor(self.keys[n][1]) for n in names if self.keys[n][0] == path})
        return {n: out[n] for n in names}


class DcpWeights(Weights):
    """FSDP's distributed checkpoint (`pytorch_model_fsdp_0/`): Accelerate stores the model state
    dict under `model.`; reads fetch only the byte ranges of the requested tensors."""

    def __init__(self, folder: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.folder = folder
        metadata = FileSystemReader(str(folder)).read_metadata()
        self.keys, self.specs = {}, {}
        for key, meta in metadata.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata) and key.startswith("model."):
                name = key.removeprefix("model.")
                self.keys[name] = key
                self.specs[name] = (meta.size, meta.properties.dtype)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        import warnings

        import torch.distributed.checkpoint as dcp

        state = {self.keys[n]: torch.empty(self.specs[n][0], dtype=self.specs[n][1]) for n in names}
        with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming a single process": intended
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(self.folder)), no_dist=True)
        return {n: state[self.keys[n]] for n in names}


class ZeroWeights(Weights):
    """DeepSpeed ZeRO-1/2/3 (`pytorch_model/`): fp32 master weights rebuilt from each rank's optimizer
    partition, following deepspeed.utils.zero_to_fp32, but through memory-mapped files and one
    tensor at a time instead of concatenating whole partitions."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.optim_files = sorted(folder.glob("*_optim_states.pt"), key=_rank_of)
        model_files = sorted(folder.glob("*_model_states.pt"), key=_rank_of)
        if not self.optim_files or not model_files:
            raise CheckpointError(f"{folder} has no DeepSpeed *_optim_states.pt / *_model_states.pt files.")
        first = _load_deepspeed(model_files[0])
        optim = _load_deepspeed(self.optim_files[0])["optimizer_state_dict"]
        self.stage = int(optim["zero_stage"])
        self.world_size = len(self.optim_files)
        self.layout: dict[str, tuple] = {}  # name → where its values live (see `read`)
        self.specs = {}
        for name in first["buffer_names"]:
            self._add(name, first["module"][name].shape, ("buffer",))
        frozen = first.get("frozen_param_shapes") or {}
        for name, shape in frozen.items():
            self._add(name, shape, ("frozen",))
        if self.stage <= 2:
            paddings = optim.get("param_alignment_paddings")
            for group, shapes in enumerate(first["param_shapes"]):
                offset = 0
                for i, (name, shape) in enumerate(shapes.items()):
                    self._add(name, shape, ("zero2", group, offset))
                    offset += shape.numel() + (paddings[group][i] if paddings else 0)
        else:
            offset = 0
            for shapes in first["param_shapes"]:
                for name, shape in shapes.items():
                    self._add(name, shape, ("zero3", offset))
                    offset += -(-shape.numel() // self.world_size)  # each rank's padded partition
        for alias, target in first["shared_params"].items():
            if target in self.layout:
                self._add(alias, self.specs[target][0], ("shared", target))

    def _add(self, name: str, shape, where: tuple) -> None:
        self.layout[name] = where
        self.specs[name] = (torch.Size(shape), torch.float32)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        # mapped per call, so pages read for one output shard are released before the next
        optim = [_load_deepspeed(f)["optimizer_state_dict"] for f in self.optim_files]
        key = "single_partition_of_fp32_groups" if self.stage <= 2 else "fp32_flat_groups"
        flats = [o[key] for o in optim]
        model_states = None
        out = {}
        for name in names:
            where = self.layout[name]
            shape = self.specs[name][0]
            if where[0] == "shared":
                where, shape = self.layout[where[1]], self.specs[where[1]][0]
            if where[0] in ("buffer", "frozen"):
                if model_states is None:
                    model_states = [_load_deepspeed(f) for f in sorted(self.folder.glob("*_model_states.pt"), key=_rank_of)]
                if where[0] == "buffer":
                    out[name] = model_states[0]["module"][name].float().clone()
                elif self.stage <= 2:
                    out[name] = model_states[0]["frozen_param_fragments"][name].float().clone()
                else:
                    parts = [m["frozen_param_fragments"][name].flatten() for m in model_states]
                    out[name] = torch.cat(parts)[: shape.numel()].view(shape).float()
            elif where[0] == "zero2":
                _, group, offset = where
                out[name] = _virtual_slice([f[group] for f in flats], offset, shape.numel()).view(shape)
            else:
                partition = -(-shape.numel() // self.world_size)
                parts = [_virtual_slice(rank_flats, where[1], partition) for rank_flats in flats]
                out[name] = torch.cat(parts)[: shape.numel()].view(shape)
        return out


def _virtual_slice(tensors: list[torch.Tensor], start: int, length: int) -> torch.Tensor:
    """`torch.cat(tensors)[start:start + length]`, copying only the pieces that overlap it."""
    pieces, base = [], 0
    for t in tensors:
        lo, hi = max(start, base), min(start + length, base + t.numel())
        if lo < hi:
            pieces.append(t[lo - base: hi - base])
        base += t.numel()
    if sum(p.numel() for p in pieces) != length:
        raise CheckpointError("ZeRO partitions are shorter than their parameter shapes say; the checkpoint is damaged.")
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()


def _rank_of(path: Path) -> int:
    match = re.search(r"zero_pp_rank_(\d+)_", path.name)
    return int(match.group(1)) if match else 0


def _load_deepspeed(path: Path) -> dict:
    """torch.load(weights_only=True, mmap=True) admitting DeepSpeed's plain-data records."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _safetensors_dtype(name: str) -> torch.dtype:
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
            "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "I8": torch.int8, "BOOL": torch.bool}[name]


def open_weights(checkpoint: Path) -> Weights:
    """The reader for whichever format the checkpoint's strategy wrote."""
    if (checkpoint / "model.safetensors").is_file():
        return SafetensorsWeights([checkpoint / "model.safetensors"])
    if (checkpoint / "pytorch_model_fsdp_0" / ".metadata").is_file():
        return DcpWeights(checkpoint / "pytorch_model_fsdp_0")
    if (checkpoint / "pytorch_model").is_dir():
        return ZeroWeights(checkpoint / "pytorch_model")
    raise CheckpointError(
        f"{checkpoint} holds no model weights this version can read (model.safetensors, "
        "pytorch_model_fsdp_0/ or pytorch_model/)."
    )


# ---------------------------------------------------------------- writing


def parse_size(text: str) -> int:
    """'5GB' → 5_000_000_000 (decimal units, as Hugging Face uses); plain digits are bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B)?\s*", text.upper())
    if not match:
        raise CheckpointError(f"--max-shard-size {text!r}: expected e.g. 5GB, 500MB or a byte count.")
    scale = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}[match.group(2)]
    return int(float(match.group(1)) * scale)


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive names grouped so each group stays under `max_shard_bytes` (a bigger tensor goes alone)."""
    shards, current, used = [], [], 0
    for name, size in sizes.items():
        if current and used + size > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    return shards + [current] if current else shards


def write_safetensors(weights: Weights, names: dict[str, str], out: Path, dtype: torch.dtype | None,
                      max_shard_bytes: int | None, stem: str = "model") -> int:
    """Write `names` (checkpoint name → output name) as `<stem>.safetensors`, or as numbered shards of
    at most `max_shard_bytes` (None: one file) with a `<stem>.safetensors.index.json`, one shard in
    memory at a time. Floating-point tensors are cast to `dtype` (None: kept). Returns bytes written."""

    def out_dtype(name):
        source = weights.specs[name][1]
        return dtype if dtype is not None and source.is_floating_point else source

    sizes = {n: weights.specs[n][0].numel() * out_dtype(n).itemsize for n in names}
    shards = plan_shards(sizes, max_shard_bytes) if max_shard_bytes else [list(sizes)]
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"{stem}.safetensors" if len(shards) == 1 else f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {names[n]: t.to(out_dtype(n)).contiguous() for n, t in weights.read(shard).items()}
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        weight_map.update({names[n]: filename for n in shard})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
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


def export(source: str | Path, out: str | Path, merge_lora: bool = False, dtype: str | None = None,
           max_shard_size: str = "5GB") -> Path:
    """Export what `find_trained(source)` finds to `out`.

    Returns `out`. Raises CheckpointError for incomplete/unsafe checkpoints, a non-empty `out`, or
    `--merge-lora` on full fine-tuning.
    """
    trained = find_trained(source)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"--out {out} is not empty; choose a new folder.")
    if merge_lora and trained.method == "full":
        raise CheckpointError(f"--merge-lora: {trained.path} is full fine-tuning; there is no adapter to merge.")
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
        from finetune.modeling import nf4_config  # the exact quantization training used

        compute = getattr(torch, PRECISIONS[trained.precision].compute)
        base = AutoModelForCausalLM.from_pretrained(base_source, dtype=torch.float32, quantization_config=nf4_config(compute))
        base = base.dequantize(dtype=torch.float32)
    else:
        base = AutoModelForCausalLM.from_pretrained(base_source, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.to(DTYPES[dtype]).save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetune export",
        description="Export a training checkpoint to a Hugging Face folder (sharded safetensors + config + "
        "tokenizer), or a LoRA/QLoRA checkpoint to a PEFT adapter (merged into the base with --merge-lora).",
    )
    parser.add_argument("checkpoint", help="A checkpoint folder (…/checkpoints/step-000200) or an output dir "
                        "(its final model, or its newest complete checkpoint if that is newer).")
    parser.add_argument("--out", required=True, help="Folder to write; must be new or empty.")
    parser.add_argument("--merge-lora", action="store_true", help="Merge LoRA/QLoRA adapters into the base weights.")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="Weights dtype (default: the model config's dtype).")
    parser.add_argument("--max-shard-size", default="5GB", help="Largest safetensors file, e.g. 5GB or 500MB "
                        "(a smaller model is one model.safetensors; larger ones are numbered shards + index).")
    parser.add_argument("--format", choices=("safetensors", "gguf"), default="safetensors",
                        help="safetensors: a Hugging Face folder; gguf: one llama.cpp file (Llama-family models with a "
                        "byte-level BPE tokenizer; LoRA is merged first).")
    parser.add_argument("--gguf-type", choices=GGUF_TYPES, default="f16", help="Tensor type of --format gguf "
                        "(norms stay f32; q8_0 keeps f16 for rows not a multiple of 32).")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="Upload the export to this Hugging Face Hub repo "
                        "(created if missing; checked before anything is written).")
    parser.add_argument("--verbose", action="store_true", help="Also show the libraries' own logs and warnings.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.verbose:
        quiet_libraries()
    if args.push_to_hub:
        hub.check_can_push(args.push_to_hub)
    if args.format == "gguf":
        out = export_gguf(args.checkpoint, args.out, args.gguf_type)
    else:
        out = export(args.checkpoint, args.out, merge_lora=args.merge_lora, dtype=args.dtype,
                     max_shard_size=args.max_shard_size)
    files = sorted(p.name for p in out.iterdir())
    print(f"exported {find_trained(args.checkpoint).path} → {out}: {', '.join(files)}")
    if args.push_to_hub:
        print(f"uploaded to {hub.push(out, args.push_to_hub)}")
    return 0
