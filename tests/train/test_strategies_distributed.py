"""Every shipped accelerate config rehearsed on 2 CPU processes (gloo), and the invariance test: the
same global batch gives the same loss trajectory and the same LR per update under every strategy
and every micro × accumulation split.

Slow (each rehearsal starts 2 Python processes and trains a 2-layer model): CI runs this file as its
own step, `pytest -m slow`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO, rehearsal_runner, retrain
from safetensors.torch import load_file

from finetune.config.flags import parse_command
from finetune.launch import rehearsal_outcome, rehearse
from finetune.train.accelerator import free_port

pytestmark = pytest.mark.slow

STEPS = 3

MOE = ["--model", "tiny-moe", "--lora-targets", "all-linear+experts"]
# name → (accelerate config, training flags); `tiny` (or the flags' model) is shrunk like any catalog model
REHEARSALS = {
    "single": ("single_gpu.yaml", []),
    "ddp": ("ddp.yaml", []),
    "multi_node": ("multi_node.yaml", []),  # rehearsed as one machine
    "fsdp": ("fsdp.yaml", []),
    "fsdp_offload": ("fsdp_offload.yaml", []),
    "fsdp_chunked_loss": ("fsdp.yaml", ["--chunked-loss"]),  # the head's gradient gathered and scattered back
    "fsdp_tp": ("fsdp.yaml", ["--tp", "2"]),  # tensor parallel over both processes: transformers' TP plan
    "zero1": ("deepspeed_zero1.yaml", []),
    "zero2": ("deepspeed_zero2.yaml", []),
    "zero3": ("deepspeed_zero3.yaml", []),
    "zero3_offload": ("deepspeed_zero3_offload.yaml", []),
    "zero2_offload_json": ("ddp.yaml", ["--deepspeed", "ds_configs/zero2_offload.json"]),  # drop-in JSON
    "fsdp_lora": ("fsdp.yaml", ["--method", "lora"]),
    "fsdp_qlora": ("fsdp_qlora.yaml", ["--method", "qlora"]),
    "zero2_lora": ("deepspeed_zero2.yaml", ["--method", "lora"]),  # the chunked loss under DeepSpeed
    "zero3_lora": ("deepspeed_zero3.yaml", ["--method", "lora"]),  # the model's own loss (ZeRO-3)
    "zero3_qlora": ("deepspeed_zero3.yaml", ["--method", "qlora"]),
    # a mixture of experts (tiny-moe: Qwen3-MoE layout), its experts 4-bit and adapted (DDP: test_resume_strategies.py)
    "fsdp_moe_qlora": ("fsdp_qlora.yaml", [*MOE, "--method", "qlora"]),
    "zero3_moe_qlora": ("deepspeed_zero3.yaml", [*MOE, "--method", "qlora"]),  # the sparse blocks are ZeRO-3 leaves
}
ONE, TWO = "on cpu, 1 process(es)", "on cpu, 2 process(es)"
STRATEGY = {"single": f"single device {ONE}", "ddp": f"DDP {TWO}", "multi_node": f"DDP {TWO}",
            "fsdp": f"FSDP2 {TWO}", "fsdp_offload": f"FSDP2 {TWO}", "fsdp_chunked_loss": f"FSDP2 {TWO}",
            "fsdp_tp": f"FSDP2 {TWO}", "fsdp_lora": f"FSDP2 {TWO}",
            "fsdp_qlora": f"FSDP2 {TWO}", "zero1": f"ZeRO-1 {TWO}", "zero2": f"ZeRO-2 {TWO}",
            "zero2_offload_json": f"ZeRO-2 {TWO}", "zero3": f"ZeRO-3 {TWO}", "zero3_offload": f"ZeRO-3 {TWO}",
            "zero2_lora": f"ZeRO-2 {TWO}", "zero3_lora": f"ZeRO-3 {TWO}", "zero3_qlora": f"ZeRO-3 {TWO}",
            "fsdp_moe_qlora": f"FSDP2 {TWO}", "zero3_moe_qlora": f"ZeRO-3 {TWO}"}
FULL_FINE_TUNING = [name for name, (_, flags) in REHEARSALS.items() if "--method" not in flags and "--model" not in flags]
# adapter tensors saved: A and B of 7 linears in each of tiny's 2 blocks; of 4 attention linears and 2 fused
# expert parameters in each of tiny-moe's
ADAPTER_TENSORS = {"tiny": 2 * 7 * 2, "tiny-moe": 2 * (4 + 2) * 2}


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    """name → Rehearsal, each run once on first use and shared by the tests below."""
    return rehearsal_runner(tmp_path_factory, REHEARSALS)


@pytest.mark.parametrize("name", list(REHEARSALS))
def test_shipped_config_rehearses_on_cpu(name, rehearsed):
    result = rehearsed(name)
    assert result.passed, rehearsal_outcome.format_report(result, STEPS) + "\n" + result.log[-4000:]
    assert result.strategy == STRATEGY[name]
    run_dir = Path(result.output_dir)
    flags = REHEARSALS[name][1]
    model = flags[flags.index("--model") + 1] if "--model" in flags else "tiny"
    assert len(result.losses) == STEPS
    if model == "tiny":  # 3 updates of tiny-moe's adapters meet batches of different lengths: it checks the adapters
        assert result.losses[-1] < result.losses[0]
    if "--method" in flags:  # LoRA / QLoRA: a non-empty adapter, never an empty shell
        tensors, values = rehearsal_outcome.safetensors_content(run_dir / "adapter_model.safetensors")
        assert tensors == ADAPTER_TENSORS[model] and values > 0
    if model != "tiny":  # every LoRA B (zero at the start) moved: the experts' adapters trained on every rank's data
        adapter = load_file(run_dir / "adapter_model.safetensors")
        moved = {name: bool(t.abs().sum() > 0) for name, t in adapter.items() if "lora_B" in name}
        assert moved and all(moved.values()) and any("experts" in name for name in moved), moved
    if name.startswith("zero"):
        resolved = json.loads((run_dir / "deepspeed_config.json").read_text())
        assert (resolved["train_micro_batch_size_per_gpu"], resolved["gradient_accumulation_steps"],
                resolved["train_batch_size"]) == (2, 2, 8)


def rehearse_json(tmp_path: Path, ds_json: dict) -> tuple[rehearsal_outcome.Rehearsal, dict]:
    """`finetune rehearse --config_file ddp.yaml --model tiny --deepspeed X.json` as a user types it;
    the rehearsal and the run.yaml its training processes read."""
    (tmp_path / "user.json").write_text(json.dumps(ds_json))
    command = parse_command(["--model", "tiny", "--deepspeed", str(tmp_path / "user.json")])
    result = rehearse.rehearse(command.config, str(REPO / "accelerate_configs" / "ddp.yaml"), tmp_path / "w",
                               steps=STEPS, given=command.given)
    assert result.passed, rehearsal_outcome.format_report(result, STEPS) + "\n" + result.log[-4000:]
    return result, yaml.safe_load((Path(result.output_dir) / "run.yaml").read_text())


def test_a_minimal_deepspeed_json_trains_on_2_processes(tmp_path):
    """`{"zero_optimization": {"stage": 1}}` alone trains: DeepSpeed would stop for want of a batch
    size, and every run-owned key is filled from the run."""
    result, _ = rehearse_json(tmp_path, {"zero_optimization": {"stage": 1}})
    assert result.strategy == f"ZeRO-1 {TWO}" and result.losses[-1] < result.losses[0]
    resolved = json.loads((Path(result.output_dir) / "deepspeed_config.json").read_text())
    assert {key: resolved[key] for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                           "train_batch_size", "gradient_clipping", "bf16", "fp16")} == {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 8,
        "gradient_clipping": 1.0, "bf16": {"enabled": False}, "fp16": {"enabled": False}}


def test_an_hf_trainer_deepspeed_json_trains_with_its_own_optimizer_and_schedule(tmp_path):
    """Issue 12: a WarmupDecayLR / AdamW file as written for the HF Trainer, no flags: the run adopts
    its LR, betas, eps, weight decay and linear decay to 0 (the rehearsal shortens warmup and length)."""
    hf = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                            "warmup_num_steps": 5, "total_num_steps": 40}},
          "zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"},
          "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    result, run_yaml = rehearse_json(tmp_path, hf)
    assert result.strategy == f"ZeRO-2 {TWO}"
    assert (run_yaml["lr_schedule"], run_yaml["min_lr_ratio"], run_yaml["adam_beta2"], run_yaml["adam_epsilon"],
            run_yaml["weight_decay"]) == ("linear", 0.0, 0.999, 1e-6, 0.01)
    # warmup 1 and 3 updates in the rehearsal: peak/2, peak, then half way down a linear decay to 0
    assert result.lrs == pytest.approx([1.5e-3, 3e-3, 1.5e-3], rel=1e-9)
    assert any("scheduler.params.total_num_steps (real run 40, rehearsal 3)" in note for note in result.notes)


def launched_with(reference: rehearsal_outcome.Rehearsal, accelerate_config: str, processes: int, micro: int) -> list[str]:
    """The rehearsal's run again under `accelerate_config` with another micro batch (same global batch)."""
    return rehearse.launch_command(str(REPO / "accelerate_configs" / accelerate_config), processes, free_port(),
                                   Path(reference.output_dir).parent / "rehearsal.yaml") + ["--micro-batch-size", str(micro)]


