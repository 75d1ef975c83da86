"""Run configuration: one typed dataclass (`TrainConfig`), its batch arithmetic and learning rate,
and its validation, all at once, before any weights load. flags.py reads it from the flags and a
YAML file (defaults < YAML file < CLI flags).

The help text of every flag is the `help` metadata of its field, so `--help`, the docs and the
saved `run.yaml` never drift apart. No torch import: `finetune plan` and `--help` stay instant.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.config.names import METHODS, OPTIMIZERS, PRECISIONS
from finetune.config.objectives import DPO_LOSSES, OBJECTIVES, objective_problems
from finetune.errors import ConfigError
from finetune.models import catalog, source

FORMATS = ("auto", "alpaca", "chat", "sharegpt", "text")
ATTENTIONS = ("auto", "sdpa", "varlen", "flex", "flash")
LR_SCALINGS = ("none", "linear", "sqrt")
LR_SCHEDULES = ("cosine", "linear", "constant")
PRECISION_CHOICES = ("auto", *PRECISIONS)
REPORT_TO = ("none", "tensorboard", "wandb")



def _field(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainConfig:
    """Everything a training run needs; `run.yaml` in the output dir is this, resolved."""

    # model
    model: str = _field("tiny", "Catalog name (e.g. llama-7b, smollm2-135m, tiny), Hugging Face id, local directory, or GGUF file (converted once, cached).")
    method: str = _field("full", "Fine-tuning method.", METHODS)
    lora_r: int = _field(16, "LoRA rank.")
    lora_alpha: int = _field(32, "LoRA scaling numerator (scale = alpha / r).")
    lora_dropout: float = _field(0.0, "Dropout on the LoRA branch.")
    lora_targets: str = _field("all-linear", "What LoRA adapts: all-linear (attention and dense MLPs), all-linear+experts "
                               "(and a mixture of experts' experts), or a comma list such as q_proj,v_proj "
                               "(also lm_head; experts, experts.down_proj, router).")
    gradient_checkpointing: bool = _field(False, "Recompute activations in backward to save memory.")
    gradient_checkpointing_layers: int | None = _field(None, "With --gradient-checkpointing: recompute only the first N decoder layers; the others keep their activations (no recompute: faster, more memory). Unset: all. `finetune plan` recommends the fewest that fit.")
    liger: bool | None = _field(None, "Liger kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy without full-vocabulary logits); unset: on for CUDA where liger-kernel is installed and imports, off on CPU. Like the chunked loss, never under ZeRO-3, with LoRA on lm_head or a quantized head.")
    chunked_loss: bool | None = _field(None, "Loss through the LM head a chunk of tokens at a time, never holding the full-vocabulary logits (as TRL's fused LM head and axolotl's chunked cross-entropy); unset: on for LoRA and QLoRA and under --tp (each rank reads its vocabulary shard of the head), except where Liger's fused loss runs, under ZeRO-3, with LoRA on lm_head, and for architectures it does not cover (llama, mistral, qwen2 are).")
    compile: bool | None = _field(None, "Regional compilation: torch.compile each decoder block in place (compile time reported apart from tokens/s, kernels cached in ~/.cache/finetune/inductor); off unless given until measured on a GPU.")
    fp8: bool = _field(False, "LoRA only: the frozen base's matmuls in float8 (weights cast once, inputs and gradients per call, fp32 accumulation); the adapters, attention and loss stay bf16. Needs an NVIDIA GPU of compute capability ≥ 8.9 (L40S, RTX 4090, H100, H200), --precision bf16-true, one GPU or DDP. Off unless given: not yet measured on a GPU.")
    attention: str = _field("auto", "Attention kernel: sdpa; varlen (torch's variable-length FlashAttention: each micro-batch of packed rows as one row of examples, no dense mask; CUDA, 16-bit, torch ≥ 2.11, not yet measured on a GPU); flex (packed rows as a document mask; GPU only, not yet measured on one); flash (needs flash-attn; packed rows flattened as for varlen); auto: sdpa.", ATTENTIONS)
    trust_remote_code: bool = _field(False, "Allow model code from the Hub repo to run (off: safe default).")
    deepspeed: str | None = _field(None, "DeepSpeed JSON (e.g. ds_configs/zero3.json); its \"auto\" values are filled from this config.")
    tp: int = _field(1, "Tensor parallelism: split every linear layer of the model over this many processes (one node's GPUs, on NVLink), which read the same rows; the world is data-parallel × tp × cp processes. Runs on FSDP2 (transformers' TP plan); an accelerate config's parallelism_config_tp_size says the same.")
    cp: int = _field(1, "Context parallelism: split every row's tokens over this many processes, which pass keys and values around a ring (for sequences one GPU cannot hold). CUDA only; runs on FSDP2 (Accelerate's ParallelismConfig); an accelerate config's parallelism_config_cp_size says the same.")
    preflight_timeout: float = _field(300.0, "Seconds each distributed preflight check (rendezvous, all-reduce) may take before the run stops with a diagnosis.")
    # data
    dataset: str = _field("builtin", "builtin, a local JSON/JSONL/CSV/Parquet file, or a Hub dataset name.")
    format: str = _field("auto", "Dataset format; auto detects it from the columns.", FORMATS)
    train_on_prompt: bool = _field(False, "Also compute the loss on prompt tokens (default: response only).")
    max_seq_len: int = _field(256, "Truncate (or pack) examples to this many tokens.")
    packing: bool = _field(False, "Pack examples into full sequences; attention never crosses examples.")
    group_by_length: bool = _field(True, "Within each update's uniformly random rows, micro-batches of similar lengths: less padding when an update is split (accumulation, ranks), the same rows per update as --no-group-by-length, so the same learning. Not the Trainer's group_by_length, which makes whole updates one length class. No effect with --packing.")
    eval_split: str = _field("0.05", "Eval data: a split name of the dataset, or a fraction of train held out.")
    max_eval_examples: int = _field(200, "Cap on eval examples (0: no evaluation at all).")
    data_cache: str | None = _field(None, "Directory for tokenized data, reused by later runs with the same data, tokenizer and options (unset: $FINETUNE_DATA_CACHE, else ~/.cache/finetune/data); none: no cache.")
    dataset_num_proc: int | None = _field(None, "Processes that tokenize (unset: one per 20,000 rows, up to the CPU count).")
    eval_generate: int | None = _field(None, "Eval prompts to answer by greedy generation for exact match (unset: all for the builtin dataset, 0 for other data; under FSDP/ZeRO-3 each generated token gathers the model).")
    # objective
    objective: str = _field("sft", "What training optimizes: sft (cross-entropy on the answers), or a preference objective "
                            "on prompt/chosen/rejected rows: dpo, simpo, orpo, kto (KTO also reads prompt/completion/label "
                            "rows). The builtin dataset has pairs for each.", tuple(OBJECTIVES))
    dpo_loss: str = _field("sigmoid", "With --objective dpo: sigmoid (the DPO paper's), ipo (squared distance to 1/(2 beta), "
                           "on mean log-probabilities), or hinge.", DPO_LOSSES)
    beta: float | None = _field(None, "Strength of a preference objective (unset: dpo 0.1, simpo 2.0, orpo 0.1, kto 0.1; "
                                "for ORPO the weight of the odds-ratio term).")
    simpo_gamma: float = _field(0.5, "With --objective simpo: the margin the chosen answer's reward must clear.")
    precompute_reference: bool | None = _field(None, "With a reference objective (dpo, kto): compute the reference "
                                               "model's log-probabilities in one pass before training, cached by the data "
                                               "and the model, and hold no reference during training; unset: on for full "
                                               "fine-tuning (instead of a frozen copy of the weights and its forward every "
                                               "step), off for LoRA/QLoRA (the reference is the base, adapters off).")
    # batch
    micro_batch_size: int = _field(16, "Examples per forward pass per process (a preference pair is one example, "
                                   "two sequences).")
    gradient_accumulation_steps: int | None = _field(None, "Micro-batches per optimizer step (derived from --global-batch-size if unset).")
    global_batch_size: int | None = _field(None, "Examples per optimizer step over all processes = micro × accumulation × world size.")
    # optimization
    optimizer: str = _field("adamw", "adamw (torch), or bitsandbytes adamw-8bit / paged-adamw-8bit.", OPTIMIZERS)
    lr: float | None = _field(None, "Peak learning rate before --lr-scaling (unset: 2e-5 full, 2e-4 LoRA/QLoRA, or the catalog model's own, 1e-3 for tiny).")
    lr_scaling: str = _field("none", "Scale --lr with global batch / --base-global-batch-size.", LR_SCALINGS)
    base_global_batch_size: int = _field(16, "Global batch size at which --lr was tuned (for --lr-scaling).")
    lr_schedule: str = _field("cosine", "Decay after warmup, stepped once per optimizer update.", LR_SCHEDULES)
    warmup_steps: int = _field(20, "Linear warmup from 0 over this many optimizer updates.")
    min_lr_ratio: float = _field(0.1, "Final LR as a fraction of the peak (cosine and linear).")
    weight_decay: float = _field(0.0, "AdamW weight decay.")
    adam_beta1: float = _field(0.9, "AdamW β1 (first-moment decay).")
    adam_beta2: float = _field(0.95, "AdamW β2 (second-moment decay); 0.95 is steadier than torch's 0.999 for LLMs.")
    adam_epsilon: float = _field(1e-8, "AdamW ε added to the denominator.")
    max_grad_norm: float = _field(1.0, "Clip the global gradient norm to this (0 disables).")
    max_steps: int | None = _field(None, "Optimizer updates to run (overrides --epochs).")
    epochs: float | None = _field(None, "Passes over the training data when --max-steps is unset (unset: 1, or the catalog model's own, 4 for tiny).")
    seed: int = _field(0, "Seed for model init, data order and dropout.")
    precision: str = _field(
        "auto", "-mixed: fp32 weights, 16-bit autocast; -true: 16-bit weights (LoRA adapters fp32). auto: bf16-mixed "
        "for full, bf16-true for LoRA/QLoRA (fp16 on GPUs without bf16; the launch config's mixed_precision family "
        "if it sets one), fp32 on CPU.", PRECISION_CHOICES)
    gpu: str | None = _field(None, "GPU model to plan this run for (--dry-run, fit check), e.g. A100-40GB; unset: the GPU this process sees.")
    allow_cpu: bool = _field(False, "Train a model of more than 1B parameters on a machine without a GPU (without it, such a run stops first and says how long a step would take).")
    fit_check: bool = _field(True, "On a GPU, stop before loading weights when the run's planned memory exceeds the free GPU memory or host RAM.")
    # output
    output_dir: str = _field("output", "Where metrics, plots, checkpoints and the final model go.")
    log_every: int = _field(10, "Write a metrics.jsonl line every N optimizer updates.")
    eval_every: int = _field(0, "Evaluate every N updates (0: only before and after training).")
    report_to: str = _field("none", "Experiment tracker through Accelerate.", REPORT_TO)
    num_samples: int = _field(3, "Sample generations printed at the end.")
    save_final: bool = _field(True, "Save the trained model (or adapter) to --output-dir at the end.")
    save_every: int = _field(0, "Save a resumable checkpoint every N optimizer updates and at the end (0: only on SIGTERM/SIGUSR1).")
    keep_last: int = _field(0, "Keep only the newest K complete checkpoints (0: keep all).")
    resume: str | None = _field(None, "auto (newest complete checkpoint in --output-dir, else start fresh) or a checkpoint/output dir path.")
    verbose: bool = _field(False, "Also show the libraries' own logs and warnings (DeepSpeed, transformers, bitsandbytes, datasets, Hub).")

    @property
    def lora_target_modules(self) -> str | list[str]:
        """PEFT's `target_modules`: the string 'all-linear' or a list of module names."""
        if self.lora_targets == "all-linear":
            return "all-linear"
        return [name.strip() for name in self.lora_targets.split(",") if name.strip()]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# every option: how a config built in code reads (it means each value it holds; see flags.Command.given)
