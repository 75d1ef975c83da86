"""Tokens per second of a workload: a per-update cost fitted to measured runs, plus the
communication that compute cannot hide, plus offload copies and the host optimizer step.

One GPU's time per micro-batch combines two clocks that run side by side:
- the host issuing kernels (eager PyTorch: Python and launch overhead per decoder layer, per
  PEFT-adapted linear, per bitsandbytes dequantization and per chunk of the chunked loss; regional
  compilation shrinks it), and
- the GPU executing them, a sum of terms that carry from one GPU to another (`gpu_terms`): dense
  matmul FLOPs at the achieved fraction of the GPU's dense peak fitted for each GPU measured; a
  mixture of experts' grouped matmuls, slower the fewer tokens each expert gets; attention FLOPs by
  kernel (flash at a fitted share of the matmul rate per chip; SDPA's kernel for an explicit mask, as
  a sliding window shorter than the row makes transformers pass, over every score; eager), head size
  and sequence length; memory-bound bytes (plan/traffic.py: norms, rotary embeddings, activations,
  LoRA branches, the loss over the vocabulary, 4-bit dequantization, context parallelism's merges) at
  the fitted fraction of the GPU's datasheet memory bandwidth; and a fixed GPU time per kernel launched
  (launch and tail). `kernel_classes` regroups them as a profiler sorts kernels.
Small shapes are bound by the host (a 1B LoRA at seq 512 spends about the same time per update on
an H100 whatever its FLOPs: bench/RESULTS.md, *Speed model*), large ones by the GPU. The two overlap
only in part: within a layer the host runs ahead while a large matmul executes and the GPU idles
through a run of small kernels, so a micro-batch takes more than the larger clock, and most where
the two are close: (Hᵖ + Gᵖ)^(1/p), with the exponent p fitted (p → ∞ is perfect overlap, p = 1 none).
The optimizer step follows, memory-bound.
The coefficients in `CALIBRATION` are fitted by bench/speed_fit.py to finetune's runs committed in
plan/calibration/measured/*.csv, the GPU kit's per-layer profile (plan/calibration/speed_terms_h200.csv)
and published runs of other trainers (plan/calibration/speed_*.csv, fitted on the GPU clock only: their
host is not ours). A GPU without measurements takes its chip's measured GPUs' matmul efficiency, or
every measured GPU's; every estimate carries the range cross-validation supports (plan/speed_range.py).

Communication is counted collective by collective (an α–β model): each collective moves a known
number of bytes per rank over the link (ring algorithms send (n−1)/n of the buffer per all-gather
or reduce-scatter, twice that per all-reduce) and pays a fixed latency per launch. What it can hide
under depends on when the strategy issues it: DDP's bucketed all-reduce runs during the last
micro-batch's backward, FSDP2/ZeRO-3 prefetch all-gathers during each forward and backward, and
ZeRO-1/2 gather the updated weights after the optimizer step, where nothing hides them, and context
parallelism's ring passes keys and values while each hop's attention computes.
`finetune scaling` measures tokens/s on 1, 2, … processes and times the gradient all-reduce to
check this model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune.config.switches import chunk_tokens
from finetune.plan import gpus, parallel, params
from finetune.plan.gpus import GPUSpec
from finetune.plan.memory import DS_BUCKET_ELEMENTS, fp8_linears, fp8_params, model_states, place_states, trainable_params
from finetune.plan.params import count_params, resolve_lora_targets
from finetune.plan.speed_range import SpeedRange, speed_range
from finetune.plan.traffic import (
    DEQUANT_KERNELS,
    adapter_matmul_bytes,
    attention_kernels,
    dequantizations,
    dequantized_bytes,
    kernel_launches,
    matmul_kernels,
    traffic,
)
from finetune.plan.workload import Workload


@dataclass(frozen=True)
class Calibration:
    """Coefficients of one GPU's time per micro-batch, fitted to measured runs by bench/speed_fit.py."""

    layer_issue_s: float  # host time to issue one decoder layer's forward + backward in eager transformers
    adapter_issue_s: float  # the same per PEFT LoRA linear (dropout, A, B, scale, add and their backward)
    dequant_issue_s: float  # per bitsandbytes 4-bit linear per dequantization (forward, backward, recompute)
    matmul_efficiency: dict[str, float]  # per GPU measured (catalog name): achieved fraction of its dense bf16 peak in matmuls
    attention_speed: dict[str, float]  # per chip: flash attention's FLOP rate ÷ the GPU's matmul rate (head size ≥ 128)
    masked_attention_speed: float  # SDPA's kernel for an explicit mask (every score computed) ÷ the matmul rate
    memory_efficiency: float  # achieved fraction of the datasheet bandwidth in the memory-bound kernels
    kernel_gpu_s: float  # GPU time per kernel launched that neither its FLOPs nor its bytes explain
    expert_tokens_half: float  # tokens per expert at which a grouped expert matmul runs at half the matmul rate
    overlap_exponent: float  # p in (Hᵖ + Gᵖ)^(1/p): how far the host's and the GPU's clocks overlap

    def efficiency(self, gpu: GPUSpec) -> float:
        """The GPU's fitted matmul efficiency (a card given by its memory: that of the card it is planned
        like); a GPU never measured takes the geometric mean of the measured GPUs of its chip, or of every
        measured GPU when its chip is new."""
        for name in (gpu.name, gpu.speed_of):
            if name in self.matmul_efficiency:
                return self.matmul_efficiency[name]
        peers = [v for name, v in self.matmul_efficiency.items() if gpus.GPUS[name].chip == gpu.chip]
        return geometric_mean(peers or list(self.matmul_efficiency.values()))

    def attention(self, chip: str) -> float:
        """The chip's flash attention speed; a chip never measured takes the measured chips' geometric mean."""
        return self.attention_speed.get(chip) or geometric_mean(list(self.attention_speed.values()))

    @property
    def chips(self) -> tuple[str, ...]:
        """The chips of the GPUs measured (plan/speed_range.py's basis)."""
        return tuple(dict.fromkeys(gpus.GPUS[name].chip for name in self.matmul_efficiency))


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


