"""Why a plan asked for is not planned, in the words the trainer would stop with.

A layout the trainer refuses (config/parallelism.py: `--tp` on a mixture of experts, LoRA on row-parallel
linears under TP, `--tp` and `--cp` together, either under DeepSpeed) is refused here with the same
sentence, so an empty answer says what the run would say instead of reading as out of memory. What the
trainer would run but the planner does not search (a TP group larger than one node, CP with offload) gets
the planner's own sentence. A speed switch the layout turns off (Liger under TP or CP) or on (the
chunked loss under TP, per vocabulary shard) is said beside the plan. Pure functions of the workload, no torch.
"""

from __future__ import annotations

from finetune.config.options import TrainConfig
from finetune.config.parallelism import Asked, parallelism_problems, resolve_parallelism
from finetune.config.switches import CP_LABELS, TP_HEAD, Switches, head_read_blocked
from finetune.errors import ConfigError
from finetune.plan import parallel
from finetune.plan.workload import Workload

# How each loss (config.switches.LOSSES) is named in a reason.
LOSS_NAMES = {"liger": "Liger's fused loss", "finetune-chunked": "the chunked loss",
              "transformers": "the model's own loss (full-vocabulary logits)"}


def layout_name(w: Workload) -> str:
    """'--tp 2', '--cp 4', '--tp 2 and --cp 2': the layout as the flags ask for it."""
    return " and ".join(f"--{name} {size}" for name, size in (("tp", w.tp), ("cp", w.cp)) if size > 1)


def trainer_layout_problems(w: Workload) -> list[str]:
    """What the trainer says when asked to lay `w` out as its tp × cp on its GPUs (resolve_parallelism's
    and parallelism_problems' sentences), as `finetune` resolves it on CUDA GPUs without --packing."""
    try:
        layout = resolve_parallelism(Asked(tp=w.tp if w.tp > 1 else None, cp=w.cp if w.cp > 1 else None), Asked(),
                                     w.world_size)
    except ConfigError as e:
        return str(e).split("\n  - ")[1:]
    return parallelism_problems(layout, spec=w.model, method=w.method,
                                lora_targets=TrainConfig(lora_targets=w.lora_targets).lora_target_modules,
                                deepspeed=w.deepspeed, offload=w.offload, cuda=True, max_seq_len=w.seq_len,
                                packing=False, attention="auto")


def layout_problems(w: Workload) -> list[str]:
    """Why `w`'s tp × cp is not planned: the trainer's refusals first; else, for a layout the trainer
    would run, what the planner does not search (parallel.tensor_parallel_sizes, context_parallel_sizes).
    Empty when it is planned (always for tp = cp = 1)."""
    if w.model_parallel == 1:
        return []
    problems = trainer_layout_problems(w)
    if problems:
        return problems
    asked = layout_name(w)
    if not w.strategy.fsdp:
        return [f"{asked} runs on FSDP2 (the trainer lays the groups out with FSDP2 over the data-parallel GPUs, "
                f"whatever the launch's strategy): --strategy {w.strategy.name} plans none; use --strategy fsdp"]
    if w.offload != "none":
        return [f"{asked} with {w.offload} offload: the planner plans TP and CP layouts without offload; use --offload none"]
    if w.tp > 1 and w.tp not in parallel.tensor_parallel_sizes(w):
        return [f"--tp {w.tp}: the planner plans TP groups of at most {min(parallel.MAX_TP, w.gpus_per_node)} GPUs inside "
                "one node that divide the GPUs (LoRA: every GPU in the one group)"]
    if w.cp > 1 and w.cp not in parallel.context_parallel_sizes(w):
        return [f"--cp {w.cp}: the planner plans CP groups of 2, 4, 8, … 64 GPUs that divide the GPUs"]
    return []


def switch_reasons(w: Workload, at_layout: Switches, without_layout: Switches) -> list[str]:
    """What the run turns off that was asked for or is on by default: the switches' own notes
    (config.switches), and a loss the layout changes (`without_layout`: the same run at tp = cp = 1):
    TP turns the chunked loss on, one vocabulary shard per GPU; a loss it or CP turns off is said with why."""
    reasons = list(at_layout.notes)
    if at_layout.loss == without_layout.loss:
        return reasons
    if w.tp > 1 and at_layout.chunked_loss:
        reasons.append(f"{layout_name(w)} runs the chunked loss on each GPU's vocabulary shard instead of "
                       f"{LOSS_NAMES[without_layout.loss]}: no GPU holds the whole vocabulary's logits")
        return reasons
    why = head_read_blocked(w.strategy, w.method, w.lora_targets) or (TP_HEAD if w.tp > 1 else None) \
        or (CP_LABELS if w.cp > 1 else "the layout")
    if not any(why in note for note in at_layout.notes):
        reasons.append(f"{layout_name(w)} turns {LOSS_NAMES[without_layout.loss]} off ({why}): "
                       f"{LOSS_NAMES[at_layout.loss]} runs instead")
    return reasons
