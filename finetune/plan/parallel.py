"""Tensor and context parallelism in plans: what one rank of a TP or CP group holds and computes.

Under transformers' TP plan of the Llama family, with finetune's sequence-parallel rules
(train/parallel.py), a TP rank computes a slice of every decoder layer: q/k/v and gate/up split by
output columns, o and down by input rows, so it holds 1/tp of the heads, the KV heads and the MLP
width (`rank_spec`); the embedding and the LM head split by vocabulary rows. Between the blocks the
residual stream is split by sequence (`sequence_shards`): each rank holds 1/tp of every row's tokens
there, and runs the norms on them; attention and the MLP gather whole rows at their input, which
their linears save whole. The loss runs per vocabulary shard (the chunked loss, on under TP), so no
rank holds the whole vocabulary's logits. So TP divides the linear weights, their gradients and
optimizer states, the residual stream and the norms' activations, and the activations inside
attention and the MLP by tp; the gathered inputs of q/k/v and gate/up stay whole. A CP rank holds
1/cp of every row's tokens, so every activation divides by cp. FSDP2 then shards what a rank holds
over the data-parallel ranks (× cp). Pure functions of the workload; the speed model adds what they
send (speed.py).
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

from finetune.config.parallelism import COLUMN_PARALLEL
from finetune.models.catalog import ModelSpec
from finetune.plan.params import LM_HEAD, ParamCounts, count_params, lora_params, resolve_lora_targets
from finetune.plan.workload import Workload

# Below this many tokens a row's activations are small beside the weights, and ring attention's
# exchange costs more than it saves: the planner searches CP only for longer rows, or where nothing
# else fits.
CP_MIN_SEQ_LEN = 8192
# A layout replaces data parallelism alone that fits only when it is this much faster: its
# communication model (speed.model_parallel_collectives) is not measured yet, and leaves out what
# splitting each matmul costs in GPU efficiency and in DTensor's dispatch overhead.
LAYOUT_SPEEDUP = 0.10
# Largest TP group the planner tries: one node of 8 GPUs on NVLink (across nodes every layer's
# all-reduces would cross the network).
MAX_TP = 8


def rank_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """The slice of each decoder layer one TP rank computes (heads, KV heads, MLP width ÷ tp)."""
    return spec if tp == 1 else _sliced(spec, tp)  # the planner asks thousands of times per plan


@cache
def _sliced(spec: ModelSpec, tp: int) -> ModelSpec:
    return replace(spec, num_heads=spec.num_heads // tp, num_kv_heads=spec.num_kv_heads // tp,
                   intermediate_size=spec.intermediate_size // tp, head_dim=spec.resolved_head_dim)


def rank_params(w: Workload) -> ParamCounts:
    """Parameter counts of one TP rank: its slice of the layers, and the embedding and LM head (one
    tensor when tied) by vocabulary rows (transformers 5 splits the input embedding whenever a
    model has a TP plan); the norms whole."""
    if w.tp == 1:
        return count_params(w.model)
    counts = count_params(rank_spec(w.model, w.tp))
    return replace(counts, head=counts.head / w.tp, embedding=counts.embedding / w.tp)


def sequence_shards(w: Workload) -> int:
    """How many ranks split the residual stream between the blocks by sequence: the TP group
    (sequence parallelism), so a rank holds 1/tp of its tokens there."""
    return w.tp


def vocabulary_rows(w: Workload) -> int:
    """Rows of the vocabulary one rank's LM head holds (torch.chunk's split over the TP group)."""
    return -(-w.model.vocab_size // w.tp)


def rank_trainable_params(w: Workload) -> float:
    """Trainable parameters one TP rank holds: its share of the whole model (full fine-tuning), or the
    LoRA adapters of its slice: an adapter's A on a column-parallel linear and its B on a row-parallel
    one read and write whole hidden vectors, so they stay whole; the other factor is split."""
    if w.method == "full":
        return rank_params(w).total
    targets = resolve_lora_targets(w.model, w.lora_targets, w.method)
    layers_only = replace(targets, modules=tuple(t for t in targets.modules if t != LM_HEAD))
    adapters = lora_params(rank_spec(w.model, w.tp), w.lora_r, layers_only)
    if LM_HEAD in targets.modules:
        adapters += w.lora_r * (w.model.hidden_size + w.model.vocab_size / w.tp)
    return adapters


def tokens_per_rank(w: Workload) -> float:
    """Tokens of a micro-batch one rank holds activations for: a CP rank holds 1/cp of each row."""
    return w.tokens_per_micro_batch / w.cp


def ring_buffer_bytes(w: Workload) -> float:
    """Ring attention's buffers while a layer runs: the keys and values being received beside the
    ones in use (two chunks of this rank's length)."""
    if w.cp == 1:
        return 0.0
    spec = w.model
    return 2 * 2 * spec.num_kv_heads * spec.resolved_head_dim * tokens_per_rank(w) * w.precision.compute_bytes


def group_in_one_node(w: Workload) -> bool:
    """Whether a TP/CP group (consecutive ranks) sits inside one node."""
    return w.model_parallel <= w.gpus_per_node


def tensor_parallel_sizes(w: Workload) -> list[int]:
    """The TP sizes the trainer can run `w` with (config/parallelism.py refuses the others): groups
    inside a node of at most MAX_TP GPUs, dividing the heads and KV heads; dense models; not for
    QLoRA; for LoRA only on column-parallel linears and with every GPU in the one group."""
    if w.method == "qlora" or w.offload != "none" or not w.strategy.fsdp or w.model.moe:
        return []
    if w.method == "lora":
        targets = resolve_lora_targets(w.model, w.lora_targets, w.method)
        if targets.parameters or targets.whole or any(t not in COLUMN_PARALLEL for t in targets.modules):
            return []
    spec = w.model
    sizes = [tp for tp in range(2, min(MAX_TP, w.gpus_per_node) + 1)
             if w.world_size % tp == 0 and spec.num_heads % tp == 0 and spec.num_kv_heads % tp == 0]
    return [tp for tp in sizes if w.method == "full" or tp == w.world_size]


def context_parallel_sizes(w: Workload) -> list[int]:
    """The CP sizes the trainer can run `w` with: powers of two dividing the GPUs and the row into
    2 × cp chunks; FSDP2 without offload."""
    if not w.strategy.fsdp or w.offload != "none":
        return []
    return [cp for cp in (2, 4, 8, 16, 32, 64) if cp <= w.world_size and w.world_size % cp == 0
            and w.seq_len % (2 * cp) == 0]


def reasons(w: Workload) -> list[str]:
    """What a TP/CP plan's layout costs, for the plan's reasons."""
    if w.model_parallel == 1:
        return []
    where = (f"{w.gpu.interconnect} inside one node" if group_in_one_node(w)
             else "the network between nodes")
    slow = "" if group_in_one_node(w) and w.gpu.interconnect != "PCIe" else " (slow: keep TP and CP groups on NVLink)"
    if w.tp > 1:
        return [f"tensor parallel over {w.tp} GPUs ({where}{slow}): each holds 1/{w.tp} of every linear layer, of the "
                f"vocabulary and of the activations, but for the whole rows attention and the MLP gather at their input "
                f"(the residual stream split by sequence between them); 8 all-gathers and reduce-scatters of activations "
                f"per layer per micro-batch (the bytes of 4 all-reduces), which nothing hides; "
                + (f"FSDP2 shards the slices over {w.sharding_ranks} data-parallel GPUs" if w.sharding_ranks > 1
                   else "no data-parallel GPUs left for FSDP2 to shard over")]
    return [f"context parallel over {w.cp} GPUs ({where}{slow}): each holds 1/{w.cp} of every row's tokens and "
            f"passes keys and values around the ring in every layer, under the attention compute; "
            f"FSDP2 shards the model over data-parallel × CP = {w.sharding_ranks} GPUs"]