# Fitted by `python bench/speed_fit.py --fit` (bench/RESULTS.md, *Speed model*) to finetune's runs on
# one H100 80GB and one H200 (plan/calibration/measured/*.csv: torch 2.11 + CUDA 13, transformers 5.17,
# peft 0.21, eager, SDPA), the GPU kit's profile of the H200's decoder layers by kernel class
# (plan/calibration/speed_terms_h200.csv), LLaMA-Factory's Llama-2-7B QLoRA runs on one A100 40GB at
# 1k–32k tokens and four published 8-GPU runs (prime-rl's Qwen3-30B-A3B, torchtitan's Llama-3.1-8B with
# and without CP; plan/calibration/speed_*.csv, GPU clock only): 13 coefficients, each with a weak prior.
# The H200 runs its matmuls at a smaller share of the same peak than the H100 measured (the same TRL
# step took 7–13 % longer there), so each GPU measured has its own matmul efficiency. Its out-of-sample
# errors are in bench/RESULTS.md (*Speed model*).
CALIBRATION = Calibration(
    layer_issue_s=4.629e-03, adapter_issue_s=5.924e-04, dequant_issue_s=4.350e-04,
    matmul_efficiency={"A100-40GB": 0.854, "H100-80GB": 0.872, "H200": 0.729},
    attention_speed={"A100": 1.000, "H100": 0.359}, masked_attention_speed=0.473,
    memory_efficiency=0.683, kernel_gpu_s=2.191e-06, expert_tokens_half=2516, overlap_exponent=3.03,
)
# The host's time to issue one decoder layer of each model code, relative to Llama's (whose runs,
# with Mistral's, the fit rests on): Python and dispatcher work, the same on any host, measured by
# `python bench/layer_issue.py` on width-64 cuts on a CPU (bench/RESULTS.md, *Layer issue by model
# code*; run to run within 0.08). The MoE cuts run transformers' grouped-matmul experts, as on a GPU, but
# keep at most 8 experts: whether the routing's host work grows with 64–128 is not measured.
LAYER_ISSUE_RELATIVE = {"llama": 1.0, "mistral": 1.01, "qwen2": 1.04, "qwen3": 1.19, "gemma3": 1.42, "mixtral": 1.53,
                        "qwen3_moe": 1.76, "gpt_oss": 2.06, "olmoe": 1.71, "deepseek_v2": 2.18}
