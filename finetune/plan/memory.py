"""Per-GPU memory of one training step, term by term, from the architecture and the workload.

The peak is a maximum over two phases, not a sum: activations are freed before the optimizer step,
and the step's temporaries exist only then. Gradients are counted in both phases because with
gradient accumulation they stay allocated across micro-steps (planning for it keeps a plan valid
for any accumulation). Every coefficient below is a byte count of a tensor PyTorch, transformers,
PEFT, bitsandbytes or DeepSpeed allocates; the ones that are fitted say what they were fitted on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from finetune.config.names import trains_pure_bf16
from finetune.config.switches import chunk_tokens
from finetune.plan import moe, parallel
from finetune.plan.params import (
    NF4_BYTES,
    NF4_DOUBLE_QUANT_BYTES,
    Linear,
    adapted,
    count_params,
    layer_kinds,
    layer_linears,
    lora_params,
    resolve_lora_targets,
)
from finetune.plan.workload import Workload

GIB = 2**30

# PyTorch's caching allocator reserves more than it hands out: freed blocks stay cached for the next
# tensor that fits them. finetune runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# (cli/__init__.py), which grows one segment per stream instead of keeping differently sized ones, so
# the gap is small, and grows with the vocabulary-sized blocks the loss frees just before a peak at the
# loss. Fitted by bench/planner_accuracy.py (`slack_fit`) to plan/calibration/allocator.csv:
# - ALLOCATOR_SLACK, the largest reserved/allocated − 1 of the rows whose loss holds no full-vocabulary
#   logits: Mistral-7B LoRA at 4096 × 2 on one H200 (finetune and TRL, chunked loss or Liger, every layer
#   or 1 of 32 checkpointed: differently sized activations), 1.016–1.020×;
# - VOCABULARY_CACHE, what a row whose peak is at the loss reserved beyond that, per byte of one fp32 copy
#   of its logits: Qwen2.5-7B QLoRA, 152k vocabulary, 2048 × 2 on one H100, 12.4 GiB allocated, 14.4
#   reserved (27.4 with the default allocator). One row: the first coefficient to refit.
# When the card is nearly full, the allocator frees its cached blocks and retries before it reports out
# of memory (expandable segments unmap their free pages), so neither term has to fit: what cannot be
# given back is what is allocated, and the CUDA and NCCL contexts (`Breakdown.held`). No GPU run has
# measured a step at that limit yet (plan.choose.TIGHT_SHARE keeps a margin).
ALLOCATOR_SLACK = 0.02
VOCABULARY_CACHE = 0.755
# Without expandable segments (other trainers' published runs: bench/planner_accuracy.py), differently
# sized blocks stay in separate segments: reserved/allocated of 14 single-GPU HF Trainer runs of dense
# models (fms-acceleration's benchmark references, A100 80GB) has its lower quartile at 1.16.
DEFAULT_ALLOCATOR_SLACK = 0.16
# CUDA context, cuBLAS workspace and kernels as nvidia-smi shows them before any tensor (torch 2.x
# with lazy module loading: 0.4–0.6 GiB on A100/H100).
CUDA_CONTEXT_GIB = 0.5
# NCCL communicators and their channel buffers, per process, when more than one GPU trains.
NCCL_GIB = 0.5
# Elements per DeepSpeed communication bucket (reduce, allgather, stage-3 prefetch); plan/files.py
# writes the same number into the DeepSpeed JSON so the estimate and the run agree.
DS_BUCKET_ELEMENTS = 50_000_000
# Bytes per element of one state of each optimizer, None: the trainable weights' dtype.
# bitsandbytes 8-bit states add one fp32 absmax per 256-element block (Optimizer2State.init_state).
OPTIMIZER_STATES = {"adamw": (2, None), "adamw-8bit": (2, 1 + 4 / 256), "paged-adamw-8bit": (2, 1 + 4 / 256)}


@dataclass(frozen=True)
class Breakdown:
    """Bytes per GPU at the peak of a step, and the host RAM the plan needs per node."""

    weights: float
    gradients: float
    optimizer: float
    activations: float  # saved activations and the loss's logits (0 when the peak is the optimizer step)
    buffers: float  # communication buckets, gathered FSDP/ZeRO-3 blocks, dequantization and optimizer scratch
    peak_phase: str  # "forward/backward" or "optimizer step"
    host_offload: float  # offloaded shards of every rank of one node
    host_loading: float  # checkpoint bytes the node's processes hold in host RAM while loading
    cached: float = 0.0  # freed vocabulary-sized blocks the allocator keeps at the peak (VOCABULARY_CACHE)

    @property
    def allocated(self) -> float:
        """Predicted torch.cuda.max_memory_allocated()."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers

    @property
    def reserved(self) -> float:
        """Predicted torch.cuda.max_memory_reserved() with expandable segments, on a card with room to spare."""
        return self.allocated * (1 + ALLOCATOR_SLACK) + self.cached

    @property
    def reserved_default_allocator(self) -> float:
        """The same without expandable segments (PyTorch's default allocator)."""
        return self.allocated * (1 + DEFAULT_ALLOCATOR_SLACK)

    def device(self, world_size: int) -> float:
        """Predicted device memory as nvidia-smi shows it on a card with room to spare: reserved +
        CUDA context (+ NCCL)."""
        return self.reserved + context_bytes(world_size)

    def held(self, world_size: int) -> float:
        """Device memory that cannot be given back at the peak, what the fit verdict compares with the
        GPU's memory: allocated + CUDA context (+ NCCL); the allocator's cache goes first."""
        return self.allocated + context_bytes(world_size)

    @property
    def host(self) -> float:
        return max(self.host_offload, self.host_loading)


