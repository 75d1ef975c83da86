"""What one plan trains: model, hardware, method, strategy and batch shape, fully pinned down.

`Workload` is the input of every estimate (memory, speed, launch files). The last few fields
describe choices other frameworks make differently from finetune (litgpt's bf16 adapters and
chunked loss, for instance); their defaults are finetune's own, and the calibration bench sets them
to reproduce published runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from finetune.config.names import PRECISIONS, STRATEGIES, Method, Offload, Optimizer, Precision, Strategy, named
from finetune.config.objectives import OBJECTIVES, Objective, log_prob_form, precomputes_reference, reference_kind
from finetune.errors import FinetuneError
from finetune.models.catalog import ModelSpec
from finetune.plan.gpus import GPUSpec

if TYPE_CHECKING:  # the run side imports torch; the planner only reads the resolved values
    from finetune.config.resolve import ResolvedRun


@dataclass(frozen=True)
class Workload:
    """One fully specified training configuration on one cluster. `strategy` and `precision` may be
    given by name ("zero3", "bf16-true"); the workload holds the Strategy and Precision."""

    model: ModelSpec
    gpu: GPUSpec
    gpus_per_node: int
    method: Method
    strategy: Strategy
    offload: Offload
    precision: Precision
    optimizer: Optimizer
    micro_batch_size: int
    seq_len: int
    gradient_checkpointing: bool
    nodes: int = 1
    checkpointed_layers: int | None = None  # with checkpointing: the first N decoder layers recompute (None: all)
    lora_r: int = 16
    lora_targets: str = "all-linear"
    gradient_accumulation_steps: int = 1
    tp: int = 1  # tensor parallel: each group of tp GPUs splits every linear layer (plan/parallel.py)
    cp: int = 1  # context parallel: each group of cp GPUs splits every row's tokens
    efficient_loading: bool = True  # FSDP: one process per node reads the checkpoint (cpu_ram_efficient_loading)
    objective: str = "sft"  # config.objectives.OBJECTIVES: a micro-batch of pairs runs twice the sequences
    precompute_reference: bool = False  # the reference's log-probabilities computed before training (no copy, no forward)
    # How the training code behaves; defaults are finetune's (transformers 5 + PEFT + bitsandbytes
    # ≥ 0.43.2 + torch AdamW). The calibration bench sets them to reproduce other frameworks' runs.
    adapter_bytes: int = 4  # PEFT upcasts LoRA weights to fp32 when the base is 16-bit
    lora_dropout: float = 0.0  # > 0 saves a mask and a dropped copy of each adapter input
    double_quant: bool = True  # QLoRA's nested quantization of the absmax constants
    # PEFT's prepare_model_for_kbit_training casts every parameter that is not 4-bit (embeddings,
    # norms, LM head) to fp32, which also makes the residual stream fp32. finetune does not call it:
    # those parameters keep the precision's weight dtype (fp32 for -mixed, 16-bit for -true).
    kbit_upcast: bool = False
    bnb_saves_input: bool = False  # bitsandbytes < 0.43.2: MatMul4Bit kept its 16-bit input for backward
    loss: str = "transformers"  # how logits and cross-entropy are held (config.switches.LOSSES): see memory.LOSS_BYTES_PER_VOCAB
    attention: str = "sdpa"  # "sdpa" (flash / memory-efficient: no s² term) or "eager"
    # packed rows under SDPA: transformers' block-diagonal mask, micro × s × s (plan.memory, plan.traffic);
    # none for unpacked full-length rows, nor where the kernel keeps packed examples apart (varlen, flex, flash)
    dense_mask: bool = False
    fused_optimizer: bool = False  # torch AdamW(fused=True): no foreach temporaries at the step
    compile: bool = False  # regional compilation of the decoder blocks (--compile): see plan.speed
    fp8: bool = False  # LoRA's frozen base linears in float8 matmuls (--fp8, train/fp8.py): plan.memory, plan.speed
    # a sliding window as long as the rows keeps its explicit mask, as transformers builds it (TRL, the
    # GPU kit's profile); finetune's trainer switches it off (ModelSpec.masks_attention)
    inert_window_kept: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", named(STRATEGIES, self.strategy, "--strategy"))
        object.__setattr__(self, "precision", named(PRECISIONS, self.precision, "--precision"))
        if not self.model.family.sdpa:  # gpt-oss's attention sinks: transformers runs it eagerly (its mask unplanned)
            object.__setattr__(self, "attention", "eager")
            object.__setattr__(self, "dense_mask", False)

    @property
    def masked_sdpa(self) -> bool:
        """SDPA gets an explicit micro × s × s mask: packed rows (`dense_mask`), or a sliding window
        shorter than the row (ModelSpec.masks_attention). It converts the mask in every layer and runs its
        memory-efficient kernel over every score (plan.memory, plan.speed; plan.traffic for packed rows)."""
        return self.attention == "sdpa" and (self.dense_mask or self.model.masks_attention(self.seq_len, self.inert_window_kept))

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def model_parallel(self) -> int:
        """GPUs of one TP or CP group: they work on the same rows."""
        return self.tp * self.cp

    @property
    def data_parallel_size(self) -> int:
        """GPUs that read different rows."""
        return self.world_size // self.model_parallel

    @property
    def sharding_ranks(self) -> int:
        """GPUs FSDP2/ZeRO shard a rank's states over: data-parallel × CP (a TP rank's slice is its own)."""
        return self.world_size // self.tp

    @property
    def deepspeed(self) -> bool:
        return self.strategy.deepspeed

    @property
    def recomputed_layers(self) -> int:
        """Decoder layers whose activations the backward recomputes (0 without checkpointing)."""
        if not self.gradient_checkpointing:
            return 0
        layers = self.model.num_layers
        return layers if self.checkpointed_layers is None else min(self.checkpointed_layers, layers)

    @property
    def partial_checkpointing(self) -> bool:
        """Checkpointing that leaves the later decoder layers' activations kept."""
        return 0 < self.recomputed_layers < self.model.num_layers

    @property
    def recompute_share(self) -> float:
        """The share of the forward that checkpointing runs again in the backward."""
        return self.recomputed_layers / self.model.num_layers

    @property
    def objective_row(self) -> Objective:
        return OBJECTIVES[self.objective]

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens that run forward and backward per micro-batch: a preference pair's two sequences."""
        return self.micro_batch_size * self.objective_row.sequences * self.seq_len

    @property
    def forward_only_passes(self) -> int:
        """Forwards without gradients per micro-batch, each of as many tokens as the trained ones: the
        reference's (none when precomputed), and KTO's mismatched rows through the policy."""
        o = self.objective_row
        reference = 0 if self.precompute_reference else o.reference_sequences
        return (reference + o.policy_no_grad_sequences) // o.sequences

    @property
    def reference_copy(self) -> bool:
        """Full fine-tuning holds a frozen copy of the weights as its reference, unless it is precomputed
        (LoRA's reference is its base with the adapters off)."""
        return reference_kind(self.objective, self.precompute_reference, self.method) == "frozen copy"

    @property
    def loss_form(self) -> str:
        """How the run holds its log-probabilities (config.switches.LOSSES): a preference objective's
        through the LM head in chunks wherever the supervised run would not hold the logits."""
        return log_prob_form(self.loss) if self.objective_row.preference else self.loss

    def with_micro_batch(self, micro_batch_size: int) -> Workload:
        return replace(self, micro_batch_size=micro_batch_size)