# Of the host's issue time, the forward's share (a bare PEFT loop at 1B LoRA s512 on the H100:
# 58 of 145 ms); checkpointing runs the forward again in the backward.
FORWARD_SHARE = 0.4
# The host's time to issue one chunk of the chunked loss (train/chunked_loss.py: the head's matmul,
# the fp32 softmax passes, the gradient's scatter and cast, the gradient matmuls: LOSS_CHUNK_CALLS plain
# tensor calls, no modules, hooks or autograd nodes), relative to a Llama decoder layer's forward + backward:
# measured on this CPU's width-64 cuts by `python bench/layer_issue.py` (bench/RESULTS.md, *Layer issue
# by model code*: 0.013 and 0.017 in two runs). The old count, 18 kernels at a layer's cost per kernel,
# made a chunk 0.16 of a layer.
LOSS_CHUNK_ISSUE_RELATIVE = 0.015
# The host's time for one plain tensor call outside any module (no hooks, no module dispatch), relative
# to a Llama decoder layer's forward + backward: a chunk of the chunked loss over its calls. What --fp8's
# casts (train/fp8.py: plain calls inside an autograd function) cost the host per kernel.
LOSS_CHUNK_CALLS = 17
TENSOR_CALL_ISSUE_RELATIVE = LOSS_CHUNK_ISSUE_RELATIVE / LOSS_CHUNK_CALLS
# Flash attention at head size 64 runs at this fraction of its head-size-128 rate (FlashAttention-2's
# kernel benchmarks: smaller tiles, the same memory traffic per FLOP). ASSUMED, not fitted.
SMALL_HEAD_ATTENTION = 0.85
# Regional compilation of the decoder blocks fuses the elementwise kernels and skips most of the
# Python of each layer; the issue time of a compiled layer as a fraction of eager. NOT MEASURED:
# an assumption until a compiled run is committed, so such plans are marked extrapolated.
COMPILED_ISSUE = 0.35
# torch's foreach AdamW (its default on CUDA; FSDP2 steps with it) makes eight passes over parameter-sized
# tensors (the weight decay, lerp, mul, addcmul, sqrt, div, add, addcdiv) where the fused kernel makes
# one. Measured on the H200 (bench/gpu_kit/defaults.py, 2-layer cuts of full fine-tuning): foreach took
# 7.8 and 16.2 ms longer per update than fused over 0.70 and 1.49 B fp32 parameters, 36–37 bytes per
# parameter at the fitted bandwidth: 9 state-sized tensors (its scratch, model_states' step_scratch, is one).
FOREACH_EXTRA_PASSES = 9
# --fp8 (train/fp8.py) casts each operand of its float8 matmuls (a base linear's input forward, its
# output's gradient backward): kernels per cast (the absolute maximum, the scale and its inverse, the
# product, the cast) and bytes moved per 16-bit element (read for the maximum, read and written as the
# product, read and written as one byte); compiled blocks fuse the product into the cast. NOT MEASURED.
FP8_CAST_KERNELS = {"eager": 6, "compiled": 3}
FP8_CAST_BYTES = {"eager": 9, "compiled": 5}
# fp32 matmuls run on TF32 tensor cores: half the bf16 rate.
FP32_SPEED = 0.5
# A GPU the catalog does not know (a dry run's device) gets an H100's bandwidth per peak TFLOP/s.
H100_TB_PER_S, H100_TFLOPS = 3.35, 989
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
EACH_ATTENTION = "each attention"  # the attention of every micro-batch (CP's ring: the next block waits for its keys)


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
    compute_s_per_token: float  # per GPU: the host's and the GPU's clocks combined, and the optimizer step
    comm_s_per_token: float  # per GPU, all collectives, before overlap
    exposed_comm_s_per_token: float  # per GPU, the part compute does not hide
    offload_s_per_token: float  # per GPU: PCIe copies and the host optimizer step
    comm_bound: bool
    launch_bound: bool = False  # the host issuing kernels, not the GPU, sets the pace
    likely: SpeedRange = SpeedRange(1.0, 1.0, "", False)  # the range the fit supports, and what it rests on

    @property
    def basis(self) -> str:
        return self.likely.basis

    @property
    def calibrated(self) -> bool:
        """Measured on this chip and shape family, with nothing unmeasured on top (communication, offload, compile)."""
        return self.likely.measured

    @property
    def low(self) -> float:
        return self.tokens_per_second * self.likely.low

    @property
    def high(self) -> float:
        return self.tokens_per_second * self.likely.high

    @property
    def scaling_efficiency(self) -> float:
        """tokens/s ÷ (GPUs × tokens/s of one GPU running the same micro-batches alone)."""
        compute = self.compute_s_per_token
        return compute / (compute + self.exposed_comm_s_per_token)