def context_bytes(world_size: int) -> float:
    """CUDA context, and NCCL's when more than one GPU trains."""
    return (CUDA_CONTEXT_GIB + (NCCL_GIB if world_size > 1 else 0.0)) * GIB


@dataclass(frozen=True)
class ModelStates:
    """Unsharded bytes of what lives for the whole run, before strategy and offload place it."""

    frozen: float  # frozen base weights (LoRA/QLoRA), incl. 4-bit packed weights
    quant_constants: float  # QLoRA absmax constants: replicated on every rank, not sharded
    trainable: float  # trainable weights as the model holds them
    gradients: float
    optimizer: float  # optimizer states, plus fp32 master weights and fp32 gradients under DeepSpeed
    step_scratch: float  # temporaries of the optimizer step (torch foreach AdamW: one state-sized copy)
    reference: float = 0.0  # a preference objective's frozen copy of the weights (Workload.reference_copy)


def trainable_params(w: Workload) -> int:
    """Full fine-tuning trains everything but a vision tower (text fine-tuning leaves it as published)."""
    if w.method == "full":
        return count_params(w.model).total - w.model.tower_params
    return lora_params(w.model, w.lora_r, resolve_lora_targets(w.model, w.lora_targets, w.method))


def trainable_bytes(w: Workload) -> int:
    """Bytes per trainable weight. DeepSpeed casts the whole module to its 16-bit dtype; PEFT
    keeps adapters in fp32 over a 16-bit base (adapter_bytes)."""
    p = w.precision
    if w.deepspeed:
        return p.compute_bytes
    if w.method == "full":
        return p.weight_bytes
    return max(p.weight_bytes, w.adapter_bytes)


def model_states(w: Workload) -> ModelStates:
    """What one GPU's model holds before FSDP/ZeRO shard it: the whole model, or a TP rank's slice."""
    counts = parallel.rank_params(w)
    p = w.precision
    n_train = parallel.rank_trainable_params(w)
    weight = trainable_bytes(w)
    base_bytes = p.compute_bytes if w.deepspeed else p.weight_bytes
    if w.method == "full":
        frozen, constants = counts.tower * base_bytes, 0.0
    elif w.method == "lora":
        frozen, constants = counts.total * base_bytes + fp8_params(w) * FP8_BYTES, 0.0
    else:
        nf4 = NF4_DOUBLE_QUANT_BYTES if w.double_quant else NF4_BYTES
        frozen = counts.quantizable * 0.5 + (counts.total - counts.quantizable) * unquantized_bytes(w)
        constants = counts.quantizable * (nf4 - 0.5)
    states, state_bytes = OPTIMIZER_STATES[w.optimizer]
    state_bytes = state_bytes or weight
    optimizer = n_train * states * state_bytes
    if w.deepspeed and p.compute_bytes < 4:
        optimizer = n_train * deepspeed_optimizer_bytes(trains_pure_bf16(p, w.method), states)
    # torch's default (foreach) AdamW on GPU allocates sqrt(exp_avg_sq) for all tensors at once;
    # DeepSpeed's FusedAdam, fused AdamW and bitsandbytes' kernels update in place.
    foreach = w.optimizer == "adamw" and not w.deepspeed and not w.fused_optimizer
    return ModelStates(
        frozen=frozen,
        quant_constants=constants,
        trainable=n_train * weight,
        gradients=n_train * weight,
        optimizer=optimizer,
        step_scratch=n_train * state_bytes if foreach else 0.0,
        # loaded again in the compute dtype, frozen (train/reference.py)
        reference=counts.total * p.compute_bytes if w.reference_copy else 0.0,
    )


