"""The planner's speed model: bytes moved per update per strategy, what compute hides, what it cannot."""

from dataclasses import replace

import pytest

from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.memory import model_states, trainable_params
from finetune.plan.speed import DDP_BUCKET_BYTES, LATENCY_S, NOTHING, collectives, estimate_speed, gathered_weight_bytes
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
