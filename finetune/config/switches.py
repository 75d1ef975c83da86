"""How the switches a run may leave unset resolve: Liger kernels, the chunked loss, fused AdamW, and
the attention kernel.

`resolve_switches` decides them from the flags and the facts of the run (device, strategy, model
type, method, LoRA targets and, once the model is loaded, its LM head). `finetune plan` calls it for
each plan; a run resolves them once (config/resolve.py: `ResolvedRun.switches`), which `--dry-run`, the
fit check and training read, so a plan counts what the run turns on (the dense mask of packed rows
under SDPA included: plan.workload.from_run).

Liger's fused linear cross-entropy and finetune's chunked loss both read the LM head's weight
outside the head's own forward, so one gate (`head_read_blocked`) keeps both out of the runs where
that reads the wrong thing. Torch-free like the rest of config/: only asking an installed
liger-kernel which architectures it covers imports it (and torch with it), once per process.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

from finetune.config.names import CHUNKED_LOSS_ARCHITECTURES, Strategy

# How a run holds its loss: plan/memory.LOSS_BYTES_PER_VOCAB counts each
LOSSES = ("liger", "finetune-chunked", "transformers")


@dataclass(frozen=True)
class Switches:
    """What a run turns on; `notes`: one line per switch asked for (or on by default) that cannot apply."""

    loss: str  # one of LOSSES
    fused_adamw: bool  # torch AdamW(fused=True): one kernel per step, no foreach temporaries
    notes: tuple[str, ...] = ()
    attention: str = "sdpa"  # "sdpa", "varlen", "flex" or "flash" (resolve_attention)

    @property
    def liger(self) -> bool:
        return self.loss == "liger"

    @property
    def chunked_loss(self) -> bool:
        return self.loss == "finetune-chunked"


def resolve_switches(*, liger: bool | None, chunked_loss: bool | None, optimizer: str, method: str, lora_targets: str,
                     cuda: bool, strategy: Strategy, model_type: str | None, head_problem: str | None = None,
                     assume_liger: bool = False, tp: int = 1, cp: int = 1, attention: str = "auto") -> Switches:
    """The run's loss and optimizer kernel. `liger` / `chunked_loss`: the flags (None: unset);
    `head_problem`: what the loaded LM head rules out (train.chunked_loss.head_problem; None
    before loading, as in a plan). `assume_liger`: `finetune plan`, planning for another machine,
    takes an asked-for Liger that is not installed here to be installed there. `tp`, `cp`: the
    run's tensor- and context-parallel sizes (config/parallelism.py). `attention`: --attention
    (resolve_attention).

    Liger, unset: on where it can run (a CUDA device, liger-kernel installed and importable, the
    architecture covered), like TRL's `use_liger_kernel`. Where Liger is wanted but cannot run, one
    note says why, and a `--liger` that asked for no logits gets the chunked loss instead. The
    chunked loss, unset: on for LoRA and QLoRA, and under TP (`chunked_loss_wanted`), where nothing blocks it."""
    notes = []
    blocked = head_read_blocked(strategy, method, lora_targets, head_problem)
    liger_on = liger if liger is not None else cuda and liger_installed()
    if liger_on:
        why = ((None if assume_liger and not liger_installed() else liger_problem(cuda, model_type)) or blocked
               or (TP_HEAD if tp > 1 else None) or (CP_LABELS if cp > 1 else None))
        if why:
            notes.append(f"running without Liger ({why})")
            liger_on = False
    asked = True if chunked_loss is None and liger and not liger_on else chunked_loss
    why_not_chunked = "Liger runs" if liger_on else blocked or architecture_problem(model_type)
    if chunked_loss and why_not_chunked:
        instead = "Liger's fused loss" if liger_on else "the model's own loss"
        notes.append(f"--chunked-loss: {why_not_chunked}; using {instead}")
    chunked_on = why_not_chunked is None and chunked_loss_wanted(asked, method, tp)
    loss = "liger" if liger_on else "finetune-chunked" if chunked_on else "transformers"
    attention, attention_note = resolve_attention(attention)
    return Switches(loss=loss, fused_adamw=fused_adamw(optimizer, cuda, strategy),
                    notes=tuple(notes) + ((attention_note,) if attention_note else ()), attention=attention)


# The attention kernels that read each packed example's bounds from sequence lengths (transformers'
# flash_attention_2, train/packed_attention.py's varlen): the collator hands them each micro-batch of
# packed rows flattened into one row with the examples' offsets (data/collate.py), since transformers'
# flash path finds the examples of packed rows from their position ids only when the batch is one row.
FLATTENING_ATTENTIONS = ("varlen", "flash")
# transformers' names of the attention kernels (`set_attn_implementation`); varlen's is the one
# train/packed_attention.py registers
ATTENTION_KERNELS = {"sdpa": "sdpa", "flex": "flex_attention", "flash": "flash_attention_2", "varlen": "finetune_varlen"}
# torch.nn.attention.varlen.varlen_attn with `scale` and causal `window_size` (torch 2.10's took is_causal)
VARLEN_TORCH = (2, 11)


def resolve_attention(asked: str) -> tuple[str, str | None]:
    """The attention kernel a run asking for `asked` uses, and a note when that is not what it asked
    for. `auto` is SDPA, packed rows included: varlen and flex have not run on a GPU yet."""
    if asked == "auto":
        return "sdpa", None
    if asked == "flash" and importlib.util.find_spec("flash_attn") is None:
        return "sdpa", "--attention flash: flash-attn is not installed; using sdpa"
    return asked, None


def attention_problem(attention: str, cuda: bool, compute_dtype: str) -> str | None:
    """Why --attention `attention` cannot run on this device at this compute dtype, or None:
    resolve_run refuses it before anything loads."""
    if attention == "flex" and not cuda:
        return ("--attention flex needs a GPU (FlexAttention has no backward on CPU); on CPU use --attention "
                "sdpa (or auto).")
    if attention != "varlen":
        return None
    if not cuda:
        return ("--attention varlen needs a CUDA GPU (torch's variable-length attention runs FlashAttention "
                "kernels, CUDA only); on CPU use --attention sdpa (or auto).")
    if compute_dtype == "float32":
        return ("--attention varlen runs FlashAttention, which takes 16-bit inputs: use --precision bf16-true "
                "or bf16-mixed (fp16 likewise), not fp32.")
    version = _version("torch")
    if _major_minor(version) < VARLEN_TORCH:
        return (f"--attention varlen needs torch ≥ {'.'.join(map(str, VARLEN_TORCH))} (torch.nn.attention.varlen "
                f"with causal windows); this is torch {version}: upgrade torch or use --attention sdpa.")
    return None


def _major_minor(version: str) -> tuple[int, int]:
    """(2, 11) of "2.11.0+cu130"; (0, 0) for a version that does not read so."""
    parts = version.split(".")
    return (int(parts[0]), int(parts[1])) if len(parts) > 1 and parts[0].isdigit() and parts[1].isdigit() else (0, 0)


# Liger under context parallelism: each rank's slice of a row comes with its labels shifted already,
# which finetune's chunked loss reads (train/chunked_loss.py) and Liger's loss is not checked with
CP_LABELS = "context parallelism hands each rank a slice of every row, with its labels shifted already"
# Liger under tensor parallelism: each rank holds a slice of the head's vocabulary rows, which Liger's loss
# would read as the whole head (finetune's chunked loss combines the slices: train/chunked_loss.py)
TP_HEAD = "tensor parallelism splits the LM head's weight by vocabulary rows"


def head_read_blocked(strategy: Strategy, method: str, lora_targets: str, head_problem: str | None = None) -> str | None:
    """Why no loss may read the LM head's weight outside the head's own forward (Liger's fused
    linear cross-entropy and finetune's chunked loss both do) in such a run, or None."""
    if strategy.zero_stage == 3:  # outside the head's forward its weight is a 0-element placeholder (trl#5891)
        return "ZeRO-3 gathers the LM head's weight only inside the head's own forward"
    if method != "full" and "lm_head" in lora_targets.split(","):  # the adapter would never train
        return "LoRA adapts the LM head, and a loss that reads its base weight would skip the adapter"
    return head_problem


def architecture_problem(model_type: str | None) -> str | None:
    """Why the chunked loss does not cover this architecture (its head is not a bare linear layer
    over the last hidden state: logit scaling, soft-capping, a bias, an auxiliary loss), or None."""
    if model_type not in CHUNKED_LOSS_ARCHITECTURES:
        return f"model type {model_type!r} is not one of {', '.join(CHUNKED_LOSS_ARCHITECTURES)}"
    return None


# Tokens per chunk of the chunked loss: a chunk's fp32 logits stay near 128 MiB whatever the vocabulary.
# The loss (train/chunked_loss.py) runs with it and the planner (plan/memory.py, plan/speed.py) counts with it.
CHUNK_LOGITS = 2**25


def chunk_tokens(vocab_size: int) -> int:
    """Tokens in one chunk of the chunked loss for a head of `vocab_size` rows."""
    return max(1, CHUNK_LOGITS // vocab_size)


def chunked_loss_wanted(asked: bool | None, method: str, tp: int = 1) -> bool:
    """When asked for, and by default for LoRA and QLoRA, whose head is frozen (full fine-tuning would
    keep the head's fp32 gradient from the forward, which outweighs the logits of short micro-batches),
    and under TP, where it is the loss that splits by vocabulary (the model's own head gathers the
    whole vocabulary's logits on every rank, and TP is for long rows)."""
    return asked if asked is not None else method != "full" or tp > 1


def fused_adamw(optimizer: str, cuda: bool, strategy: Strategy) -> bool:
    """torch's AdamW with fused=True: on a GPU, where the trainable parameters are on it when the
    optimizer is built; FSDP2 builds it over parameters still on the host and steps foreach after
    `prepare` moves them (torch's default on CUDA)."""
    return optimizer == "adamw" and cuda and not strategy.fsdp


def fp8_problem(method: str, precision: str, strategy: Strategy, fp8_device: bool, tp: int = 1) -> str | None:
    """Why `--fp8` (train/fp8.py: the frozen base of LoRA in float8 matmuls) cannot run in such a run,
    or None. `fp8_device`: the GPU runs NVIDIA's float8 matmuls (compute capability ≥ 8.9)."""
    if method != "lora":
        trains = "full fine-tuning trains them" if method == "full" else "QLoRA's base is 4-bit already"
        return f"--fp8 casts LoRA's frozen 16-bit base weights to float8, and {trains}: use --method lora or drop --fp8"
    if not fp8_device:
        return "--fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (L40S, RTX 4090, H100, H200)"
    if precision != "bf16-true":
        return f"--fp8 casts LoRA's base from bf16 weights: use --precision bf16-true, not {precision}"
    if strategy.shards_weights or strategy.deepspeed or tp > 1:  # a float8 copy of each whole weight, cast once
        return f"--fp8 keeps a float8 copy of every frozen weight whole on each GPU: one GPU or DDP, not {strategy.label}"
    return None


def liger_problem(cuda: bool, model_type: str | None) -> str | None:
    """Why Liger cannot run here for this architecture, or None."""
    if not cuda:
        return "Liger's Triton kernels need a CUDA GPU"
    table, why = liger_table()
    if why:
        return why
    if model_type not in table:
        return f"Liger does not support model type {model_type!r}"
    return None


def liger_function(model_type: str) -> Callable:
    """Liger's `apply_liger_kernel_to_<arch>` for a model type `liger_problem` passed."""
    return liger_table()[0][model_type]


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


@functools.cache
def liger_table() -> tuple[dict[str, Callable], str | None]:
    """Liger's model type → apply function table, or ({}, why there is none): not installed, or
    installed but failing to import (a liger-kernel built for another transformers), which costs a
    run nothing but Liger."""
    if not liger_installed():
        return {}, "liger-kernel is not installed (pip install liger-kernel)"
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception as e:  # any failure of a third-party import: the run goes on without it
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return {}, f"liger-kernel {_version('liger-kernel')} does not import: {type(e).__name__}: {detail}"
    return dict(MODEL_TYPE_TO_APPLY_LIGER_FN), None


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "(unknown version)"