def deepspeed_optimizer_bytes(pure_bf16: bool, states: float) -> float:
    """Bytes per trainable parameter that DeepSpeed's ZeRO optimizer holds beside a 16-bit module:
    a master copy of the weights, a flat copy of the gradient partition for the step, and the Adam
    states. fp32 all three (the "16 bytes per parameter" of its estimator, with the 16-bit gradient);
    bf16 for pure bf16 full fine-tuning (bf16_master_weights_and_grads, bf16_optimizer_states).
    Measured per rank on the engine by tests/checkpoint/test_resume_strategies.py."""
    held = 2 if pure_bf16 else 4
    return held + held + states * held


def unquantized_bytes(w: Workload) -> int:
    """Bytes per QLoRA parameter left out of 4-bit (embeddings, norms, LM head): fp32 after PEFT's
    prepare_model_for_kbit_training, else the base's dtype (DeepSpeed's 16-bit cast included)."""
    if w.deepspeed:
        return w.precision.compute_bytes
    return 4 if w.kbit_upcast else w.precision.weight_bytes


def residual_bytes(w: Workload) -> int:
    """Bytes per element of the residual stream: the embedding output's dtype, which the norms and
    residual adds keep. An fp32 embedding (fp32 weights under autocast, or PEFT's k-bit upcast)
    makes it fp32, unless FSDP's mixed precision or DeepSpeed computes with 16-bit copies of it."""
    if w.strategy.computes_on_copies:
        return w.precision.compute_bytes
    if w.method == "qlora":
        return unquantized_bytes(w)
    return w.precision.residual_bytes


def layer_activation_bytes(w: Workload) -> float:
    """Bytes one decoder layer saves for backward, per token (flash/SDPA attention: no s² term).

    Counted tensor by tensor for transformers' Llama layer: RMSNorm saves its input upcast to fp32;
    a linear saves its input only when its weight trains (full fine-tuning) or a LoRA adapter reads
    it; under autocast every matmul makes its own 16-bit copy of an fp32 input; SDPA saves q, k, v
    and its output; SwiGLU saves gate, up and the activation. A bitsandbytes 4-bit linear casts its
    input to the compute dtype and its output back to the input's dtype, so under QLoRA everything
    between the matmuls is held in the residual stream's dtype (fp32 after PEFT's k-bit upcast).
    Under TP the norms run on the rank's sequence shard of the residual stream
    (parallel.sequence_shards) and attention and the MLP on its heads and width; the linears reading
    the normalized stream save the gathered whole rows.
    """
    spec, p = parallel.rank_spec(w.model, w.tp), w.precision  # a TP rank's heads and MLP width
    h, e = spec.hidden_size, p.compute_bytes
    q_width = spec.num_heads * spec.resolved_head_dim
    kv_width = spec.num_kv_heads * spec.resolved_head_dim
    inter = spec.shared_expert_intermediate_size if spec.moe else spec.intermediate_size  # MoE: the shared expert
    residual = residual_bytes(w)
    out = residual if w.method == "qlora" else e  # dtype of a projection's output
    attn = attention_bytes(w)
    full = w.method == "full"
    lora = None if full else resolve_lora_targets(spec, w.lora_targets, w.method)
    targets = () if full else tuple(linear.name for linear in layer_linears(spec) if lora.adapts(linear.name))
    adapter = max(p.weight_bytes, w.adapter_bytes)

    norm_input = residual if spec.norm_bias else 4  # LayerNorm saves its input; RMSNorm an fp32 copy
    norm_output = residual if full else 0  # the normalized input of the trainable norm weight
    saved = spec.norms_per_layer * h * (norm_input + norm_output) / parallel.sequence_shards(w)  # a TP rank's shard

    names = [linear.name for linear in layer_linears(spec)]
    attention_in = ["q_proj", "k_proj", "v_proj"]
    mlp_in = [n for n in ("gate_proj", "up_proj") if n in names]
    if spec.norms_per_layer == 1:  # parallel block: attention and MLP read one normalized input
        groups = [(h, residual, attention_in + mlp_in)]
    else:
        groups = [(h, residual, attention_in), (h, residual, mlp_in)]
    groups += [(q_width, attn, ["o_proj"]), (inter, out, ["down_proj"])]
    for width, dtype_bytes, consumers in groups:
        saved += _linear_inputs(width, dtype_bytes, consumers, full, targets, e, p.autocast, adapter, w.lora_dropout)
        if w.method == "qlora" and w.bnb_saves_input:
            # old MatMul4Bit kept the 16-bit input: shared when it already was 16-bit, else one cast per linear
            saved += width * e * (1 if dtype_bytes == e else len(consumers))
    if full and w.attention == "sdpa":
        saved -= attn * q_width  # o_proj's input is SDPA's output, already saved by SDPA
    lora_out = e if p.autocast else adapter
    saved += sum(w.lora_r * lora_out for name in names if name in lora.modules) if lora else 0  # lora_A outputs

    if w.attention == "eager":
        # scores and fp32 softmax output, per query token: one row of s keys per head
        saved += attn * (q_width + 2 * kv_width) + (4 + attn) * spec.num_heads * w.seq_len
    else:
        saved += attn * (2 * q_width + 2 * kv_width) + 4 * spec.num_heads  # q, k, v, out, logsumexp
    saved += dense_mask_bytes(w) + repeated_kv_bytes(w)
    saved += out * inter * (3 if spec.mlp_gated else 1)  # gate, up, act(gate) | act input
    if spec.moe:
        saved += moe.routed_activation_bytes(w)
    return saved - liger_layer_savings(w, h, inter, residual, out)


