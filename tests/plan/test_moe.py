"""Mixture-of-experts models and Gemma 3 through the planner and the trainer's construction: total vs
active parameters of the published configs, plans for every method and strategy, what the output
says (no expert parallelism, MXFP4 loaded dequantized), QLoRA of Qwen3-30B-A3B on one 24 GB card,
and the trainable parameters by kind that a run prints, planned as built."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from finetune.cli import main as cli_main
from finetune.config.names import METHODS, STRATEGIES
from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.choose import Request, plan
from finetune.plan.params import count_params
from finetune.plan.speed import training_flops
from finetune.plan.workload import Workload


@pytest.mark.parametrize(("name", "total", "active"), [
    ("qwen3-30b-a3b", 30.53, 3.35),  # Qwen's model card: 30.5B total, 3.3B activated
    ("qwen3-235b-a22b", 235.09, 22.19),
    ("mixtral-8x7b", 46.70, 12.88),  # Mistral: 46.7B total, 12.9B per token
    ("gpt-oss-20b", 20.91, 4.19),  # OpenAI: 21B total, 3.6B active without the 0.58B embedding table
    ("olmoe-1b-7b", 6.92, 1.28),
    ("gemma-3-12b", 12.19, 11.77),  # the language model is active, the 0.42B vision tower is not
])
def test_published_configs_count_total_and_active_parameters(name, total, active):
    counts = count_params(catalog.get(name))
    assert (round(counts.total / 1e9, 2), round(counts.active / 1e9, 2)) == (total, active)


def test_speed_counts_the_active_experts_only():
    spec = catalog.get("qwen3-30b-a3b")
    w = Workload(model=spec, gpu=gpus.get("H100"), gpus_per_node=1, method="full", strategy="single", offload="none",
                 precision="bf16-mixed", optimizer="adamw", micro_batch_size=1, seq_len=1024, gradient_checkpointing=False)
    counts = count_params(spec)
    forward, _ = training_flops(w)
    attention = 2 * 1024 * spec.num_heads * spec.resolved_head_dim * spec.num_layers
    assert forward == 2 * counts.matmul + attention
    assert counts.matmul < 0.12 * counts.total  # 8 of 128 experts, not all of them


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "gemma-3-12b"])
def test_every_method_and_strategy_is_planned(name):
    spec = catalog.get(name)
    planned = {(p.workload.method, p.workload.strategy.name) for p in plan(Request(spec, gpus.get("H100"), 8))[0]}
    assert planned >= {(method, strategy) for method in METHODS for strategy in STRATEGIES if strategy != "single"}
    single = {p.workload.method for p in plan(Request(spec, gpus.get("H200"), 1))[0]}
    assert single == set(METHODS)


def test_qlora_of_qwen3_30b_a3b_fits_one_24gb_card_and_mixtral_one_40gb_card():
    qwen, best = plan(Request(catalog.get("qwen3-30b-a3b"), gpus.get("RTX4090"), 1, method="qlora"))
    assert best is not None and qwen[best].fits
    mixtral = catalog.get("mixtral-8x7b")
    assert plan(Request(mixtral, gpus.get("RTX4090"), 1, method="qlora"))[1] is None
    plans, best = plan(Request(mixtral, gpus.get("A100-40GB"), 1, method="qlora"))
    assert best is not None and plans[best].memory.weights > 20 * 2**30  # every expert resident, in 4 bits


def test_plan_output_says_what_it_assumes_about_experts(capsys):
    assert cli_main(["plan", "--model", "gpt-oss-20b", "--gpus", "2xH100", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert (model["experts"], model["experts_per_token"]) == (32, 4) and model["active_params"] < model["params"]
    assert any("expert parallelism is not in Accelerate" in note for note in model["notes"])
    assert any("MXFP4" in note and "Mxfp4Config(dequantize=True)" in note for note in model["notes"])
    assert cli_main(["plan", "--model", "qwen3-30b-a3b", "--gpus", "1xRTX4090", "--method", "qlora"]) == 0
    table = capsys.readouterr().out
    assert "30.53B params (3.35B active: 8 of 128 experts per token)" in table
    assert "note: mixture of experts: every expert is resident" in table


def shrunk_catalog_model(directory, name: str, layers: int) -> str:
    """A local config.json of the catalog entry `name` with `layers` decoder layers: full-width layers, quick to build."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(replace(catalog.get(name), num_layers=layers).to_hf_config_dict()))
    return str(directory)