def test_same_global_batch_gives_the_same_losses_and_lr_under_every_strategy_and_split(rehearsed, tmp_path):
    reference = rehearsed("single")  # 1 process: micro 2 × accumulation 4
    runs = {name: rehearsed(name) for name in FULL_FINE_TUNING}  # 2 processes: micro 2 × accumulation 2
    runs["single micro 8 × accum 1"] = retrain(launched_with(reference, "single_gpu.yaml", 1, 8), tmp_path / "a", STEPS)
    runs["ddp micro 1 × accum 4"] = retrain(launched_with(reference, "ddp.yaml", 2, 1), tmp_path / "b", STEPS)
    runs["zero3 micro 1 × accum 4"] = retrain(launched_with(reference, "deepspeed_zero3.yaml", 2, 1), tmp_path / "c", STEPS)
    # 4 processes: FSDP2 over 2 data-parallel ranks × tensor parallel over 2 (2 cores run it, slowly)
    runs["fsdp × tp 2 × 2"] = retrain(launched_with(reference, "fsdp.yaml", 4, 2) + ["--tp", "2"], tmp_path / "e", STEPS)
    # no launcher at all: `python -m finetune --deepspeed ...` runs a 1-process ZeRO job (ZeRO-Offload on one GPU)
    runs["no launcher, zero2_offload.json"] = retrain(
        [sys.executable, "-m", "finetune", "--config", str(Path(reference.output_dir).parent / "rehearsal.yaml"),
         "--deepspeed", str(REPO / "ds_configs" / "zero2_offload.json")], tmp_path / "d", STEPS)
    for name, result in runs.items():
        assert result.lrs == reference.lrs, name
        assert result.losses == pytest.approx(reference.losses, rel=1e-6), name
    assert reference.losses[0] != reference.losses[-1]  # the model trains; equal numbers are not vacuous
    assert_exports_as_saved(Path(runs["fsdp × tp 2 × 2"].output_dir), tmp_path / "export")


