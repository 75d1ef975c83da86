"""Checking checkpoint pickles before any library unpickles them.

Accelerate (custom state), DCP (non-tensor items, metadata) and DeepSpeed (all its files) load with
`weights_only=False` or plain `pickle`; every global their files name is checked against an
allow-list first, without running any of them.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

# Globals that checkpoint pickles may name besides torch's weights-only set. Accelerate loads the
# RNG states with NumPy's array globals admitted; DCP and DeepSpeed unpickle their files with
# weights_only=False, so every global in them is checked against this list before they load.
SAFE_GLOBALS = frozenset({
    # NumPy RNG state (Accelerate's random_states_N.pkl)
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
    "numpy.dtypes.UInt32DType", "_codecs.encode",
    # plain data in DCP's .metadata
    "torch.Size", "torch.float32", "torch.float16", "torch.bfloat16", "torch.float64", "torch.int64", "torch.int32",
    "torch.uint8", "torch.int8", "torch.bool", "torch.serialization._get_layout", "pathlib.PosixPath",
    "torch.distributed.checkpoint.metadata.Metadata", "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta", "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    # DeepSpeed optimizer records: a loss-scale holder, an enum, (start, numel) pairs
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
})


class _AllowListUnpickler(pickle.Unpickler):
    """Unpickles plain pickles that name only SAFE_GLOBALS (Python docs, "Restricting Globals")."""

    def find_class(self, module: str, name: str):
        if f"{module}.{name}" not in SAFE_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


def _torch_file_globals(source) -> set[str]:
    """Globals of a torch.save zip file outside torch's weights-only set; reads only data.pkl."""
    try:
        return set(torch.serialization.get_unsafe_globals_in_checkpoint(source)) - SAFE_GLOBALS
    except (pickle.UnpicklingError, RuntimeError) as e:  # an opcode the weights-only reader does not know, a bad zip
        return {f"<unreadable: {e}>"}


def unsafe_pickle_globals(checkpoint: Path) -> dict[str, list[str]]:
    """{file: [disallowed globals]} over every pickle in `checkpoint`, without running any of them:
    torch.save files via torch's weights-only checker, DCP's plain-pickle `.metadata` through an
    allow-list unpickler, and the torch.save items DCP embeds in its `.distcp` shards. Empty: safe."""
    found = {}
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        with open(path, "rb") as f:
            head = f.read(2)
        if path.suffix == ".distcp":
            continue  # raw tensor bytes and torch.save items, checked through their .metadata
        if head == b"PK":
            unsafe = _torch_file_globals(str(path))
        elif path.name == ".metadata":
            try:
                dcp_metadata = _AllowListUnpickler(io.BytesIO(path.read_bytes())).load()
                unsafe = _dcp_embedded_globals(path.parent, dcp_metadata)
            except pickle.UnpicklingError as e:
                unsafe = {str(e)}
        else:
            continue
        if unsafe:
            found[str(path.relative_to(checkpoint))] = sorted(unsafe)
    return found


def _dcp_embedded_globals(folder: Path, dcp_metadata) -> set[str]:
    """Disallowed globals in the non-tensor items (torch.save blobs) stored inside DCP shard files."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    byte_items = {fqn for fqn, meta in dcp_metadata.state_dict_metadata.items() if isinstance(meta, BytesStorageMetadata)}
    unsafe = set()
    for index, info in dcp_metadata.storage_data.items():
        if index.fqn in byte_items:
            with open(folder / info.relative_path, "rb") as f:
                f.seek(info.offset)
                unsafe |= _torch_file_globals(io.BytesIO(f.read(info.length)))
    return unsafe
