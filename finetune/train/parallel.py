"""Tensor and context parallelism at run time: what Accelerate is told, and over which ranks the
loop sums its token counts and losses.

Who does what (verified 2026-11-28 on CPU with accelerate 1.15, transformers 5.23, torch 2.13):
- TP: transformers lays the model out when it loads (train/skeleton.py: its TP plan with this module's
  sequence-parallel rules, `sequence_parallel_plan`, then FSDP2 over the data-parallel ranks).
  Accelerate gets the device mesh, so its data loaders hand the ranks of a TP group the same rows,
  but not the ParallelismConfig: under FSDP2 its TP preparation imports `ReplicateParallel`, which
  transformers 5 no longer has. The run is Accelerate's FSDP2 (its sharded checkpoints, DTensor-aware
  clipping) around a model that is already sharded.
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
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard
from transformers.distributed.tensor_parallel import (
    ColwiseParallel,
    EmbeddingParallel,
    RowwiseParallel,
    SequenceParallel,
    TensorParallelLayer,
)

from finetune.config.parallelism import Parallelism
from finetune.errors import FinetuneError

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


# ---------------------------------------------------------------- sequence parallelism
#
# transformers' TP plan of the Llama family leaves every rank of a TP group the whole residual stream:
# the embedding all-reduces its lookups, each row-parallel linear all-reduces its output, the norms run
# on whole rows, and the LM head gathers the whole vocabulary's logits. The rules below (Megatron-LM's
# sequence parallelism, in DTensor terms) keep the residual stream sharded by sequence between the
# blocks instead: the embedding and each row-parallel linear reduce-scatter onto sequence shards, the
# norms run on their rank's shard, and attention and the MLP all-gather whole rows at their input (their
# column-parallel linears need every token); backward runs the reverse, all-gather for reduce-scatter.
# Between the blocks the hidden states are DTensors sharded on dim 1, so the model's own code sees the
# whole row's shape (positions, masks) and rows of any length split (unevenly: a generated token sits
# on one rank). Each linear's input is saved whole, as the gathered rows it multiplies.


class _WholeRowsIn(TensorParallelLayer):
    """Attention or the MLP: its hidden states (sequence shards) are all-gathered into whole rows, kept
    a replicated DTensor, so the column-parallel linears' input gradients come back partial and are
    reduce-scattered onto the shards in one collective."""

    def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
        if args:
            return (whole_rows(args[0]), *args[1:]), kwargs
        return args, kwargs | {"hidden_states": whole_rows(kwargs["hidden_states"])}


class _LookupOntoShards(EmbeddingParallel):
    """The input embedding, split by vocabulary rows: each rank's lookups are partial sums, reduce-scattered
    onto sequence shards."""

    def transform_output_post_forward(self, module, output, mesh):
        if not isinstance(output, DTensor):
            output = DTensor.from_local(output, mesh, [Partial()], run_check=False)
        return output.redistribute(placements=[Shard(1)])


class _HeadOnWholeRows(ColwiseParallel):
    """The LM head in the model's own forward (generation, and a loss the chunked loss does not take):
    whole rows in, the whole vocabulary's logits out. The chunked loss reads the head's weight itself,
    one vocabulary shard per rank (train/chunked_loss.py)."""

    def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
        return super().transform_inputs_pre_forward(module, (whole_rows(args[0]), *args[1:]), kwargs, mesh)


def whole_rows(hidden):
    """Sequence shards (a DTensor sharded on dim 1) as a replicated DTensor of whole rows."""
    return hidden.redistribute(placements=[Replicate()]) if isinstance(hidden, DTensor) else hidden


# finetune's styles, by the name its plans give them (transformers' registry of parallel styles)
SEQUENCE_STYLES = {
    "sequence_norm": SequenceParallel(use_local_output=False),
    "whole_rows_in": _WholeRowsIn(),
    "rowwise_onto_shards": RowwiseParallel(input_layouts=Shard(-1), output_layouts=Shard(1), use_local_output=False),
    "lookup_onto_shards": _LookupOntoShards(shard_dim=0),
    "head_on_whole_rows": _HeadOnWholeRows(input_layouts=Replicate(), output_layouts=Replicate()),
}
# transformers' style → finetune's, for the modules on the residual stream
REPLACED = {"rowwise": "rowwise_onto_shards", "embedding_rowwise": "lookup_onto_shards",
            "colwise_gather_output": "head_on_whole_rows"}
# styles inside attention and the MLP, whose input is the gathered whole rows
INSIDE_BLOCKS = ("colwise", "packed_colwise", "replicated_with_grad_allreduce")


def sequence_parallel_plan(model: torch.nn.Module) -> dict[str, str]:
    """The rules `model`'s TP plan needs for sequence parallelism (`DistributedConfig(tp_plan=...)`
    overrides those rules and keeps the others), from the model's own plan and modules (a meta-device
    instance will do): its row-parallel linears, embedding and head as in REPLACED; every module
    holding column-parallel linears gathers whole rows; the norms on the residual stream (children
    of a decoder layer, and the final norm beside the layers) run on sequence shards. Registers
    finetune's styles with transformers. Raises FinetuneError for a plan with other styles, whose
    place in the sequence-parallel layout nobody has checked."""
    for name, style in SEQUENCE_STYLES.items():
        ALL_PARALLEL_STYLES.register(name, style)
    plan = dict(model.tp_plan)
    unknown = sorted({style for style in plan.values() if style not in REPLACED and style not in INSIDE_BLOCKS})
    if unknown:
        raise FinetuneError(f"--tp: {type(model).__name__}'s tensor-parallel plan uses {', '.join(unknown)}, which "
                            "finetune's sequence-parallel layout does not place; train it without --tp (FSDP2)")
    rules = {name: REPLACED[style] for name, style in plan.items() if style in REPLACED}
    rules |= {name.rpartition(".")[0]: "whole_rows_in" for name, style in plan.items() if style in ("colwise", "packed_colwise")}
    layers = {name.partition(".*.")[0] for name in plan if ".*." in name}  # e.g. model.layers
    stream = {f"{layer}.*" for layer in layers} | {layer.rpartition(".")[0] for layer in layers}
    for name, module in model.named_modules():
        generic = replace_layer_number_by_wildcard(name)
        if type(module).__name__.endswith("Norm") and generic.rpartition(".")[0] in stream:
            rules[generic] = "sequence_norm"
    return rules


def adapters_read_local_rows(model: torch.nn.Module) -> None:
    """LoRA under sequence-parallel TP: an adapter's A is a plain weight every rank holds whole, which
    cannot multiply the DTensor of whole rows its column-parallel linear reads, so its branch (from
    its dropout on) takes the rows as a local tensor. The gradient it sends back is whole on every rank
    (the B after it, column-parallel, all-reduces what comes back through it): replicated."""
    for name, module in model.named_modules():
        if ".lora_dropout." in name:
            module.register_forward_pre_hook(_local_rows)


def _local_rows(module, args):
    rows, *rest = args
    return (rows.to_local(grad_placements=[Replicate()]), *rest) if isinstance(rows, DTensor) else None
