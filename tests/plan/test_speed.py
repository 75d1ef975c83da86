"""The planner's speed model: bytes moved per update per strategy, what compute hides, what it cannot;
the GPU terms of masked attention, Liger's kernels, mixtures of experts and context parallelism."""

from dataclasses import replace

import pytest

from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.memory import estimate, layer_activation_bytes, model_states, trainable_params
from finetune.plan.speed import (
    CALIBRATION,
    DDP_BUCKET_BYTES,
    LATENCY_S,
    NOTHING,
    collectives,
    estimate_speed,
    exposed_seconds,
    gathered_weight_bytes,
    gpu_seconds,
    gpu_terms,
    grouped_efficiency,
    kernel_classes,
    model_parallel_collectives,
    model_parallel_link,
)
from finetune.plan.traffic import ring_bytes
from finetune.plan.workload import Workload

LLAMA_7B = catalog.get("llama-7b")


def workload(**overrides) -> Workload:
    fields = dict(model=LLAMA_7B, gpu=gpus.get("A100-80GB"), gpus_per_node=4, method="full", strategy="ddp",
                  offload="none", precision="bf16-mixed", optimizer="adamw", micro_batch_size=4, seq_len=2048,
                  gradient_checkpointing=True)
    return Workload(**(fields | overrides))


def test_one_gpu_moves_nothing_and_scales_perfectly():
    speed = estimate_speed(workload(gpus_per_node=1, strategy="single"))
    assert collectives(workload(gpus_per_node=1, strategy="single")) == ()
    assert speed.comm_s_per_token == 0 and speed.scaling_efficiency == 1.0


