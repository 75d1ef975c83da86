"""What one plan trains: model, hardware, method, strategy and batch shape, fully pinned down.

`Workload` is the input of every estimate (memory, speed, launch files). The last few fields
describe choices other frameworks make differently from finetune (litgpt's bf16 adapters and
chunked loss, for instance); their defaults are finetune's own, and the calibration bench sets them
to reproduce published runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from finetune.catalog.gpus import GPUSpec
from finetune.catalog.models import ModelSpec

METHODS = ("full", "lora", "qlora")
STRATEGIES = ("single", "ddp", "fsdp", "zero1", "zero2", "zero3")
OFFLOADS = ("none", "optimizer", "params")
OPTIMIZERS = ("adamw", "adamw-8bit", "paged-adamw-8bit", "sgd")
DEEPSPEED = ("zero1", "zero2", "zero3")
SHARDED_PARAMS = ("fsdp", "zero3")

# Which offloads each strategy supports: FSDP only offloads parameters (its CPU offload moves
# params, grads and the optimizer step to the host together); ZeRO offloads the optimizer from
# stage 1, parameters at stage 3 only; DDP and one GPU keep everything on the device.
VALID_OFFLOADS = {
    "single": ("none",),
    "ddp": ("none",),
    "fsdp": ("none", "params"),
    "zero1": ("none", "optimizer"),
    "zero2": ("none", "optimizer"),
    "zero3": ("none", "optimizer", "params"),
}


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what a precision mode stores and computes in."""

    weight_bytes: int  # stored weights: trainable ones and the frozen base (unless 4-bit)
    compute_bytes: int  # activations and matmul inputs
    autocast: bool  # torch.autocast: fp32 residual stream, each matmul casts its input to 16 bits


PRECISIONS = {
    "bf16-mixed": Precision(4, 2, True),  # fp32 weights, grads and states; bf16 matmuls (Accelerate)
    "fp16-mixed": Precision(4, 2, True),  # same layout; the loss scaler's state is negligible
    "bf16-true": Precision(2, 2, False),  # everything in bf16 (LoRA adapters: see adapter_bytes)
    "fp32": Precision(4, 4, False),
}


@dataclass(frozen=True)
class Workload:
    """One fully specified training configuration on one cluster."""

    model: ModelSpec
    gpu: GPUSpec
    gpus_per_node: int
    method: str
    strategy: str
    offload: str
    precision: str
    optimizer: str
    micro_batch_size: int
    seq_len: int
    gradient_checkpointing: bool
    nodes: int = 1
    lora_r: int = 16
    lora_targets: str = "all-linear"
    gradient_accumulation_steps: int = 1
    # How the training code behaves; defaults are finetune's (transformers + PEFT + torch AdamW).
    adapter_bytes: int = 4  # PEFT upcasts LoRA weights to fp32 when the base is 16-bit
    lora_dropout: float = 0.0  # > 0 saves a mask and a dropped copy of each adapter input
    double_quant: bool = True  # QLoRA's nested quantization of the absmax constants
    chunked_loss: bool = False  # litgpt: LM head and cross-entropy in chunks, no fp32 logits
    attention: str = "sdpa"  # "sdpa" (flash / memory-efficient: no s² term) or "eager"
    fused_optimizer: bool = False  # torch AdamW(fused=True): no foreach temporaries at the step

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def precision_spec(self) -> Precision:
        return PRECISIONS[self.precision]

    @property
    def deepspeed(self) -> bool:
        return self.strategy in DEEPSPEED

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.seq_len

    def with_micro_batch(self, micro_batch_size: int) -> Workload:
        return replace(self, micro_batch_size=micro_batch_size)
