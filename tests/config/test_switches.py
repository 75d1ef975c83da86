"""Liger, the chunked loss and fused AdamW decided once (config/switches.py) for the plan, the dry run, the
fit check and the run: one gate for both losses that read the LM head outside its forward, an installed
liger-kernel that does not import costing only Liger, and an unset --liger resolved as a CUDA run would.

Without a GPU, CUDA runs are resolved at the level of the resolving functions (cuda=True), never trained;
liger-kernel is a package written into a temporary folder, one that imports and one that does not."""

from __future__ import annotations

import pytest
from helpers import LIGER_BROKEN, LIGER_WORKING

from finetune.config import switches as switches_module
from finetune.config.names import STRATEGIES
from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.config.switches import liger_table, resolve_switches
from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.choose import Request, plan
from finetune.plan.files import train_flags
from finetune.plan.memory import estimate
from finetune.plan.workload import from_run
from finetune.train.dry_run import run_of_plan

H100 = Device(cuda=True, name="NVIDIA H100 80GB HBM3", bf16=True, free_bytes=80 * 2**30, total_bytes=80 * 2**30)
SINGLE, FSDP, ZERO3 = STRATEGIES["single"], STRATEGIES["fsdp"], STRATEGIES["zero3"]


def switches(liger=None, chunked_loss=None, cuda=True, strategy=SINGLE, model_type="llama", method="lora",
             lora_targets="all-linear", optimizer="adamw", head_problem=None):
    return resolve_switches(liger=liger, chunked_loss=chunked_loss, optimizer=optimizer, method=method,
                            lora_targets=lora_targets, cuda=cuda, strategy=strategy, model_type=model_type,
                            head_problem=head_problem)


def test_liger_is_gated_wherever_the_chunked_loss_is(liger_kernel):
    """ZeRO-3, LoRA on the head and a quantized head keep out both losses that read the head's weight;
    an unset --liger is on where it can run and says why where it cannot."""
    liger_kernel(LIGER_WORKING)
    assert switches() == switches(liger=True) and switches().loss == "liger" and not switches().notes
    assert switches(method="full").loss == "liger"
    zero3 = switches(strategy=ZERO3)
    assert zero3.loss == "transformers"
    assert zero3.notes == ("running without Liger (ZeRO-3 gathers the LM head's weight only inside the head's own forward)",)
    head = switches(lora_targets="q_proj,v_proj,lm_head", liger=True, chunked_loss=True)
    assert head.loss == "transformers" and head.notes == (
        "running without Liger (LoRA adapts the LM head, and a loss that reads its base weight would skip the adapter)",
        "--chunked-loss: LoRA adapts the LM head, and a loss that reads its base weight would skip the adapter; "
        "using the model's own loss")
    quantized = switches(head_problem="its LM head is quantized")
    assert quantized.loss == "transformers" and quantized.notes == ("running without Liger (its LM head is quantized)",)
    # Liger covers only its architectures; the chunked loss stands in where it covers the model
    qwen = switches(model_type="qwen2")
    assert qwen.loss == "finetune-chunked" and qwen.notes == ("running without Liger (Liger does not support model type 'qwen2')",)
    assert (switches(cuda=False).loss, switches(cuda=False).notes) == ("finetune-chunked", ())  # CPU: off without a word
    assert switches(liger=True, chunked_loss=True).notes == ("--chunked-loss: Liger runs; using Liger's fused loss",)


@pytest.fixture
def without_liger(monkeypatch):
    """As on a machine without liger-kernel, whatever this one has."""
    monkeypatch.setattr(switches_module, "liger_installed", lambda: False)
    liger_table.cache_clear()
    yield
    liger_table.cache_clear()


