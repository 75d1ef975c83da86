"""What eager PyTorch runs on the GPU besides matmul FLOPs: the bytes its memory-bound kernels move
(divided by the GPU's memory bandwidth) and how many kernels it launches (each costs the GPU a few
µs of launch and tail whatever its size).

Eager transformers runs every elementwise operation as its own kernel that reads its inputs from
device memory and writes its output back: RMSNorm (upcast, square, mean, scale, downcast, weight),
rotary embeddings, the residual adds, the gated MLP's activation, PEFT's LoRA branch (fp32 adapters:
the input cast up, the scaled output added and cast back), the loss over the vocabulary, and
bitsandbytes' dequantization of every 4-bit weight. Matmuls are not counted here (they are
compute-bound at training shapes; plan/speed.py counts their FLOPs). Counts follow the kernels the
forward launches, in bytes per element of the tensor each acts on. The backward of an elementwise
kernel reads its saved input and the output's gradient and writes the input's gradient; the
residual adds pass the gradient through: BACKWARD_TRAFFIC times the forward's bytes overall.
Liger's kernels (`--liger`) fuse the norm, the rotary embedding, SwiGLU and the loss, each into one
pass.

The counts are this module's assumptions read off transformers', PEFT's and bitsandbytes' code, not
measurements; the speed model fits how much of the datasheet bandwidth the bytes run at, and what a
kernel launch costs (bench/speed_fit.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.models.catalog import ModelSpec
from finetune.plan import moe
from finetune.plan.memory import model_states, residual_bytes, trainable_params
from finetune.plan.params import adapted, count_params, layer_linears, resolve_lora_targets
from finetune.plan.workload import Workload

# Bytes per element of the hidden state, per RMSNorm, forward (16-bit stream): upcast (2 + 4),
# square (4 + 4), mean (4), scale (4 + 4), downcast (4 + 2), weight (2 + 2). Liger: read and write.
NORM_BYTES = {"eager": 36, "liger": 4}
# Bytes per element of q and k, rotary embedding: x·cos (4), rotate_half's negate and cat (6), ·sin
# (4), the add (6). Liger rotates in place: read and write.
ROPE_BYTES = {"eager": 20, "liger": 4}
# Bytes per element of the MLP's intermediate width: SiLU (4) and the gate × up product (6); Liger's
# SwiGLU reads both and writes one. A two-matrix MLP has only its activation.
GATED_MLP_BYTES = {"eager": 10, "liger": 6}
PLAIN_MLP_BYTES = 4
# Bytes per vocabulary entry per token of the loss, forward and backward together: 16-bit logits
# written, the fp32 upcast, log-softmax (reads twice, writes once), its gradient and the 16-bit
# gradient of the logits (transformers' loss; finetune's chunked loss makes the same passes a chunk
# at a time). Liger's fused linear cross-entropy keeps each chunk's logits on chip: write and read
# once, and the gradient. ASSUMED from the kernels' passes; the loss has not been timed on a GPU.
LOSS_BYTES = {"eager": 44, "liger": 8}
# Backward bytes ÷ forward bytes of the elementwise kernels: ~1.1 for PEFT's LoRA branch (the casts
# and the scale run once more, the add passes the gradient), ~1.7 for RMSNorm and ~1.8 for SwiGLU
# (saved inputs and the gradient read, the input gradient written), 0 for the residual adds.
BACKWARD_TRAFFIC = 1.5
# Eager attention (`--attention eager`) writes every score: QKᵀ in 16 bits, the fp32 softmax's
# upcast, passes and downcast, read again by the product with V; bytes per score, forward.
EAGER_SCORE_BYTES = 28
# bitsandbytes NF4 → 16-bit, per weight and dequantization: 4-bit weight and absmax read, 16-bit written.
DEQUANT_BYTES = 2.5
# Autocast casts each fp32 weight to 16 bits once per forward (the cast is cached for the backward).
AUTOCAST_WEIGHT_BYTES = 6


@dataclass(frozen=True)
class Traffic:
    """Memory-bound bytes of one micro-batch: a part per token and a part per micro-batch."""

    per_token: float
    per_micro_batch: float

    def bytes(self, tokens: int) -> float:
        return tokens * self.per_token + self.per_micro_batch


# Kernels one decoder layer launches in the forward besides its linears: eager RMSNorm (8 each),
# rotary embedding (5 each for q and k), SDPA with its transposes (2), the residual adds (2) and
# SwiGLU (2); Liger fuses each norm, the rotary embedding and SwiGLU into one.
LAYER_KERNELS = {"eager": 2 * 8 + 10 + 2 + 2 + 2, "liger": 2 + 1 + 2 + 2 + 1}
# Per PEFT LoRA linear (input cast, A, B, scale, add, output cast; bitsandbytes' 4-bit base adds a
# defensive clone), per bitsandbytes dequantization (absmax, then the weight: double quantization).
ADAPTER_KERNELS, DEQUANT_KERNELS = 6, 2
# A backward launches about twice the forward's kernels (input and weight gradients).
BACKWARD_KERNELS = 2


def kernels(w: Workload) -> str:
    """Which elementwise kernels run: Liger's fused ones or eager transformers'."""
    return "liger" if w.loss == "liger" else "eager"


def layer_forward_bytes(w: Workload) -> float:
    """Bytes per token one decoder layer's elementwise kernels move in the forward."""
    spec, e, r = w.model, w.precision.compute_bytes, residual_bytes(w)
    h, inter = spec.hidden_size, moe.activated_width(spec) if spec.moe else spec.intermediate_size
    q, kv = spec.num_heads * spec.resolved_head_dim, spec.num_kv_heads * spec.resolved_head_dim
    k = kernels(w)
    scale = r / 2  # the counts above are for a 16-bit residual stream; fp32 doubles them
    moved = spec.norms_per_layer * h * NORM_BYTES[k] * scale
    moved += 2 * 3 * r * h  # two residual adds: read both, write one
    moved += (q + kv) * ROPE_BYTES[k] * e / 2
    moved += inter * (GATED_MLP_BYTES[k] if spec.mlp_gated else PLAIN_MLP_BYTES) * e / 2
    if w.precision.mixed and not w.strategy.computes_on_copies:  # autocast casts each linear's fp32 input
        moved += sum(linear.fan_in for linear in layer_linears(spec)) * (4 + e)
    if w.attention == "eager":  # every query's row of scores, every head
        moved += spec.num_heads * w.seq_len * EAGER_SCORE_BYTES
    if w.dense_mask:  # packed rows under SDPA: every query's row of the mask, once for all heads. ASSUMED
        # from torch's code, not timed on a GPU: SDPA converts the boolean mask to the query's dtype (1 byte
        # read, e written per element) and its memory-efficient kernel reads that copy (e)
        moved += w.seq_len * (1 + 2 * e)
    if spec.moe:  # tokens gathered to their experts and back, in the layers that hold experts
        moved += moe.routing_bytes(w) * spec.moe_layers / spec.num_layers
    return moved + adapter_forward_bytes(w)


