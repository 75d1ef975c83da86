"""What a built model trains, by kind: trainable / total parameters of its attention, dense MLPs,
experts, router, embeddings, head and norms (models/families.parameter_kind sorts them), printed
before every run and `--dry-run` so that an adapter which reaches no expert is seen before it trains.

Counts are logical sizes: a 4-bit weight counts its unpacked elements, a ZeRO-3 placeholder the size
DeepSpeed recorded; adapters count with the module they adapt.
"""

from __future__ import annotations

import math

import torch

from finetune.models import families


def logical_numel(param: torch.Tensor) -> int:
    """Elements a parameter stands for: bitsandbytes' 4-bit storage (a Linear4bit's Params4bit, or an
    expert parameter quantized in place, which carries its quant_state too) counts unpacked, and
    ZeRO-3 leaves an empty placeholder and records the real size in ds_numel."""
    quant_state = getattr(param, "quant_state", None)
    if quant_state is not None:
        return math.prod(quant_state.shape)
    return getattr(param, "ds_numel", param.numel())


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts at logical size. One count for every method: PEFT's
    `get_nb_trainable_parameters` exists only on a PeftModel, which full fine-tuning does not have."""
    trainable = total = 0
    for param in model.parameters():
        n = logical_numel(param)
        total += n
        trainable += n if param.requires_grad else 0
    return trainable, total


def by_kind(model: torch.nn.Module, model_type: str) -> dict[str, tuple[int, int]]:
    """kind → (trainable, total) parameters, kinds in families.KINDS order, kinds the model lacks left out."""
    fam = families.family(model_type)
    counts = {kind: [0, 0] for kind in families.KINDS}
    for name, param in model.named_parameters():
        n, kind = logical_numel(param), families.parameter_kind(name, fam)
        counts[kind][1] += n
        counts[kind][0] += n if param.requires_grad else 0
    return {kind: (trainable, total) for kind, (trainable, total) in counts.items() if total}


def table(kinds: dict[str, tuple[int, int]], planned: dict[str, tuple[int, int]] | None = None) -> str:
    """The by-kind counts as aligned lines ('experts  0 / 24,159,191,040'), with the planner's beside them."""
    lines = [f"  {'by kind':<11} {'trainable':>15} {'total':>17}" + ("   planned trainable / total" if planned else "")]
    for kind, (trainable, total) in kinds.items():
        line = f"  {kind:<11} {trainable:>15,} {total:>17,}"
        if planned is not None:
            want = planned.get(kind, (0, 0))
            line += f"   {want[0]:,} / {want[1]:,}" + ("" if want == (trainable, total) else "  (differs)")
        lines.append(line)
    return "\n".join(lines)


def lora_warnings(config, model_type: str) -> list[str]:
    """families.lora_warnings for a LoRA/QLoRA run's --lora-targets (`config`: its TrainConfig)."""
    fam = families.family(model_type)
    if config.method == "full" or fam is None:
        return []
    targets = families.lora_targets(config.lora_targets, fam, config.model, quantized=config.method == "qlora")
    return families.lora_warnings(config.lora_targets, fam, targets)
