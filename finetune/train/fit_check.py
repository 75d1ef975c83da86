"""The checks every run makes before anything loads: on a GPU, whether the run's plan fits the GPU's
free memory and the host's available RAM (`check_fit`); on a machine without one, whether the model
is small enough to train on its CPUs (`check_cpu_run`). Each stops with what would work instead.
"""

from __future__ import annotations

import os
import shlex

from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, ResolvedRun
from finetune.errors import FinetuneError, FitError
from finetune.models.source import architecture_of
from finetune.plan import gpus as gpu_catalog
from finetune.plan.gpus import GPUSpec
from finetune.plan.memory import GIB, Breakdown, estimate
from finetune.plan.params import count_params
from finetune.plan.workload import Workload, from_run


def fit_problem(workload: Workload, memory: Breakdown, free_bytes: int, host_free_bytes: int | None) -> str | None:
    """Why the run will not fit a GPU with `free_bytes` free (and a host with `host_free_bytes`
    available, per node), with what would; None when it fits. The planner's rule: what the run cannot
    give back at its peak (memory.Breakdown.held: allocated + CUDA context) against the free memory;
    the allocator's cache is given back before it runs out, so a tight run starts."""
    w, needed = workload, memory.held(workload.world_size)
    problems = []
    if needed > free_bytes:
        problems.append(f"it needs {needed / GIB:.1f} GiB per GPU ({', '.join(_largest_terms(memory))} GiB, and the CUDA "
                        f"context) but {free_bytes / GIB:.1f} GiB are free")
    if host_free_bytes is not None and memory.host > host_free_bytes:
        problems.append(f"it needs {memory.host / GIB:.0f} GiB of host RAM per node (offload and loading) but "
                        f"{host_free_bytes / GIB:.0f} GiB are available")
    if not problems:
        return None
    fixes = []
    if w.micro_batch_size > 1:
        fixes.append("a smaller --micro-batch-size (with more --gradient-accumulation-steps)")
    if not w.gradient_checkpointing:
        fixes.append("--gradient-checkpointing")
    elif w.partial_checkpointing:
        fixes.append(f"more --gradient-checkpointing-layers (of {w.model.num_layers}; unset: all)")
    if w.method != "qlora":
        fixes.append("--method qlora" if w.method == "lora" else "--method lora or qlora")
    fixes.append("another strategy or offload")
    query = shlex.join(["finetune", "plan", "--model", w.model.name, "--gpus", f"{w.gpus_per_node}x{w.gpu.name}",
                        *(["--nodes", str(w.nodes)] if w.nodes > 1 else [])])
    return ("This run will not fit: " + "; ".join(problems) + ".\nTry " + ", ".join(fixes)
            + f"; `{query}` shows what fits. --no-fit-check runs it anyway.")


def check_fit(run: ResolvedRun, device: Device) -> None:
    """Stop before weights load when this run's plan does not fit the GPU's free memory (`fit_problem`)
    or the host's available RAM. Runs whose architecture the planner cannot read are not checked."""
    if run.spec is None:
        return
    gpu = GPUSpec(catalog_name(device), (device.total_bytes or 0) / GIB, 0.0, device.bf16, "unknown", 0.0, 0.0, 0.0)
    workload = from_run(run, gpu)
    problem = fit_problem(workload, estimate(workload), device.free_bytes or 0, host_available_bytes())
    if problem:
        raise FitError(problem)


def catalog_name(device: Device) -> str:
    """How `finetune plan --gpus` names this device: its catalog entry ('NVIDIA A100-SXM4-40GB' →
    A100-40GB), else a catalog GPU of the same memory size, else the card by its memory ('72GB')."""
    memory_gib = (device.total_bytes or 0) / GIB
    found = gpu_catalog.identify(device.name, memory_gib) if device.name else None
    alike = gpu_catalog.same_size(memory_gib)
    return found.name if found else alike[0] if alike else gpu_catalog.by_memory(max(1.0, round(memory_gib, 1))).name


# Sustained fp32 training FLOP/s of one CPU core, from one measured step on the 2-core machine the
# tests run on: SmolLM2-135M, LoRA all-linear, micro batch 8 × 128, ~5.5 s
# → 4 × 134.5 M params × 1,024 tokens / 5.5 s / 2 cores.
CPU_FLOPS_PER_CORE = 5e10
# Above this many parameters a CPU step takes minutes to hours: such a run starts only when asked.
CPU_PARAMS_LIMIT = 1e9


def check_cpu_run(config: TrainConfig) -> None:
    """On a machine without a GPU, stop a model above CPU_PARAMS_LIMIT before anything loads (or asks
    the Hub), saying what a step would cost here, unless --allow-cpu. Models the planner cannot read
    are not checked."""
    import torch

    spec = architecture_of(config.model)
    if config.allow_cpu or spec is None or torch.cuda.is_available():
        return
    params, active = count_params(spec).total, count_params(spec).active  # a mixture of experts computes with its active ones
    if params <= CPU_PARAMS_LIMIT:
        return
    tokens = config.micro_batch_size * config.max_seq_len * (config.gradient_accumulation_steps or 1)
    cores = os.cpu_count() or 1
    seconds = (6 if config.method == "full" else 4) * active * tokens / (CPU_FLOPS_PER_CORE * cores)
    raise FinetuneError(
        f"This machine has no GPU: {spec.name} ({params / 1e9:.2f}B parameters) would train on its {cores} CPU cores "
        f"at about {_duration(seconds)} per optimizer step ({tokens:,} tokens; estimated at {CPU_FLOPS_PER_CORE:.0e} "
        f"FLOP/s per core). Plan a GPU run with `finetune plan --model {config.model} --gpus 1xA100-80GB`, "
        "or add --allow-cpu to train here anyway."
    )


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _largest_terms(memory) -> list[str]:
    terms = {"weights": memory.weights, "gradients": memory.gradients, "optimizer": memory.optimizer,
             "activations": memory.activations, "buffers": memory.buffers}
    return [f"{name} {value / GIB:.1f}" for name, value in sorted(terms.items(), key=lambda kv: -kv[1])[:3]]


def host_available_bytes() -> int:
    """The host RAM available to a new allocation (Linux's MemAvailable), as psutil reads it."""
    import psutil

    return psutil.virtual_memory().available