def liger_layer_savings(w: Workload, h: int, inter: int, residual: int, out: int) -> float:
    """Bytes per token Liger's fused layer kernels (--liger) save for backward below transformers' own:
    its RMSNorm keeps the input in the residual stream's dtype and one fp32 scale per token instead of
    an fp32 copy, and its SwiGLU recomputes the activation from gate and up instead of keeping it."""
    if w.loss != "liger":
        return 0.0
    norms = w.model.norms_per_layer * (h * (4 - residual) - 4) if not w.model.norm_bias else 0
    return norms + (out * inter if w.model.mlp_gated else 0)


def attention_bytes(w: Workload) -> int:
    """Bytes per element of attention's inputs and output: SDPA runs under autocast in 16 bits, else in
    the projections' output dtype (the residual stream's under QLoRA, whose 4-bit linears return it)."""
    p = w.precision
    return p.compute_bytes if p.autocast or w.method != "qlora" else residual_bytes(w)


def dense_mask_bytes(w: Workload) -> float:
    """Bytes per token a decoder layer saves of the explicit mask SDPA gets (Workload.masked_sdpa: packed
    rows, or a sliding window shorter than the row): SDPA converts the boolean micro × s × s mask
    to the query's dtype and saves that copy for backward."""
    return attention_bytes(w) * w.seq_len if w.masked_sdpa else 0.0


def repeated_kv_bytes(w: Workload) -> float:
    """Bytes per token a decoder layer saves beyond q, k, v and the output when SDPA gets an explicit mask
    (Workload.masked_sdpa) and the model groups its KV heads: handed a mask, transformers repeats keys and
    values to every query head before SDPA (its `use_gqa_in_sdpa`), and SDPA saves the repeated ones."""
    if not w.masked_sdpa:
        return 0.0
    spec = parallel.rank_spec(w.model, w.tp)
    return 2 * attention_bytes(w) * (spec.num_heads - spec.num_kv_heads) * spec.resolved_head_dim


def _linear_inputs(width, dtype_bytes, consumers, full, targets, e, autocast, adapter, dropout) -> float:
    """Bytes saved for the input of a group of linears that read the same tensor."""
    if full:
        copies = len(consumers) if autocast and dtype_bytes > e else 0
        return width * (e * copies if copies else dtype_bytes)
    adapted = [c for c in consumers if c in targets]
    if not adapted:
        return 0.0
    mask = width * len(adapted) if dropout > 0 else 0.0
    if autocast and adapter > e:
        return width * e * len(adapted) + mask  # PEFT casts the input to fp32, each lora_A's autocast back to 16 bits
    if dtype_bytes == adapter and dropout == 0:
        return width * dtype_bytes  # every adapter reads the tensor itself
    return width * adapter * len(adapted) + mask  # PEFT casts the input to the adapter's dtype


def loss_activation_bytes(w: Workload) -> float:
    """Bytes per token after the last layer: final norm (on a TP rank's sequence shard), LM head input
    (whole rows), logits and cross-entropy (LOSS_BYTES_PER_VOCAB per vocabulary entry: the model's own
    head gathers the whole vocabulary's logits under TP too)."""
    spec, p = w.model, w.precision
    h, e, shards = spec.hidden_size, p.compute_bytes, parallel.sequence_shards(w)
    saved = 4 * h / shards  # final RMSNorm's fp32 input
    if w.method == "full":
        saved += h * residual_bytes(w) / shards + h * e  # normalized input of the norm weight, LM head input
    # without autocast the head computes in its weight's dtype: fp32 after PEFT's k-bit upcast
    logits = e if p.autocast or w.method != "qlora" else residual_bytes(w)
    return saved + LOSS_BYTES_PER_VOCAB[w.loss_form](logits) * spec.vocab_size