EVERY_OPTION = frozenset(f.name for f in dataclasses.fields(TrainConfig))


@dataclass(frozen=True)
class BatchShape:
    """micro × accumulation × data-parallel ranks = global, resolved once for the run. The ranks of
    one tensor- or context-parallel group (`model_parallel` of them) read the same rows."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    model_parallel: int = 1

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.model_parallel

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel_size

    @property
    def ranks_text(self) -> str:
        """How the shape's last factor prints: "world 4", or "data-parallel 2" under TP/CP."""
        return f"world {self.world_size}" if self.model_parallel == 1 else f"data-parallel {self.data_parallel_size}"


def resolve_batch_shape(config: TrainConfig, world_size: int, model_parallel: int = 1) -> BatchShape:
    """Derive gradient accumulation (or check it) so micro × accum × data-parallel ranks = global
    (the world's processes, less the `model_parallel` factor of TP/CP groups that share rows).

    Raises ConfigError when the three given numbers do not multiply out.
    """
    micro, accum, total = config.micro_batch_size, config.gradient_accumulation_steps, config.global_batch_size
    if micro < 1:
        raise ConfigError(f"--micro-batch-size must be ≥ 1, got {micro}")
    shape = BatchShape(micro, 1, world_size, model_parallel)
    per_step = micro * shape.data_parallel_size
    if total is None:
        return BatchShape(micro, accum or 1, world_size, model_parallel)
    if total % per_step:
        raise ConfigError(
            f"--global-batch-size {total} is not a multiple of micro batch {micro} × {shape.ranks_text} "
            f"= {per_step}. Use e.g. --global-batch-size {max(1, round(total / per_step)) * per_step}."
        )
    derived = total // per_step
    if accum is not None and accum != derived:
        raise ConfigError(
            f"Batch sizes do not multiply out: micro {micro} × accumulation {accum} × {shape.ranks_text} "
            f"= {per_step * accum}, but --global-batch-size is {total}. "
            f"Drop one of the flags or use --gradient-accumulation-steps {derived}."
        )
    return BatchShape(micro, derived, world_size, model_parallel)


