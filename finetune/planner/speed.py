"""Tokens per second of a workload: FLOPs per token over achievable throughput, plus the
communication and offload time that compute cannot hide.

A rough model by design: it ranks plans (sharding over PCIe vs NVLink, offload, QLoRA's
dequantization) and flags communication-bound ones; absolute numbers are ±30 %.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.planner.memory import model_states, trainable_params
from finetune.planner.params import count_params
from finetune.planner.workload import Workload

# Fraction of the GPU's dense bf16 peak a fine-tuning step reaches with transformers + SDPA
# (model FLOPs utilisation; published HF/Accelerate fine-tuning runs report 35–50 % on A100/H100).
BASE_MFU = 0.40
# bitsandbytes dequantizes every 4-bit weight for each forward and backward matmul: QLoRA steps
# run at about 0.6× the speed of LoRA on a 16-bit base (QLoRA paper and bitsandbytes benchmarks).
QLORA_SPEED = 0.6
# fp32 matmuls run on TF32 tensor cores: half the bf16 rate.
FP32_SPEED = 0.5
# Per-strategy overhead beyond communication volume (hooks, launches, synchronisation of sharded
# parameters): a rough guess from published scaling tables, enough to prefer the simpler strategy
# when two plans are otherwise as fast.
STRATEGY_EFFICIENCY = {"single": 1.0, "ddp": 0.97, "zero1": 0.96, "zero2": 0.95, "fsdp": 0.92, "zero3": 0.88}
# Share of communication that overlaps with compute (DDP bucketing, FSDP/ZeRO-3 prefetch).
COMM_OVERLAP = 0.7
# Network between nodes, per node, GB/s per direction (200 Gb/s Ethernet/InfiniBand class).
INTER_NODE_GB_PER_S = 25.0
# Host↔device copies for offload: achievable PCIe 4.0 x16 bandwidth, GB/s.
PCIE_GB_PER_S = 20.0
# DeepSpeed CPUAdam / the host optimizer step: parameters updated per second by one node's CPUs.
CPU_ADAM_PARAMS_PER_S = 1.0e9


@dataclass(frozen=True)
class Speed:
    tokens_per_second: float  # whole cluster
    compute_s_per_token: float  # per GPU
    comm_s_per_token: float  # per GPU, before overlap
    offload_s_per_token: float  # per GPU: PCIe copies and the host optimizer step
    comm_bound: bool


def flops_per_token(w: Workload) -> float:
    """Training FLOPs per token: 2 per matmul weight forward, 2 for input gradients, 2 per trainable
    weight for weight gradients, the forward again when checkpointing recomputes it; attention adds
    2·s·width per layer forward (causal half of QKᵀ and AV) and twice that backward."""
    adapters = 0 if w.method == "full" else trainable_params(w)
    matmul = count_params(w.model).matmul + adapters
    trainable = matmul if w.method == "full" else adapters
    attention = 2 * w.seq_len * w.model.num_heads * w.model.resolved_head_dim * w.model.num_layers
    forward = 2 * matmul + attention
    backward = 2 * matmul + 2 * trainable + 2 * attention
    return forward + backward + (forward if w.gradient_checkpointing else 0)


def gathered_weight_bytes(w: Workload) -> float:
    """Bytes of all weights as FSDP/ZeRO-3 all-gather them (16-bit; QLoRA's packed 4-bit)."""
    counts = count_params(w.model)
    e = w.precision_spec.compute_bytes
    if w.method == "qlora":
        return counts.quantizable * 0.5 + (counts.total - counts.quantizable) * e
    return counts.total * e


def estimate_speed(w: Workload) -> Speed:
    n = w.world_size
    efficiency = BASE_MFU * STRATEGY_EFFICIENCY[w.strategy] * (QLORA_SPEED if w.method == "qlora" else 1.0) * (FP32_SPEED if w.precision == "fp32" else 1.0)
    compute = flops_per_token(w) / (w.gpu.bf16_tflops * 1e12 * efficiency)

    tokens_micro = w.tokens_per_micro_batch
    tokens_update = tokens_micro * w.gradient_accumulation_steps
    states = model_states(w)
    e = w.precision_spec.compute_bytes
    all_weights = gathered_weight_bytes(w)
    ring = (n - 1) / n
    per_micro, per_update = 0.0, 0.0
    if w.strategy == "ddp":
        per_update = 2 * ring * states.gradients
    elif w.strategy == "zero1":
        per_update = ring * (states.gradients + trainable_params(w) * e)
    elif w.strategy == "zero2":
        per_micro, per_update = ring * states.gradients, ring * trainable_params(w) * e
    elif w.strategy in ("fsdp", "zero3"):
        per_micro = ring * (2 * all_weights + states.gradients)  # all-gather forward + backward, reduce-scatter
    bandwidth = min(w.gpu.link_gb_per_s, INTER_NODE_GB_PER_S if w.nodes > 1 else w.gpu.link_gb_per_s) * 1e9
    comm = (per_micro / tokens_micro + per_update / tokens_update) / bandwidth if n > 1 else 0.0

    offload = 0.0
    if w.offload != "none":
        shard = trainable_params(w) / n
        copies = shard * (e + e)  # gradients to the host, updated 16-bit weights back
        step = shard * w.gpus_per_node / CPU_ADAM_PARAMS_PER_S
        offload += (copies / (PCIE_GB_PER_S * 1e9) + step) / tokens_update
    if w.offload == "params":
        offload += 2 * all_weights / n / (PCIE_GB_PER_S * 1e9) / tokens_micro  # weights in for forward and backward

    per_token = compute + max(0.0, comm - COMM_OVERLAP * compute) + offload
    return Speed(
        tokens_per_second=n / per_token,
        compute_s_per_token=compute,
        comm_s_per_token=comm,
        offload_s_per_token=offload,
        comm_bound=comm > compute,
    )
