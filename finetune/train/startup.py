"""A run's Accelerator started, watched and reported: built (accelerator.py) under the preflight
watchdog, so a rendezvous that hangs says what to check instead of waiting forever; the job's
preflight checks; the resolved DeepSpeed JSON written beside the run; and the effective distributed
setup printed on the main process.

Apart from accelerator.py because building decides how the strategy runs, and this decides what a
user sees of it and what the run leaves on disk: a test or tool that needs an Accelerator builds one
without starting a watchdog thread, probing the output folder or printing.
"""

from __future__ import annotations

from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.fsdp import CPUOffloadPolicy

from finetune.config import deepspeed_json
from finetune.config.resolve import ResolvedRun
from finetune.config.run_folder import DEEPSPEED_CONFIG, RunFolder
from finetune.train import preflight
from finetune.train.accelerator import build_accelerator, launched


def start_accelerator(run: ResolvedRun) -> Accelerator:
    """The run's Accelerator, built and checked under a watchdog (--preflight-timeout), with what it
    built written (the resolved DeepSpeed JSON) and printed (`describe_setup`, the preflight line).
    Raises ConfigError when Accelerate would run another strategy or world size than the launch
    announced, PreflightError when the job cannot train as launched."""
    config, deepspeed = run.config, run.deepspeed
    with preflight.watchdog(config.preflight_timeout) as dog:
        dog.stage("rendezvous", preflight.rendezvous_advice())
        accelerator = build_accelerator(run)
        checked = preflight.run_checks(accelerator, config.output_dir, dog)
    if deepspeed is not None and accelerator.is_main_process:
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        deepspeed_json.write(deepspeed.config, RunFolder(config.output_dir).deepspeed_config)
    accelerator.print(describe_setup(accelerator, run) + "\n" + checked)
    return accelerator


def describe_setup(accelerator: Accelerator, run: ResolvedRun) -> str:
    """The effective distributed setup, one fact per line, so a stale default accelerate config can
    never change a run silently."""
    batch, deepspeed, precision = run.batch, run.deepspeed, run.precision
    lines = [
        f"strategy: {run.strategy.label} on {accelerator.device.type}"
        + (" (gloo)" if launched() and accelerator.device.type == "cpu" else ""),
        f"world size: {accelerator.num_processes} process{'es' if accelerator.num_processes > 1 else ''}"
        + (f" on {run.launch.num_machines} machines" if run.launch.num_machines > 1 else ""),
        f"precision: {precision.name} (weights {precision.weights}, compute {precision.compute})",
    ]
    if run.parallelism.model_parallel > 1:
        lines.append(f"layout: {run.parallelism.label} (tp {run.parallelism.tp}, cp {run.parallelism.cp}, "
                     f"dp_shard {run.parallelism.dp_shard}); "
                     + ("transformers' TP plan, sequence-parallel, then FSDP2" if run.parallelism.tp > 1
                        else "ring attention, FSDP2 over dp × cp"))
    if accelerator.distributed_type == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        wrap = getattr(plugin.auto_wrap_policy, "__name__", str(plugin.auto_wrap_policy))
        wrap = ("by transformers (its FSDP plan)" if run.parallelism.tp > 1
                else f"{wrap} (block class from the model's _no_split_modules)")
        lines += [
            f"sharding: reshard after forward {plugin.reshard_after_forward}, wrap {wrap}",
            f"state dict: {plugin.state_dict_type.name}, cpu offload {isinstance(plugin.cpu_offload, CPUOffloadPolicy)}, "
            f"cpu-RAM-efficient loading {plugin.cpu_ram_efficient_loading}",
        ]
    if deepspeed is not None:
        offload = deepspeed_json.offload_devices(deepspeed.config)
        lines += [
            f"ZeRO stage {deepspeed_json.zero_stage(deepspeed.config)}, offload "
            + (", ".join(f"{name} → {device}" for name, device in offload.items()) or "none"),
            f"DeepSpeed config: {deepspeed.source}, resolved into {DEEPSPEED_CONFIG}",
            *deepspeed.notes,
        ]
    lines.append(
        f"batch: micro {batch.micro_batch_size} × accumulation {batch.gradient_accumulation_steps} × {batch.ranks_text} "
        f"= global {batch.global_batch_size}"
    )
    return "distributed setup:\n  " + "\n  ".join(lines)
