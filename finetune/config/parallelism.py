"""Tensor and context parallelism: how a run's processes split each step besides data parallelism.

A run's world is dp_replicate × dp_shard × tp × cp processes (the four sizes of Accelerate's
ParallelismConfig). The ranks of one tensor-parallel (TP) group each hold a slice of every linear
layer (q/k/v and gate/up by output columns, o and down by input rows) and of the residual stream
between the layers (by sequence: train/parallel.py), and read the same rows; the ranks of one
context-parallel (CP) group each hold a slice of every row's tokens and pass keys and values around
a ring. Only the groups that read different rows count as data parallel: the batch
arithmetic (micro × accumulation × data-parallel ranks = global) and the token-weighted loss are
over them.

Resolved once, from --tp/--cp and the launch's `parallelism_config`, with every combination
finetune cannot run refused in one message before any weights load. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.errors import ConfigError
from finetune.models.catalog import ModelSpec

# The linears transformers' tensor-parallel plans of the Llama family split by input rows (the others
# by output columns). PEFT 0.21 adapts column-parallel linears under transformers 5.23's DTensor TP,
# but a LoRA adapter on a row-parallel one fails in its forward (a local shape mismatch).
ROW_PARALLEL = ("o_proj", "down_proj")
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# Why context parallelism cannot run without a GPU here: torch's ring attention shards only the CUDA
# SDPA kernels (flash, memory-efficient, cuDNN). Measured with torch 2.13.0+cpu: the CPU flash kernel
# has no sharding strategy, the math kernel mixes DTensors with plain tensors, and CPU has no
# memory-efficient kernel.
CP_NEEDS_CUDA = ("context parallelism needs CUDA GPUs: torch's ring attention (context_parallel) shards only the CUDA "
                 "SDPA kernels; on CPU, aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy")


@dataclass(frozen=True)
class Parallelism:
    """How the world's processes split one step. Ranks are laid out with tp innermost, then cp, then
    dp_shard, then dp_replicate (Accelerate's and torchtitan's order): a TP group is consecutive ranks."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.cp

    @property
    def data_parallel(self) -> int:
        """Ranks that read different rows."""
        return self.dp_replicate * self.dp_shard

    @property
    def model_parallel(self) -> int:
        """Ranks that share one row: a TP × CP group."""
        return self.tp * self.cp

    @property
    def label(self) -> str:
        """e.g. "TP 2 × FSDP 2": the dimensions a run uses, for its setup printout and plans."""
        parts = [f"{name} {size}" for name, size in (("TP", self.tp), ("CP", self.cp), ("FSDP", self.dp_shard),
                                                      ("replicas", self.dp_replicate)) if size > 1]
        return " × ".join(parts) or "data parallel only"


@dataclass(frozen=True)
class Asked:
    """The sizes a launch or the flags asked for (None: not set there)."""

    dp_replicate: int | None = None
    dp_shard: int | None = None
    tp: int | None = None
    cp: int | None = None


def resolve_parallelism(flags: Asked, launch: Asked, world_size: int) -> Parallelism:
    """The run's layout: --tp/--cp, or the launch's parallelism_config (they must agree when both are
    set), data-parallel sharding over the ranks left. Raises ConfigError when the sizes do not divide
    the world, or ask for replicas (HSDP), which finetune does not run."""
    problems, sizes = [], {}
    for name in ("tp", "cp"):
        flag, launched = getattr(flags, name), getattr(launch, name)
        if flag is not None and launched is not None and flag != launched:
            problems.append(f"--{name} {flag} disagrees with the accelerate config's parallelism_config_{name}_size {launched}; "
                            "drop one or make them agree")
        sizes[name] = launched or flag or 1
    replicas = launch.dp_replicate or 1
    if replicas > 1:
        problems.append(f"parallelism_config_dp_replicate_size {replicas}: finetune does not run replicated sharding (HSDP); "
                        "set it to 1 (FSDP shards over every data-parallel rank)")
    grouped = sizes["tp"] * sizes["cp"] * replicas
    if world_size % grouped:
        problems.append(f"{world_size} process(es) cannot be split into groups of tp {sizes['tp']} × cp {sizes['cp']}"
                        + (f" × replicas {replicas}" if replicas > 1 else "")
                        + f"; launch a multiple of {grouped} processes")
    shards = world_size // grouped if not world_size % grouped else 1
    if launch.dp_shard is not None and not problems and launch.dp_shard != shards:
        problems.append(f"parallelism_config_dp_shard_size {launch.dp_shard}: with {world_size} processes, tp {sizes['tp']} "
                        f"and cp {sizes['cp']} it must be {shards} (dp_replicate × dp_shard × tp × cp = processes)")
    if problems:
        raise ConfigError("Invalid parallelism:\n  - " + "\n  - ".join(problems))
    return Parallelism(dp_replicate=replicas, dp_shard=shards, tp=sizes["tp"], cp=sizes["cp"])


