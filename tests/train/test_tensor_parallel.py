"""Tensor parallelism with sequence parallelism (train/parallel.py): which module of a model gets
which style, and, on 2 CPU processes (slow), that two TP ranks compute what one process computes:
the loss, every gradient and a greedy generation, through the model's own loss and the chunked
loss per vocabulary shard, for full fine-tuning and LoRA. The runs through the trainer (a rehearsal
equal to one process, FSDP2 × TP on 4 processes, resume and export) are in
test_strategies_distributed.py and tests/checkpoint/test_resume_strategies.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO

from finetune.errors import FinetuneError


def meta_model(name: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.models.catalog import get
    from finetune.models.families import shrink

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**shrink(get(name).to_hf_config_dict(), 2, 64)))


LLAMA_RULES = {
    "model.embed_tokens": "lookup_onto_shards",  # vocabulary-parallel lookups, reduce-scattered onto sequence shards
    "model.layers.*.input_layernorm": "sequence_norm",
    "model.layers.*.self_attn": "whole_rows_in",  # all-gather whole rows for q/k/v
    "model.layers.*.self_attn.o_proj": "rowwise_onto_shards",  # reduce-scatter back
    "model.layers.*.post_attention_layernorm": "sequence_norm",
    "model.layers.*.mlp": "whole_rows_in",
    "model.layers.*.mlp.down_proj": "rowwise_onto_shards",
    "model.norm": "sequence_norm",
    "lm_head": "head_on_whole_rows",  # the model's own forward: whole rows in, whole vocabulary out
}


@pytest.mark.parametrize("name", ["tiny", "qwen2.5-7b", "qwen3-8b"])
def test_the_sequence_parallel_plan_gives_the_residual_stream_its_styles(name):
    """The rules override transformers' plan where the residual stream passes; its column-parallel
    linears (q/k/v, gate/up) and Qwen3's per-head norms keep their own styles."""
    from finetune.train.parallel import sequence_parallel_plan

    model = meta_model(name)
    rules = sequence_parallel_plan(model)
    assert rules == LLAMA_RULES
    assert model.tp_plan["model.layers.*.self_attn.q_proj"] == "colwise" and "model.layers.*.self_attn.q_proj" not in rules


def test_gemma_3s_four_norms_a_layer_and_its_nested_language_model_are_placed():
    from finetune.train.parallel import sequence_parallel_plan

    rules = sequence_parallel_plan(meta_model("gemma-3-12b"))
    layers = "model.language_model.layers.*"
    assert {name for name, style in rules.items() if style == "sequence_norm"} == {
        f"{layers}.input_layernorm", f"{layers}.post_attention_layernorm", f"{layers}.pre_feedforward_layernorm",
        f"{layers}.post_feedforward_layernorm", "model.language_model.norm"}
    assert rules["model.language_model.embed_tokens"] == "lookup_onto_shards" and rules["lm_head"] == "head_on_whole_rows"
    assert not any("vision" in name or "projector" in name for name in rules)  # the tower is not tensor-parallel


def test_a_plan_with_styles_the_layout_does_not_place_is_refused():
    """transformers' plan for experts (moe_tp_experts, packed expert weights) all-reduces whole rows
    the sequence-parallel stream does not take: config/parallelism.py refuses it first, this is the
    backstop for a model finetune's catalog does not know."""
    from finetune.train.parallel import sequence_parallel_plan

    with pytest.raises(FinetuneError, match="uses moe_tp_experts, which finetune's sequence-parallel layout does not place"):
        sequence_parallel_plan(meta_model("tiny-moe"))


SAME_AS_ONE_PROCESS = """
import json, os, sys, zlib
import torch, torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.distributed import DistributedConfig
from finetune.train import chunked_loss, parallel

folder, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
ids = torch.randint(0, 64, (2, 13))  # 13 tokens: the sequence splits unevenly, 7 and 6
labels = ids.clone()
labels[0, :3] = -100
kwargs = {}
if "RANK" in os.environ:
    dist.init_process_group("gloo")
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    kwargs["distributed_config"] = DistributedConfig(tp_size=2, tp_plan=parallel.sequence_parallel_plan(skeleton))


def same_adapters(model):
    # the same adapters in both runs (PEFT draws them differently per layout)
    for name, param in model.named_parameters():
        if "lora_" in name:
            whole = torch.randn(param.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) / 10
            with torch.no_grad():
                param.copy_(distribute_tensor(whole, param.device_mesh, param.placements) if isinstance(param, DTensor) else whole)


def step(case):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    if case == "lora":
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        if kwargs:
            parallel.adapters_read_local_rows(model)
        same_adapters(model)
    base = model.get_base_model() if case == "lora" else model
    if case != "own":
        chunked_loss.install(base)
    between = []
    base.model.layers[1].register_forward_pre_hook(lambda module, args: between.append(args[0]))
    model.train()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    with torch.no_grad():
        generated = model.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)[0].tolist()
    local = between[0].to_local() if isinstance(between[0], DTensor) else between[0]
    kept = {"loss": loss.item(), "generated": generated, "between": [type(between[0]).__name__,
            str(getattr(between[0], "placements", "")), list(local.shape)]}
    return kept, grads


results = {case: step(case) for case in ("own", "chunked", "lora")}
if not kwargs or dist.get_rank() == 0:
    torch.save({case: grads for case, (_, grads) in results.items()}, out + ".pt")
    json.dump({case: kept for case, (kept, _) in results.items()}, open(out, "w"))
"""


@pytest.fixture(scope="module")
def one_and_two_processes(tmp_path_factory):
    """What one process and two TP ranks compute (loss, generation, what layer 1 receives; gradients),
    for the model's own loss, the chunked loss and LoRA."""
    import torch
    from helpers import tiny_model_dir

    from finetune.launch.rehearse import rehearsal_env
    from finetune.train.accelerator import free_port

    tmp_path = tmp_path_factory.mktemp("tp")
    folder = tiny_model_dir(tmp_path / "model")  # 2 layers of width 32, 4 heads, 2 KV heads, vocabulary 64
    (tmp_path / "check.py").write_text(SAME_AS_ONE_PROCESS)
    env = rehearsal_env() | {"PYTHONPATH": str(REPO)}
    alone = [sys.executable, str(tmp_path / "check.py"), str(folder), str(tmp_path / "one")]
    pair = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            str(tmp_path / "check.py"), str(folder), str(tmp_path / "two")]
    for command in (alone, pair):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    return [(json.loads((tmp_path / name).read_text()), torch.load(tmp_path / f"{name}.pt")) for name in ("one", "two")]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["own", "chunked", "lora"])
def test_two_tp_ranks_compute_one_processes_loss_gradients_and_generation(case, one_and_two_processes):
    """Loss equal to 1e-6 relative (float32: summation order), every gradient within 1e-6, the same
    greedy tokens; between the layers each rank holds its shard of the sequence."""
    import torch

    (one, grads_one), (two, grads_two) = ((kept[case], grads[case]) for kept, grads in one_and_two_processes)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6) and one["loss"] > 0
    assert two["generated"] == one["generated"]
    assert one["between"] == ["Tensor", "", [2, 13, 32]]
    assert two["between"] == ["DTensor", "(Shard(dim=1),)", [2, 7, 32]]
    assert grads_one.keys() == grads_two.keys() and len(grads_one) > 0
    for name, grad in grads_one.items():
        torch.testing.assert_close(grads_two[name], grad, rtol=0, atol=1e-6, msg=name)