def test_ddp_all_reduces_the_gradients_once_per_update_in_buckets():
    w = workload(gradient_accumulation_steps=4)
    (reduce,) = collectives(w)
    gradients = model_states(w).gradients  # fp32 gradients of 6.74B parameters
    assert gradients == trainable_params(w) * 4
    assert reduce.wire_bytes == pytest.approx(2 * 3 / 4 * gradients)  # ring all-reduce: 2(n-1)/n of the buffer
    assert reduce.launches == -(-gradients // DDP_BUCKET_BYTES)
    assert collectives(replace(w, gradient_accumulation_steps=1)) == (reduce,)  # no_sync: independent of accumulation


def test_sharded_strategies_gather_weights_every_micro_batch():
    w = workload(method="lora", strategy="fsdp", precision="bf16-true", gradient_accumulation_steps=2)
    gather, scatter = collectives(w)
    assert gather.wire_bytes == pytest.approx(2 * 2 * 3 / 4 * gathered_weight_bytes(w))  # 2 micro-batches × (forward + backward)
    assert gather.launches == 2 * 2 * (LLAMA_7B.num_layers + 1)
    assert scatter.wire_bytes == pytest.approx(2 * 3 / 4 * model_states(w).gradients)


def test_zero2_gathers_updated_weights_after_the_step_where_nothing_hides_them():
    w = workload(strategy="zero2", gpu=gpus.get("RTX4090"))
    gather = next(c for c in collectives(w) if c.hides_under == NOTHING)
    speed = estimate_speed(w)
    gb_per_s = w.gpu.link_gb_per_s
    exposed_at_least = gather.seconds(gb_per_s, LATENCY_S) / (w.micro_batch_size * w.seq_len)
    assert speed.exposed_comm_s_per_token >= exposed_at_least > 0
    assert speed.scaling_efficiency < 1


def test_slow_links_and_nodes_make_sharding_communication_bound():
    nvlink = estimate_speed(workload(strategy="fsdp"))
    # one 512-token micro-batch per update: the whole 7B is gathered twice for little compute
    pcie = estimate_speed(workload(strategy="fsdp", gpu=gpus.get("RTX4090"), micro_batch_size=1, seq_len=512,
                                   gradient_checkpointing=True))
    two_nodes = estimate_speed(workload(strategy="fsdp", gpus_per_node=8, nodes=2))
    assert not nvlink.comm_bound and nvlink.scaling_efficiency > 0.95
    assert pcie.comm_bound and pcie.scaling_efficiency < 0.6
    assert two_nodes.scaling_efficiency < nvlink.scaling_efficiency


def test_exposed_communication_grows_with_gpus_on_a_fixed_link():
    efficiencies = [estimate_speed(workload(gpus_per_node=n, gpu=gpus.get("L40S"))).scaling_efficiency for n in (2, 4, 8)]
    assert efficiencies == sorted(efficiencies, reverse=True) and efficiencies[0] < 1


def lora(**overrides) -> Workload:
    """One GPU, LoRA, bf16-true, flash-sized shapes (Mistral-7B by default, its sliding window included)."""
    fields = dict(model=catalog.get("mistral-7b"), gpu=gpus.get("H200"), gpus_per_node=1, method="lora", strategy="single",
                  offload="none", precision="bf16-true", optimizer="adamw", micro_batch_size=2, seq_len=4096,
                  gradient_checkpointing=True)
    return Workload(**(fields | overrides))


def test_a_sliding_window_shorter_than_the_row_sends_attention_to_the_masked_kernel():
    """Mistral-7B v0.1's 4096-token window. At 4096 tokens it masks nothing, and the trainer switches it
    off (train/sliding_window.py): flash attention skips the masked half. Kept, as transformers builds
    it (TRL, the measured rows), SDPA gets its mask: attention computes every score at the masked
    kernel's fitted speed, and every layer keeps the mask cast to 16 bits (2 bytes × seq per token) and
    the keys and values transformers repeats to every query head once SDPA gets a mask (8 KV heads → 32).
    One token longer, the window bites and is kept either way."""
    switched_off, kept = lora(), lora(inert_window_kept=True)
    spec = switched_off.model
    assert not spec.masks_attention(4096) and spec.masks_attention(4096, inert_window_kept=True)
    assert spec.masks_attention(4097) and not spec.masks_attention(4095, inert_window_kept=True)
    per_token = [gpu_terms(w, CALIBRATION)["attention"] / w.tokens_per_micro_batch for w in (kept, switched_off)]
    assert per_token[0] > 1.4 * per_token[1]  # twice the FLOPs, at a faster rate per FLOP than flash's on Hopper
    assert estimate_speed(switched_off).tokens_per_second > estimate_speed(kept).tokens_per_second
    unwindowed = lora(model=replace(LLAMA_7B, sliding_window=None), inert_window_kept=True)
    assert not unwindowed.model.masks_attention(10**6, inert_window_kept=True)
    assert layer_activation_bytes(kept) - layer_activation_bytes(switched_off) == 2 * 4096 + 2 * 2 * (32 - 8) * 128
    longer = lora(seq_len=4097)
    assert layer_activation_bytes(longer) == layer_activation_bytes(replace(longer, inert_window_kept=True))


def test_liger_keeps_fewer_activations_in_every_layer():
    """Liger's RMSNorm keeps its input in 16 bits (and an fp32 scale) instead of an fp32 copy, its SwiGLU
    recomputes the activation: what the H200's runs with 31 of 32 layers keeping activations showed
    (60.8 GiB with Liger, 71.6 without)."""
    plain, fused = lora(checkpointed_layers=1), lora(checkpointed_layers=1, loss="liger")
    spec = plain.model
    saved = 2 * (spec.hidden_size * (4 - 2) - 4) + 2 * spec.intermediate_size
    assert layer_activation_bytes(plain) - layer_activation_bytes(fused) == saved
    assert estimate(plain).activations - estimate(fused).activations > 10 * 2**30


def test_the_gpu_classes_add_up_to_the_gpu_clock():
    for w in (lora(), lora(method="qlora"), lora(method="full", precision="bf16-mixed", seq_len=1024),
              lora(model=catalog.get("qwen3-30b-a3b"), lora_targets="all-linear+experts")):
        classes = kernel_classes(w, CALIBRATION)
        assert sum(classes.values()) == pytest.approx(gpu_seconds(w, CALIBRATION))
        assert all(v >= 0 for v in classes.values()) and (classes["dequant"] > 0) == (w.method == "qlora")


def test_experts_run_slower_the_fewer_tokens_each_expert_gets():
    """The grouped expert matmuls: a fixed cost per expert worth expert_tokens_half tokens, so an expert's
    share of a micro-batch sets its efficiency: longer rows and larger micro-batches help, more experts
    at the same top-k (fewer tokens each) hurt."""
    moe = catalog.get("qwen3-30b-a3b")
    short, long = lora(model=moe, seq_len=2048, micro_batch_size=1), lora(model=moe, seq_len=16384, micro_batch_size=1)
    assert grouped_efficiency(short, CALIBRATION) < grouped_efficiency(long, CALIBRATION) < 1
    per_token = [gpu_terms(w, CALIBRATION)["experts"] / w.tokens_per_micro_batch for w in (short, long)]
    assert per_token[0] > 2 * per_token[1]
    more = lora(model=replace(moe, num_experts=256), seq_len=16384, micro_batch_size=1)
    assert grouped_efficiency(more, CALIBRATION) < grouped_efficiency(long, CALIBRATION)
    assert "experts" not in gpu_terms(lora(), CALIBRATION)
    targeted = lora(model=moe, lora_targets="all-linear+experts")
    assert gpu_terms(targeted, CALIBRATION)["experts"] > gpu_terms(lora(model=moe), CALIBRATION)["experts"]


def test_the_ring_hides_under_attention_only_at_long_context():
    """CP's keys and values (and their fp32 gradients) cross the ring while each hop's attention runs:
    at 128k tokens on 8 GPUs attention hides them; at 16k over a slow link they are exposed. The ring's
    merges add bytes with every hop, and at a fixed number of tokens per GPU the per-GPU rate falls as
    degree and length grow (each token attends to more)."""
    full = dict(model=catalog.get("llama-3.1-8b"), gpu=gpus.get("H100-80GB"), gpus_per_node=8, method="full",
                strategy="fsdp", precision="bf16-mixed", micro_batch_size=1)
    long, short = lora(cp=8, seq_len=131072, **full), lora(cp=8, seq_len=16384, **full | dict(gpu=gpus.get("L40S")))
    for w, hidden in ((long, True), (short, False)):
        (ring,) = model_parallel_collectives(w)
        attention = gpu_terms(w, CALIBRATION)["attention"] / w.model_parallel
        exposed = exposed_seconds((ring,), *model_parallel_link(w), 0.0, 0.0, 1, attention)
        assert (exposed == 0) == hidden
    assert ring_bytes(lora(cp=4, seq_len=65536, **full)) > ring_bytes(lora(cp=2, seq_len=65536, **full)) > 0
    per_gpu = [estimate_speed(lora(cp=cp, seq_len=32768 * cp, **full)).tokens_per_second / 8 for cp in (1, 2, 4, 8)]
    assert per_gpu == sorted(per_gpu, reverse=True)