def adapter_forward_bytes(w: Workload) -> float:
    """Bytes per token of PEFT's LoRA branches in one layer, forward. Under autocast (every precision
    but fp32) the branch computes in the compute dtype: lora_A reads the input, lora_B writes its
    output, × scaling and + the base output; PEFT first casts a 16-bit base's input to the fp32
    adapter's dtype, which autocast casts back for lora_A; bitsandbytes' 4-bit base skips that cast
    and clones its output instead. Without autocast the whole branch runs in the adapter's dtype
    and is cast back at the end."""
    if w.method == "full":
        return 0.0
    targets = resolve_lora_targets(w.model, w.lora_targets, w.method)
    a, e = w.adapter_bytes, w.precision.compute_bytes
    if w.precision.autocast:
        per_in = e + (0 if w.method == "qlora" or a == e else 2 * (e + a))
        per_out = 6 * e + (2 * e if w.method == "qlora" else 0)  # B's output, the scale, the add (, the clone)
    else:
        cast = a + e if a != e else 0
        per_in, per_out = cast + a, 3 * a + (e + 2 * a) + cast  # out: B's output, the scale, the add, the cast back
    return sum(per_in * linear.fan_in + per_out * linear.fan_out for linear in adapted(layer_linears(w.model), targets)
               if linear.kind != "experts")  # LoRA on fused experts adds to the weight instead (plan/moe.py)


def adapter_matmul_bytes(w: Workload) -> float:
    """Of `traffic`, the bytes PEFT's LoRA matmuls themselves move per micro-batch (lora_A reading its
    input, lora_B writing its output, and their backward): a profiler counts these kernels as matmuls,
    though at rank r they are bound by these bytes, not by FLOPs."""
    if w.method == "full":
        return 0.0
    targets = resolve_lora_targets(w.model, w.lora_targets, w.method)
    width = w.precision.compute_bytes if w.precision.autocast else w.adapter_bytes
    per_token = sum(width * (linear.fan_in + linear.fan_out) for linear in adapted(layer_linears(w.model), targets)
                    if linear.kind != "experts")
    return w.tokens_per_micro_batch * w.model.num_layers * per_token * (1 + w.recompute_share + BACKWARD_TRAFFIC)


# torch's ring attention (context parallelism), bytes per element of this rank's attention output (q)
# and of its keys and values (kv) per hop past the first: the forward turns each block's output fp32 and
# merges it into the running output through its log-sum-exp (three fp32 passes, and the load-balanced
# half's copies) and concatenates the keys and values it passes on; the backward adds each block's
# query, key and value gradients into fp32 sums and concatenates the key and value gradients it passes on.
RING_FORWARD_BYTES = {"q": 48, "kv": 8}
RING_BACKWARD_BYTES = {"q": 12, "kv": 48}
# Kernels per hop past the first: the block's attention, the merge's passes, the concatenation.
RING_HOP_KERNELS = 10


