"""Exact parameter counts from architecture numbers: what each memory term is multiplied by.

Counts follow the module layout transformers builds for each family (models/families.py): embeddings;
per decoder layer the attention projections (grouped-query, or DeepSeek's latent attention), the MLP
(dense, or a mixture of experts: router, every routed expert, shared experts), norms; the final norm;
an untied or tied LM head; a vision tower beside the language model. A test compares them with models
instantiated on the meta device. Of a mixture of experts every expert is resident (`total`) while each
token goes through its top-k (`active`). LoRA and 4-bit counts follow PEFT and bitsandbytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from finetune.models import families
from finetune.models.catalog import ModelSpec
from finetune.models.families import LM_HEAD, LoraTargets

# bitsandbytes NF4: 4 bits per weight plus one absmax per block of 64 weights. Without double
# quantization the absmax is fp32 (4 B / 64); with it, the absmax is 8-bit (1 B / 64) and every 256
# absmaxes share one fp32 second-level constant (4 B / (64·256)).
NF4_BYTES = 0.5 + 4 / 64
NF4_DOUBLE_QUANT_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


@dataclass(frozen=True)
class Linear:
    """One weight matrix of a decoder layer, named as transformers names its module (or, for experts,
    the fused parameter); `copies` stacks one matrix per routed expert."""

    name: str
    fan_in: int
    fan_out: int
    bias: bool
    kind: str = "attention"  # families.KINDS: attention, dense MLP, experts, router
    copies: int = 1
    quantized: bool = True  # QLoRA stores it in 4 bits (a router that is no nn.Linear stays 16-bit)
    active: int | None = None  # copies a token goes through (experts: top-k); None: all

    @property
    def weight_params(self) -> int:
        return self.copies * self.fan_in * self.fan_out

    @property
    def params(self) -> int:
        return self.copies * (self.fan_in * self.fan_out + (self.fan_out if self.bias else 0))

    @property
    def active_weight_params(self) -> int:
        return (self.copies if self.active is None else self.active) * self.fan_in * self.fan_out


def attention_linears(spec: ModelSpec) -> tuple[Linear, ...]:
    """The attention projections, in forward order: q/k/v/o with grouped-query widths (Phi-3 fuses
    q, k, v), or DeepSeek's latent attention (q through a rank-q_lora_rank bottleneck when it has
    one; k and v from one compressed kv of rank kv_lora_rank plus a shared rotary key)."""
    h, fam = spec.hidden_size, spec.family
    if fam.mla:
        heads, qk = spec.num_heads, spec.qk_nope_head_dim + spec.qk_rope_head_dim
        q = ((Linear("q_a_proj", h, spec.q_lora_rank, False), Linear("q_b_proj", spec.q_lora_rank, heads * qk, False))
             if spec.q_lora_rank else (Linear("q_proj", h, heads * qk, False),))
        return (*q, Linear("kv_a_proj_with_mqa", h, spec.kv_lora_rank + spec.qk_rope_head_dim, False),
                Linear("kv_b_proj", spec.kv_lora_rank, heads * (spec.qk_nope_head_dim + spec.v_head_dim), False),
                Linear("o_proj", heads * spec.v_head_dim, h, False))
    q, kv = spec.num_heads * spec.resolved_head_dim, spec.num_kv_heads * spec.resolved_head_dim
    bias, o_bias = spec.attention_bias, spec.o_proj_bias or spec.linear_bias
    if fam.attention[0] == "qkv_proj":
        return Linear("qkv_proj", h, q + 2 * kv, bias), Linear("o_proj", q, h, o_bias)
    return (Linear("q_proj", h, q, bias), Linear("k_proj", h, kv, bias), Linear("v_proj", h, kv, bias),
            Linear("o_proj", q, h, o_bias))


def dense_mlp(spec: ModelSpec, inter: int) -> tuple[Linear, ...]:
    """A dense MLP of width `inter`: SwiGLU gate/up/down (Phi-3 fuses gate and up), or fc1/fc2."""
    h, bias = spec.hidden_size, spec.linear_bias
    if "gate_up_proj" in spec.family.mlp:
        mlp = (Linear("gate_up_proj", h, 2 * inter, bias, "dense MLP"),)
    elif spec.mlp_gated:
        mlp = (Linear("gate_proj", h, inter, bias, "dense MLP"), Linear("up_proj", h, inter, bias, "dense MLP"))
    else:
        mlp = (Linear("up_proj", h, inter, bias, "dense MLP"),)
    return mlp + (Linear("down_proj", inter, h, bias, "dense MLP"),)


def moe_mlp(spec: ModelSpec) -> tuple[Linear, ...]:
    """A mixture-of-experts block: the router (one logit per expert), every routed expert's fused
    gate_up and down projections (each token goes through experts_per_token of them), and the shared
    experts every token goes through (Qwen2-MoE's behind a 1-output sigmoid gate)."""
    h, experts = spec.hidden_size, spec.family.experts
    e, k, inter, bias = spec.num_experts, spec.experts_per_token, spec.expert_intermediate_size, experts.bias
    block = (Linear(experts.router, h, e, bias, "router", quantized=False),
             Linear("experts.gate_up_proj", h, 2 * inter, bias, "experts", copies=e, active=k),
             Linear("experts.down_proj", inter, h, bias, "experts", copies=e, active=k))
    if spec.shared_expert_intermediate_size:
        block += dense_mlp(spec, spec.shared_expert_intermediate_size)
    if experts.shared_gate:
        block += (Linear("shared_expert_gate", h, 1, False, "router"),)
    return block


@cache  # the planner asks thousands of times per plan while it searches micro batches and checkpointing
def layer_linears(spec: ModelSpec) -> tuple[Linear, ...]:
    """The weight matrices of the largest decoder layer (a mixture of experts where the model has one), in forward order."""
    return attention_linears(spec) + (moe_mlp(spec) if spec.moe else dense_mlp(spec, spec.intermediate_size))


@cache
def layer_kinds(spec: ModelSpec) -> tuple[tuple[int, tuple[Linear, ...]], ...]:
    """(how many layers, their linears) for each kind of decoder layer the model has: dense layers,
    then layers with experts."""
    dense = attention_linears(spec) + dense_mlp(spec, spec.intermediate_size)
    kinds = [(spec.num_layers - spec.moe_layers, dense)] + ([(spec.moe_layers, layer_linears(spec))] if spec.moe else [])
    return tuple((n, linears) for n, linears in kinds if n)


def norm_params(spec: ModelSpec) -> tuple[int, int]:
    """(one decoder layer's norm parameters, the final norm's): RMSNorm a weight per unit, LayerNorm
    a bias too, OLMo's LayerNorm none; queries and keys normalized per head or over their width."""
    h, fam = spec.hidden_size, spec.family
    per_unit = 0 if not fam.norm_weights else 2 if spec.norm_bias else 1
    layer = spec.norms_per_layer * h * per_unit
    if fam.qk_norm == "head":
        layer += 2 * spec.resolved_head_dim
    elif fam.qk_norm == "width":
        layer += (spec.num_heads + spec.num_kv_heads) * spec.resolved_head_dim
    if fam.mla:  # RMSNorms inside the low-rank bottlenecks
        layer += spec.kv_lora_rank + spec.q_lora_rank
    if fam.sinks:  # not a norm: one attention-sink logit per head, counted with the layer's small parameters
        layer += spec.num_heads
    return layer, h * per_unit


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one architecture; `layer` is its largest decoder layer (the FSDP wrap unit)."""

    embedding: int
    head: int  # 0 when tied to the embedding
    layer: int
    layer_linear_weights: int  # the part of `layer` that 4-bit quantization stores as NF4
    final_norm: int
    num_layers: int
    layers: int  # every decoder layer together
    linear_weights: int  # every layer's weights that QLoRA stores as NF4
    routed_out: int = 0  # of `layers`, the expert parameters one token does not go through
    tower: int = 0  # outside the language model (a vision tower): frozen, never quantized
    active_matmul: int = 0  # every layer's matmul weights one token goes through (experts: its top-k)

    @property
    def total(self) -> int:
        return self.embedding + self.head + self.final_norm + self.layers + self.tower

    @property
    def active(self) -> int:
        """Parameters one token's forward uses: all but the experts it is not routed to (and the tower)."""
        return self.total - self.tower - self.routed_out

    @property
    def root(self) -> int:
        """Parameters outside the decoder layers (embedding, final norm, head, tower): FSDP's root unit."""
        return self.embedding + self.head + self.final_norm + self.tower

    @property
    def quantizable(self) -> int:
        """Weights QLoRA stores in 4 bits: the layers' linears and experts (bitsandbytes skips the head)."""
        return self.linear_weights

    @property
    def matmul(self) -> int:
        """Parameters that take part in a matmul per token (all but the embedding lookup and the
        experts a token is not routed to; a tied head counts)."""
        return self.active_matmul + (self.head or self.embedding)


@cache
def count_params(spec: ModelSpec) -> ParamCounts:
    h = spec.hidden_size
    layer_norms, final_norm = norm_params(spec)
    layers = linear_weights = active = routed_out = 0
    for n, linears in layer_kinds(spec):
        layers += n * (sum(linear.params for linear in linears) + layer_norms)
        linear_weights += n * sum(linear.weight_params for linear in linears if linear.quantized)
        active += n * sum(linear.active_weight_params for linear in linears)
        routed_out += n * sum(linear.params * (linear.copies - linear.active) // linear.copies
                              for linear in linears if linear.active is not None)
    largest = layer_linears(spec)
    return ParamCounts(
        embedding=spec.vocab_size * h,
        head=0 if spec.tie_word_embeddings else spec.vocab_size * h,
        layer=sum(linear.params for linear in largest) + layer_norms,
        layer_linear_weights=sum(linear.weight_params for linear in largest if linear.quantized),
        final_norm=final_norm,
        num_layers=spec.num_layers,
        layers=layers,
        linear_weights=linear_weights,
        routed_out=routed_out,
        tower=spec.tower_params,
        active_matmul=active,
    )


@cache  # asked for every memory and speed estimate of the search
def resolve_lora_targets(spec: ModelSpec, targets: str, method: str = "lora") -> LoraTargets:
    """`--lora-targets` for this model and method (families.lora_targets): raises FinetuneError
    naming what its family accepts when a term names nothing in it."""
    return families.lora_targets(targets, spec.family, spec.name, quantized=method == "qlora")


def adapted(linears: tuple[Linear, ...], targets: LoraTargets) -> list[Linear]:
    """The linears (and fused expert parameters) of a layer that LoRA adapts."""
    return [linear for linear in linears if targets.adapts(linear.name)]


def lora_params(spec: ModelSpec, r: int, targets: LoraTargets) -> int:
    """LoRA adds A (r × fan_in) and B (fan_out × r) to every targeted linear of every layer, r per
    expert to a targeted fused expert parameter (PEFT's ParamWrapper), and to the LM head
    (hidden → vocabulary) when it is a target; a router named as a target trains whole."""
    total = sum(n * sum(r * linear.copies * (linear.fan_in + linear.fan_out) for linear in adapted(linears, targets))
                for n, linears in layer_kinds(spec))
    whole = sum(n * sum(linear.params for linear in linears if linear.name in targets.whole)
                for n, linears in layer_kinds(spec))
    head = r * (spec.hidden_size + spec.vocab_size) if LM_HEAD in targets.modules else 0
    return total + whole + head


def params_by_kind(spec: ModelSpec, method: str, r: int, targets: LoraTargets | None) -> dict[str, tuple[int, int]]:
    """kind (families.KINDS) → (trainable, total) parameters of the model a run builds, as
    train/inventory.by_kind counts it: adapters count with the module they adapt, a router trained
    whole adds its trainable copy, a vision tower never trains."""
    counts = {kind: [0, 0] for kind in families.KINDS}

    def add(kind: str, params: int, trains: bool, adapters: int = 0) -> None:
        counts[kind][0] += (params if trains else 0) + adapters
        counts[kind][1] += params + adapters

    full, h = method == "full", spec.hidden_size
    add("embeddings", spec.vocab_size * h, full)
    head_adapter = r * (h + spec.vocab_size) if targets is not None and LM_HEAD in targets.modules else 0
    if not spec.tie_word_embeddings or head_adapter:
        add("head", 0 if spec.tie_word_embeddings else spec.vocab_size * h, full, head_adapter)
    layer_norms, final_norm = norm_params(spec)
    sinks = spec.num_heads if spec.family.sinks else 0
    add("norms", final_norm, full)
    for n, linears in layer_kinds(spec):
        add("norms", n * (layer_norms - sinks), full)
        add("attention", n * sinks, full)
        for linear in linears:
            adapter = r * linear.copies * (linear.fan_in + linear.fan_out) if targets and targets.adapts(linear.name) else 0
            add(linear.kind, n * linear.params, full, n * adapter)
            if targets is not None and linear.name in targets.whole:
                add(linear.kind, n * linear.params, True)
    add("other", spec.tower_params, False)
    return {kind: (trainable, total) for kind, (trainable, total) in counts.items() if total}
