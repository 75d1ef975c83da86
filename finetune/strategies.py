"""Distributed strategy → one configured Accelerator.

The strategy arrives as data: the accelerate config the user launched with (`accelerate launch
--config_file accelerate_configs/X.yaml`, which Accelerate hands to each process as environment
variables) and, for DeepSpeed, an optional JSON file (`--deepspeed ds.json` or the YAML's
`deepspeed_config_file`). This module turns that data into an `Accelerator` and the run's
`BatchShape`, and prints what it built; the training loop never asks which strategy it runs under.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedType,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
)
from torch.distributed.fsdp import CPUOffloadPolicy

from finetune import deepspeed_json, preflight
from finetune.catalog import models as catalog
from finetune.config import BatchShape, ConfigError, TrainConfig, resolve_batch_shape, scaled_lr

RESOLVED_DEEPSPEED_FILE = "deepspeed_config.json"
# how conflicts name DeepSpeed settings that came from the accelerate config rather than a JSON file
LAUNCH_DEEPSPEED = "accelerate config (deepspeed_config section; delete a key there to let finetune set it)"


def launcher_world_size() -> int:
    """Processes in the job as the launcher (torchrun / accelerate launch) announced it; 1 without one.

    Read before the Accelerator exists because the accumulation steps it needs depend on it.
    """
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched() -> bool:
    """True under torchrun / accelerate launch (they set LOCAL_RANK), even for one process."""
    return "LOCAL_RANK" in os.environ


def resolve_mixed_precision(requested: str, cuda: bool, bf16_supported: bool, launcher: str | None) -> str:
    """The Accelerate `mixed_precision` for a run.

    An explicit --mixed-precision wins. `auto` takes the launcher's choice (the accelerate config's
    `mixed_precision`) on GPUs, else bf16 where the GPU supports it; on CPU it is always fp32 ('no'),
    so CPU rehearsals compare exact numbers.
    """
    if requested != "auto":
        return requested
    if not cuda:
        return "no"
    if launcher and launcher != "no":
        return launcher
    return "bf16" if bf16_supported else "no"


@dataclass(frozen=True)
class DeepSpeedSetup:
    """A resolved DeepSpeed configuration and where it came from."""

    source: str  # the JSON path, or LAUNCH_DEEPSPEED for `--use_deepspeed --zero_stage N` launches
    config: dict
    notes: list[str] = field(default_factory=list)


def build_accelerator(config: TrainConfig) -> tuple[Accelerator, BatchShape]:
    """Create the run's Accelerator and its micro × accumulation × world batch shape, and print the
    effective distributed setup on the main process.

    Works without a launcher (one process, CPU or CUDA) and under `accelerate launch` / torchrun with
    DDP, FSDP2 or DeepSpeed. Launched on CPU, the process group uses gloo: without it Accelerate
    sees world size 1 under DeepSpeed. Joining the process group and the preflight checks run under
    a watchdog (--preflight-timeout). Raises ConfigError when the batch sizes do not multiply out or
    a DeepSpeed JSON disagrees with the run, PreflightError when the job cannot train as launched.
    """
    cuda = torch.cuda.is_available()
    batch = resolve_batch_shape(config, launcher_world_size())
    mixed_precision = resolve_mixed_precision(
        config.mixed_precision,
        cuda=cuda,
        bf16_supported=cuda and torch.cuda.is_bf16_supported(),
        launcher=os.environ.get("ACCELERATE_MIXED_PRECISION"),
    )
    deepspeed = resolve_deepspeed(config, batch, mixed_precision)
    if deepspeed is not None and not launched():
        become_single_process_launch()
    fsdp_plugin = fsdp_plugin_from_launch() if deepspeed is None else None
    with preflight.watchdog(config.preflight_timeout) as dog:
        dog.stage("rendezvous", preflight.rendezvous_advice())
        accelerator = Accelerator(
            gradient_accumulation_steps=batch.gradient_accumulation_steps,
            mixed_precision=mixed_precision,
            log_with=None if config.report_to == "none" else config.report_to,
            project_dir=config.output_dir,
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
            # the loop steps the LR scheduler itself, once per optimizer update, under every strategy
            step_scheduler_with_optimizer=False,
            deepspeed_plugin=_deepspeed_plugin(deepspeed),
            fsdp_plugin=fsdp_plugin,
            # launched on CPU: gloo, and MULTI_CPU rather than Accelerate's silent one-process fallback
            # for a MULTI_GPU config (DeepSpeed selects its CPU accelerator itself)
            cpu=launched() and not cuda and deepspeed is None,
            kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if launched() and not cuda else [],
        )
        if fsdp_plugin is not None and accelerator.distributed_type != DistributedType.FSDP:
            enable_fsdp_on_cpu(accelerator, fsdp_plugin)
        if accelerator.num_processes != batch.world_size or (
            batch.world_size > 1 and accelerator.distributed_type == DistributedType.NO
        ):
            raise ConfigError(
                f"The launcher announced WORLD_SIZE={batch.world_size} but Accelerate runs {accelerator.num_processes} "
                f"process(es) as {accelerator.distributed_type.value}; launch with `accelerate launch` or torchrun."
            )
        checked = preflight.run_checks(accelerator, config.output_dir, dog)
    if deepspeed is not None and accelerator.is_main_process:
        deepspeed_json.write(deepspeed.config, Path(config.output_dir) / RESOLVED_DEEPSPEED_FILE)
    accelerator.print(describe_setup(accelerator, batch, deepspeed) + "\n" + checked)
    return accelerator, batch


def become_single_process_launch() -> None:
    """Set the variables a launcher would for a 1-process job, so `python -m finetune --deepspeed X`
    works (ZeRO-Offload on one GPU) instead of failing on an uninitialised process group."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fsdp_plugin_from_launch() -> FullyShardedDataParallelPlugin | None:
    """The FSDP plugin the accelerate config asks for (None without FSDP). Only FSDP2 is supported:
    FSDP1 cannot save optimizer state of sharded models reliably and is legacy in Accelerate."""
    if not _env_flag("ACCELERATE_USE_FSDP"):
        return None
    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise ConfigError(
            f"The accelerate config sets fsdp_version {plugin.fsdp_version}; finetune runs FSDP2. "
            "Set `fsdp_version: 2` under fsdp_config (see accelerate_configs/fsdp.yaml)."
        )
    return plugin