def training_flops(w: Workload) -> tuple[float, float]:
    """(forward, backward) training FLOPs per token: 2 per matmul weight forward, 2 for input
    gradients, 2 per trainable weight for weight gradients, the forward of the layers checkpointing
    recomputes again in the backward, and a preference objective's forwards without gradients (its
    reference's, KTO's mismatched rows); attention adds 2·s·width per layer forward (causal half of QKᵀ
    and AV) and twice that backward."""
    counts = count_params(w.model)
    adapters = 0 if w.method == "full" else trainable_params(w)
    matmul = counts.matmul + adapters
    trainable = matmul if w.method == "full" else adapters
    attention = attention_flops(w)
    forward = 2 * matmul + attention
    backward = 2 * matmul + 2 * trainable + 2 * attention
    recomputed = forward - 2 * (counts.head or counts.embedding)  # the decoder layers; the LM head runs once
    # a preference objective's forwards without gradients (the reference's; KTO's mismatched rows) of the base
    reference = w.forward_only_passes * (2 * counts.matmul + attention)
    return forward + reference, backward + recomputed * w.recompute_share


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
    """What each rank sends per optimizer update under `w.strategy` (nothing on one GPU), over the
    ranks it shards over (a TP rank's slice over the data-parallel ranks)."""
    n = w.sharding_ranks
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
    gathered = 2 * ring * gathered_weight_bytes(w) / w.tp
    return (
        Collective("all-gather weights (forward, backward)", micro * gathered, micro * 2 * units, EACH_MICRO_BATCH,
                   micro * gathered / (2 * units), micro),
        Collective("reduce-scatter gradients", micro * ring * gradients, micro * units, EACH_MICRO_BATCH,
                   micro * ring * gradients / units, micro),
    )