# Usual peak LRs at global batch ~16 for 7B-class models: full fine-tuning moves every weight, so it
# needs a 10× smaller step than LoRA's freshly initialised adapters.
DEFAULT_LR = {"full": 2e-5, "lora": 2e-4, "qlora": 2e-4}


def base_lr(config: TrainConfig) -> float:
    """--lr, else the catalog model's own default, else the method's."""
    if config.lr is not None:
        return config.lr
    spec = catalog.lookup(config.model)
    return spec.default_lr if spec is not None and spec.default_lr else DEFAULT_LR[config.method]


def planned_epochs(config: TrainConfig) -> float:
    """--epochs, else the catalog model's own default, else one pass."""
    if config.epochs is not None:
        return config.epochs
    spec = catalog.lookup(config.model)
    return spec.default_epochs if spec is not None and spec.default_epochs else 1.0


def scaled_lr(config: TrainConfig, global_batch_size: int) -> float:
    """Peak LR after --lr-scaling: linear or square-root in global batch / base global batch."""
    ratio = global_batch_size / config.base_global_batch_size
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[config.lr_scaling]
    return base_lr(config) * factor


def validate(config: TrainConfig) -> None:
    """Check every field at once; raise one ConfigError listing all problems with their fixes."""
    problems = []
    for f in dataclasses.fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices and value not in choices:
            problems.append(f"--{flag_name(f.name)} {value!r} is not one of {', '.join(choices)}")
    positive = ("lora_r", "lora_alpha", "max_seq_len", "micro_batch_size", "log_every", "base_global_batch_size", "tp", "cp")
    for name in positive:
        if getattr(config, name) < 1:
            problems.append(f"--{flag_name(name)} must be ≥ 1, got {getattr(config, name)}")
    not_negative = ("save_every", "keep_last", "warmup_steps", "eval_every", "num_samples", "max_eval_examples",
                    "weight_decay", "max_grad_norm")
    for name in not_negative:
        if getattr(config, name) < 0:
            problems.append(f"--{flag_name(name)} must be ≥ 0, got {getattr(config, name)}")
    if not 0 <= config.min_lr_ratio <= 1:
        problems.append(f"--min-lr-ratio must be in [0, 1], got {config.min_lr_ratio}")
    if config.preflight_timeout <= 0:
        problems.append(f"--preflight-timeout must be > 0, got {config.preflight_timeout}")
    try:
        if not 0 < float(config.eval_split) < 1:
            problems.append(f"--eval-split {config.eval_split}: a held-out fraction must be between 0 and 1")
    except ValueError:
        pass  # a split name, checked against the dataset's splits when it loads
    for name in ("gradient_accumulation_steps", "global_batch_size", "max_steps", "dataset_num_proc"):
        value = getattr(config, name)
        if value is not None and value < 1:
            problems.append(f"--{flag_name(name)} must be ≥ 1, got {value}")
    if config.gradient_checkpointing_layers is not None:
        if config.gradient_checkpointing_layers < 1:
            problems.append(f"--gradient-checkpointing-layers must be ≥ 1, got {config.gradient_checkpointing_layers} "
                            "(no checkpointing: drop --gradient-checkpointing)")
        elif not config.gradient_checkpointing:
            problems.append("--gradient-checkpointing-layers says how many layers --gradient-checkpointing recomputes: "
                            "add --gradient-checkpointing")
    if config.eval_generate is not None and config.eval_generate < 0:
        problems.append(f"--eval-generate must be ≥ 0, got {config.eval_generate}")
    if config.max_eval_examples == 0 and (config.eval_every or config.eval_generate):
        problems.append("--max-eval-examples 0 turns evaluation off; drop --eval-every/--eval-generate or allow eval examples")
    if config.lr is not None and not (0 < config.lr < math.inf):
        problems.append(f"--lr must be a positive number, got {config.lr}")
    if config.epochs is not None and config.epochs <= 0 and config.max_steps is None:
        problems.append(f"--epochs must be > 0, got {config.epochs}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(config, name) < 1:
            problems.append(f"--{flag_name(name)} must be in [0, 1), got {getattr(config, name)}")
    if config.adam_epsilon <= 0:
        problems.append(f"--adam-epsilon must be > 0, got {config.adam_epsilon}")
    if not 0 <= config.lora_dropout < 1:
        problems.append(f"--lora-dropout must be in [0, 1), got {config.lora_dropout}")
    problems += objective_problems(config)
    problems += filter(None, [source.model_problem(config.model), output_dir_problem(config.output_dir),
                              resume_problem(config.resume)])
    if problems:
        raise ConfigError("Invalid configuration:\n  - " + "\n  - ".join(problems))


def output_dir_problem(output_dir: str) -> str | None:
    """Why the run could not write to --output-dir (a file in the way, a folder it may not write to), or
    None; checked here because the default model is written before anything else touches the folder."""
    path = Path(output_dir)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        what = "is a file" if existing == path else f"cannot be created: {existing} is a file"
        return f"--output-dir {output_dir} {what}, not a folder; name a folder (it is created if missing)"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--output-dir {output_dir}: no permission to write in {existing}; name a folder you can write to"
    return None


def resume_problem(resume: str | None) -> str | None:
    """A --resume path that does not exist (auto and unset are always fine)."""
    if resume in (None, "auto") or Path(resume).exists():
        return None
    return (f"--resume {resume}: no such checkpoint; name a checkpoint folder (OUTPUT/checkpoints/step-NNNNNN), "
            "an output dir that holds checkpoints, or auto")


def flag_name(option: str) -> str:
    """The command-line flag of a TrainConfig field, without its dashes: micro_batch_size → micro-batch-size."""
    return option.replace("_", "-")