# Bytes per vocabulary entry per token at the loss's peak (the start of backward), given the
# logits' bytes per element. MemTracker on fake tensors (1-layer Llama shapes, vocab 32k and 128k,
# bf16-true and bf16-mixed, fp32-head QLoRA stand-in) measures 12 for transformers' loss either way.
LOSS_BYTES_PER_VOCAB = {
    # transformers ≥ 4.46: the logits the model returns, fp32 log-softmax output, its fp32
    # gradient, and the 16-bit gradient of 16-bit logits (fp32 logits skip the upcast copy)
    "transformers": lambda logits: 12,
    # transformers ≤ 4.45 and torchtune ≤ 0.2: fp32 logits kept, fp32 log-probs, and the fp32
    # gradients of both (the shifted copy of the logits lives only during forward)
    "transformers-legacy": lambda logits: 16,
    # litgpt: LM head and cross-entropy in chunks, 16-bit logits and log-probs
    "chunked": lambda logits: 2 * logits,
    # torchtune's CEWithChunkedOutputLoss: 16-bit logits, each chunk's fp32 log-probs
    "chunked-fp32": lambda logits: logits + 4,
    # the same loss under torch.compile: Inductor saves only the logits and recomputes each of the
    # 8 chunks' fp32 softmax in backward (upcast, softmax and gradient: 3 × 4 bytes / 8)
    "chunked-compiled": lambda logits: logits + 1.5,
    # Liger's fused linear cross-entropy (--liger): LM head, loss and gradient chunk by chunk,
    # never the full-vocabulary logits
    "liger": lambda logits: 0,
    # finetune's chunked loss (--chunked-loss, train/chunked_loss.py): the same, in plain torch; it
    # keeps the gradient of the head's input instead (LOSS_SCRATCH_PER_HIDDEN) and one chunk's
    # logits at a time (chunk_scratch_bytes)
    "finetune-chunked": lambda logits: 0,
}

def chunk_scratch_bytes(w: Workload) -> float:
    """The chunked loss's scratch beside the saved activations while it runs (train/chunked_loss.py,
    measured with MemTracker): one chunk's fp32 logits, worked on in place, beside the 16-bit matmul
    output they were copied from or the 16-bit gradient made from them. When the head trains, its
    fp32 gradient is kept from the forward to backward, and each chunk's contribution passes through
    a 16-bit and an fp32 copy of the head's size, beside the chunk's 16-bit gradient."""
    if w.loss_form != "finetune-chunked":
        return 0.0
    spec, e = w.model, w.precision.compute_bytes
    vocabulary = parallel.vocabulary_rows(w)  # under TP: the rank's shard of the head
    chunk = min(chunk_tokens(vocabulary), w.tokens_per_micro_batch) * vocabulary
    logits = chunk * (4 + (e if e < 4 else 0))
    if w.method != "full":
        return logits
    head = vocabulary * spec.hidden_size
    return 4 * head + max(logits, head * (e + 4 if e < 4 else 4) + chunk * e)


# Scratch beside the saved activations while backward starts at the loss: gradients of the
# final hidden state around the LM head, in bytes per hidden unit per token (MemTracker on
# 1-layer Llama shapes leaves 0-5 once the loss holds 12 bytes per vocabulary entry).
LOSS_SCRATCH_PER_HIDDEN = 4
# Scratch while backward runs through a decoder layer (gradients of its activations), as a
# fraction of that layer's saved activations. The loss phase dominates when the logits are held;
# with a chunked or fused loss this phase often sets the peak.
LAYER_SCRATCH = 0.6


def activation_bytes(w: Workload) -> tuple[float, float]:
    """Saved activations of one micro-batch on one GPU at the two candidate peaks of backward:
    at the loss (every layer's activations plus logits and cross-entropy) and inside the last
    layer (every layer's activations, the layer's recomputed activations under checkpointing, and
    its gradient scratch). A checkpointed layer keeps only its input. With the first N of the
    layers checkpointed, backward meets the others first and has freed their activations by the
    time it recomputes one, so the peak is that of the last layer, not recomputed.
    """
    spec = w.model
    tokens = parallel.tokens_per_rank(w)
    layer = layer_activation_bytes(w)
    recomputed = w.recomputed_layers
    layer_input = spec.hidden_size * residual_bytes(w) / parallel.sequence_shards(w)  # what a checkpointed layer keeps
    kept = recomputed * layer_input + (spec.num_layers - recomputed) * layer
    if w.masked_sdpa:  # the boolean mask (micro × s² bytes): through the forward, and to the end of backward as an
        kept += w.seq_len  # input of every recomputed layer
    at_loss = loss_activation_bytes(w) + LOSS_SCRATCH_PER_HIDDEN * spec.hidden_size + moe.router_logits_bytes(w)
    last_recomputed = recomputed == spec.num_layers
    masked = dense_mask_bytes(w) + repeated_kv_bytes(w)  # SDPA's masked path: no scratch of their own (simulated)
    in_layer = (layer if last_recomputed else 0.0) + LAYER_SCRATCH * (layer - masked)
    if w.strategy.fsdp and w.method != "full" and not recomputed:
        # adapters under FSDP2: the largest working set (working_set_bytes) comes once backward has
        # released the last layer's saved activations (FSDPMemTracker, tests/plan/test_planner_simulate.py;
        # with some layers checkpointed the simulated peak is 5-9 % under this model without it)
        in_layer -= layer
    copies = autocast_weight_copies(w) + materialized_copies(w)
    gradient = moe.weight_gradient_bytes(w, lora_targets(w))
    return tokens * (kept + at_loss) + copies + chunk_scratch_bytes(w), tokens * (kept + in_layer) + copies + gradient