def model_parallel_collectives(w: Workload) -> tuple[Collective, ...]:
    """What each rank of a TP or CP group sends its group per optimizer update (plan/parallel.py).

    TP, sequence-parallel: every decoder layer all-gathers whole rows into attention and into the MLP
    and reduce-scatters their outputs back onto sequence shards in the forward, the reverse in the
    backward (a reduce-scatter for each all-gather), and again for each forward checkpointing
    recomputes; each moves (tp − 1)/tp of a micro-batch's hidden states (compute dtype), so a layer's
    all-gather and reduce-scatter send the bytes of the one all-reduce they replace. The embedding
    and the loss add one pair each (the loss's per-chunk sums are a few floats a token). They sit
    between a layer's matmuls, so nothing hides them. CP, as torch's ring attention runs it: every
    layer all-gathers the keys and values of the other cp − 1 ranks in the forward (again in a
    recomputed forward) and in the backward, and passes each hop's key and value gradients on in
    fp32 (cp sends); all while attention computes (the next block waits for them).
    """
    spec, e, micro = w.model, w.precision.compute_bytes, w.gradient_accumulation_steps
    items = []
    if w.tp > 1:
        shard = (w.tp - 1) / w.tp * w.tokens_per_micro_batch * spec.hidden_size * e  # one all-gather or reduce-scatter
        per_layer = 8 + 4 * w.recompute_share  # 4 forward, 4 backward, 4 per recomputed forward
        per_micro = spec.num_layers * per_layer + 4  # + the embedding's and the loss's pair, forward and backward
        sums = 0  # the chunked loss all-reduces 3 sums a token per chunk: latency, not bytes
        if w.loss == "finetune-chunked":
            sums = 3 * math.ceil(w.tokens_per_micro_batch / chunk_tokens(parallel.vocabulary_rows(w)))
        else:  # the model's own head gathers the whole vocabulary's logits
            per_micro += spec.vocab_size / spec.hidden_size
        launches = micro * (round(spec.num_layers * per_layer + 4) + sums)
        items.append(Collective("all-gather / reduce-scatter activations (TP)", micro * per_micro * shard, launches, NOTHING,
                                micro * per_micro * shard, launches))
    if w.cp > 1:
        kv = 2 * spec.num_kv_heads * spec.resolved_head_dim * w.tokens_per_micro_batch / w.cp * e
        gathers = 2 + w.recompute_share  # forward, recomputed forward, backward
        per_layer = (w.cp - 1) * gathers * kv + w.cp * 2 * kv  # the gradients' sends in fp32: twice kv's bytes
        launches = micro * round(spec.num_layers * (gathers + w.cp))
        items.append(Collective("pass keys and values round the ring (CP)", micro * spec.num_layers * per_layer,
                                launches, EACH_ATTENTION))
    return tuple(items)


def model_parallel_link(w: Workload) -> tuple[float, float]:
    """(GB/s per direction, latency in s) of a TP/CP group's link: inside a node its GPUs' own link
    (NVLink, or PCIe), across nodes the network."""
    if w.model_parallel <= w.gpus_per_node:
        return w.gpu.link_gb_per_s, LATENCY_S
    return min(w.gpu.link_gb_per_s, INTER_NODE_GB_PER_S), INTER_NODE_LATENCY_S


def link(w: Workload) -> tuple[float, float]:
    """(GB/s per direction, latency in s) of the slowest link the collectives cross."""
    if w.nodes > 1:
        return min(w.gpu.link_gb_per_s, INTER_NODE_GB_PER_S), INTER_NODE_LATENCY_S
    return w.gpu.link_gb_per_s, LATENCY_S


def exposed_seconds(items: tuple[Collective, ...], gb_per_s: float, latency_s: float,
                    forward_s: float, backward_s: float, micro_batches: int, attention_s: float = 0.0) -> float:
    """Communication time per update that compute does not hide, window by window (`attention_s`:
    one micro-batch's attention, what CP's ring hides under)."""
    windows = {LAST_BACKWARD: backward_s, EACH_BACKWARD: micro_batches * backward_s,
               EACH_MICRO_BATCH: micro_batches * (forward_s + backward_s), EACH_ATTENTION: micro_batches * attention_s,
               NOTHING: 0.0}
    exposed = 0.0
    for window, compute in windows.items():
        inside = [c for c in items if c.hides_under == window]
        tail = sum(c.tail_seconds(gb_per_s, latency_s) for c in inside)
        rest = sum(c.seconds(gb_per_s, latency_s) for c in inside) - tail
        exposed += tail + max(0.0, rest - OVERLAP * compute)
    return exposed


def issue_seconds(w: Workload, c: Calibration) -> float:
    """Host time to issue one micro-batch's kernels: per decoder layer (by its model code), per
    adapted linear (once more for the layers whose forward checkpointing recomputes), per 4-bit
    dequantization."""
    layers = w.model.num_layers
    targets = None if w.method == "full" else resolve_lora_targets(w.model, w.lora_targets, w.method)
    adapted = 0 if targets is None else sum(n * len(params.adapted(linears, targets)) for n, linears in params.layer_kinds(w.model))
    passes = 1 + FORWARD_SHARE * (w.recompute_share + w.forward_only_passes)
    layer_s = c.layer_issue_s * LAYER_ISSUE_RELATIVE.get(w.model.model_type, 1.0)
    per_pass = (layers * layer_s + adapted * c.adapter_issue_s) * (COMPILED_ISSUE if w.compile else 1.0)
    # --fp8's casts: plain tensor calls, each at the chunked loss's measured cost per call
    fp8_issue = fp8_kernels(w) * TENSOR_CALL_ISSUE_RELATIVE * c.layer_issue_s * (COMPILED_ISSUE if w.compile else 1.0)
    return passes * per_pass + dequantizations(w) * c.dequant_issue_s + loss_issue_seconds(w, c) + fp8_issue


