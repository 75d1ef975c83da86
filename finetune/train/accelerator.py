"""Resolved run → one configured Accelerator.

The strategy arrives as data: the accelerate config the user launched with (`accelerate launch
--config_file accelerate_configs/X.yaml`, which Accelerate hands to each process as environment
variables) and, for DeepSpeed, an optional JSON file (`--deepspeed ds.json` or the YAML's
`deepspeed_config_file`). `resolve.resolve_run` reads that data; this module turns the resolved
run into an `Accelerator`; the training loop never asks which strategy it runs under. What a run
sees of the start (the watchdog, the preflight checks, the JSON written, the printout) is
startup.py's: building stays free of output, so the strategy's construction reads on one screen.
"""

from __future__ import annotations

import json
import os
import socket

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedType,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
)
from torch.distributed.fsdp import CPUOffloadPolicy

from finetune.config.names import trains_pure_bf16
from finetune.config.resolve import LAUNCH_DEEPSPEED, DeepSpeedSetup, ResolvedRun
from finetune.errors import ConfigError
from finetune.train import parallel


def launched() -> bool:
    """True under torchrun / accelerate launch (they set LOCAL_RANK), even for one process."""
    return "LOCAL_RANK" in os.environ


def build_accelerator(run: ResolvedRun) -> Accelerator:
    """The run's Accelerator: its plugins (gradient accumulation, data loading, FSDP2 or DeepSpeed),
    mixed precision and process-group kwargs, the FSDP-on-CPU switch, and the TP/CP layout handed over.

    Works without a launcher (one process, CPU or CUDA) and under `accelerate launch` / torchrun with
    DDP, FSDP2 or DeepSpeed. Launched on CPU, the process group uses gloo: without it Accelerate
    sees world size 1 under DeepSpeed. Builds only: a run starts it through startup.start_accelerator,
    which watches the rendezvous, checks the job, writes and prints what was built. Raises
    ConfigError when Accelerate would run another strategy or world size than the launch announced.
    """
    config, deepspeed = run.config, run.deepspeed
    cuda = torch.cuda.is_available()
    if deepspeed is not None and not launched():
        become_single_process_launch()
    fsdp_plugin = fsdp_plugin_from_launch(run) if run.strategy.fsdp else None
    with parallel.launch_parallelism_withheld():
        accelerator = Accelerator(
            # the loop collects each accumulation window before its first forward, so Accelerate must
            # not also sync at the end of the dataloader: that would step on every micro-batch of an
            # epoch's last window
            gradient_accumulation_plugin=GradientAccumulationPlugin(
                num_steps=run.batch.gradient_accumulation_steps, sync_with_dataloader=False),
            mixed_precision=accelerate_mixed_precision(run),
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
        parallel.hand_over(accelerator, run.parallelism)
    if accelerator.num_processes != run.world_size or (
        run.world_size > 1 and accelerator.distributed_type == DistributedType.NO
    ):
        raise ConfigError(
            f"The launcher announced WORLD_SIZE={run.world_size} but Accelerate runs {accelerator.num_processes} "
            f"process(es) as {accelerator.distributed_type.value}; launch with `accelerate launch` or torchrun."
        )
    return accelerator


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


def fsdp_plugin_from_launch(run: ResolvedRun) -> FullyShardedDataParallelPlugin:
    """The FSDP2 plugin the accelerate config asks for (`resolve_run` has refused FSDP1), or, for a
    --tp/--cp run launched without one, FSDP2 with sharded checkpoints and the decoder block as unit."""
    if run.launch.fsdp:
        return FullyShardedDataParallelPlugin()
    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                          state_dict_type="SHARDED_STATE_DICT")


def accelerate_mixed_precision(run: ResolvedRun) -> str:
    """Accelerate's mixed_precision for the run. Pure bf16 full fine-tuning under FSDP2 (bf16-true:
    bf16 weights, gradients and AdamW states, as torchtune trains) passes "no": with any other value
    Accelerate upcasts trainable 16-bit parameters to fp32 master weights in `prepare`, which would
    make the run bf16-mixed. The weights are bf16 already, so every matmul computes in bf16. (Under
    ZeRO, DeepSpeed's bf16 section keeps bf16 master weights instead: config/deepspeed_json.py.)"""
    pure_bf16 = trains_pure_bf16(run.precision, run.config.method)
    return "no" if pure_bf16 and run.strategy.fsdp else run.precision.accelerate


def enable_fsdp_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """The one CPU-only switch: make Accelerate run FSDP on CPU processes (gloo).

    Accelerate enables FSDP only on GPU-like devices and otherwise falls back to DDP (MULTI_CPU). The
    code FSDP2 runs once enabled (fully_shard, DTensor collectives, sharded checkpoints) is the GPU
    code, so this is what lets `finetune rehearse` and the tests exercise the real FSDP path. It is
    also why TP and CP run on CPU: Accelerate refuses a ParallelismConfig under MULTI_CPU, and
    `parallel.hand_over` attaches the layout once the run is FSDP here.
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
