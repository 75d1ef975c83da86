"""The analytic per-GPU peak stays within 10 % of one simulated training step on fake tensors
(MemTracker on one device, FSDPMemTracker on a fake process group for FSDP2).

Real catalog shapes cut to 2–4 layers keep each simulation to seconds. FSDP cases use SGD:
FSDPMemTracker counts AdamW states of DTensor shards several times over under fake tensors.
"""

from dataclasses import replace

import pytest

from finetune.catalog import gpus, models
from finetune.planner.memory import estimate
from finetune.planner.workload import Workload

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")


def shrunk(name: str, layers: int, **overrides) -> Workload:
    fields = dict(model=replace(models.get(name), num_layers=layers), gpu=gpus.get("H100"), gpus_per_node=1,
                  method="full", strategy="single", offload="none", precision="bf16-true", optimizer="adamw",
                  micro_batch_size=1, seq_len=1024, gradient_checkpointing=False)
    fields.update(overrides)
    return Workload(**fields)


CASES = {
    "full 7B-shape": shrunk("llama-7b", 2),
    "full bf16-mixed 1B-shape": shrunk("llama-3.2-1b", 4, seq_len=512, micro_batch_size=2, precision="bf16-mixed"),
    "lora all-linear": shrunk("llama-7b", 2, method="lora", seq_len=2048),
    "lora checkpointing": shrunk("llama-7b", 2, method="lora", seq_len=2048, gradient_checkpointing=True),
    "lora q,v on qwen2.5": shrunk("qwen2.5-7b", 2, method="lora", lora_targets="q_proj,v_proj"),
    "fsdp2 2 ranks": shrunk("llama-7b", 4, strategy="fsdp", gpus_per_node=2, optimizer="sgd"),
    "fsdp2 8 ranks seq 2048": shrunk("llama-7b", 4, strategy="fsdp", gpus_per_node=8, optimizer="sgd", seq_len=2048),
    "fsdp2 lora 4 ranks": shrunk("llama-7b", 4, strategy="fsdp", gpus_per_node=4, optimizer="sgd", method="lora", seq_len=2048),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_analytic_peak_within_10_percent_of_simulation(name):
    from finetune.planner.simulate import simulate

    w = CASES[name]
    simulated = simulate(w).peak_bytes
    assert estimate(w).allocated == pytest.approx(simulated, rel=0.10)


def test_simulate_refuses_qlora_clearly():
    from finetune.errors import FinetuneError
    from finetune.planner.simulate import simulate

    with pytest.raises(FinetuneError, match="4-bit"):
        simulate(shrunk("llama-7b", 2, method="qlora"))
