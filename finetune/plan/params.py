"""Exact parameter counts from architecture numbers: what each memory term is multiplied by.

Counts follow the module layout transformers builds (embeddings, per layer: q/k/v/o projections
with GQA widths, the MLP, norms; the final norm; an untied or tied LM head), so a test can compare
them with a model instantiated on the meta device. LoRA and 4-bit counts follow PEFT and
bitsandbytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from finetune.models.catalog import ModelSpec
from finetune.errors import FinetuneError

# bitsandbytes NF4: 4 bits per weight plus one absmax per block of 64 weights. Without double
# quantization the absmax is fp32 (4 B / 64); with it, the absmax is 8-bit (1 B / 64) and every 256
# absmaxes share one fp32 second-level constant (4 B / (64·256)).
NF4_BYTES = 0.5 + 4 / 64
NF4_DOUBLE_QUANT_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


@dataclass(frozen=True)
class Linear:
    """One nn.Linear inside a decoder layer, named as in transformers' Llama family."""

    name: str
    fan_in: int
    fan_out: int
    bias: bool

    @property
    def weight_params(self) -> int:
        return self.fan_in * self.fan_out


@cache  # the planner asks thousands of times per plan while it searches micro batches and checkpointing
def layer_linears(spec: ModelSpec) -> tuple[Linear, ...]:
    """The linears of one decoder layer, in forward order."""
    h, inter = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.resolved_head_dim, spec.num_kv_heads * spec.resolved_head_dim
    attention = (
        Linear("q_proj", h, q, spec.attention_bias),
        Linear("k_proj", h, kv, spec.attention_bias),
        Linear("v_proj", h, kv, spec.attention_bias),
        Linear("o_proj", q, h, spec.linear_bias),
    )
    if spec.mlp_gated:
        mlp = (Linear("gate_proj", h, inter, spec.linear_bias), Linear("up_proj", h, inter, spec.linear_bias))
    else:
        mlp = (Linear("up_proj", h, inter, spec.linear_bias),)
    return attention + mlp + (Linear("down_proj", inter, h, spec.linear_bias),)


def linear_names(spec: ModelSpec) -> tuple[str, ...]:
    return tuple(linear.name for linear in layer_linears(spec))


# PEFT adapts the output layer only when it is named: "all-linear" leaves it out.
LM_HEAD = "lm_head"


def resolve_lora_targets(spec: ModelSpec, targets: str) -> tuple[str, ...]:
    """'all-linear' (PEFT: every linear in the layers, not the LM head) or a comma list of names,
    which may include the LM head (`lm_head`).

    Raises FinetuneError naming the valid module names when a target is not a linear of the model.
    """
    names = linear_names(spec)
    if targets.strip() == "all-linear":
        return names
    chosen = tuple(dict.fromkeys(t.strip() for t in targets.split(",") if t.strip()))
    unknown = [t for t in chosen if t not in (*names, LM_HEAD)]
    if unknown or not chosen:
        raise FinetuneError(
            f"--lora-targets {targets!r}: {', '.join(unknown) or 'empty'} not a linear of {spec.name}. "
            f"Use all-linear or a comma list of: {', '.join((*names, LM_HEAD))}."
        )
    return chosen


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one architecture; `layer` is one decoder layer (the FSDP wrap unit)."""

    embedding: int
    head: int  # 0 when tied to the embedding
    layer: int
    layer_linear_weights: int  # the part of `layer` that 4-bit quantization stores as NF4
    final_norm: int
    num_layers: int

    @property
    def total(self) -> int:
        return self.embedding + self.head + self.final_norm + self.num_layers * self.layer

    @property
    def root(self) -> int:
        """Parameters outside the decoder layers (embedding, final norm, head): FSDP's root unit."""
        return self.embedding + self.head + self.final_norm

    @property
    def quantizable(self) -> int:
        """Weights of the layer linears: what QLoRA stores in 4 bits (bitsandbytes skips the head)."""
        return self.num_layers * self.layer_linear_weights

    @property
    def matmul(self) -> int:
        """Parameters that take part in a matmul per token (all but the embedding lookup, tied head counts)."""
        head = self.head or self.embedding
        return self.num_layers * self.layer_linear_weights + head


@cache
def count_params(spec: ModelSpec) -> ParamCounts:
    h = spec.hidden_size
    linears = layer_linears(spec)
    weights = sum(linear.weight_params for linear in linears)
    biases = sum(linear.fan_out for linear in linears if linear.bias)
    norm = h * (2 if spec.norm_bias else 1)
    return ParamCounts(
        embedding=spec.vocab_size * h,
        head=0 if spec.tie_word_embeddings else spec.vocab_size * h,
        layer=weights + biases + spec.norms_per_layer * norm,
        layer_linear_weights=weights,
        final_norm=norm,
        num_layers=spec.num_layers,
    )


def lora_params(spec: ModelSpec, r: int, targets: tuple[str, ...]) -> int:
    """LoRA adds A (r × fan_in) and B (fan_out × r) to every targeted linear of every layer, and to
    the LM head (hidden → vocabulary) when it is a target."""
    per_layer = sum(r * (linear.fan_in + linear.fan_out) for linear in layer_linears(spec) if linear.name in targets)
    head = r * (spec.hidden_size + spec.vocab_size) if LM_HEAD in targets else 0
    return spec.num_layers * per_layer + head