def dequantization_seconds(w: Workload, c: Calibration = CALIBRATION) -> tuple[float, float]:
    """(host, GPU) seconds per micro-batch that QLoRA's dequantizations take on each clock."""
    gpu = (dequantized_bytes(w) / (memory_bytes_per_s(w) * c.memory_efficiency)
           + dequantizations(w) * DEQUANT_KERNELS * c.kernel_gpu_s)
    return dequantizations(w) * c.dequant_issue_s, gpu


def loss_issue_seconds(w: Workload, c: Calibration) -> float:
    """Host time of the chunked loss's Python loop: per chunk of tokens (the fewer tokens the larger the
    vocabulary, config.switches.chunk_tokens) LOSS_CHUNK_ISSUE_RELATIVE of a Llama layer's issue time.
    The model's own loss and Liger's are a few kernels per micro-batch."""
    if w.loss_form != "finetune-chunked":
        return 0.0
    chunks = math.ceil(w.tokens_per_micro_batch / chunk_tokens(w.model.vocab_size))
    return chunks * LOSS_CHUNK_ISSUE_RELATIVE * c.layer_issue_s


def gpu_terms(w: Workload, c: Calibration) -> dict[str, float]:
    """GPU seconds of one micro-batch by term: the dense matmuls' FLOPs at the GPU's fitted share of
    its peak, a mixture of experts' grouped matmuls slower the fewer tokens each expert gets, attention
    by kernel, head size and sequence length, memory-bound bytes at the fitted share of the bandwidth,
    and a fixed time per kernel launched (bench/gpu_kit/speed_terms.py measures each)."""
    tokens, rate = w.tokens_per_micro_batch, matmul_rate(w, c)
    forward, backward = training_flops(w)
    attention = attention_flops(w) * (3 + w.recompute_share)  # forward, backward twice, recompute
    experts, extra = expert_flops(w)
    terms = {"matmul": tokens * (forward + backward - attention - experts - fp8_flops(w)) / rate,
             "attention": tokens * attention * attention_cost(w, c) / rate,
             "memory-bound": traffic(w).bytes(tokens) / (memory_bytes_per_s(w) * c.memory_efficiency),
             "kernel launches": kernel_launches(w) * c.kernel_gpu_s}
    if experts:
        terms["experts"] = tokens * (experts + extra) / (rate * grouped_efficiency(w, c))
    return terms | ({"fp8 matmul": fp8_seconds(w, c)} if w.fp8 else {})


def matmul_rate(w: Workload, c: Calibration) -> float:
    """FLOP/s of the dense matmuls: the GPU's bf16 peak at its fitted efficiency (TF32 for fp32)."""
    return w.gpu.bf16_tflops * 1e12 * c.efficiency(w.gpu) * (FP32_SPEED if w.precision.fp32 else 1.0)


def fp8_flops(w: Workload) -> float:
    """FLOPs per token of the frozen base matmuls --fp8 runs in float8: forward, input gradient, and
    the forward again for the layers checkpointing recomputes (no weight gradient: the base is frozen)."""
    return 2 * fp8_params(w) * (2 + w.recompute_share)