def from_run(run: ResolvedRun, gpu: GPUSpec) -> Workload:
    """The one translation of a training run into the planner's Workload: model, method, LoRA
    settings, precision, optimizer, strategy and offload (from the launch config / DeepSpeed JSON),
    world size, machines and TP/CP layout, micro batch, accumulation, sequence length and checkpointing (and of how
    many layers).

    Raises FinetuneError when the planner cannot read the model's architecture without a download.
    """
    config, switches = run.config, run.switches
    if run.spec is None:
        raise FinetuneError(
            f"Cannot plan --model {config.model}: its architecture is not in the catalog and no config.json is "
            "available locally (a local model directory, or the Hugging Face cache, has one)."
        )
    return Workload(
        model=run.spec, gpu=gpu, gpus_per_node=run.launch.gpus_per_node, nodes=run.launch.num_machines,
        method=config.method, strategy=run.strategy, offload=run.offload, precision=run.precision,
        optimizer=config.optimizer, micro_batch_size=run.batch.micro_batch_size, seq_len=config.max_seq_len,
        gradient_checkpointing=config.gradient_checkpointing, checkpointed_layers=config.gradient_checkpointing_layers,
        lora_r=config.lora_r, lora_targets=config.lora_targets, lora_dropout=config.lora_dropout,
        gradient_accumulation_steps=run.batch.gradient_accumulation_steps,
        tp=run.parallelism.tp, cp=run.parallelism.cp,
        efficient_loading=run.launch.fsdp_cpu_ram_efficient_loading or not run.strategy.fsdp,
        # Liger, the chunked loss, fused AdamW and the attention kernel as the run resolves them
        # (config.switches); compilation is off unless asked for
        loss=switches.loss, fused_optimizer=switches.fused_adamw, compile=bool(config.compile), fp8=config.fp8,
        objective=config.objective,
        precompute_reference=precomputes_reference(config.objective, config.precompute_reference, config.method),
        dense_mask=config.packing and switches.attention == "sdpa",
    )


# AMD's chips have FP8 tensor cores, but the trainer runs train/fp8.py only on NVIDIA GPUs (train/run.py
# checks for CUDA without HIP): MI300X's float8 formats are the fnuz variants, and MI355X's OCP formats are
# not measured through torch._scaled_mm on ROCm
AMD_CHIPS = ("MI300X", "MI355X")


def runs_fp8(gpu: GPUSpec) -> bool:
    """`gpu` runs train/fp8.py's float8 matmuls (NVIDIA, compute capability ≥ 8.9)."""
    return gpu.fp8_tflops > 0 and gpu.chip not in AMD_CHIPS
