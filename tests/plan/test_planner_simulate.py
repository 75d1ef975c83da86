"""The analytic per-GPU peak stays within 10 % of two simulated micro-steps of the same run on fake
tensors (MemTracker on one device, FSDPMemTracker on a fake process group for FSDP2), where the
simulated model and optimizer are the trainer's own construction.

Real catalog shapes cut to 2–4 layers (written as local config.json folders, which `--model`
accepts) keep each simulation to seconds.
"""

from __future__ import annotations

import json

import pytest
from helpers import shrunk_config_dir

from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.errors import FinetuneError
from finetune.plan import gpus
from finetune.plan.memory import estimate
from finetune.plan.workload import from_run
from finetune.train.simulate import simulate

H100 = Device(cuda=True, name="NVIDIA H100 80GB HBM3", bf16=True)


CASES = {  # name → (catalog shape, layers, training flags, processes under FSDP or 1)
    "full bf16-true 7B-shape": ("llama-7b", 2, dict(precision="bf16-true", max_seq_len=1024), 1),
    "full bf16-mixed 1B-shape": ("llama-3.2-1b", 4, dict(max_seq_len=512, micro_batch_size=2), 1),
    "lora all-linear": ("llama-7b", 2, dict(method="lora", max_seq_len=2048), 1),
    "lora, the model's own loss": ("llama-7b", 2, dict(method="lora", max_seq_len=2048, chunked_loss=False), 1),
    "lora 128k vocabulary": ("llama-3.1-8b", 2, dict(method="lora", max_seq_len=2048), 1),
    "full, chunked loss": ("llama-3.2-1b", 4, dict(max_seq_len=2048, chunked_loss=True), 1),
    "lora checkpointing": ("llama-7b", 2, dict(method="lora", max_seq_len=2048, gradient_checkpointing=True), 1),
    "lora checkpointing 2 of 4 layers": ("llama-7b", 4, dict(method="lora", max_seq_len=2048, gradient_checkpointing=True,
                                                             gradient_checkpointing_layers=2), 1),
    "full bf16-mixed checkpointing 1 of 4 layers": ("llama-3.2-1b", 4, dict(max_seq_len=1024, gradient_checkpointing=True,
                                                                            gradient_checkpointing_layers=1), 1),
    "lora q,v on qwen2.5": ("qwen2.5-7b", 2, dict(method="lora", lora_targets="q_proj,v_proj", max_seq_len=1024), 1),
    # packed rows under SDPA: the dense mask, converted and saved by every layer (plan.memory)
    "lora packed rows seq 4096": ("llama-7b", 2, dict(method="lora", max_seq_len=4096, micro_batch_size=2, packing=True), 1),
    "lora packed rows checkpointing, grouped KV heads": ("llama-3.1-8b", 4, dict(method="lora", max_seq_len=4096, micro_batch_size=2,
                                                                             packing=True, gradient_checkpointing=True), 1),
    "fsdp2 full 2 ranks": ("llama-7b", 4, dict(max_seq_len=1024), 2),
    "fsdp2 full 8 ranks seq 2048": ("llama-7b", 4, dict(max_seq_len=2048), 8),
    "fsdp2 lora 4 ranks": ("llama-7b", 4, dict(method="lora", max_seq_len=2048), 4),
    "fsdp2 lora checkpointing 4 ranks": ("llama-7b", 4, dict(method="lora", max_seq_len=2048, gradient_checkpointing=True), 4),
    "fsdp2 lora checkpointing 3 of 4 layers 4 ranks": ("llama-7b", 4, dict(method="lora", max_seq_len=2048, gradient_checkpointing=True,
                                                                          gradient_checkpointing_layers=3), 4),
    # mixtures of experts at full width: routed activations, LoRA's W + ΔW copies of the experts, FSDP2's units
    "moe lora all-linear+experts": ("qwen3-30b-a3b", 2, dict(method="lora", lora_targets="all-linear+experts",
                                                              max_seq_len=1024), 1),
    "moe lora checkpointing seq 4096": ("qwen3-30b-a3b", 2, dict(method="lora", max_seq_len=4096, gradient_checkpointing=True), 1),
    "moe fsdp2 lora 4 ranks": ("mixtral-8x7b", 4, dict(method="lora", max_seq_len=512), 4),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_analytic_peak_within_10_percent_of_simulation(name, tmp_path):
    shape, layers, flags, processes = CASES[name]
    config = TrainConfig(model=shrunk_config_dir(tmp_path / "model", shape, layers), micro_batch_size=flags.pop("micro_batch_size", 1),
                         **flags)
    launch = Launch(world_size=processes, fsdp=True, fsdp_cpu_ram_efficient_loading=True) if processes > 1 else Launch()
    run = resolve_run(config, launch, H100)
    simulated = simulate(run).peak_bytes
    assert estimate(from_run(run, gpus.get("H100"))).allocated == pytest.approx(simulated, rel=0.10)


def test_simulate_refuses_what_cannot_run_on_fake_tensors(tmp_path):
    model = shrunk_config_dir(tmp_path / "model", "llama-7b", 2)
    with pytest.raises(FinetuneError, match="4-bit"):
        simulate(resolve_run(TrainConfig(model=model, method="qlora"), Launch(), H100))
    zero3 = tmp_path / "zero3.json"
    zero3.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(FinetuneError, match="checks full and LoRA .* not ZeRO-3"):
        simulate(resolve_run(TrainConfig(model=model, deepspeed=str(zero3)), Launch(world_size=2), H100))


def test_plan_simulate_says_which_plans_it_checks_and_simulates_one_it_can(tmp_path):
    """A recommended ZeRO-2 or QLoRA plan is outside what --simulate runs: the output names what it
    checks, then simulates the best-ranked plan it can run (or says that none is one)."""
    from finetune.cli.plan import simulation_text
    from finetune.models.source import resolve_model
    from finetune.plan.choose import Request, plan

    spec = resolve_model(shrunk_config_dir(tmp_path / "model", "llama-7b", 2))
    plans, _ = plan(Request(model=spec, gpu=gpus.get("A100-40GB"), gpus_per_node=2, method="lora", offload="none", seq_len=512))
    by_strategy = {p.workload.strategy.name: p for p in plans}
    text = simulation_text([by_strategy["zero2"], by_strategy["ddp"], by_strategy["fsdp"]], 0)
    assert text.startswith("--simulate checks full and LoRA fine-tuning with torch's AdamW, on one GPU or FSDP2 without "
                           "offload; the recommended plan is ZeRO-2 (DDP's reducer and the DeepSpeed engine are not simulated).")
    assert "Simulating the best plan it checks instead: lora FSDP2." in text
    assert "Simulated two micro-steps of this run on fake tensors (lora, FSDP2, 2 rank(s)" in text

    qlora, _ = plan(Request(model=spec, gpu=gpus.get("A100-40GB"), gpus_per_node=1, method="qlora", seq_len=512))
    assert simulation_text(qlora, None).endswith("the closest plan is QLoRA (bitsandbytes' 4-bit kernels do not run on "
                                                 "fake tensors). None of these plans is one it checks: nothing simulated.")


def test_packed_rows_dense_mask_is_planned_where_the_run_builds_one(tmp_path):
    """Packed rows under SDPA: transformers' block-diagonal mask, which SDPA converts to bf16 and saves in
    every layer beside the keys and values transformers repeats to every query head once it hands SDPA
    a mask (Llama-3.1-8B: 8 KV heads for 32); in the plan's traffic, the mask is converted and read again
    in every layer's forward. The planned extra over unpacked full-length rows is what two simulated
    micro-steps add, within 10 %; varlen (and flex) build no mask, and neither do unpacked rows."""
    from finetune.plan.memory import dense_mask_bytes, layer_activation_bytes, repeated_kv_bytes, unmeasured_terms
    from finetune.plan.traffic import layer_forward_bytes

    model = shrunk_config_dir(tmp_path / "model", "llama-3.1-8b", 2)
    runs = {flags: resolve_run(TrainConfig(model=model, method="lora", max_seq_len=4096, micro_batch_size=2, **dict(flags)),
                               Launch(), H100) for flags in ((), (("packing", True),), (("packing", True), ("attention", "varlen")),
                                                              (("packing", True), ("attention", "flex")))}
    plain, packed, varlen, flex = (from_run(run, gpus.get("H100")) for run in runs.values())
    assert (plain.dense_mask, packed.dense_mask, varlen.dense_mask, flex.dense_mask) == (False, True, False, False)
    assert (dense_mask_bytes(packed), repeated_kv_bytes(packed)) == (2 * 4096, 2 * 2 * (32 - 8) * 128)  # bf16, per token
    assert dense_mask_bytes(varlen) == repeated_kv_bytes(varlen) == 0
    assert layer_activation_bytes(packed) - layer_activation_bytes(plain) == 2 * 4096 + 2 * 2 * 24 * 128
    assert layer_forward_bytes(packed) - layer_forward_bytes(plain) == 4096 * (1 + 2 * 2)
    assert estimate(varlen).allocated == estimate(plain).allocated
    mentioned = [[term for term in unmeasured_terms(w) if term.startswith("packed rows' attention mask")] for w in (packed, varlen)]
    assert mentioned == [["packed rows' attention mask under SDPA, with the KV heads repeated for it (0.3 GiB, simulated on CPU; "
                          "--attention varlen builds none)"], []]
    simulated = simulate(runs[(("packing", True),)]).peak_bytes - simulate(runs[()]).peak_bytes
    planned = estimate(packed).allocated - estimate(plain).allocated
    assert planned == pytest.approx(simulated, rel=0.10) and planned > 2 * 2 * 4096**2 * 2  # two layers' bf16 masks
