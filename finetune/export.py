"""`finetune export CHECKPOINT_OR_OUTPUT_DIR --out DIR [--merge-lora] [--dtype bf16|fp16|fp32]`.

Turns a training checkpoint (see checkpointing.py) into a folder that `from_pretrained` loads:
- full fine-tuning: sharded safetensors + index, config, generation config, tokenizer;
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
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from finetune.checkpointing import HF_DIR, CheckpointError, find_checkpoint, read_manifest, unsafe_pickle_globals

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
    """`model.safetensors` from single-process and DDP checkpoints (DDP names start with `module.`)."""

    def __init__(self, path: Path):
        self.path = path
        with safe_open(str(path), "pt") as f:
            self.keys = {key.removeprefix("module."): key for key in f.keys()}
            self.specs = {}
            for name, key in self.keys.items():
                piece = f.get_slice(key)
                self.specs[name] = (torch.Size(piece.get_shape()), _safetensors_dtype(piece.get_dtype()))

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        with safe_open(str(self.path), "pt") as f:
            return {name: f.get_tensor(self.keys[name]) for name in names}


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
        return SafetensorsWeights(checkpoint / "model.safetensors")
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


def _copy_hf_files(checkpoint: Path, out: Path, skip: set[str]) -> None:
    """Config, generation config, tokenizer and adapter config saved with the checkpoint, minus `skip`."""
    for path in (checkpoint / HF_DIR).iterdir():
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


def export(source: str | Path, out: str | Path, merge_lora: bool = False, dtype: str | None = None,
           max_shard_size: str = "5GB") -> Path:
    """Export the checkpoint `source` (or the newest complete one of output dir `source`) to `out`.

    Returns `out`. Raises CheckpointError for incomplete/unsafe checkpoints, a non-empty `out`, or
    `--merge-lora` on a full fine-tuning checkpoint.
    """
    checkpoint = find_checkpoint(source)
    manifest = read_manifest(checkpoint)
    method = manifest["config"]["method"]
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"--out {out} is not empty; choose a new folder.")
    if merge_lora and method == "full":
        raise CheckpointError("--merge-lora: this checkpoint is full fine-tuning; there is no adapter to merge.")
    unsafe = unsafe_pickle_globals(checkpoint)
    if unsafe:
        raise CheckpointError(f"Refusing to read {checkpoint}: unsafe pickles {unsafe}.")
    hf_config = json.loads((checkpoint / HF_DIR / "config.json").read_text())
    dtype = dtype or CONFIG_DTYPES.get(hf_config.get("dtype") or hf_config.get("torch_dtype"), "fp32")
    max_bytes = parse_size(max_shard_size)
    weights = open_weights(checkpoint)
    out.mkdir(parents=True, exist_ok=True)

    if method == "full":
        names = {n: n for n in weights.specs}
        if hf_config.get("tie_word_embeddings") and "lm_head.weight" in names:
            del names["lm_head.weight"]  # the same tensor as the input embedding
        write_safetensors(weights, names, out, DTYPES[dtype], max_bytes)
        _copy_hf_files(checkpoint, out, skip={ADAPTER_CONFIG})
        _rewrite_json(out / "config.json", dtype=TORCH_DTYPE_NAMES[dtype], torch_dtype=None)
        return out

    adapter_dir = out if not merge_lora else Path(tempfile.mkdtemp(prefix="adapter-", dir=out.parent))
    try:
        names = {n: adapter_name(n) for n in weights.specs if ".lora_" in n}
        write_safetensors(weights, names, adapter_dir, None, max_shard_bytes=None, stem="adapter_model")
        _copy_hf_files(checkpoint, adapter_dir, skip={"config.json"})
        _rewrite_json(adapter_dir / ADAPTER_CONFIG, base_model_name_or_path=manifest["base_model"])
        if merge_lora:
            _merge(manifest, adapter_dir, out, dtype, max_shard_size)
            _copy_hf_files(checkpoint, out, skip={"config.json", "generation_config.json", ADAPTER_CONFIG})
            _rewrite_json(out / "config.json", quantization_config=None)
    finally:
        if merge_lora:
            shutil.rmtree(adapter_dir)
    return out


def _merge(manifest: dict, adapter_dir: Path, out: Path, dtype: str, max_shard_size: str) -> None:
    """Base + adapters merged with PEFT's merge_and_unload, saved in `dtype`.

    QLoRA adapters were trained against the NF4-quantized base, so that is what they are merged
    into: the base is quantized exactly as in training (same BitsAndBytesConfig) and dequantized.
    The merged weights thus equal the trained model's effective weights, rounded once to `dtype`.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_source = manifest["base_model"]
    if manifest["config"]["method"] == "qlora":
        from finetune.modeling import nf4_config  # the exact quantization training used

        compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(manifest["identity"]["mixed_precision"], torch.float32)
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
                        "(its newest complete checkpoint is used).")
    parser.add_argument("--out", required=True, help="Folder to write; must be new or empty.")
    parser.add_argument("--merge-lora", action="store_true", help="Merge LoRA/QLoRA adapters into the base weights.")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="Weights dtype (default: the model config's dtype).")
    parser.add_argument("--max-shard-size", default="5GB", help="Largest safetensors file, e.g. 5GB or 500MB.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = export(args.checkpoint, args.out, merge_lora=args.merge_lora, dtype=args.dtype,
                 max_shard_size=args.max_shard_size)
    files = sorted(p.name for p in out.iterdir())
    print(f"exported {find_checkpoint(args.checkpoint)} → {out}: {', '.join(files)}")
    return 0
