"""The words the planner, the trainer, checkpoints and rehearse share: precisions and strategies.

One table each, so `finetune plan --precision bf16-true --strategy zero3`, the training flags the
plan prints, the launch files it writes, the setup printout of a run and the manifest of its
checkpoints all name the same thing the same way. No torch import: the planner stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from finetune.errors import FinetuneError
from finetune.models.families import chunked_loss_types

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# the label of a token the loss skips (prompt, padding): PyTorch's and transformers' ignore_index
IGNORE_INDEX = -100
Method = Literal["full", "lora", "qlora"]
Optimizer = Literal["adamw", "adamw-8bit", "paged-adamw-8bit"]  # torch AdamW, bitsandbytes 8-bit (paged) AdamW
Offload = Literal["none", "optimizer", "params"]  # what moves to host RAM, least first
METHODS: tuple[str, ...] = get_args(Method)
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
OFFLOADS: tuple[str, ...] = get_args(Offload)


@dataclass(frozen=True)
class Precision:
    """How a run stores and computes: the dtype weights load in, and the dtype matmuls run in.

    `-mixed` loads fp32 weights (fp32 master weights, gradients and optimizer states) and computes
    under torch.autocast; `-true` loads the weights in 16 bits and computes in 16 bits too (LoRA
    adapters stay fp32, as PEFT creates them). Both run with the same Accelerate `mixed_precision`
    (autocast, fp16 loss scaling, DeepSpeed's bf16/fp16 section, FSDP2's compute dtype), so a
    launch file never has to know which of the two a run uses.
    """

    name: str
    weights: str  # dtype the model's weights load in (torch dtype name)
    compute: str  # dtype of matmuls and activations
    accelerate: str  # Accelerate's mixed_precision: no | bf16 | fp16

    @property
    def weight_bytes(self) -> int:
        return DTYPE_BYTES[self.weights]

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute]

    @property
    def mixed(self) -> bool:
        """fp32 weights under 16-bit autocast: an fp32 residual stream, and every matmul casts its input."""
        return self.weights != self.compute

    @property
    def autocast(self) -> bool:
        return self.accelerate != "no"

    @property
    def fp32(self) -> bool:
        """Everything in fp32: no autocast, no 16-bit matmuls."""
        return self.compute == "float32"

    @property
    def residual_bytes(self) -> int:
        """The residual stream's dtype: the embedding's (the weights'), since autocast leaves the
        embedding lookup, the norms and the residual adds alone."""
        return self.weight_bytes if self.autocast else self.compute_bytes


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("bf16-mixed", weights="float32", compute="bfloat16", accelerate="bf16"),
    Precision("bf16-true", weights="bfloat16", compute="bfloat16", accelerate="bf16"),
    Precision("fp16-mixed", weights="float32", compute="float16", accelerate="fp16"),
    Precision("fp16-true", weights="float16", compute="float16", accelerate="fp16"),
    Precision("fp32", weights="float32", compute="float32", accelerate="no"),
)}


def default_precision(method: str, bf16: bool) -> Precision:
    """`--precision auto` on a GPU: full fine-tuning keeps fp32 master weights (-mixed); LoRA and
    QLoRA freeze the base, so storing it in fp32 would only waste memory (-true). GPUs without bf16
    (V100, T4) use fp16 with loss scaling."""
    family = "bf16" if bf16 else "fp16"
    return PRECISIONS[f"{family}-mixed" if method == "full" else f"{family}-true"]


def trains_pure_bf16(precision: Precision, method: str) -> bool:
    """bf16-true full fine-tuning: bf16 weights, gradients and AdamW states with no fp32 master copy,
    as torchtune trains. Under FSDP2 Accelerate's mixed precision is off (train/accelerator.py); under
    ZeRO the DeepSpeed JSON keeps master weights, gradients and optimizer states in bf16
    (config/deepspeed_json.py)."""
    return method == "full" and precision.weights == "bfloat16"


def check_precision(precision: Precision, method: str, strategy: Strategy | None = None, offload: str = "none") -> None:
    """Refuse combinations that would not run as named: fp16 weights cannot be updated stably
    (Accelerate's loss scaler refuses to unscale fp16 gradients); DeepSpeed keeps offloaded bf16
    optimizer states only with its own CPU Adam, while finetune steps torch's AdamW."""
    if trains_pure_bf16(precision, method) and strategy is not None and strategy.deepspeed and offload != "none":
        raise FinetuneError(
            f"--precision bf16-true full fine-tuning under {strategy.label} with {offload} offload is not supported: "
            "DeepSpeed keeps offloaded bf16 optimizer states only with its own CPU Adam. Use --precision bf16-mixed "
            "with offload, or ZeRO without offload."
        )
    if precision.weights == "float16" and method == "full":
        raise FinetuneError(
            "--precision fp16-true keeps the weights in fp16, which full fine-tuning cannot update stably "
            "(fp16 gradients cannot be unscaled). Use --precision fp16-mixed (fp32 master weights) or LoRA/QLoRA."
        )


@dataclass(frozen=True)
class Strategy:
    """A way to spread one training step over GPUs, with what it shards and how Accelerate names it."""

    name: str  # single | ddp | fsdp | zero1 | zero2 | zero3: flags, plans, manifests
    label: str  # what people call it
    distributed_type: str  # Accelerate's DistributedType value (MULTI_GPU covers MULTI_CPU)
    shards_weights: bool
    shards_gradients: bool
    shards_optimizer: bool
    offloads: tuple[str, ...]  # what it can move to host RAM: none, optimizer, params

    @property
    def deepspeed(self) -> bool:
        return self.distributed_type == "DEEPSPEED"

    @property
    def fsdp(self) -> bool:
        return self.distributed_type == "FSDP"

    @property
    def computes_on_copies(self) -> bool:
        """FSDP2's mixed precision and DeepSpeed compute with 16-bit copies of the weights they hold,
        so autocast never casts a weight and the residual stream runs in the compute dtype."""
        return self.fsdp or self.deepspeed

    @property
    def distributed(self) -> bool:
        """Needs several ranks (every strategy but `single`)."""
        return self.distributed_type != "NO"

    @property
    def ddp(self) -> bool:
        """Several ranks, each with whole weights, gradients and optimizer states (all-reduce)."""
        return self.distributed_type == "MULTI_GPU"

    @property
    def zero_stage(self) -> int | None:
        return int(self.name[-1]) if self.deepspeed else None


# FSDP's CPU offload moves parameters, gradients and the optimizer step to the host together;
# ZeRO offloads the optimizer from stage 1 and parameters at stage 3 only.
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("single", "single device", "NO", False, False, False, ("none",)),
    Strategy("ddp", "DDP", "MULTI_GPU", False, False, False, ("none",)),
    Strategy("fsdp", "FSDP2", "FSDP", True, True, True, ("none", "params")),
    Strategy("zero1", "ZeRO-1", "DEEPSPEED", False, False, True, ("none", "optimizer")),
    Strategy("zero2", "ZeRO-2", "DEEPSPEED", False, True, True, ("none", "optimizer")),
    Strategy("zero3", "ZeRO-3", "DEEPSPEED", True, True, True, ("none", "optimizer", "params")),
)}


def named(table: dict, value, flag: str):
    """The entry of `table` (STRATEGIES, PRECISIONS) that `value` names; an entry passes through.
    Lets a Workload or Request be written with names (`strategy="ddp"`) and still hold the object."""
    if not isinstance(value, str):
        return value
    if value not in table:
        raise FinetuneError(f"{flag} {value!r} is not one of {', '.join(table)}")
    return table[value]


def zero_strategy(stage: int, source: str) -> Strategy:
    """The ZeRO strategy of a DeepSpeed config's `zero_optimization.stage` (`source` names the file)."""
    if stage not in (1, 2, 3):
        raise FinetuneError(f"{source}: zero_optimization.stage {stage} is not supported; use 1, 2 or 3.")
    return STRATEGIES[f"zero{stage}"]


# Architectures whose CausalLM head is a bare linear layer over the backbone's last hidden state (no
# logit scaling, soft-capping or bias; a load-balancing loss is added as the model adds it): the chunked loss (train/chunked_loss.py) is
# checked against each one's own loss (tests/train/test_chunked_loss.py); config/switches.py decides where it runs.
# The family table (models/families.py) says which.
CHUNKED_LOSS_ARCHITECTURES = chunked_loss_types()
