"""DPO (and KTO) rehearsed on 2 CPU processes under every shipped strategy, with each way of holding the
reference: LoRA's adapters off, full fine-tuning's frozen copy (sharded as the policy under FSDP2 and
ZeRO-3) and its precomputed log-probabilities. Each rehearsal passes (3 updates, a sharded checkpoint,
the final model or adapter saved), and the same global batch gives the same losses whatever the
strategy and the split into ranks and accumulation: every pair of an update weighs the same
(train/loop.py).

Slow: each rehearsal starts 2 Python processes.
"""

from __future__ import annotations

import pytest
from helpers import rehearsal_runner

from finetune.launch import rehearsal_outcome

pytestmark = pytest.mark.slow

STEPS = 3
LORA, FULL_COPY = ["--method", "lora"], ["--method", "full", "--no-precompute-reference"]
# name → (accelerate config, training flags besides --model tiny --objective dpo)
REHEARSALS = {
    "single_lora": ("single_gpu.yaml", LORA),
    "ddp_lora": ("ddp.yaml", LORA),
    "fsdp_lora": ("fsdp.yaml", LORA),
    "fsdp_qlora": ("fsdp_qlora.yaml", ["--method", "qlora"]),
    "zero2_lora": ("deepspeed_zero2.yaml", LORA),
    "zero3_lora": ("deepspeed_zero3.yaml", LORA),  # the model's own logits: ZeRO-3 gathers the head in its forward
    "single_full_copy": ("single_gpu.yaml", FULL_COPY),
    "ddp_full_copy": ("ddp.yaml", FULL_COPY),
    "fsdp_full_copy": ("fsdp.yaml", FULL_COPY),  # the copy sharded over the policy's mesh
    "zero3_full_copy": ("deepspeed_zero3.yaml", FULL_COPY),  # the copy a stage-3 engine of its own
    "zero1_full_precomputed": ("deepspeed_zero1.yaml", ["--method", "full"]),
    "fsdp_full_precomputed": ("fsdp.yaml", ["--method", "full"]),
    "fsdp_kto_lora": ("fsdp.yaml", [*LORA, "--objective", "kto"]),
}


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    return rehearsal_runner(tmp_path_factory, REHEARSALS, "--objective", "dpo")


@pytest.mark.parametrize("name", list(REHEARSALS))
def test_preference_runs_rehearse_under_every_shipped_strategy(name, rehearsed):
    result = rehearsed(name)
    assert result.passed, rehearsal_outcome.format_report(result, STEPS) + "\n" + result.log[-4000:]
    assert len(result.losses) == STEPS and all(0 < loss < 2 for loss in result.losses)
    if "kto" not in name:  # the policy starts as its reference: every pair's loss is log 2
        assert abs(result.losses[0] - 0.693147) < 1e-4, result.losses


def test_every_strategy_and_split_gives_the_same_dpo_losses(rehearsed):
    """Global batch 8 pairs: micro 2 × accumulation 4 on one process, × 2 on two (DDP, FSDP2, ZeRO-2/3)."""
    for family in (("single_lora", "ddp_lora", "fsdp_lora", "zero2_lora"), ("single_full_copy", "ddp_full_copy",
                                                                            "fsdp_full_copy", "zero3_full_copy",
                                                                            "fsdp_full_precomputed")):
        expected = rehearsed(family[0]).losses
        for name in family[1:]:
            assert rehearsed(name).losses == pytest.approx(expected, rel=1e-5), name