def lora_targets(w: Workload):
    return None if w.method == "full" else resolve_lora_targets(w.model, w.lora_targets, w.method)


def materialized_copies(w: Workload) -> float:
    """The 16-bit copies of MoE layers' weights that backward keeps (moe.materialized_weight_bytes), one
    per layer whose activations are kept, and the one a checkpointed layer recomputes."""
    layer = moe.materialized_weight_bytes(w, lora_targets(w))
    if not layer:
        return 0.0
    kept = w.model.num_layers - w.recomputed_layers + (w.recomputed_layers > 0)
    return layer * min(kept, w.model.moe_layers)


def kept_layer_activations(w: Workload) -> float:
    """Bytes the decoder layers that do not recompute hold for backward, per GPU: the activations
    no GPU run has measured beyond MEASURED_KEPT_TOKENS (see `unmeasured_terms`)."""
    return w.tokens_per_micro_batch * (w.model.num_layers - w.recomputed_layers) * layer_activation_bytes(w)


# The most tokens per micro-batch of a measured GPU run that kept every layer's activations (no
# checkpointing: plan/calibration/measured/h100-2026-11-25.csv, llama-3.2-1b at 2048 × 1). The measured
# 7B runs at 4096 × 2 and 4096 × 4 checkpointed every layer (planned within 3 %).
MEASURED_KEPT_TOKENS = 2048


def unmeasured_terms(w: Workload) -> list[str]:
    """What of `w`'s memory no GPU run has measured yet (plan/calibration/measured/*.csv; the GPU
    kit's first command measures each): every plan lists them, and the partial checkpointing
    recommendation keeps a margin on the first (plan.choose.KEPT_ACTIVATIONS_MARGIN)."""
    terms = []
    kept = w.model.num_layers - w.recomputed_layers
    if kept and (w.partial_checkpointing or w.tokens_per_micro_batch > MEASURED_KEPT_TOKENS):
        terms.append(f"activations of the {kept} decoder layers that keep theirs "
                     f"({kept_layer_activations(w) / GIB:.1f} GiB at {w.tokens_per_micro_batch:,} tokens per micro-batch)")
    if w.dense_mask:  # each layer that keeps its activations holds its copies, a recomputed one while it runs
        holding = kept + (w.recomputed_layers > 0)
        mask = w.tokens_per_micro_batch * (holding * (dense_mask_bytes(w) + repeated_kv_bytes(w)) + w.seq_len)
        terms.append(f"packed rows' attention mask under SDPA, with the KV heads repeated for it ({mask / GIB:.1f} GiB, "
                     "simulated on CPU; --attention varlen builds none)")
    if w.loss_form == "liger":
        terms.append("Liger's fused loss (counted as holding no logits)")
    if w.loss_form == "finetune-chunked":
        terms.append(f"the chunked loss's scratch ({chunk_scratch_bytes(w) / GIB:.2f} GiB, simulated on CPU)")
    if w.fused_optimizer and w.optimizer == "adamw" and not w.deepspeed:
        terms.append("fused AdamW's step (counted without foreach temporaries)")
    if w.fp8:
        terms.append(f"--fp8's float8 weight copies and cast scratch ({(fp8_params(w) * FP8_BYTES + fp8_scratch_bytes(w)) / GIB:.1f} GiB)")
    if w.objective_row.preference:
        terms.append(f"--objective {w.objective} (counted as {w.objective_row.sequences} sequence(s) per example"
                     + (", a frozen copy of the weights as the reference" if w.reference_copy else "") + ")")
    return terms