def parallelism_problems(p: Parallelism, *, spec: ModelSpec | None, method: str, lora_targets: tuple[str, ...] | str,
                         deepspeed: bool, offload: str, cuda: bool, max_seq_len: int, packing: bool,
                         attention: str) -> list[str]:
    """What a run laid out as `p` cannot do, each with its fix (empty when tp = cp = 1).
    `lora_targets`: the adapted linears' names, or "all-linear"."""
    problems = []
    if p.model_parallel == 1:
        return problems
    which = " and ".join(f"--{name} {size}" for name, size in (("tp", p.tp), ("cp", p.cp)) if size > 1)
    if deepspeed:
        problems.append(f"{which} runs on FSDP2, not DeepSpeed ZeRO: launch with accelerate_configs/fsdp.yaml")
    if p.tp > 1 and p.cp > 1:
        problems.append("--tp and --cp together: CP runs through Accelerate's ParallelismConfig, whose FSDP2 shards the model "
                        "itself and cannot take one transformers has already split for TP (Accelerate 1.15, transformers 5); "
                        "use one of them")
    if p.tp > 1:
        if offload != "none":
            problems.append(f"--tp {p.tp} with FSDP {offload} offload: transformers lays out the TP model and its FSDP2 "
                            "itself, without the accelerate config's offload; launch with accelerate_configs/fsdp.yaml")
        problems += _tensor_parallel_problems(p, spec, method, lora_targets)
    if p.cp > 1:
        if not cuda:
            problems.append(f"--cp {p.cp}: {CP_NEEDS_CUDA}. Plan it with `finetune plan ... --cp {p.cp}`")
        if max_seq_len % (2 * p.cp):
            fixed = -(-max_seq_len // (2 * p.cp)) * 2 * p.cp
            problems.append(f"--cp {p.cp} cuts each row into 2 × {p.cp} chunks (two per rank, for balance under the causal "
                            f"mask): --max-seq-len {max_seq_len} is not a multiple of {2 * p.cp}; use e.g. {fixed}")
        if packing:
            problems.append(f"--cp {p.cp} with --packing: ring attention applies only the causal mask, so packed examples "
                            "would attend to each other; drop --packing")
        if attention not in ("auto", "sdpa"):
            problems.append(f"--cp {p.cp} with --attention {attention}: ring attention replaces SDPA's kernels only; "
                            "use --attention sdpa")
    return problems


def _tensor_parallel_problems(p: Parallelism, spec: ModelSpec | None, method: str,
                              lora_targets: tuple[str, ...] | str) -> list[str]:
    problems = []
    if method == "qlora":
        problems.append(f"--tp {p.tp} with QLoRA: bitsandbytes' 4-bit weights cannot be split into tensor-parallel "
                        "slices; use --method lora (or QLoRA under FSDP2 without --tp)")
    if method == "lora":
        if p.data_parallel > 1:
            problems.append(f"LoRA with --tp {p.tp} on {p.world_size} processes: PEFT adds adapters after transformers "
                            "has laid out TP × FSDP, and cannot shape them to the 2-D sharded weights; use --tp "
                            f"{p.world_size} (every process in one TP group), or FSDP2 without --tp")
        adapted = COLUMN_PARALLEL + ROW_PARALLEL if lora_targets == "all-linear" else lora_targets
        rows = [name for name in adapted if name in ROW_PARALLEL]
        if rows:
            problems.append(f"LoRA with --tp {p.tp} on {', '.join(rows)}: PEFT 0.21 cannot adapt row-parallel linears under "
                            f"transformers' TP; use --lora-targets {','.join(COLUMN_PARALLEL)}")
    if spec is not None and spec.moe:
        problems.append(experts_refusal(spec.name, p.tp))
    if spec is not None:
        for what, count in (("attention heads", spec.num_heads), ("key/value heads", spec.num_kv_heads)):
            if count % p.tp:
                usable = [size for size in range(2, count + 1) if count % size == 0][:4]
                problems.append(f"--tp {p.tp}: {spec.name} has {count} {what}, which do not split into {p.tp} equal groups; "
                                f"use a --tp that divides {count} (e.g. {', '.join(map(str, usable)) or 'none'})")
    return problems



def experts_refusal(model: str, tp: int) -> str:
    """Why `--tp` cannot lay out the mixture of experts `model`, and what to use instead: the one
    sentence the trainer stops with and a plan gives for it."""
    return (f"--tp {tp} with a mixture of experts ({model}): finetune's tensor-parallel layout splits dense layers only "
            "(transformers' plan for the experts splits each expert's width and all-reduces the block's whole rows, "
            "which the sequence-parallel residual stream does not take); use FSDP2 without --tp "
            "(accelerate_configs/fsdp.yaml: each GPU holds 1/N of every expert) or DeepSpeed ZeRO-3 (each sparse block "
            "gathered whole); expert parallelism is not in Accelerate")