def enable_fsdp_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """The one CPU-only switch: make Accelerate run FSDP on CPU processes (gloo).

    Accelerate enables FSDP only on GPU-like devices and otherwise falls back to DDP (MULTI_CPU). The
    code FSDP2 runs once enabled (fully_shard, DTensor collectives, sharded checkpoints) is the GPU
    code, so this is what lets `finetune rehearse` and the tests exercise the real FSDP path.
    Mixed precision stays off on CPU, so the plugin needs no precision policy; CPU offload keeps its
    code path but without pinned memory, which needs a GPU.
    """
    if accelerator.device.type != "cpu":
        raise ConfigError("FSDP was requested but Accelerate did not enable it on this accelerator; check the launch config.")
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    PartialState().distributed_type = DistributedType.FSDP


def resolve_deepspeed(config: TrainConfig, batch: BatchShape, mixed_precision: str) -> DeepSpeedSetup | None:
    """The run's DeepSpeed configuration with every "auto" filled, or None when DeepSpeed is off.

    Sources, in order: --deepspeed, the accelerate config's `deepspeed_config_file`, or the config
    Accelerate builds from `--use_deepspeed --zero_stage N` (its "auto" batch values are filled here
    too, so packed or batch-sampler dataloaders never reach Accelerate's `None * int`, accelerate#841).
    """
    file_from_launch = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    path = config.deepspeed or (file_from_launch if file_from_launch != "none" else None)
    if path is not None:
        source, raw = Path(path).name, deepspeed_json.load(path)
    elif _env_flag("ACCELERATE_USE_DEEPSPEED"):
        source, raw = LAUNCH_DEEPSPEED, DeepSpeedPlugin().deepspeed_config
    else:
        return None
    run = deepspeed_json.RunValues.from_config(config, batch, mixed_precision, scaled_lr(config, batch.global_batch_size),
                                               model_hidden_size(config.model))
    resolved, notes = deepspeed_json.resolve(raw, source, run)
    return DeepSpeedSetup(source=str(path) if path else source, config=resolved, notes=notes)


