"""QLoRA and fp16-true activation terms against PyTorch's MemTracker on fake tensors.

bitsandbytes' kernels cannot run on fake tensors, so QLoRA runs with a stand-in for its Linear4bit:
a frozen 16-bit linear that, like Linear4bit, casts its input to the compute dtype and its output
back to the input's dtype, and saves nothing for backward but its weight (bitsandbytes ≥ 0.43.2).
Every other parameter is fp32 when the run loads fp32 weights (-mixed) or when PEFT's
prepare_model_for_kbit_training would upcast it (`kbit_upcast`, as other trainers run QLoRA). The planner
is compared with its 4-bit storage swapped for the stand-in's 16-bit weights and without the
dequantization scratch the stand-in does not need.
"""

from dataclasses import replace

import pytest
import torch
import transformers

from finetune.config.options import TrainConfig
from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.memory import dequant_scratch_bytes, estimate
from finetune.plan.params import NF4_DOUBLE_QUANT_BYTES, count_params
from finetune.plan.workload import Workload
from finetune.train import skeleton

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shrunk(name: str, method: str, precision: str, checkpointing: bool, kbit_upcast: bool = False) -> Workload:
    return Workload(model=replace(catalog.get(name), num_layers=2), gpu=gpus.get("T4"), gpus_per_node=1, method=method,
                    strategy="single", offload="none", precision=precision, optimizer="adamw", micro_batch_size=1,
                    seq_len=512, gradient_checkpointing=checkpointing, lora_targets="q_proj,k_proj,v_proj,o_proj",
                    kbit_upcast=kbit_upcast)


CASES = {
    "qlora bf16-true (finetune: 16-bit everywhere but the 4-bit matmuls)": shrunk("llama-7b", "qlora", "bf16-true", False),
    "qlora bf16-true after PEFT's k-bit upcast (fp32 everywhere else)": shrunk("llama-7b", "qlora", "bf16-true", False, True),
    "qlora fp16-true checkpointing, k-bit upcast (autocast over an fp32 head)": shrunk("llama-7b", "qlora", "fp16-true", True, True),
    "qlora bf16-mixed on qwen2.5 (large vocabulary)": shrunk("qwen2.5-7b", "qlora", "bf16-mixed", False),
    "lora fp16-true (fp16 base, fp32 adapters, autocast)": shrunk("llama-7b", "lora", "fp16-true", False),
}


class Linear4bitStandIn(torch.nn.Linear):
    def forward(self, x):
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)


def build(w: Workload, compute_dtype):
    """The plan's model on the meta device (QLoRA: stand-in linears, fp32 everything else), prepared as
    training prepares it (skeleton.prepare_for_training: LoRA adapters, checkpointing, train mode), then
    given fake CPU storage as --dry-run's skeleton is (skeleton.give_fake_storage)."""
    config = transformers.AutoConfig.for_model(**w.model.to_hf_config_dict())
    config._attn_implementation = "sdpa"
    run = TrainConfig(method=w.method, lora_r=w.lora_r, lora_alpha=2 * w.lora_r, lora_targets=w.lora_targets,
                      gradient_checkpointing=w.gradient_checkpointing)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=compute_dtype)
        if w.method == "qlora":
            for layer in model.model.layers:
                for block in (layer.self_attn, layer.mlp):
                    for name, child in list(block.named_children()):
                        if name in LINEARS:
                            setattr(block, name, Linear4bitStandIn(child.in_features, child.out_features, bias=False, dtype=compute_dtype))
            if w.kbit_upcast or w.precision.mixed:
                for name, param in model.named_parameters():
                    if not any(linear in name for linear in LINEARS):
                        param.data = param.data.float()
        model = skeleton.prepare_for_training(model, run)
    skeleton.give_fake_storage(model)
    return model


def simulated_peak(w: Workload) -> int:
    """MemTracker's peak over two micro-steps with an AdamW step after each."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    compute_dtype = torch.float16 if w.precision.compute == "float16" else torch.bfloat16
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build(w, compute_dtype)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=True)
        tracker = MemTracker()
        for param in model.parameters():  # MemTracker cannot hook frozen parameters
            if not param.requires_grad:
                tracker._param_to_grad_hook_handles.setdefault(param, (_NoHook(), _NoHook()))
        tracker.track_external(model, optimizer)
        batch = torch.randint(0, w.model.vocab_size, (w.micro_batch_size, w.seq_len))
        with tracker:
            for _ in range(2):
                tracker.reset_mod_stats()
                with torch.autocast("cpu", dtype=compute_dtype, enabled=w.precision.autocast):
                    loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                optimizer.step()
        snapshot = tracker.get_tracker_snapshot("peak")
        return max(stats.get("Total", 0) for stats in snapshot.values())


class _NoHook:
    def remove(self) -> None:
        pass


def planner_with_stand_in(w: Workload) -> float:
    planned = estimate(w).allocated
    if w.method != "qlora":
        return planned
    quantizable = count_params(w.model).quantizable
    return planned - quantizable * NF4_DOUBLE_QUANT_BYTES + quantizable * 2 - dequant_scratch_bytes(w)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_activation_terms_within_5_percent_of_memtracker(name):
    w = CASES[name]
    assert planner_with_stand_in(w) == pytest.approx(simulated_peak(w), rel=0.05)
