"""Tensor and context parallelism at run time: what Accelerate is told, and over which ranks the
loop sums its token counts and losses.

Who does what (verified 2026-11-28 on CPU with accelerate 1.15, transformers 5.23, torch 2.13):
- TP: transformers lays the model out when it loads (train/loading.py: its TP plan, then FSDP2 over
  the data-parallel ranks). Accelerate gets the device mesh, so its data loaders hand the ranks of a
  TP group the same rows, but not the ParallelismConfig: under FSDP2 its TP preparation imports
  `ReplicateParallel`, which transformers 5 no longer has. The run is Accelerate's FSDP2 (its
  sharded checkpoints, DTensor-aware clipping) around a model that is already sharded.
- CP: Accelerate's own path: ParallelismConfig(dp_shard, cp), FSDP2 over dp_shard × cp, and
  torch's ring attention around each micro-batch (`sequence_shards`). CUDA only
  (config/parallelism.CP_NEEDS_CUDA).
An accelerate config's `parallelism_config` section reaches each process as variables that make
Accelerate build its own ParallelismConfig, which it would refuse on CPU (MULTI_CPU) and break on
TP; finetune has read them into the resolved run and withholds them while the Accelerator is built.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig

from finetune.config.parallelism import Parallelism

# set by `accelerate launch` for a config with a parallelism_config section
LAUNCH_PARALLELISM_VARIABLE = "ACCELERATE_USE_PARALLELISM_CONFIG"


def accelerate_config(p: Parallelism) -> ParallelismConfig:
    return ParallelismConfig(dp_replicate_size=p.dp_replicate, dp_shard_size=p.dp_shard, tp_size=p.tp, cp_size=p.cp)


@contextmanager
def launch_parallelism_withheld() -> Iterator[None]:
    """Build the Accelerator inside this: the launch's parallelism variables are hidden from it."""
    withheld = os.environ.pop(LAUNCH_PARALLELISM_VARIABLE, None)
    try:
        yield
    finally:
        if withheld is not None:
            os.environ[LAUNCH_PARALLELISM_VARIABLE] = withheld


def hand_over(accelerator: Accelerator, p: Parallelism) -> None:
    """Tell the (FSDP2) Accelerator about a TP or CP layout; nothing for data parallelism alone."""
    if p.model_parallel == 1:
        return
    config = accelerate_config(p)
    accelerator.state.device_mesh = config.build_device_mesh(accelerator.device.type)
    if p.cp > 1:
        accelerator.state.parallelism_config = config
    if p.tp > 1:  # transformers wrapped the decoder layers; Accelerate's prepare finds an FSDP2 module
        accelerator.state.fsdp_plugin.auto_wrap_policy = None


class LossRanks:
    """The ranks the loop's token-weighted loss sums over (train/loop.py's docstring).

    Token counts are summed over the ranks that read different rows (data parallel). Every rank that
    holds a share of the step's tokens (data × context parallel) computes its tokens' loss sum over
    the step's count; FSDP averages their gradients, so each scales its loss by how many share, and
    the step's loss is the sum of the shares. The ranks of a TP group hold the same rows and loss.
    Without TP or CP both are the whole world.
    """

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        mesh = accelerator.torch_device_mesh
        self.whole_world = mesh is None
        self.rows, self.row_ranks = _group(mesh, "dp") if mesh is not None else (None, accelerator.num_processes)
        self.shares, self.sharing = _group(mesh, "dp_cp") if mesh is not None else (None, accelerator.num_processes)

    def sum_over_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._sum(tensor, self.rows, self.row_ranks)

    def sum_over_shares(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._sum(tensor, self.shares, self.sharing)

    def _sum(self, tensor: torch.Tensor, group, size: int) -> torch.Tensor:
        if self.whole_world:
            return self.accelerator.reduce(tensor, reduction="sum")
        if size == 1:
            return tensor
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total


def _group(mesh, name: str):
    """(process group, size) of the mesh dimension `name`: Accelerate flattens "dp" and "dp_cp" out of
    the dimensions in use, so a layout without such ranks (TP alone) has none: (None, 1)."""
    try:
        sub = mesh[name]
    except (KeyError, RuntimeError, ValueError):
        return None, 1
    return sub.get_group(), sub.size()


def sequence_shards(accelerator: Accelerator, batch: dict):
    """Under CP: each rank computes its slice of the batch's rows (ring attention passes keys and values
    round); the sliced tensors stay sliced. Elsewhere nothing happens."""
    config = accelerator.parallelism_config
    if config is None or not config.cp_enabled:
        return nullcontext()
    buffers = [batch[key] for key in ("input_ids", "labels", "shift_labels", "position_ids")]
    return accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                              no_restore_buffers=set(buffers))