def autocast_weight_copies(w: Workload) -> float:
    """Under autocast, fp32 weights are cast to 16 bits for each matmul, and backward keeps those
    copies: one 16-bit copy of every matmul weight (a checkpointed layer's only while it recomputes).
    Under QLoRA only the LM head is such a matmul (fp32 after PEFT's k-bit upcast); 16-bit weights
    (fp16-true), FSDP2 and DeepSpeed already hold compute weights, so they make none."""
    p = w.precision
    if not p.autocast or w.strategy.computes_on_copies:
        return 0.0
    counts = parallel.rank_params(w)
    head = counts.head or counts.embedding
    if w.method == "qlora":
        return p.compute_bytes * head if unquantized_bytes(w) > p.compute_bytes else 0.0
    if p.weight_bytes == p.compute_bytes:
        return 0.0
    layers = w.model.num_layers - w.recomputed_layers + (w.recomputed_layers > 0)
    return p.compute_bytes * (layers * counts.layer_linear_weights + head)


def working_set_bytes(w: Workload) -> tuple[float, float]:
    """Unsharded copies FSDP2 / ZeRO-3 hold per GPU, at the loss and inside a decoder layer.

    FSDP2 keeps its root unit (embedding, final norm, head) gathered from forward to the end of
    backward; inside a layer it also holds that layer's gathered 16-bit weights, the prefetched
    next layer and the layer's unsharded gradients before reduce-scatter (a whole layer for full
    fine-tuning, its adapters for LoRA). ZeRO-3 gathers modules one at a time (the largest of a
    layer, the embedding and the head), its unsharded gradients, and a reduce bucket.
    """
    if not w.strategy.shards_weights:
        return 0.0, 0.0
    counts = parallel.rank_params(w)
    e = w.precision.compute_bytes
    layer = e * counts.layer
    if w.method == "qlora":  # 4-bit weights travel packed in their 16-bit storage
        layer -= (e - 0.5) * counts.layer_linear_weights
    if w.strategy.fsdp:
        layer_gradients = e * parallel.rank_trainable_params(w) / counts.num_layers if w.method != "full" else e * counts.layer
        # a mixture of experts holds a third layer unsharded at that moment (FSDPMemTracker: Mixtral and
        # Qwen3-MoE shapes, LoRA and full, tests/plan/test_planner_simulate.py; dense layers hold two)
        gathered = (3 if w.model.moe else 2) * layer
        return e * counts.root, e * counts.root + gathered + layer_gradients
    largest = max(layer, e * counts.embedding, e * counts.head)
    gathered = 2 * largest + e * DS_BUCKET_ELEMENTS
    return gathered, gathered


def comm_buffer_bytes(w: Workload, states: ModelStates) -> float:
    """Communication buffers that live for the whole run.

    DDP copies gradients into its own buckets (Accelerate leaves gradient_as_bucket_view off), so
    it holds a second copy of the gradients. ZeRO-1/2 keep reduce and allgather buckets.
    """
    if w.strategy.ddp:
        return states.gradients
    if w.deepspeed and not w.strategy.shards_weights:
        return 3 * DS_BUCKET_ELEMENTS * w.precision.compute_bytes  # double-buffered reduce + allgather
    return 0.0


def dequant_scratch_bytes(w: Workload) -> float:
    """QLoRA dequantizes one linear's weight to 16 bits for each matmul, forward and backward."""
    if w.method != "qlora":
        return 0.0
    largest = max(linear.weight_params for linear in layer_linears(w.model) if linear.kind != "experts")
    return largest * w.precision.compute_bytes  # dequantized experts: moe.materialized_weight_bytes


# --fp8 (train/fp8.py) keeps a float8 copy of each frozen weight it casts, one byte per weight, beside
# the 16-bit one; a cast makes an fp32 copy of its operand on the way (4 bytes per element, then 1)
FP8_BYTES = 1
FP8_CAST_BYTES = 4 + FP8_BYTES


def fp8_linears(w: Workload) -> list[tuple[int, Linear]]:
    """(layers, linear) of each frozen base linear --fp8 casts: the LoRA-adapted linears of the decoder
    layers that are one matrix (fused experts keep their 16-bit matmuls)."""
    if not w.fp8:
        return []
    targets = lora_targets(w)
    return [(n, linear) for n, linears in layer_kinds(w.model) for linear in adapted(linears, targets) if linear.copies == 1]


def fp8_params(w: Workload) -> int:
    """Weights --fp8 holds a float8 copy of."""
    return sum(n * linear.weight_params for n, linear in fp8_linears(w))