def assert_exports_as_saved(run_dir: Path, out: Path) -> None:
    """The run's last checkpoint, consolidated by `finetune export` into one safetensors file, loads in
    plain transformers with the logits of the model the run saved at its end."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.export.safetensors import export

    export(sorted((run_dir / "checkpoints").glob("step-*"))[-1], out)
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    tokens = torch.tensor([[1, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3]])
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(input_ids=tokens).logits
                  for folder in (out, run_dir)]
    assert torch.equal(*logits)


@pytest.mark.parametrize(("chunked", "zero3"), [("fsdp_lora", "zero3_lora"), ("fsdp_qlora", "zero3_qlora"),
                                               ("zero2_lora", "zero3_lora"), ("fsdp_moe_qlora", "zero3_moe_qlora")])
def test_adapters_train_the_same_under_fsdp2_zero2_and_zero3(chunked, zero3, rehearsed):
    """FSDP2 and ZeRO-2 run the chunked loss, ZeRO-3 the model's own: the same trajectory."""
    assert rehearsed(chunked).lrs == rehearsed(zero3).lrs
    assert rehearsed(chunked).losses == pytest.approx(rehearsed(zero3).losses, rel=1e-6)


BATCH_SAMPLER_UNDER_DEEPSPEED = """
import sys, torch
from transformers import AutoModelForCausalLM
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler
from finetune.config.options import TrainConfig
from finetune.launch.rehearse import shrunk_model_config
from finetune.train.run import resolve
from finetune.train.accelerator import build_accelerator

run, _ = resolve(TrainConfig(model="tiny", micro_batch_size=2, deepspeed=sys.argv[1], output_dir=sys.argv[2]))
accelerator = build_accelerator(run)
model = AutoModelForCausalLM.from_config(shrunk_model_config(TrainConfig(model="tiny"))[0])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
rows = [torch.arange(8) for _ in range(8)]
loader = DataLoader(rows, batch_sampler=BatchSampler(SequentialSampler(rows), 2, drop_last=True))  # batch_size is None
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
print("micro batch", accelerator.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"])
"""


def test_batch_sampler_loaders_prepare_under_deepspeed(tmp_path):
    """accelerate#841: with "auto" batch sizes Accelerate reads `loader.batch_size`, None for batch
    samplers (packing), and fails; finetune fills them before prepare()."""
    done = subprocess.run([sys.executable, "-c", BATCH_SAMPLER_UNDER_DEEPSPEED, str(REPO / "ds_configs" / "zero2.json"),
                           str(tmp_path)], env=rehearse.rehearsal_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "micro batch 2"
