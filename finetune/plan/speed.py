"""Tokens per second of a workload: a per-update cost fitted to measured runs, plus the
communication that compute cannot hide, plus offload copies and the host optimizer step.

One GPU's time per micro-batch is the larger of two clocks that run side by side:
- the host issuing kernels (eager PyTorch: Python and launch overhead per decoder layer, per
  PEFT-adapted linear and per bitsandbytes dequantization; regional compilation shrinks it), and
- the GPU executing them (matmul FLOPs at an efficiency that grows with the tokens per micro-batch,
  attention FLOPs by sequence length, memory-bound passes over the logits and 4-bit weights).
Small shapes are bound by the first (a 1B LoRA at seq 512 spends ~135 ms per update on an H100
whatever its FLOPs), large ones by the second. The optimizer step follows, memory-bound.
The coefficients in `CALIBRATION` are fitted by bench/speed_fit.py to the runs committed in
bench/gpu/measured/*.csv; GPUs without measurements scale the GPU clock by their peak TFLOP/s and
memory bandwidth, and `Speed.calibrated` says which kind a number is.

Communication is counted collective by collective (an α–β model): each collective moves a known
number of bytes per rank over the link (ring algorithms send (n−1)/n of the buffer per all-gather
or reduce-scatter, twice that per all-reduce) and pays a fixed latency per launch. What it can hide
under depends on when the strategy issues it: DDP's bucketed all-reduce runs during the last
micro-batch's backward, FSDP2/ZeRO-3 prefetch all-gathers during each forward and backward, and
ZeRO-1/2 gather the updated weights after the optimizer step, where nothing hides them.
`finetune scaling` measures tokens/s on 1, 2, … processes and times the gradient all-reduce to
check this model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune.plan.memory import DS_BUCKET_ELEMENTS, model_states, place_states, trainable_params
from finetune.plan.params import count_params, layer_linears, resolve_lora_targets
from finetune.plan.workload import Workload



@dataclass(frozen=True)
class Calibration:
    """Coefficients of one GPU's time per micro-batch, fitted to measured runs by bench/speed_fit.py."""

    layer_issue_s: float  # host time to issue one decoder layer's forward + backward in eager transformers
    adapter_issue_s: float  # the same per PEFT LoRA linear (dropout, A, B, scale, add and their backward)
    dequant_issue_s: float  # per bitsandbytes 4-bit linear per dequantization (forward, backward, recompute)
    peak_mfu: float  # fraction of the dense bf16 peak the matmuls reach at large micro-batches
    half_tokens: float  # tokens per micro-batch at which the matmuls reach half of peak_mfu
    liger_gpu_speedup: float  # GPU clock without ÷ with Liger kernels (TRL SFTTrainer ± use_liger_kernel)


# Fitted on one H100 80GB (torch 2.11 + CUDA 13, transformers 5.17, peft 0.21, eager, SDPA):
# bench/gpu/measured/h100-2026-11-25.csv, `python bench/speed_fit.py` (bench/RESULTS.md, per row).
CALIBRATION = Calibration(
    layer_issue_s=6.48e-3, adapter_issue_s=0.334e-3, dequant_issue_s=0.441e-3, peak_mfu=0.436, half_tokens=1695,
    liger_gpu_speedup=1.214,
)
# GPU classes with measured runs behind CALIBRATION; every other GPU is extrapolated from them.
CALIBRATED_GPUS = ("H100-80GB",)
# Of the host's issue time, the forward's share (a bare PEFT loop at 1B LoRA s512 on the H100:
# 58 of 145 ms); checkpointing runs the forward again in the backward.
FORWARD_SHARE = 0.4
# Attention FLOPs (flash / memory-efficient SDPA) run at this fraction of the matmuls' rate:
# FlashAttention-2 reports 50–73 % of peak forward and less backward, dense GEMMs ~75 % (assumed, not fitted).
ATTENTION_SPEED = 0.6
# Regional compilation of the decoder blocks fuses the elementwise kernels and skips most of the
# Python of each layer; the issue time of a compiled layer as a fraction of eager. NOT MEASURED:
# an assumption until a compiled run is committed, so such plans are marked extrapolated.
COMPILED_ISSUE = 0.35
# fp32 matmuls run on TF32 tensor cores: half the bf16 rate.
FP32_SPEED = 0.5
# Bytes per vocabulary entry per token that transformers' unfused loss moves through memory:
# 16-bit logits written and read, fp32 upcast, log-softmax and its gradient, 16-bit logit gradient.
UNFUSED_LOSS_BYTES = 24
# Memory bandwidth, TB/s (vendor datasheets), for the memory-bound passes (loss, dequantization,
# optimizer step); GPUs missing here scale the H100's by their peak TFLOP/s.
MEMORY_TB_PER_S = {
    "A100-40GB": 1.555, "A100-80GB": 2.039, "H100-80GB": 3.35, "H200": 4.8, "L40S": 0.864, "A10G": 0.6,
    "L4": 0.3, "RTX3090": 0.936, "RTX4090": 1.008, "RTX6000-Ada": 0.96, "V100-16GB": 0.9, "V100-32GB": 0.9,
    "T4": 0.32, "MI300X": 5.3,
}
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
    compute_s_per_token: float  # per GPU: the larger of the host's and the GPU's clock, and the optimizer step
    comm_s_per_token: float  # per GPU, all collectives, before overlap
    exposed_comm_s_per_token: float  # per GPU, the part compute does not hide
    offload_s_per_token: float  # per GPU: PCIe copies and the host optimizer step
    comm_bound: bool
    launch_bound: bool = False  # the host issuing kernels, not the GPU, sets the pace
    basis: str = ""  # "calibrated on H100-80GB" or "extrapolated: <why>"

    @property
    def calibrated(self) -> bool:
        return self.basis.startswith("calibrated")

    @property
    def scaling_efficiency(self) -> float:
        """tokens/s ÷ (GPUs × tokens/s of one GPU running the same micro-batches alone)."""
        compute = self.compute_s_per_token
        return compute / (compute + self.exposed_comm_s_per_token)


