"""Tokens per second of a workload: compute at a fixed fraction of the GPU's peak, plus the
communication that compute cannot hide, plus offload copies and the host optimizer step.

Communication is counted collective by collective (an α–β model): each collective moves a known
number of bytes per rank over the link (ring algorithms send (n−1)/n of the buffer per all-gather
or reduce-scatter, twice that per all-reduce) and pays a fixed latency per launch. What it can hide
under depends on when the strategy issues it: DDP's bucketed all-reduce runs during the last
micro-batch's backward, FSDP2/ZeRO-3 prefetch all-gathers during each forward and backward, and
ZeRO-1/2 gather the updated weights after the optimizer step, where nothing hides them.
`finetune scaling` measures tokens/s on 1, 2, … processes and times the gradient all-reduce to
check this model.

A rough model by design: it ranks plans (sharding over PCIe vs NVLink, offload, QLoRA's
dequantization) and flags communication-bound ones; absolute numbers are ±30 %.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune.plan.memory import DS_BUCKET_ELEMENTS, model_states, trainable_params
from finetune.plan.params import count_params
from finetune.plan.workload import Workload

# Fraction of the GPU's dense bf16 peak a fine-tuning step reaches with transformers + SDPA
# (model FLOPs utilisation; published HF/Accelerate fine-tuning runs report 35–50 % on A100/H100).
BASE_MFU = 0.40
# bitsandbytes dequantizes every 4-bit weight for each forward and backward matmul: QLoRA steps
# run at about 0.6× the speed of LoRA on a 16-bit base (QLoRA paper and bitsandbytes benchmarks).
QLORA_SPEED = 0.6
# fp32 matmuls run on TF32 tensor cores: half the bf16 rate.
FP32_SPEED = 0.5
# Share of a compute window that communication issued during it can hide under: NCCL kernels take
# SMs and memory bandwidth from the compute they overlap with, and the first bucket only starts
# once its gradients exist.
OVERLAP = 0.7
# Latency of one collective launch (NCCL ring, small message): nccl-tests report 15–30 µs inside
# an NVLink or PCIe node and 30–60 µs across InfiniBand/RoCE nodes.
LATENCY_S = 20e-6
INTER_NODE_LATENCY_S = 50e-6
# Network between nodes, per node, GB/s per direction (200 Gb/s Ethernet/InfiniBand class).
INTER_NODE_GB_PER_S = 25.0
# torch DDP's default gradient bucket (bucket_cap_mb=25): one all-reduce launch per bucket.
DDP_BUCKET_BYTES = 25 * 2**20
# Host↔device copies for offload: achievable PCIe 4.0 x16 bandwidth, GB/s.
PCIE_GB_PER_S = 20.0
# DeepSpeed CPUAdam / the host optimizer step: parameters updated per second by one node's CPUs.
CPU_ADAM_PARAMS_PER_S = 1.0e9

# When a collective runs, hence what compute it can hide under (per optimizer update).
LAST_BACKWARD = "last backward"  # the backward of the update's last micro-batch (DDP, ZeRO-1 under no_sync)
EACH_BACKWARD = "each backward"  # the backward of every micro-batch (ZeRO-2's partitioned gradients)
EACH_MICRO_BATCH = "each micro-batch"  # forward and backward of every micro-batch (FSDP2/ZeRO-3 prefetch)
NOTHING = "nothing"  # after the optimizer step (ZeRO-1/2 gather the updated weights)


@dataclass(frozen=True)
class Collective:
    """One kind of collective a strategy runs, counted per optimizer update on each rank.

    The tail is the part that cannot overlap even inside its window: DDP's last bucket is reduced
    after the backward has finished, FSDP2 gathers the first unit before the forward has anything
    to compute and reduce-scatters the last one after the backward is done.
    """

    what: str  # e.g. "all-reduce gradients"
    wire_bytes: float  # bytes each rank sends per update
    launches: int  # collective calls per update, each paying the latency
    hides_under: str  # LAST_BACKWARD, EACH_BACKWARD, EACH_MICRO_BATCH or NOTHING
    tail_bytes: float = 0.0  # of wire_bytes, sent when no compute is left to hide it
    tail_launches: int = 0

    def seconds(self, gb_per_s: float, latency_s: float) -> float:
        return self.launches * latency_s + self.wire_bytes / (gb_per_s * 1e9)

    def tail_seconds(self, gb_per_s: float, latency_s: float) -> float:
        return self.tail_launches * latency_s + self.tail_bytes / (gb_per_s * 1e9)


@dataclass(frozen=True)
class Speed:
    tokens_per_second: float  # whole cluster
    compute_s_per_token: float  # per GPU
    comm_s_per_token: float  # per GPU, all collectives, before overlap
    exposed_comm_s_per_token: float  # per GPU, the part compute does not hide
    offload_s_per_token: float  # per GPU: PCIe copies and the host optimizer step
    comm_bound: bool

    @property
    def scaling_efficiency(self) -> float:
        """tokens/s ÷ (GPUs × tokens/s of one GPU running the same micro-batches alone)."""
        compute = self.compute_s_per_token
        return compute / (compute + self.exposed_comm_s_per_token)


def training_flops(w: Workload) -> tuple[float, float]:
    """(forward, backward) training FLOPs per token: 2 per matmul weight forward, 2 for input
    gradients, 2 per trainable weight for weight gradients, the forward again in the backward when
    checkpointing recomputes it; attention adds 2·s·width per layer forward (causal half of QKᵀ
    and AV) and twice that backward."""
    adapters = 0 if w.method == "full" else trainable_params(w)
    matmul = count_params(w.model).matmul + adapters
    trainable = matmul if w.method == "full" else adapters
    attention = 2 * w.seq_len * w.model.num_heads * w.model.resolved_head_dim * w.model.num_layers
    forward = 2 * matmul + attention
    backward = 2 * matmul + 2 * trainable + 2 * attention
    return forward, backward + (forward if w.gradient_checkpointing else 0)


def gathered_weight_bytes(w: Workload) -> float:
    """Bytes of all weights as FSDP/ZeRO-3 all-gather them (16-bit; QLoRA's packed 4-bit)."""
    counts = count_params(w.model)
    e = w.precision.compute_bytes
    if w.method == "qlora":
        return counts.quantizable * 0.5 + (counts.total - counts.quantizable) * e
    return counts.total * e


def collectives(w: Workload) -> tuple[Collective, ...]:
    """What each rank sends per optimizer update under `w.strategy` (nothing on one GPU)."""
    n = w.world_size
    if n == 1:
        return ()
    ring = (n - 1) / n
    micro = w.gradient_accumulation_steps
    gradients = model_states(w).gradients  # unsharded, in the dtype they are reduced in
    trainable = trainable_params(w)
    ds_buckets = math.ceil(trainable / DS_BUCKET_ELEMENTS)
    updated = ring * trainable * w.precision.compute_bytes
    updated_weights = Collective("all-gather updated weights", updated, ds_buckets, NOTHING, updated, ds_buckets)
    if w.strategy.ddp:
        last_bucket = 2 * ring * min(gradients, DDP_BUCKET_BYTES)
        return (Collective("all-reduce gradients", 2 * ring * gradients, math.ceil(gradients / DDP_BUCKET_BYTES),
                           LAST_BACKWARD, last_bucket, 1),)
    last_bucket = ring * min(gradients, DS_BUCKET_ELEMENTS * gradients / max(trainable, 1))
    if not w.strategy.shards_gradients:  # ZeRO-1
        return (Collective("reduce-scatter gradients", ring * gradients, ds_buckets, LAST_BACKWARD, last_bucket, 1),
                updated_weights)
    if not w.strategy.shards_weights:  # ZeRO-2
        return (Collective("reduce-scatter gradients", micro * ring * gradients, micro * ds_buckets, EACH_BACKWARD,
                           micro * last_bucket, micro), updated_weights)
    # fsdp, zero3: one unit per decoder layer plus the root (embeddings, head); weights are gathered
    # for the forward and again for the backward, gradients reduce-scattered in the backward
    units = w.model.num_layers + 1
    gathered = 2 * ring * gathered_weight_bytes(w)
    return (
        Collective("all-gather weights (forward, backward)", micro * gathered, micro * 2 * units, EACH_MICRO_BATCH,
                   micro * gathered / (2 * units), micro),
        Collective("reduce-scatter gradients", micro * ring * gradients, micro * units, EACH_MICRO_BATCH,
                   micro * ring * gradients / units, micro),
    )


def link(w: Workload) -> tuple[float, float]:
    """(GB/s per direction, latency in s) of the slowest link the collectives cross."""
    if w.nodes > 1:
        return min(w.gpu.link_gb_per_s, INTER_NODE_GB_PER_S), INTER_NODE_LATENCY_S
    return w.gpu.link_gb_per_s, LATENCY_S


def exposed_seconds(items: tuple[Collective, ...], gb_per_s: float, latency_s: float,
                    forward_s: float, backward_s: float, micro_batches: int) -> float:
    """Communication time per update that compute does not hide, window by window."""
    windows = {LAST_BACKWARD: backward_s, EACH_BACKWARD: micro_batches * backward_s,
               EACH_MICRO_BATCH: micro_batches * (forward_s + backward_s), NOTHING: 0.0}
    exposed = 0.0
    for window, compute in windows.items():
        inside = [c for c in items if c.hides_under == window]
        tail = sum(c.tail_seconds(gb_per_s, latency_s) for c in inside)
        rest = sum(c.seconds(gb_per_s, latency_s) for c in inside) - tail
        exposed += tail + max(0.0, rest - OVERLAP * compute)
    return exposed


def estimate_speed(w: Workload) -> Speed:
    n = w.world_size
    efficiency = BASE_MFU * (QLORA_SPEED if w.method == "qlora" else 1.0) * (FP32_SPEED if w.precision.fp32 else 1.0)
    throughput = w.gpu.bf16_tflops * 1e12 * efficiency
    tokens_micro = w.tokens_per_micro_batch
    tokens_update = tokens_micro * w.gradient_accumulation_steps
    forward, backward = (flops * tokens_micro / throughput for flops in training_flops(w))  # seconds per micro-batch
    compute = w.gradient_accumulation_steps * (forward + backward)

    items = collectives(w)
    gb_per_s, latency_s = link(w)
    comm = sum(c.seconds(gb_per_s, latency_s) for c in items)
    exposed = exposed_seconds(items, gb_per_s, latency_s, forward, backward, w.gradient_accumulation_steps)

    offload = 0.0  # per update
    e = w.precision.compute_bytes
    if w.offload != "none":
        shard = trainable_params(w) / n
        copies = shard * (e + e)  # gradients to the host, updated 16-bit weights back
        offload += copies / (PCIE_GB_PER_S * 1e9) + shard * w.gpus_per_node / CPU_ADAM_PARAMS_PER_S
    if w.offload == "params":  # weights come in for forward and backward of every micro-batch
        offload += w.gradient_accumulation_steps * 2 * gathered_weight_bytes(w) / n / (PCIE_GB_PER_S * 1e9)

    return Speed(
        tokens_per_second=n * tokens_update / (compute + exposed + offload),
        compute_s_per_token=compute / tokens_update,
        comm_s_per_token=comm / tokens_update,
        exposed_comm_s_per_token=exposed / tokens_update,
        offload_s_per_token=offload / tokens_update,
        comm_bound=comm > compute,
    )