def fp8_seconds(w: Workload, c: Calibration) -> float:
    """GPU seconds of one micro-batch's float8 matmuls: their FLOPs at the GPU's fitted share of its
    FP8 peak (the bf16 matmuls' share, not fitted on FP8), the casts of their operands at the fitted
    share of the bandwidth, their kernels, and the backward's transposed copy of each float8 weight."""
    tokens, passes = w.tokens_per_micro_batch, 1 + w.recompute_share
    rate = w.gpu.fp8_tflops * 1e12 * c.efficiency(w.gpu)
    cast = "compiled" if w.compile else "eager"
    cast_elements = sum(n * (passes * linear.fan_in + linear.fan_out) for n, linear in fp8_linears(w))
    cast_bytes = tokens * cast_elements * FP8_CAST_BYTES[cast] + 2 * fp8_params(w)
    return (tokens * fp8_flops(w) / rate + cast_bytes / (memory_bytes_per_s(w) * c.memory_efficiency)
            + fp8_kernels(w) * c.kernel_gpu_s)


def fp8_kernels(w: Workload) -> float:
    """Kernels --fp8 adds per micro-batch: the casts of each float8 matmul's operand (forward, recompute,
    backward) and the backward's transposed weight."""
    cast = FP8_CAST_KERNELS["compiled" if w.compile else "eager"]
    return sum(n * ((2 + w.recompute_share) * cast + 1) for n, _ in fp8_linears(w))


def gpu_seconds(w: Workload, c: Calibration) -> float:
    """GPU time of one micro-batch: the sum of its terms."""
    return sum(gpu_terms(w, c).values())


def attention_cost(w: Workload, c: Calibration) -> float:
    """Seconds of attention per causal attention FLOP, in matmul-FLOP seconds. Flash kernels (SDPA
    without a mask, flex) skip the masked half at the chip's fitted speed, slower for small heads; an
    explicit mask (Workload.masked_sdpa: packed rows, or a sliding window shorter than the row) sends SDPA
    to its memory-efficient kernel, which computes every score at its own fitted speed; eager attention
    computes every score with two batched matmuls at the matmul rate (the s² scores it writes are
    memory traffic, plan/traffic.py)."""
    if w.attention == "eager":
        return 2.0
    if w.masked_sdpa:
        return 2.0 / c.masked_attention_speed
    return 1.0 / (c.attention(w.gpu.chip) * (SMALL_HEAD_ATTENTION if w.model.resolved_head_dim < 128 else 1.0))


def expert_flops(w: Workload) -> tuple[float, float]:
    """(of training_flops, the routed experts' part; FLOPs beyond training_flops) per token: the experts a
    token goes through, forward, input gradient, recompute, and their weight gradient when they train;
    PEFT's LoRA on the fused expert parameters also computes the full weight gradient, which training_flops
    (counting the adapters') leaves out."""
    if not w.model.moe:
        return 0.0, 0.0
    active = sum(n * sum(linear.active_weight_params for linear in linears if linear.kind == "experts")
                 for n, linears in params.layer_kinds(w.model))
    counted = active * (4 + 2 * w.recompute_share + (2 if w.method == "full" else 0))
    targets = None if w.method == "full" else resolve_lora_targets(w.model, w.lora_targets, w.method)
    return counted, 2 * active if targets is not None and targets.experts else 0.0


def grouped_efficiency(w: Workload, c: Calibration) -> float:
    """The grouped expert matmul's rate ÷ the dense matmuls': m / (m + m½) with m the tokens each expert
    gets on this rank (a micro-batch's tokens × top-k ÷ experts), m½ fitted: each expert's matmul carries
    a fixed cost (its weights read, partial waves of tiles, the grouping's offsets) worth m½ tokens of work."""
    spec = w.model
    per_expert = w.tokens_per_micro_batch / w.cp * spec.experts_per_token / spec.num_experts
    return per_expert / (per_expert + c.expert_tokens_half)