def training_flops(w: Workload) -> tuple[float, float]:
    """(forward, backward) training FLOPs per token: 2 per matmul weight forward, 2 for input
    gradients, 2 per trainable weight for weight gradients, the forward of the layers checkpointing
    recomputes again in the backward; attention adds 2·s·width per layer forward (causal half of QKᵀ
    and AV) and twice that backward."""
    counts = count_params(w.model)
    adapters = 0 if w.method == "full" else trainable_params(w)
    matmul = counts.matmul + adapters
    trainable = matmul if w.method == "full" else adapters
    attention = attention_flops(w)
    forward = 2 * matmul + attention
    backward = 2 * matmul + 2 * trainable + 2 * attention
    recomputed = forward - 2 * (counts.head or counts.embedding)  # the decoder layers; the LM head runs once
    return forward, backward + recomputed * w.recompute_share


def attention_flops(w: Workload) -> float:
    """Forward attention FLOPs per token: 2·s·width per layer (the causal half of QKᵀ and AV)."""
    return 2 * w.seq_len * w.model.num_heads * w.model.resolved_head_dim * w.model.num_layers


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


def issue_seconds(w: Workload, c: Calibration) -> float:
    """Host time to issue one micro-batch's kernels: per decoder layer, per adapted linear (once
    more for the layers whose forward checkpointing recomputes), per 4-bit dequantization."""
    layers = w.model.num_layers
    adapted = 0 if w.method == "full" else layers * len(resolve_lora_targets(w.model, w.lora_targets))
    passes = 1 + FORWARD_SHARE * w.recompute_share
    per_pass = (layers * c.layer_issue_s + adapted * c.adapter_issue_s) * (COMPILED_ISSUE if w.compile else 1.0)
    dequant = 0.0
    if w.method == "qlora":  # each 4-bit linear is dequantized in the forward, the backward and any recompute
        dequant = layers * len(layer_linears(w.model)) * (2 + w.recompute_share) * c.dequant_issue_s
    return passes * per_pass + dequant


def gpu_seconds(w: Workload, c: Calibration) -> float:
    """GPU time of one micro-batch: matmuls at an efficiency that grows with the tokens per
    micro-batch, attention by sequence length, and the memory-bound passes."""
    tokens = w.tokens_per_micro_batch
    rate = w.gpu.bf16_tflops * 1e12 * c.peak_mfu * tokens / (tokens + c.half_tokens)
    rate *= FP32_SPEED if w.precision.fp32 else 1.0
    forward, backward = training_flops(w)
    attention = attention_flops(w) * (3 + w.recompute_share)  # forward, backward twice, recompute
    seconds = tokens * ((forward + backward - attention) / rate + attention / (rate * ATTENTION_SPEED))
    moved = 0.0 if w.loss == "liger" else tokens * w.model.vocab_size * UNFUSED_LOSS_BYTES
    if w.method == "qlora":  # 4-bit read, 16-bit written, per dequantization
        moved += count_params(w.model).quantizable * 2.5 * (2 + w.recompute_share)
    seconds += moved / memory_bytes_per_s(w)
    return seconds / (c.liger_gpu_speedup if w.loss == "liger" else 1.0)


def optimizer_seconds(w: Workload) -> float:
    """The optimizer step, memory-bound: trainable weights, gradients and states read, weights and
    states written (and the foreach temporaries), for the share of states this GPU updates
    (all of them on one GPU or DDP, 1/n sharded, none when offloaded)."""
    states = model_states(w)
    share = place_states(w, states).optimizer / states.optimizer if states.optimizer else 0.0
    moved = 2 * states.trainable + states.gradients + 2 * states.optimizer + 2 * states.step_scratch
    return share * moved / memory_bytes_per_s(w)


def memory_bytes_per_s(w: Workload) -> float:
    """The GPU's memory bandwidth, bytes/s (datasheet; else the H100's scaled by peak TFLOP/s)."""
    tb_per_s = MEMORY_TB_PER_S.get(w.gpu.name, MEMORY_TB_PER_S["H100-80GB"] * w.gpu.bf16_tflops / 989)
    return tb_per_s * 1e12


def speed_basis(w: Workload) -> str:
    """Whether the compute clock rests on runs measured on this GPU class, and if not, why not."""
    if w.gpu.name not in CALIBRATED_GPUS:
        return f"extrapolated: no measured runs on {w.gpu.name} (calibrated on {', '.join(CALIBRATED_GPUS)})"
    if w.compile:
        return "extrapolated: compiled blocks not measured yet"
    if w.world_size > 1 or w.offload != "none":
        return f"extrapolated: calibrated on one {w.gpu.name}; communication and offload not measured"
    return f"calibrated on {w.gpu.name}"


def estimate_speed(w: Workload, calibration: Calibration = CALIBRATION) -> Speed:
    n = w.world_size
    tokens_update = w.tokens_per_micro_batch * w.gradient_accumulation_steps
    issue, gpu = issue_seconds(w, calibration), gpu_seconds(w, calibration)
    forward_share = training_flops(w)[0] / sum(training_flops(w))
    forward, backward = gpu * forward_share, gpu * (1 - forward_share)  # the windows communication hides under
    compute = w.gradient_accumulation_steps * max(issue, gpu) + optimizer_seconds(w)

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
        launch_bound=issue > gpu,
        basis=speed_basis(w),
    )
