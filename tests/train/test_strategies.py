"""Strategy selection in one process: precision, plugins from the launch environment, the setup
printout. Multi-process runs are in test_strategies_distributed.py, rehearse's pieces in test_rehearse.py."""

from __future__ import annotations

import os
import re

import pytest
from helpers import REPO

from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, Launch, resolve_precision, resolve_run
from finetune.errors import ConfigError, FinetuneError
from finetune.train.accelerator import fsdp_plugin_from_launch
from finetune.train.run import resolve
from finetune.train.startup import describe_setup, start_accelerator

A100 = Device(cuda=True, name="NVIDIA A100-SXM4-40GB", bf16=True)
T4 = Device(cuda=True, name="Tesla T4", bf16=False)


@pytest.mark.parametrize(("requested", "method", "device", "launcher", "expected"), [
    ("auto", "full", Device(), "bf16", "fp32"),  # CPU: always fp32, whatever the accelerate config says
    ("auto", "full", A100, None, "bf16-mixed"),  # full fine-tuning keeps fp32 master weights
    ("auto", "lora", A100, None, "bf16-true"),  # a frozen base needs no fp32 copy
    ("auto", "qlora", T4, None, "fp16-true"),  # no bf16: fp16 with loss scaling
    ("auto", "full", T4, None, "fp16-mixed"),
    ("auto", "lora", A100, "fp16", "fp16-true"),  # the accelerate config's family on a GPU
    ("bf16-mixed", "full", Device(), None, "bf16-mixed"),  # explicit: CPU autocast runs bf16
])
def test_precision_resolution(requested, method, device, launcher, expected):
    assert resolve_precision(requested, method, device, launcher).name == expected


@pytest.mark.parametrize(("requested", "method", "device", "launcher", "message"), [
    ("bf16-true", "lora", A100, "fp16", "the launch fixes fp16"),
    ("bf16-mixed", "full", T4, None, "has no bf16"),
    ("fp16-mixed", "full", Device(), None, "needs a GPU"),
])
def test_precision_conflicts_are_refused(requested, method, device, launcher, message):
    with pytest.raises(ConfigError, match=message):
        resolve_precision(requested, method, device, launcher)


def test_precisions_that_would_not_run_as_named_are_refused():
    with pytest.raises(FinetuneError, match="fp16-true keeps the weights in fp16"):
        resolve_run(TrainConfig(precision="fp16-true"), Launch(), T4)



def test_pure_bf16_full_fine_tuning_under_fsdp2_turns_accelerates_upcast_off():
    """Accelerate upcasts trainable 16-bit parameters to fp32 under FSDP2 unless its mixed precision
    is off: off for bf16-true full fine-tuning there, kept for LoRA (fp32 adapters) and other strategies."""
    from finetune.train.accelerator import accelerate_mixed_precision

    def mixed_precision(method: str, launch: Launch) -> str:
        return accelerate_mixed_precision(resolve_run(TrainConfig(precision="bf16-true", method=method), launch, A100))

    assert mixed_precision("full", Launch(world_size=2, fsdp=True)) == "no"
    assert mixed_precision("lora", Launch(world_size=2, fsdp=True)) == "bf16"
    assert mixed_precision("full", Launch(world_size=2)) == "bf16"


def test_single_process_accelerator_without_launcher(tmp_path, capsys):
    config = TrainConfig(micro_batch_size=2, global_batch_size=8, output_dir=str(tmp_path / "out"))
    run, _ = resolve(config)
    accelerator = start_accelerator(run)
    assert (run.batch.micro_batch_size, run.batch.gradient_accumulation_steps, run.batch.world_size) == (2, 4, 1)
    assert accelerator.gradient_accumulation_steps == 4 and accelerator.num_processes == 1
    assert accelerator.gradient_state.plugin_kwargs["sync_with_dataloader"] is False  # the loop owns its windows
    assert accelerator.step_scheduler_with_optimizer is False
    assert accelerator.mixed_precision == "no"
    *setup_lines, preflight = capsys.readouterr().out.splitlines()
    assert setup_lines == [
        "distributed setup:",
        "  strategy: single device on cpu",
        "  world size: 1 process",
        "  precision: fp32 (weights float32, compute float32)",
        "  batch: micro 2 × accumulation 4 × world 1 = global 8",
    ]
    # the time it took is whatever this machine's load made it: matched as a pattern
    assert re.fullmatch(r"preflight: 1 rank\(s\) on 1 machine\(s\) joined; all-reduce ok; package versions equal; "
                        r"output dir writable \(\d+\.\d s\)", preflight)
    assert not list((tmp_path / "out").iterdir())  # the writability probe cleans up after itself


def test_fsdp1_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="sets fsdp_version 1; finetune runs FSDP2. Set `fsdp_version: 2`"):
        resolve(TrainConfig())
    monkeypatch.setenv("FSDP_VERSION", "2")
    run = resolve(TrainConfig())[0]
    assert run.strategy.name == "fsdp"
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    plugin = fsdp_plugin_from_launch(run)
    assert plugin.fsdp_version == 2 and plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"


def test_batch_shape_errors_surface_before_any_process_group(tmp_path):
    config = TrainConfig(micro_batch_size=3, global_batch_size=8, output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="--global-batch-size 8 is not a multiple of micro batch 3"):
        resolve(config)


def test_setup_printout_names_deepspeed_source_and_offload():
    class StubAccelerator:  # describe_setup only reads these attributes
        distributed_type = __import__("accelerate").utils.DistributedType.DEEPSPEED
        num_processes = 8
        device = __import__("torch").device("cuda", 0)

    config = TrainConfig(model="llama-7b", micro_batch_size=4, gradient_accumulation_steps=2,
                         deepspeed=str(REPO / "ds_configs" / "zero3_offload.json"))
    run = resolve_run(config, Launch(world_size=8), A100)
    text = describe_setup(StubAccelerator(), run)
    assert text.splitlines()[1:] == [
        "  strategy: ZeRO-3 on cuda",
        "  world size: 8 processes",
        "  precision: bf16-mixed (weights float32, compute bfloat16)",
        "  ZeRO stage 3, offload optimizer → cpu, param → cpu",
        f"  DeepSpeed config: {REPO / 'ds_configs' / 'zero3_offload.json'}, resolved into deepspeed_config.json",
        "  batch: micro 4 × accumulation 2 × world 8 = global 64",
    ]


def test_launch_reads_the_environment_as_it_is_now(monkeypatch):
    """datasets' `map(num_proc=N)` rebinds os.environ to a copy; the launch must still see what
    `accelerate launch` set (a default argument bound to the old object did not)."""
    monkeypatch.setattr(os, "environ", {**os.environ, "WORLD_SIZE": "3", "ACCELERATE_USE_FSDP": "true"})
    launch = Launch.from_environment()
    assert (launch.world_size, launch.fsdp) == (3, True)