def test_where_the_chunked_loss_runs(without_liger):
    """Without liger-kernel installed: on by default for LoRA and QLoRA, when asked for full
    fine-tuning, never under ZeRO-3, with LoRA on the head, or for an architecture it does not cover."""
    assert switches().loss == "finetune-chunked" and switches(method="qlora", lora_targets="q_proj,v_proj").chunked_loss
    assert switches(method="full").loss == "transformers"
    assert switches(method="full", chunked_loss=True, strategy=FSDP).chunked_loss
    assert switches(chunked_loss=False).loss == "transformers"
    assert switches(chunked_loss=True, strategy=ZERO3).loss == "transformers"
    assert switches(model_type="gemma2").loss == switches(model_type=None).loss == "transformers"
    assert switches(model_type="qwen3_moe", method="qlora").loss == "finetune-chunked"  # a mixture of experts too
    assert switches(lora_targets="q_proj,lm_head").loss == "transformers"
    asked = switches(liger=True, method="full")  # asked for no logits: the chunked loss stands in
    assert asked.loss == "finetune-chunked"
    assert asked.notes == ("running without Liger (liger-kernel is not installed (pip install liger-kernel))",)


def test_a_liger_that_does_not_import_costs_the_run_only_liger(liger_kernel):
    liger_kernel(LIGER_BROKEN)
    line = ("running without Liger (liger-kernel 0.8.5 does not import: ImportError: cannot import name "
            "'LlamaFlashAttention2' from 'transformers.models.llama.modeling_llama')")
    for asked in (None, True):
        chosen = resolve_run(TrainConfig(method="lora", liger=asked), Launch(), H100).switches
        assert (chosen.loss, chosen.notes) == ("finetune-chunked", (line,))
    run = resolve_run(TrainConfig(model="mistral-7b", method="lora"), Launch(), H100)
    assert from_run(run, gpus.get("H100")).loss == "finetune-chunked"


def test_plan_dry_run_and_fit_check_count_an_unset_liger_as_the_run_turns_it_on(liger_kernel):
    """With liger-kernel installed: `finetune plan`, the dry run's plan and the fit check (all from_run
    or the planner) plan Liger's loss as a CUDA run resolves it, and the plan's launch command resolves
    back to the planned workload, with --no-liger (and the chunked loss) pinned where the plan left Liger out."""
    liger_kernel(LIGER_WORKING)
    config = TrainConfig(model="mistral-7b", method="lora", max_seq_len=4096, micro_batch_size=2, gradient_checkpointing=True)
    run = resolve_run(config, Launch(), H100)
    assert run.switches.liger  # what the run turns on
    assert from_run(run, gpus.get("H100")).loss == "liger"  # what the dry run and the fit check plan
    request = dict(model=catalog.get("mistral-7b"), gpu=gpus.get("H100"), gpus_per_node=1, method="lora", seq_len=4096)
    for liger, chunked, loss, pinned in ((None, None, "liger", []), (False, None, "finetune-chunked", ["--no-liger"]),
                                         (False, False, "transformers", ["--no-liger", "--no-chunked-loss"])):
        plans, best = plan(Request(**request, liger=liger, chunked_loss=chunked))
        chosen = plans[best]
        assert chosen.workload.loss == loss
        assert [flag for flag in train_flags(chosen.workload) if "liger" in flag or "chunked" in flag] == pinned
        assert from_run(run_of_plan(chosen, ".", "out"), chosen.workload.gpu) == chosen.workload


def test_fused_adamw_is_planned_where_the_run_builds_it():
    """On a GPU the run builds AdamW fused (no foreach temporaries at the step), except under FSDP2,
    which builds it over parameters still on the host; the plan counts the step scratch accordingly."""
    assert switches().fused_adamw and switches(strategy=ZERO3).fused_adamw
    assert not switches(cuda=False).fused_adamw and not switches(strategy=FSDP).fused_adamw
    assert not switches(optimizer="adamw-8bit").fused_adamw
    config = TrainConfig(model="llama-3.2-1b", method="full", max_seq_len=512, micro_batch_size=1)
    gpu = resolve_run(config, Launch(), H100)
    cpu = resolve_run(config, Launch(), Device())
    assert from_run(gpu, gpus.get("H100")).fused_optimizer and not from_run(cpu, gpus.get("H100")).fused_optimizer
    fused, foreach = estimate(from_run(gpu, gpus.get("H100"))), estimate(from_run(cpu, gpus.get("H100")))
    assert (fused.peak_phase, foreach.peak_phase) == ("forward/backward", "optimizer step")
    assert foreach.buffers == pytest.approx(1.236e9 * 4, rel=0.01)  # foreach: one fp32 copy of the states
    assert fused.allocated < foreach.allocated
