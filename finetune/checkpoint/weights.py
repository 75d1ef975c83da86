"""Readers of the model weights a checkpoint holds, one per format the checkpointer's strategies
write: model.safetensors (single process, DDP), DCP shards (FSDP) or ZeRO partitions (DeepSpeed; the
fp32 master weights). Export reads through them one output shard at a time, so host memory stays
near one shard rather than the whole model. Callers check `unsafe_pickle_globals` first.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from finetune.errors import CheckpointError


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
    tensor at a time instead of concatenating whole partitions. Ours rather than DeepSpeed's
    `get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True)`: that one unpickles every rank's
    file with `weights_only=False` (arbitrary code from a downloaded checkpoint); this one loads
    with `weights_only=True` and an allow-list of DeepSpeed's three plain-data classes."""

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