def kernel_classes(w: Workload, c: Calibration = CALIBRATION) -> dict[str, float]:
    """The GPU terms of one micro-batch regrouped as a profiler sorts kernels by name (bench/gpu_kit/
    speed_terms.py): matmul (the linears, the experts and PEFT's LoRA matmuls with the bytes those
    move), attention, 4-bit dequantization, and the other, memory-bound kernels; each with its kernels'
    fixed time. They sum to gpu_seconds."""
    terms, k = gpu_terms(w, c), c.kernel_gpu_s
    bandwidth = memory_bytes_per_s(w) * c.memory_efficiency
    lora, dequant = adapter_matmul_bytes(w) / bandwidth, dequantized_bytes(w) / bandwidth
    matmuls, attention, dequants = matmul_kernels(w), attention_kernels(w), dequantizations(w) * DEQUANT_KERNELS
    other = kernel_launches(w) - matmuls - attention - dequants
    return {"matmul": terms["matmul"] + terms.get("experts", 0.0) + lora + matmuls * k,
            "attention": terms["attention"] + attention * k,
            "dequant": dequant + dequants * k,
            "other": terms["memory-bound"] - lora - dequant + other * k}


def optimizer_seconds(w: Workload, c: Calibration = CALIBRATION) -> float:
    """The optimizer step, memory-bound: trainable weights, gradients and states read, weights and
    states written in one pass (a fused kernel), and foreach AdamW's further passes, for the share of
    states this GPU updates (all of them on one GPU or DDP, 1/n sharded, none when offloaded)."""
    states = model_states(w)
    share = place_states(w, states).optimizer / states.optimizer if states.optimizer else 0.0
    moved = 2 * states.trainable + states.gradients + 2 * states.optimizer + FOREACH_EXTRA_PASSES * states.step_scratch
    return share * moved / (memory_bytes_per_s(w) * c.memory_efficiency)


def micro_batch_seconds(issue: float, gpu: float, c: Calibration) -> float:
    """One micro-batch: the host's issue time and the GPU's time, overlapping in part, (Hᵖ + Gᵖ)^(1/p)."""
    longer = max(issue, gpu)
    if not longer:
        return 0.0
    p = c.overlap_exponent
    return longer * ((issue / longer) ** p + (gpu / longer) ** p) ** (1 / p)


def update_seconds(w: Workload, c: Calibration = CALIBRATION) -> float:
    """One GPU's time per optimizer update without communication or offload: its micro-batches' two
    clocks and the optimizer step (what a single-GPU run takes per update)."""
    micro = micro_batch_seconds(issue_seconds(w, c), gpu_seconds(w, c), c)
    return w.gradient_accumulation_steps * micro + optimizer_seconds(w, c)


def memory_bytes_per_s(w: Workload) -> float:
    """The GPU's memory bandwidth, bytes/s (datasheet; a GPU without one: an H100's per peak TFLOP/s)."""
    return (w.gpu.memory_tb_per_s or H100_TB_PER_S * w.gpu.bf16_tflops / H100_TFLOPS) * 1e12


def estimate_speed(w: Workload, calibration: Calibration = CALIBRATION) -> Speed:
    n = w.data_parallel_size  # a TP/CP group's GPUs share each micro-batch's FLOPs and tokens
    tokens_update = w.tokens_per_micro_batch * w.gradient_accumulation_steps
    issue, terms = issue_seconds(w, calibration), gpu_terms(w, calibration)
    gpu, attention = sum(terms.values()) / w.model_parallel, terms["attention"] / w.model_parallel
    forward_share = training_flops(w)[0] / sum(training_flops(w))
    forward, backward = gpu * forward_share, gpu * (1 - forward_share)  # the windows communication hides under
    compute = w.gradient_accumulation_steps * micro_batch_seconds(issue, gpu, calibration) + optimizer_seconds(w, calibration)

    items = collectives(w)
    gb_per_s, latency_s = link(w)
    comm = sum(c.seconds(gb_per_s, latency_s) for c in items)
    exposed = exposed_seconds(items, gb_per_s, latency_s, forward, backward, w.gradient_accumulation_steps)
    group, (group_gb_per_s, group_latency_s) = model_parallel_collectives(w), model_parallel_link(w)
    comm += sum(c.seconds(group_gb_per_s, group_latency_s) for c in group)
    exposed += exposed_seconds(group, group_gb_per_s, group_latency_s, forward, backward, w.gradient_accumulation_steps,
                               attention)

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
        likely=speed_range(w, calibration.chips),
    )