def _deepspeed_plugin(deepspeed: DeepSpeedSetup | None) -> DeepSpeedPlugin | None:
    if deepspeed is None:
        return None
    if deepspeed.source == LAUNCH_DEEPSPEED:
        # built from the launch's environment: a second plugin from a dict would trip Accelerate's
        # "deepspeed_config_file plus accelerate DeepSpeed fields" check, so resolve this one in place
        plugin = DeepSpeedPlugin()
        plugin.deepspeed_config.clear()
        plugin.deepspeed_config.update(deepspeed.config)
        return plugin
    return DeepSpeedPlugin(hf_ds_config=json.loads(json.dumps(deepspeed.config)))


def model_hidden_size(model: str) -> int | None:
    """Hidden size from the catalog or a local config.json, without loading weights; None for Hub ids."""
    spec = catalog.lookup(model)
    if spec is not None:
        return spec.hidden_size
    config_file = Path(model) / "config.json"
    if config_file.is_file():
        return json.loads(config_file.read_text()).get("hidden_size")
    return None


# ---------------------------------------------------------------- the setup printout


def strategy_name(accelerator: Accelerator) -> str:
    kind = accelerator.distributed_type
    if kind == DistributedType.NO:
        return "single process"
    if kind == DistributedType.FSDP:
        return f"FSDP{accelerator.state.fsdp_plugin.fsdp_version}"
    if kind == DistributedType.DEEPSPEED:
        return f"DeepSpeed ZeRO-{deepspeed_json.zero_stage(accelerator.state.deepspeed_plugin.deepspeed_config)}"
    return "DDP"


def describe_setup(accelerator: Accelerator, batch: BatchShape, deepspeed: DeepSpeedSetup | None = None) -> str:
    """The effective distributed setup, one fact per line, so a stale default accelerate config can
    never change a run silently."""
    machines = int(os.environ.get("GROUP_WORLD_SIZE", "1"))  # torchrun's node count
    lines = [
        f"strategy: {strategy_name(accelerator)} on {accelerator.device.type}"
        + (" (gloo)" if launched() and accelerator.device.type == "cpu" else ""),
        f"world size: {accelerator.num_processes} process{'es' if accelerator.num_processes > 1 else ''}"
        + (f" on {machines} machines" if machines > 1 else ""),
        f"precision: {'fp32' if accelerator.mixed_precision == 'no' else accelerator.mixed_precision}",
    ]
    if accelerator.distributed_type == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        wrap = getattr(plugin.auto_wrap_policy, "__name__", str(plugin.auto_wrap_policy))
        lines += [
            f"sharding: reshard after forward {plugin.reshard_after_forward}, wrap {wrap} "
            "(block class from the model's _no_split_modules)",
            f"state dict: {plugin.state_dict_type.name}, cpu offload {isinstance(plugin.cpu_offload, CPUOffloadPolicy)}, "
            f"cpu-RAM-efficient loading {plugin.cpu_ram_efficient_loading}",
        ]
    if deepspeed is not None:
        offload = deepspeed_json.offload_devices(deepspeed.config)
        lines += [
            f"ZeRO stage {deepspeed_json.zero_stage(deepspeed.config)}, offload "
            + (", ".join(f"{name} → {device}" for name, device in offload.items()) or "none"),
            f"DeepSpeed config: {deepspeed.source}, resolved into {RESOLVED_DEEPSPEED_FILE}",
            *deepspeed.notes,
        ]
    lines.append(
        f"batch: micro {batch.micro_batch_size} × accumulation {batch.gradient_accumulation_steps} × world "
        f"{batch.world_size} = global {batch.global_batch_size}"
    )
    return "distributed setup:\n  " + "\n  ".join(lines)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"
