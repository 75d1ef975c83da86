"""`finetune plan --fp8`: the float8 copy of LoRA's frozen base in memory, the base's matmul FLOPs at
the GPU's FP8 rate as their own speed term, the flag in the launch command, and the requests it
cannot plan refused with the reason."""

from dataclasses import replace

import pytest

from finetune.config.flags import parse_config
from finetune.errors import FinetuneError
from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.choose import Request, plan
from finetune.plan.files import train_flags
from finetune.plan.memory import estimate
from finetune.plan.speed import (
    CALIBRATION,
    LOSS_CHUNK_CALLS,
    LOSS_CHUNK_ISSUE_RELATIVE,
    fp8_kernels,
    gpu_terms,
    issue_seconds,
)
from finetune.plan.traffic import layer_kernels
from finetune.plan.workload import Workload

LLAMA_8B = catalog.get("llama-3.1-8b")


def anchor(**overrides) -> Workload:
    """NeMo AutoModel's published shape: Llama-3.1-8B LoRA r16 on all linear layers, s4096, micro batch 2."""
    fields = dict(model=LLAMA_8B, gpu=gpus.get("H100-80GB"), gpus_per_node=1, method="lora", strategy="single",
                  offload="none", precision="bf16-true", optimizer="adamw", micro_batch_size=2, seq_len=4096,
                  gradient_checkpointing=False, loss="liger", fused_optimizer=True)
    return Workload(**(fields | overrides))


def base_linear_weights(spec) -> int:
    """q, k, v, o, gate, up, down of every layer, from the architecture's own numbers."""
    h, kv = spec.hidden_size, spec.num_kv_heads * spec.resolved_head_dim
    return spec.num_layers * (2 * h * h + 2 * h * kv + 3 * h * spec.intermediate_size)


def test_fp8_holds_one_byte_more_per_frozen_linear_weight():
    plain, fp8 = estimate(anchor()), estimate(anchor(fp8=True))
    assert fp8.weights - plain.weights == base_linear_weights(LLAMA_8B)  # 6.98e9 bytes: 6.5 GiB
    assert fp8.gradients == plain.gradients and fp8.optimizer == plain.optimizer


def test_the_frozen_base_matmuls_move_to_their_own_term_at_the_fp8_rate():
    """The bf16 matmul term loses the base's forward and input-gradient FLOPs (no weight gradient: frozen);
    the "fp8 matmul" term runs them at the H100's FP8 peak (1979 vs 989 TFLOP/s) plus the casts of
    their operands, which compiled blocks fuse: eager they take back most of the gain."""
    w, c = anchor(), CALIBRATION
    plain, fp8 = gpu_terms(w, c), gpu_terms(replace(w, fp8=True), c)
    base_flops = 2 * base_linear_weights(LLAMA_8B) * 2 * w.tokens_per_micro_batch
    in_bf16 = base_flops / (989e12 * c.efficiency(w.gpu))
    assert plain["matmul"] - fp8["matmul"] == pytest.approx(in_bf16, rel=1e-9)
    assert "fp8 matmul" not in plain and set(fp8) - set(plain) == {"fp8 matmul"}
    compiled = gpu_terms(replace(w, fp8=True, compile=True), c)["fp8 matmul"]
    at_fp8_rate = base_flops / (1979e12 * c.efficiency(w.gpu))
    assert at_fp8_rate < compiled < 0.75 * in_bf16 and compiled < fp8["fp8 matmul"] < in_bf16


def test_eager_casts_cost_the_host_time_compiled_blocks_save():
    """Each cast is a handful of kernels per linear: eager, the host issues them one by one, each a
    plain tensor call at the chunked loss's measured cost per call (a chunk's share of a layer over its
    calls), not at a decoder layer's cost per kernel (its modules and hooks included), 10× more."""
    w = anchor()
    eager = issue_seconds(replace(w, fp8=True), CALIBRATION) - issue_seconds(w, CALIBRATION)
    compiled = issue_seconds(replace(w, fp8=True, compile=True), CALIBRATION) - issue_seconds(replace(w, compile=True), CALIBRATION)
    assert 0 < compiled < eager / 2
    kernels = fp8_kernels(replace(w, fp8=True))
    assert eager == pytest.approx(kernels * LOSS_CHUNK_ISSUE_RELATIVE / LOSS_CHUNK_CALLS * CALIBRATION.layer_issue_s)
    assert eager < kernels * CALIBRATION.layer_issue_s / layer_kernels(LLAMA_8B) / 5


def request(**overrides) -> Request:
    fields = dict(model=LLAMA_8B, gpu=gpus.get("H100-80GB"), gpus_per_node=1, method="lora", seq_len=4096,
                  micro_batch_size=2, fp8=True)
    return Request(**(fields | overrides))


def test_fp8_plans_carry_the_flag_and_are_marked_unmeasured():
    plans, best = plan(request(method="auto"))
    assert {p.workload.method for p in plans} == {"lora"}  # full and QLoRA cannot run it
    chosen = plans[best]
    assert chosen.workload.fp8 and "fp8 matmuls modelled, not measured" in chosen.speed.basis
    flags = train_flags(chosen.workload)
    assert flags[-1] == "--fp8" and parse_config(flags).fp8


@pytest.mark.parametrize(("overrides", "reason"), [
    (dict(gpu=gpus.get("A100-80GB")), "--fp8: A100-80GB cannot run finetune's float8 matmuls"),
    (dict(gpu=gpus.get("MI300X")), "--fp8: MI300X cannot run finetune's float8 matmuls"),
    (dict(gpu=gpus.get("MI325X")), "--fp8: MI325X cannot run finetune's float8 matmuls"),
    (dict(gpu=gpus.get("MI355X")), "--fp8: MI355X cannot run finetune's float8 matmuls"),
    (dict(method="qlora"), "--fp8 casts LoRA's frozen 16-bit base weights to float8, and QLoRA's base is 4-bit"),
    (dict(gpus_per_node=2, strategy="fsdp"), "--fp8 keeps a float8 copy of every frozen weight whole on each GPU"),
])
def test_requests_fp8_cannot_run_are_refused_with_the_reason(overrides, reason):
    with pytest.raises(FinetuneError) as refused:
        plan(request(**overrides))
    assert reason in str(refused.value)
