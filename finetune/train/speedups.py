"""Speed switches applied to a loaded model before `accelerator.prepare`: Liger kernels, the chunked
loss, regional compilation of the decoder blocks, the attention kernel. Each one that cannot apply (CPU, an
architecture Liger does not cover, a package not installed) says so in one line and the run goes on
without it; numerically each is the plain path (tests/test_speedups.py, tests/test_chunked_loss.py on CPU).

A switch is on by default only where a GPU run measured it faster: Liger (on CUDA, when installed:
TRL SFTTrainer ran 1.20× faster with it on an H100, bench/RESULTS.md) and flex attention for packed
rows on a GPU (no dense mask to build). The chunked loss is on by default for LoRA and QLoRA for
the memory it saves (the full-vocabulary logits, likely the 2.2 GiB TRL held less than finetune in
the 7B QLoRA run) and the time (1.15× the length-grouped Trainer on CPU; bench/RESULTS.md); Liger's
fused loss replaces it where Liger runs. Compilation is off unless asked
for until the GPU kit (bench/gpu/throughput.py) has measured it; its time is reported apart from
training time.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from dataclasses import dataclass

import torch

from finetune.config.names import STRATEGIES, Strategy, chunked_loss_blocked, chunked_loss_wanted
from finetune.config.options import TrainConfig
from finetune.models import chunked_loss


@dataclass(frozen=True)
class Speedups:
    """What a run turns on; `notes` says why a requested switch is off."""

    liger: bool
    compile: bool
    attention: str  # "sdpa", "flex" or "flash"
    notes: tuple[str, ...] = ()


def choose_speedups(config: TrainConfig, cuda: bool, model_type: str) -> Speedups:
    """Resolve unset/auto switches for this device and model, and drop the ones that cannot apply."""
    notes = []
    liger = config.liger if config.liger is not None else cuda and liger_installed()
    why_not = liger_unavailable(cuda, model_type) if liger else None
    if why_not:
        notes, liger = [f"--liger: {why_not}; running without"], False
    compile_ = bool(config.compile)  # unmeasured on a GPU: off unless asked for
    attention = config.attention
    if attention == "auto":
        attention = "flex" if cuda and config.packing else "sdpa"
    if attention == "flash" and importlib.util.find_spec("flash_attn") is None:
        notes, attention = [*notes, "--attention flash: flash-attn is not installed; using sdpa"], "sdpa"
    return Speedups(liger=liger, compile=compile_, attention=attention, notes=tuple(notes))


def liger_unavailable(cuda: bool, model_type: str) -> str | None:
    """Why Liger cannot run here, or None."""
    if not cuda:
        return "Liger's Triton kernels need a CUDA GPU"
    if not liger_installed():
        return "liger-kernel is not installed (pip install liger-kernel)"
    if liger_function(model_type) is None:
        return f"Liger does not support model type {model_type!r}"
    return None


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def liger_function(model_type: str) -> Callable | None:
    """Liger's `apply_liger_kernel_to_<arch>` for a transformers model type, if it has one."""
    if not liger_installed():
        return None
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)


# transformers' names of the attention kernels
ATTENTION_IMPLEMENTATIONS = {"sdpa": "sdpa", "flex": "flex_attention", "flash": "flash_attention_2"}


def apply_speedups(model: torch.nn.Module, config: TrainConfig, cuda: bool, say: Callable[[str], None],
                   strategy: Strategy = STRATEGIES["single"]) -> torch.nn.Module:
    """Turn on what `choose_speedups` chose for `model` (a transformers model, PEFT-wrapped or not), in
    place, and the chunked loss where names.uses_chunked_loss puts it, given whether Liger really runs."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    chosen = choose_speedups(config, cuda, base.config.model_type)
    for note in chosen.notes:
        say(note)
    if chosen.liger:  # RMSNorm, RoPE, SwiGLU modules of this instance; the CausalLM forward's fused loss
        liger_function(base.config.model_type)(model=base)
    chunked = use_chunked_loss(base, config, chosen.liger, strategy, say)
    if chosen.attention != "sdpa":
        base.set_attn_implementation(ATTENTION_IMPLEMENTATIONS[chosen.attention])
    if chosen.compile:
        os.environ.setdefault(INDUCTOR_CACHE_VARIABLE, str(inductor_cache()))
        compile_blocks(model)
    say(f"speed switches: liger {'on' if chosen.liger else 'off'}, chunked loss {'on' if chunked else 'off'}, "
        f"compile {'on' if chosen.compile else 'off'}, attention {chosen.attention}")
    return model


def use_chunked_loss(base: torch.nn.Module, config: TrainConfig, liger: bool, strategy: Strategy,
                     say: Callable[[str], None]) -> bool:
    """Install the chunked loss on `base` where it runs; say why not when it was asked for. Where a
    requested Liger cannot run, the chunked loss stands in for its fused loss (the plan counted no logits)."""
    why_not = (chunked_loss_blocked(liger, strategy, base.config.model_type, config.method, config.lora_targets)
               or chunked_loss.unsupported(base))
    if config.chunked_loss and why_not:
        say(f"--chunked-loss: {why_not}; using the model's own loss")
    asked = True if config.chunked_loss is None and config.liger else config.chunked_loss
    if why_not or not chunked_loss_wanted(asked, config.method):
        return False
    chunked_loss.install(base)
    return True


# Inductor's compiled kernels: in ~/.cache (not /tmp, which reboots clear), so later runs of the same
# shapes load them instead of compiling again; a directory the user set wins
INDUCTOR_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def inductor_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "finetune" / "inductor"


def compile_seconds() -> float:
    """Seconds this process has spent compiling (Dynamo's capture, AOTAutograd, Inductor), so far:
    the run reports them apart from training time."""
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent().get("entire_frame_compile", 0.0)


def compile_blocks(model: torch.nn.Module, **compile_kwargs) -> int:
    """torch.compile every repeated block (the decoder layers) in place: regional compilation, one
    compiled graph reused by all layers; in place, so parameter names, FSDP2 hooks and checkpoints
    stay those of the eager model. `compile_kwargs` go to torch.compile. Returns how many blocks."""
    from accelerate.utils.other import is_repeated_blocks

    blocks = [block for module in model.modules() if is_repeated_blocks(module) for block in module]
    for block in blocks:
        block.compile(**compile_kwargs)
    return len(blocks)