@pytest.mark.parametrize(("name", "method", "targets"), [
    ("qwen3-30b-a3b", "lora", "all-linear+experts"),
    ("qwen3-30b-a3b", "full", "all-linear"),
    ("mixtral-8x7b", "lora", "q_proj,experts.down_proj,router"),
    ("gemma-3-12b", "lora", "all-linear"),
])
def test_moe_and_gemma_3_model_states_and_kinds_are_planned_as_built(name, method, targets, tmp_path):
    from test_plan_run import A100, assert_built_equals_planned

    from finetune.config.options import TrainConfig
    from finetune.config.resolve import Launch, resolve_run
    from finetune.plan.workload import from_run
    from finetune.train.dry_run import build, planned_by_kind

    config = TrainConfig(model=shrunk_catalog_model(tmp_path / "m", name, 3), method=method, lora_targets=targets)
    assert_built_equals_planned(config, A100, tmp_path)
    run = resolve_run(config, Launch(), A100)
    built = build(run)
    assert built.kinds == planned_by_kind(from_run(run, gpus.get("A100-80GB")))
    if method == "lora" and name != "gemma-3-12b":
        assert built.kinds["experts"][0] > 0  # the experts train, through PEFT's target_parameters
    if "router" in targets:
        assert built.kinds["router"][0] > 0


def test_dry_run_prints_what_trains_by_kind_and_warns_when_no_expert_does(tmp_path, capsys):
    model = shrunk_catalog_model(tmp_path / "m", "mixtral-8x7b", 2)
    assert cli_main(["--model", model, "--method", "lora", "--dry-run", "--gpu", "H100"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ") and line.split()}
    assert lines["experts"][0] == "0" and lines["attention"][0] != "0"  # trainable of the attention, none of the experts
    assert "--lora-targets all-linear: no expert of this mixture-of-experts model trains" in out
    assert "--lora-targets all-linear+experts adapts them too" in out
    assert cli_main(["--model", model, "--method", "lora", "--lora-targets", "all-linear+experts", "--dry-run",
                     "--gpu", "H100"]) == 0
    out = capsys.readouterr().out
    assert "no expert" not in out and "(differs)" not in out


# config.json as the Hub publishes each model (the fields the planner reads, with their published names):
# Qwen3-MoE says num_experts, gpt-oss experts_per_token and MXFP4, Gemma 3 nests its language model
PUBLISHED = {
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960,
                      "output_router_logits": False, "router_aux_loss_coef": 0.001},
    "mixtral-8x7b": {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "vocab_size": 32000, "tie_word_embeddings": False, "max_position_embeddings": 32768},
    "gpt-oss-20b": {"model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880, "num_local_experts": 32,
                    "experts_per_token": 4, "vocab_size": 201088, "tie_word_embeddings": False, "attention_bias": True,
                    "max_position_embeddings": 131072, "quantization_config": {"quant_method": "mxfp4"}},
    "gemma-3-12b": {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "num_hidden_layers": 48, "hidden_size": 3840, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 15360, "vocab_size": 262208},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                          "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 896, "patch_size": 14,
                          "vision_use_head": False}},
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_json_plans_as_its_catalog_entry(name, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(PUBLISHED[name]))
    from finetune.models.source import resolve_model

    spec, entry = resolve_model(str(path)), catalog.get(name)
    assert count_params(spec) == count_params(entry) and spec.quantized == entry.quantized
    assert cli_main(["plan", "--model", str(path), "--gpus", "8xH100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["params"] == count_params(entry).total


def test_mxfp4_weights_load_dequantized_and_refuse_qlora(tmp_path):
    from finetune.config.options import TrainConfig
    from finetune.config.resolve import Device, Launch, resolve_run
    from finetune.errors import FinetuneError
    from finetune.train.skeleton import model_kwargs

    lora = resolve_run(TrainConfig(model="gpt-oss-20b", method="lora"), Launch(), Device())
    quantization = model_kwargs(lora)["quantization_config"]
    assert (quantization.quant_method, quantization.dequantize) == ("mxfp4", True)
    qlora = resolve_run(TrainConfig(model="gpt-oss-20b", method="qlora"), Launch(), Device())
    with pytest.raises(FinetuneError, match="MXFP4.*--method lora"):
        model_kwargs(qlora)


def test_zero3_treats_each_sparse_block_as_a_leaf():
    from helpers import tiny_model

    from finetune.train.skeleton import mark_zero3_leaves

    model = tiny_model("qwen3-30b-a3b")
    mark_zero3_leaves(model)
    blocks = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]
    assert blocks and all(getattr(block, "_z3_leaf", False) for block in blocks)
    assert not any(getattr(m, "_z3_leaf", False) for m in model.modules() if m not in blocks)


def test_simulation_refuses_fp32_experts_it_cannot_run():
    from finetune.train.simulate import cannot_simulate

    w = Workload(model=catalog.get("mixtral-8x7b"), gpu=gpus.get("H100"), gpus_per_node=1, method="lora",
                 strategy="single", offload="none", precision="bf16-mixed", optimizer="adamw", micro_batch_size=1,
                 seq_len=512, gradient_checkpointing=False)
    assert "fp32" in cannot_simulate(w)
    assert cannot_simulate(replace(w, precision="bf16-true")) is None
