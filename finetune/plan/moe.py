"""What a mixture of experts adds to a training step, beyond a dense model of its active size.

Every expert is resident: weights, gradients and optimizer states count all of them (plan/params.py);
FSDP2 and ZeRO-3 shard them like any weight, a whole MoE layer being one unit. Expert parallelism
(each GPU holding some experts and tokens travelling to them) is not in Accelerate, so no plan here
places experts apart; `NOTES` says so in every MoE plan.

Per token, transformers 5's grouped-matmul experts (the default, `grouped_mm`) save for backward:
the router's fp32 probabilities and top-k indices; for each of the k experts a token goes to, the
expert's two inputs (the grouped matmul keeps both operands, whether or not the experts train), the
gate and up projections and the activation (as a dense SwiGLU MLP does), the expert's output (its
routing weight's gradient reads it) and the indices that sort tokens by expert and back. LoRA on fused
expert parameters (PEFT's ParamWrapper) and QLoRA's 4-bit experts (dequantized by bitsandbytes'
parametrization) each hand the grouped matmul a 16-bit copy of the whole layer's experts, which
backward keeps: one copy per layer whose activations are kept, like a saved activation that does not
grow with the batch. Measured against MemTracker on fake tensors (tests/plan/test_planner_simulate.py).

Because the experts are fused 3-D parameters, not linear layers, `--lora-targets all-linear` adapts no
expert: `lora_reach` says what it adapts instead, in the trainer's words (families.lora_warnings), and
the planner plans `with_experts` beside it.
"""

from __future__ import annotations

from finetune.models import families
from finetune.models.families import ALL_LINEAR, EXPERTS, PRESETS, LoraTargets
from finetune.plan.params import layer_kinds, params_by_kind, resolve_lora_targets
from finetune.plan.workload import Workload

NOTES = (
    "mixture of experts: every expert is resident on every GPU (FSDP2 and ZeRO-3 shard them like any weight); "
    "expert parallelism is not in Accelerate, so no plan places experts on different GPUs",
)
MXFP4_NOTE = ("{name}'s published experts are MXFP4: finetune loads them dequantized to bf16 (transformers' "
              "Mxfp4Config(dequantize=True)) and plans them so; QLoRA plans assume a bf16 copy as --model "
              "(the MXFP4 checkpoint itself trains with LoRA or full fine-tuning)")
INDEX_BYTES = 8  # int64 indices: the top-k choice, the sort by expert, the way back


def expert_bytes(w: Workload) -> int:
    """Bytes per element the experts compute in: grouped matmuls are outside autocast, so they run in
    the weights' dtype (fp32 for -mixed), unless FSDP2/DeepSpeed hand them 16-bit copies; QLoRA's
    are dequantized to the dtype they were loaded in."""
    p = w.precision
    return p.compute_bytes if w.strategy.computes_on_copies and w.method != "qlora" else p.weight_bytes


def routed_activation_bytes(w: Workload) -> float:
    """Bytes one MoE block saves per token for its router and routed experts (see the module docstring)."""
    spec = w.model
    k, x = spec.experts_per_token, expert_bytes(w)
    h, inter = spec.hidden_size, spec.expert_intermediate_size
    router = spec.num_experts * 4 + k * (INDEX_BYTES + 4)  # fp32 probabilities, top-k indices and weights
    inputs = (h + inter) * x  # gathered hidden state, gated activation: the grouped matmuls' operands
    per_slot = inputs + 3 * inter * x + h * x + 3 * INDEX_BYTES + x  # gate, up, act; output; indices; routing weight
    return router + k * per_slot


def materialized_weight_bytes(w: Workload, targets: LoraTargets | None) -> float:
    """Bytes of one layer's weights backward keeps as a 16-bit copy: the experts (and any linear) LoRA
    adapts through PEFT's target_parameters (W + ΔW), and QLoRA's dequantized experts."""
    if w.method == "full" or not w.model.moe:
        return 0.0
    return sum(linear.weight_params for linear in _moe_layer(w)
               if (linear.kind == "experts" and w.method == "qlora") or _through_parameter(linear, targets)) * expert_bytes(w)


