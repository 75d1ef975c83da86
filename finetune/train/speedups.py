"""Speed switches applied to a loaded model before `accelerator.prepare`: Liger kernels, the chunked
loss, float8 matmuls for LoRA's frozen base (train/fp8.py), regional compilation of the decoder blocks
(LoRA adapters and float8 matmuls inside them), the attention kernel, and a sliding window no row reaches
switched off (train/sliding_window.py). Each one that cannot apply (CPU, an architecture Liger does not
cover, a package not installed or not importing) says so in one line and the run goes on without it;
numerically each is the plain path (tests/train/test_speedups.py, tests/train/test_chunked_loss.py,
tests/train/test_sliding_window.py on CPU). Liger, the chunked loss, fused AdamW and the attention
kernel resolve once, with the run (config/resolve.py: `ResolvedRun.switches`), and again only where the
built model tells more (`with_model`); `--dry-run` and the fit check read the same field.

Defaults (bench/RESULTS.md has what each rests on, and which have run on a GPU): Liger where it can
run (it made TRL SFTTrainer faster on an H100); the chunked loss for LoRA and QLoRA, for the logits
it does not hold; compilation off until the GPU kit (bench/gpu_kit/throughput.py) has measured it,
its time reported apart from training time; `--fp8` off unless given, since it rounds the base's
matmul operands to float8 and has not run on a GPU; attention `auto` = sdpa, packing included, because
varlen (train/packed_attention.py) and flex attention are unmeasured on a GPU (varlen's kernel does not
run on CPU at all), and transformers 5.17 recompiles flex attention whenever the model flips between
train and eval (with --eval-every it can pass Dynamo's recompile limit and run uncompiled). The
attention kernel resolves in config/switches.py too; what only the loaded model or the GPU can tell
(varlen on a model with attention sinks or soft-capped scores, or an older GPU) is refused here, before
training starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from finetune.config.resolve import ResolvedRun
from finetune.config.switches import ATTENTION_KERNELS, FLATTENING_ATTENTIONS, liger_function
from finetune.errors import ConfigError
from finetune.train import chunked_loss, sliding_window


def with_model(run: ResolvedRun, model: torch.nn.Module) -> ResolvedRun:
    """`run` once `model` (a transformers model, PEFT-wrapped or not) is built: its switches as this
    model's architecture and LM head decide them (ResolvedRun.with_loaded_model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return run.with_loaded_model(base.config.model_type, chunked_loss.head_problem(base))


def flattens_packed_rows(model: torch.nn.Module) -> bool:
    """Whether `model`'s attention reads each packed example's offsets (config.switches.FLATTENING_ATTENTIONS),
    so the collator hands it every micro-batch of packed rows as one row (data/collate.flattened)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config._attn_implementation in [ATTENTION_KERNELS[name] for name in FLATTENING_ATTENTIONS]


def apply_speedups(model: torch.nn.Module, run: ResolvedRun, say: Callable[[str], None]) -> torch.nn.Module:
    """Turn on `run`'s switches for `model` (a transformers model, PEFT-wrapped or not), in place: the
    loss and attention kernel `run.switches` resolved (`run` as `with_model` returns it for this model),
    --fp8 and --compile as asked."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config, chosen = run.config, run.switches
    for note in chosen.notes:
        say(note)
    if chosen.liger:  # RMSNorm, RoPE, SwiGLU modules of this instance; the CausalLM forward's fused loss
        liger_function(base.config.model_type)(model=base)
    if chosen.chunked_loss:
        chunked_loss.install(base)
    if chosen.attention == "varlen":  # torch's varlen kernel, and fp8 below: imported by the runs that ask
        from finetune.train import packed_attention

        if why := packed_attention.problem(base):
            raise ConfigError(why)
        packed_attention.register()
    if chosen.attention != "sdpa":
        base.set_attn_implementation(ATTENTION_KERNELS[chosen.attention])
    window = sliding_window.switch_off_inert_window(base, config.max_seq_len)
    if window:
        say(window)
    fp8_text = ""
    if config.fp8:  # before compiling, so the compiled blocks hold the float8 matmuls
        from finetune.train import fp8

        replaced, kept = fp8.install(model)
        fp8_text = f", fp8 on ({replaced} base linears" + (f"; {kept} kept bf16, sizes not multiples of 16)" if kept else ")")
    if config.compile:
        os.environ.setdefault(INDUCTOR_CACHE_VARIABLE, str(inductor_cache()))
        compile_blocks(model)
    say(f"speed switches: liger {'on' if chosen.liger else 'off'}, chunked loss {'on' if chosen.chunked_loss else 'off'}, "
        f"compile {'on' if config.compile else 'off'}, attention {chosen.attention}{fp8_text}")
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
    compiled graph reused by all layers (their weights are the graph's inputs); in place, so parameter
    names, FSDP2 hooks and checkpoints stay those of the eager model. PEFT's LoRA layers and
    train/fp8.py's float8 linears inside a block compile with it, and so does its activation
    checkpointing (transformers checkpoints inside the layer's forward): one graph for the layers
    that recompute and one for those that keep their activations.

    Only forwards that build a graph for backward run compiled: evaluation and generation run
    under no_grad, where the blocks see a KV cache whose per-layer state would make Dynamo compile
    each layer apart until its recompile limit, so they run eager. `compile_kwargs` go to
    torch.compile. Returns how many blocks."""
    from accelerate.utils.other import is_repeated_blocks

    blocks = [block for module in model.modules() if is_repeated_blocks(module) for block in module]
    for block in blocks:
        # what nn.Module.compile sets, with no_grad calls sent to the eager forward
        block._compiled_call_impl = _when_training(torch.compile(block._call_impl, **compile_kwargs), block._call_impl)
    return len(blocks)


def _when_training(compiled: Callable, eager: Callable) -> Callable:
    """`compiled` where autograd records (training, checkpointing's recompute), else `eager`."""
    def call(*args, **kwargs):
        return (compiled if torch.is_grad_enabled() else eager)(*args, **kwargs)
    return call
