"""Speed switches applied to a loaded model before `accelerator.prepare`: Liger kernels, the chunked
loss, regional compilation of the decoder blocks, the attention kernel. Each one that cannot apply (CPU, an
architecture Liger does not cover, a package not installed or not importing) says so in one line and the
run goes on without it; numerically each is the plain path (tests/train/test_speedups.py,
tests/train/test_chunked_loss.py on CPU). Liger, the chunked loss and fused AdamW resolve in
config/switches.py, which `finetune plan`, `--dry-run` and the fit check call too.

Defaults (bench/RESULTS.md has what each rests on, and which have run on a GPU): Liger where it can
run (it made TRL SFTTrainer faster on an H100); the chunked loss for LoRA and QLoRA, for the logits
it does not hold; compilation off until the GPU kit (bench/gpu_kit/throughput.py) has measured it,
its time reported apart from training time; attention `auto` = sdpa, packing included, because flex
attention is unmeasured on a GPU and transformers 5.17 recompiles it whenever the model flips between
train and eval (with --eval-every it can pass Dynamo's recompile limit and run uncompiled).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.config.names import STRATEGIES, Strategy
from finetune.config.options import TrainConfig
from finetune.config.switches import Switches, liger_function, resolve_switches
from finetune.train import chunked_loss


@dataclass(frozen=True)
class Speedups(Switches):
    """What a run turns on: config.switches' loss and AdamW, and compilation and the attention kernel;
    `notes` says why a switch asked for is off."""

    compile: bool = False
    attention: str = "sdpa"  # "sdpa", "flex" or "flash"


def choose_speedups(config: TrainConfig, cuda: bool, model_type: str, strategy: Strategy = STRATEGIES["single"],
                    head_problem: str | None = None) -> Speedups:
    """Resolve unset/auto switches for this device, model and strategy, and drop the ones that cannot
    apply (`head_problem`: what the loaded LM head rules out, train.chunked_loss.head_problem)."""
    switches = resolve_switches(liger=config.liger, chunked_loss=config.chunked_loss, optimizer=config.optimizer,
                                method=config.method, lora_targets=config.lora_targets, cuda=cuda, strategy=strategy,
                                model_type=model_type, head_problem=head_problem, tp=config.tp, cp=config.cp)
    notes = list(switches.notes)
    compile_ = bool(config.compile)  # unmeasured on a GPU: off unless asked for
    attention = "sdpa" if config.attention == "auto" else config.attention  # flex unmeasured on a GPU
    if attention == "flash" and importlib.util.find_spec("flash_attn") is None:
        notes, attention = [*notes, "--attention flash: flash-attn is not installed; using sdpa"], "sdpa"
    return Speedups(loss=switches.loss, fused_adamw=switches.fused_adamw, notes=tuple(notes), compile=compile_,
                    attention=attention)


# transformers' names of the attention kernels
ATTENTION_IMPLEMENTATIONS = {"sdpa": "sdpa", "flex": "flex_attention", "flash": "flash_attention_2"}


def apply_speedups(model: torch.nn.Module, config: TrainConfig, cuda: bool, say: Callable[[str], None],
                   strategy: Strategy = STRATEGIES["single"]) -> torch.nn.Module:
    """Turn on what `choose_speedups` chose for `model` (a transformers model, PEFT-wrapped or not), in place."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    chosen = choose_speedups(config, cuda, base.config.model_type, strategy, chunked_loss.head_problem(base))
    for note in chosen.notes:
        say(note)
    if chosen.liger:  # RMSNorm, RoPE, SwiGLU modules of this instance; the CausalLM forward's fused loss
        liger_function(base.config.model_type)(model=base)
    if chosen.chunked_loss:
        chunked_loss.install(base)
    if chosen.attention != "sdpa":
        base.set_attn_implementation(ATTENTION_IMPLEMENTATIONS[chosen.attention])
    if chosen.compile:
        os.environ.setdefault(INDUCTOR_CACHE_VARIABLE, str(inductor_cache()))
        compile_blocks(model)
    say(f"speed switches: liger {'on' if chosen.liger else 'off'}, chunked loss {'on' if chosen.chunked_loss else 'off'}, "
        f"compile {'on' if chosen.compile else 'off'}, attention {chosen.attention}")
    return model


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
