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