def lora_weight_bytes(w: Workload, targets: LoraTargets | None) -> float:
    """Bytes of one layer's W + ΔW that LoRA through PEFT's target_parameters writes for each forward."""
    if targets is None or not w.model.moe:
        return 0.0
    return sum(linear.weight_params for linear in _moe_layer(w) if _through_parameter(linear, targets)) * expert_bytes(w)


def _moe_layer(w: Workload):
    return max(layer_kinds(w.model), key=lambda kind: sum(linear.weight_params for linear in kind[1]))[1]


def _through_parameter(linear, targets: LoraTargets | None) -> bool:
    """LoRA reaches this weight through PEFT's target_parameters (a fused expert, or a renamed linear)."""
    return targets is not None and (linear.name in targets.parameters or f"{linear.name}.weight" in targets.parameters)


def weight_gradient_bytes(w: Workload, targets: LoraTargets | None) -> float:
    """Backward's full-size gradient of a LoRA-targeted expert parameter (the grouped matmul's weight
    gradient, which PEFT then reduces to the adapters): one at a time, the down projection's first."""
    if targets is None or not targets.experts:
        return 0.0
    experts = [linear for linear in max(layer_kinds(w.model), key=lambda kind: len(kind[1]))[1]
               if linear.kind == "experts" and linear.name in targets.parameters]
    return experts[-1].weight_params * expert_bytes(w)


def router_logits_bytes(w: Workload) -> float:
    """Per token, all layers: with the auxiliary loss on (output_router_logits), every MoE layer's
    router logits are kept for the load-balancing loss, which softmaxes them in fp32."""
    spec = w.model
    return spec.moe_layers * spec.num_experts * (w.precision.compute_bytes + 4) if spec.router_aux_loss else 0.0


# Memory passes over a token's k expert slots in one MoE layer's forward: its hidden state gathered
# (written, read by the grouped matmul), the experts' outputs (written, read by the routing-weight
# multiply), weighted (written, read back in token order by the sum).
ROUTING_PASSES = 6


def routing_bytes(w: Workload) -> float:
    """Bytes one token moves through memory in one MoE layer's forward to reach its experts and come
    back (plan/traffic.py scales the forward's bytes to the backward and any recompute); the speed
    model's matmuls count only the active experts' FLOPs."""
    spec = w.model
    return spec.experts_per_token * spec.hidden_size * expert_bytes(w) * ROUTING_PASSES


def activated_width(spec) -> int:
    """The MLP width one token goes through in an MoE layer: its top-k experts and the shared ones."""
    return spec.experts_per_token * spec.expert_intermediate_size + spec.shared_expert_intermediate_size


def misses_experts(w: Workload) -> bool:
    """A LoRA/QLoRA run of a mixture of experts whose --lora-targets adapt no expert."""
    return w.method != "full" and w.model.moe and not resolve_lora_targets(w.model, w.lora_targets, w.method).experts


def with_experts(lora_targets: str) -> str:
    """The --lora-targets that add every expert to `lora_targets`: the preset for all-linear."""
    return PRESETS[1] if lora_targets == ALL_LINEAR else f"{lora_targets},{EXPERTS}"


def lora_reach(w: Workload) -> str:
    """What a LoRA run that `misses_experts` adapts, and the trainer's own warning about the experts
    (families.lora_warnings): 'LoRA adapts attention (6.7M adapter parameters); --lora-targets …'."""
    targets = resolve_lora_targets(w.model, w.lora_targets, w.method)
    kinds = params_by_kind(w.model, w.method, w.lora_r, targets)
    reached = [f"{kind} ({trainable / 1e6:,.1f}M trainable)" for kind, (trainable, _) in kinds.items() if trainable]
    warning = families.lora_warnings(w.lora_targets, w.model.family, targets)[0]
    return f"LoRA adapts {' and '.join(reached) or 'nothing'} and no expert: {warning}"