def ring_bytes(w: Workload) -> float:
    """Bytes per token (of the micro-batch) the ring's merges and copies move, every layer, forward,
    recompute and backward: (cp − 1) hops, each on this rank's 1/cp of the tokens, so per token of the
    whole row the same (cp − 1) hops' bytes."""
    if w.cp == 1:
        return 0.0
    spec = w.model
    q, kv = spec.num_heads * spec.resolved_head_dim, 2 * spec.num_kv_heads * spec.resolved_head_dim
    forward = RING_FORWARD_BYTES["q"] * q + RING_FORWARD_BYTES["kv"] * kv
    backward = RING_BACKWARD_BYTES["q"] * q + RING_BACKWARD_BYTES["kv"] * kv
    return (w.cp - 1) * spec.num_layers * (forward * (1 + w.recompute_share) + backward)


def layer_kernels(spec: ModelSpec) -> int:
    """Kernels an eager decoder layer without adapters launches, forward and backward."""
    return (LAYER_KERNELS["eager"] + len(layer_linears(spec))) * (1 + BACKWARD_KERNELS)


def kernel_launches(w: Workload) -> float:
    """Kernels one micro-batch launches in its decoder layers: forward, the recomputed forward, a
    preference objective's forwards without gradients (Workload.forward_only_passes), and the backward;
    the ring's per hop under context parallelism."""
    lora = _adapted_count(w)
    forward = LAYER_KERNELS[kernels(w)] + len(layer_linears(w.model)) + lora * (ADAPTER_KERNELS + (w.method == "qlora"))
    ring = (w.cp - 1) * RING_HOP_KERNELS * (2 + w.recompute_share)
    return w.model.num_layers * (forward * _passes(w) + ring) + dequantizations(w) * DEQUANT_KERNELS


def matmul_kernels(w: Workload) -> float:
    """Of `kernel_launches`, the matmuls: each linear (a fused expert parameter's grouped matmul one),
    and LoRA's A and B per adapted linear."""
    return w.model.num_layers * (len(layer_linears(w.model)) + 2 * _adapted_count(w)) * _passes(w)


def attention_kernels(w: Workload) -> float:
    """Of `kernel_launches`, the attention kernels: one per layer and pass (one per hop under CP)."""
    return w.model.num_layers * w.cp * _passes(w)


def _passes(w: Workload) -> float:
    return 1 + w.recompute_share + w.forward_only_passes + BACKWARD_KERNELS


def _adapted_count(w: Workload) -> int:
    if w.method == "full":
        return 0
    return len(adapted(layer_linears(w.model), resolve_lora_targets(w.model, w.lora_targets, w.method)))


def dequantizations(w: Workload) -> float:
    """4-bit linears dequantized per micro-batch: each in the forward, the backward, any recompute and
    any forward without gradients."""
    if w.method != "qlora":
        return 0.0
    quantized = [linear for linear in layer_linears(w.model) if linear.quantized]
    return w.model.num_layers * len(quantized) * (2 + w.recompute_share + w.forward_only_passes)


def dequantized_bytes(w: Workload) -> float:
    """Bytes bitsandbytes moves per micro-batch turning the 4-bit base into 16-bit weights."""
    passes = 2 + w.recompute_share + w.forward_only_passes
    return count_params(w.model).quantizable * DEQUANT_BYTES * passes if w.method == "qlora" else 0.0


def traffic(w: Workload) -> Traffic:
    """Memory-bound bytes of one micro-batch: every layer's elementwise kernels forward, again for
    the layers checkpointing recomputes, BACKWARD_TRAFFIC × in the backward, and the loss over the
    vocabulary, per token; per micro-batch, QLoRA's dequantizations (forward, backward, recompute),
    autocast's weight casts and the weight gradients' writes."""
    spec = w.model
    passes = 1 + w.recompute_share + w.forward_only_passes + BACKWARD_TRAFFIC
    per_token = spec.num_layers * layer_forward_bytes(w) * passes + spec.vocab_size * LOSS_BYTES[kernels(w)] + ring_bytes(w)
    counts = count_params(spec)
    per_micro_batch = dequantized_bytes(w)
    # LoRA on fused experts writes W + ΔW and the grouped matmul reads it, per pass, in every MoE layer
    targets = None if w.method == "full" else resolve_lora_targets(spec, w.lora_targets, w.method)
    per_micro_batch += 2 * moe.lora_weight_bytes(w, targets) * spec.moe_layers * (2 + w.recompute_share)
    if w.precision.mixed and w.method == "full" and not w.strategy.computes_on_copies:
        per_micro_batch += counts.matmul * AUTOCAST_WEIGHT_BYTES * (1 + w.recompute_share)
    trainable = trainable_params(w)
    if trainable:  # each weight gradient written in the compute dtype, then added to .grad in its own dtype
        gradient = model_states(w).gradients / trainable
        per_micro_batch += trainable * (w.precision.compute_bytes + 2 * gradient)
    return Traffic(per_token, per_micro_batch)