def fp8_scratch_bytes(w: Workload) -> float:
    """--fp8's temporaries at its widest linear: the operand it casts (the input forward, the output's
    gradient backward) as fp32 and as float8 for one micro-batch, and, backward, the float8 weight
    laid out transposed for the kernel."""
    linears = [linear for _, linear in fp8_linears(w)]
    if not linears:
        return 0.0
    widest = max(max(linear.fan_in, linear.fan_out) for linear in linears)
    largest = max(linear.weight_params for linear in linears)
    return parallel.tokens_per_rank(w) * widest * FP8_CAST_BYTES + largest * FP8_BYTES


# Hugging Face checkpoints come in safetensors files of at most 5 GB (save_pretrained's default).
CHECKPOINT_SHARD_BYTES = 5e9


def loading_host_bytes(w: Workload) -> float:
    """Host RAM per node while the weights load. finetune loads straight onto each GPU (QLoRA
    quantizes on the way), so each process holds about one checkpoint file at a time; under FSDP
    with cpu-RAM-efficient loading one process per node reads the whole checkpoint and the others
    receive their shards, and without it every process holds a full copy."""
    model_bytes = count_params(w.model).total * w.precision.weight_bytes
    if w.strategy.fsdp:
        return model_bytes * (1 if w.efficient_loading else w.gpus_per_node)
    return w.gpus_per_node * min(model_bytes, CHECKPOINT_SHARD_BYTES)


@dataclass(frozen=True)
class Placement:
    """Model states of one GPU after the strategy sharded them and offload moved some to the host."""

    weights: float
    gradients: float
    optimizer: float
    step_scratch: float
    offloaded: float  # bytes this GPU's process keeps in host RAM instead


def place_states(w: Workload, states: ModelStates) -> Placement:
    """What of `states` one GPU holds under `w`'s strategy and offload. Shared by the estimate and
    by `--dry-run`'s measurement of the trainer's own construction, so both place states alike."""
    n, strategy = w.sharding_ranks, w.strategy
    weights = (states.frozen + states.trainable + states.reference) / (n if strategy.shards_weights else 1) + states.quant_constants
    gradients = states.gradients / (n if strategy.shards_gradients else 1)
    optimizer = states.optimizer / (n if strategy.shards_optimizer else 1)
    step_scratch = states.step_scratch / (n if strategy.shards_optimizer else 1)
    offloaded = 0.0
    if w.offload != "none":
        # The optimizer steps on the host; DeepSpeed also streams each reduced gradient partition
        # to the host (its estimator counts only the 16-bit parameters on the GPU).
        offloaded += optimizer + (gradients if w.deepspeed else 0.0)
        optimizer, step_scratch = 0.0, 0.0
        gradients = 0.0 if w.deepspeed else gradients
    if w.offload == "params":
        offloaded += weights - states.quant_constants + gradients
        weights, gradients = states.quant_constants, 0.0
    return Placement(weights, gradients, optimizer, step_scratch, offloaded)


def estimate(w: Workload) -> Breakdown:
    """Per-GPU peak memory of one training step of `w`, by term."""
    states = model_states(w)
    placed = place_states(w, states)
    weights, gradients, optimizer, step_scratch = placed.weights, placed.gradients, placed.optimizer, placed.step_scratch

    persistent = comm_buffer_bytes(w, states)
    scratch = dequant_scratch_bytes(w) + fp8_scratch_bytes(w) + parallel.ring_buffer_bytes(w)
    moments = [(acts, gathered + scratch) for acts, gathered in zip(activation_bytes(w), working_set_bytes(w))]
    activations, transient = max(moments, key=sum)
    cached = cached_logits_bytes(w) if moments.index((activations, transient)) == 0 else 0.0
    if activations + transient >= step_scratch:
        phase, buffers = "forward/backward", persistent + transient
    else:
        phase, activations, buffers, cached = "optimizer step", 0.0, persistent + step_scratch, 0.0

    return Breakdown(
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=activations,
        buffers=buffers,
        peak_phase=phase,
        host_offload=placed.offloaded * w.gpus_per_node,
        host_loading=loading_host_bytes(w),
        cached=cached,
    )


def cached_logits_bytes(w: Workload) -> float:
    """What the allocator keeps cached beside a peak at the loss: VOCABULARY_CACHE of one fp32 copy of
    the micro-batch's logits, when the loss holds full-vocabulary logits (not Liger's, not the chunked loss)."""
    if not LOSS_BYTES_PER_VOCAB[w.loss_form](w.precision.compute_bytes):
        return 0.0
    return VOCABULARY_CACHE * parallel.tokens_per_rank(w) * w.model.vocab_size * 4


def backward_activations(w: Workload) -> float:
    """Activations per GPU at the peak of forward/backward, also where the optimizer step sets the
    step's peak (`estimate` then reports none): `w` planned with an optimizer step that allocates
    nothing, which changes nothing else."""
    return estimate(replace(w, fused_optimizer=True)).activations
