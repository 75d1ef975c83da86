"""--gradient-checkpointing-layers N: only the first N decoder layers recompute in the backward.

The step is the same computation (loss and gradients equal to checkpointing every layer and to
none); the later layers really keep their activations (their MLP runs once per step, a checkpointed
layer's twice); the planner counts the recompute share in time and the kept activations in memory
(tests/plan/test_planner_simulate.py compares those with fake-tensor runs), and recommends the fewest
checkpointed layers that leave headroom.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import tiny_model

from finetune.config.options import TrainConfig, validate
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.errors import ConfigError
from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.choose import KEPT_ACTIVATIONS_MARGIN, PARTIAL_CHECKPOINTING_HEADROOM, Request, fewest_checkpointed, plan
from finetune.plan.files import launch_command
from finetune.plan.memory import ALLOCATOR_SLACK, GIB, estimate, kept_layer_activations, unmeasured_terms
from finetune.plan.speed import estimate_speed
from finetune.plan.workload import Workload
from finetune.train.skeleton import prepare_for_training

LAYERS = 4


def one_step(checkpointing: bool, layers: int | None, method: str = "full"):
    """Loss, gradients and MLP calls per decoder layer of one forward and backward of a 4-layer Llama."""
    model = tiny_model("tiny", layers=LAYERS, vocab_size=64)
    config = TrainConfig(method=method, gradient_checkpointing=checkpointing, gradient_checkpointing_layers=layers,
                         lora_r=4, lora_targets="all-linear")
    model = prepare_for_training(model, config)
    decoder_layers = model.get_base_model().model.layers if method != "full" else model.model.layers
    calls = [0] * LAYERS
    for index, layer in enumerate(decoder_layers):  # a pre-hook: the recompute stops early, inside the MLP
        layer.mlp.register_forward_pre_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, calls


@pytest.mark.parametrize("method", ["full", "lora"])
def test_first_n_layers_recompute_and_the_step_is_unchanged(method):
    loss_all, grads_all, calls_all = one_step(True, None, method)
    loss_two, grads_two, calls_two = one_step(True, 2, method)
    loss_none, grads_none, calls_none = one_step(False, None, method)
    assert calls_all == [2, 2, 2, 2]
    assert calls_two == [2, 2, 1, 1]
    assert calls_none == [1, 1, 1, 1]
    torch.testing.assert_close(loss_two, loss_all, rtol=0, atol=0)
    torch.testing.assert_close(loss_two, loss_none, rtol=0, atol=0)
    assert grads_two.keys() == grads_all.keys() == grads_none.keys()
    for name in grads_two:
        torch.testing.assert_close(grads_two[name], grads_all[name], rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(grads_two[name], grads_none[name], rtol=1e-6, atol=1e-7, msg=name)


def test_bad_layer_counts_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="add --gradient-checkpointing"):
        validate(TrainConfig(gradient_checkpointing_layers=2, output_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="must be ≥ 1"):
        validate(TrainConfig(gradient_checkpointing=True, gradient_checkpointing_layers=0, output_dir=str(tmp_path)))
    config = TrainConfig(model="llama-7b", gradient_checkpointing=True, gradient_checkpointing_layers=33,
                         output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="llama-7b has 32 decoder layers; use 32 or less"):
        resolve_run(config, Launch(), Device())


def mistral_lora(**changes) -> Workload:
    w = Workload(model=catalog.get("mistral-7b"), gpu=gpus.get("H100"), gpus_per_node=1, method="lora", strategy="single",
                 offload="none", precision="bf16-true", optimizer="adamw", micro_batch_size=2, seq_len=4096,
                 gradient_checkpointing=True, loss="finetune-chunked")
    return replace(w, **changes)


def test_each_checkpointed_layer_trades_memory_for_time():
    """Fewer checkpointed layers: more memory and more tokens/s, one layer at a time, except that
    checkpointing the last layer too saves nothing (backward recomputes it at once); all 32 is the
    same plan as leaving the count unset, and none is the same as no checkpointing."""
    plans = [mistral_lora(checkpointed_layers=n) for n in range(1, 33)]
    memory = [estimate(w).allocated for w in plans]
    speed = [estimate_speed(w).tokens_per_second for w in plans]
    assert all(a > b for a, b in zip(memory[:-1], memory[1:-1]))
    assert memory[-1] == pytest.approx(memory[-2], rel=0.01)
    assert all(a > b for a, b in zip(speed, speed[1:]))
    assert estimate(plans[-1]) == estimate(mistral_lora())
    assert estimate_speed(plans[-1]) == estimate_speed(mistral_lora())
    assert estimate_speed(mistral_lora(checkpointed_layers=0)) == estimate_speed(mistral_lora(gradient_checkpointing=False))


def test_planner_checkpoints_the_fewest_layers_that_leave_headroom():
    w = mistral_lora()
    chosen = fewest_checkpointed(w)
    budget = PARTIAL_CHECKPOINTING_HEADROOM * w.gpu.memory_gib * GIB
    n = chosen.recomputed_layers
    assert 1 <= n < 32

    def with_margin(layers: int) -> float:
        """The plan with the kept layers' activations (unmeasured on a GPU) counted larger."""
        candidate = replace(w, checkpointed_layers=layers)
        margin = KEPT_ACTIVATIONS_MARGIN * kept_layer_activations(candidate) * (1 + ALLOCATOR_SLACK)
        return estimate(candidate).device(1) + margin

    assert with_margin(n) <= budget < with_margin(n - 1)
    assert estimate(replace(w, checkpointed_layers=n - 1)).device(1) <= budget  # the margin costs a layer or more
    assert any(term.startswith(f"activations of the {32 - n} decoder layers") for term in unmeasured_terms(chosen))
    tight = replace(w, gpu=gpus.get("A100-40GB"), micro_batch_size=10)  # over 90 % even with all 32: left unset
    assert fewest_checkpointed(tight).checkpointed_layers is None


def test_recommended_plan_and_its_launch_command_carry_the_layer_count():
    plans, best = plan(Request(model=catalog.get("mistral-7b"), gpu=gpus.get("H100"), gpus_per_node=1, method="lora",
                               seq_len=4096, micro_batch_size=2, gradient_checkpointing=True))
    chosen = plans[best]
    n = chosen.workload.recomputed_layers
    assert n < 32 and f"--gradient-checkpointing --gradient-checkpointing-layers {n}" in launch_command(chosen)
    assert any(reason.startswith(f"checkpointing: the first {n} of 32 layers") for reason in chosen.reasons)
    every_layer = estimate_speed(replace(chosen.workload, checkpointed_layers=None)).tokens_per_second
    assert chosen.speed.tokens_per_second > every_layer
    asked = plan(Request(model=catalog.get("mistral-7b"), gpu=gpus.get("H100"), gpus_per_node=1, method="lora",
                         seq_len=4096, micro_batch_size=2, gradient_checkpointing=True, gradient_checkpointing_layers=20))
    assert asked[0][asked[1]].workload.recomputed_layers == 20
