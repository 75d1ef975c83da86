"""The planner counts a preference objective as the trainer runs it (config/objectives.py): the doubled
rows of a pair, the reference's forward (none when precomputed) and its frozen copy of the weights,
the log-probabilities' logits; the plan's launch command trains that objective; `--dry-run` builds what
the plan counts and two fake-tensor micro-steps of each objective stay within 10 % of it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import shrunk_config_dir
from test_planner_simulate import H100

from finetune.config.flags import parse_command
from finetune.config.options import TrainConfig
from finetune.config.resolve import Launch, resolve_run
from finetune.errors import FinetuneError
from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.choose import Request, plan
from finetune.plan.files import train_flags
from finetune.plan.memory import GIB, estimate
from finetune.plan.speed import estimate_speed
from finetune.plan.workload import from_run
from finetune.train.dry_run import built_states, plan_run
from finetune.train.simulate import simulate


def planned(objective: str = "sft", **fields):
    request = Request(**{"model": catalog.get("llama-3.1-8b"), "gpu": gpus.get("H100-80GB"), "gpus_per_node": 1,
                         "method": "lora", "seq_len": 2048, "micro_batch_size": 2, "gradient_checkpointing": True,
                         "objective": objective} | fields)
    plans, recommended = plan(request)
    return plans[recommended]


def test_a_dpo_plan_holds_the_activations_of_both_sequences_of_its_pairs():
    """The issue's plan: micro batch 2 pairs = 4 sequences of 2048; at the same checkpointing twice the
    activations. With the checkpointed layers left to the planner, DPO recomputes more of them to fit."""
    sft, dpo = planned(gradient_checkpointing_layers=32), planned("dpo", gradient_checkpointing_layers=32)
    assert (sft.workload.tokens_per_micro_batch, dpo.workload.tokens_per_micro_batch) == (4096, 8192)
    assert dpo.memory.activations >= 1.9 * sft.memory.activations
    assert dpo.speed.tokens_per_second < sft.speed.tokens_per_second  # the reference's forward, every micro-batch
    free_sft, free_dpo = planned(), planned("dpo")
    assert free_dpo.workload.recomputed_layers > free_sft.workload.recomputed_layers
    assert free_dpo.memory.activations >= 1.5 * free_sft.memory.activations  # the check
    assert "--objective dpo" in " ".join(train_flags(free_dpo.workload))


def test_a_frozen_copy_adds_the_weights_in_the_compute_dtype_sharded_as_the_policys():
    full = dict(method="full", gradient_checkpointing_layers=32, model=catalog.get("llama-3.2-1b"))
    precomputed, copy = planned("dpo", **full), planned("dpo", precompute_reference=False, **full)
    params = 1_235_814_400  # llama-3.2-1b
    assert copy.memory.weights - precomputed.memory.weights == pytest.approx(2 * params, rel=1e-6)  # bf16 copy
    assert copy.speed.tokens_per_second < precomputed.speed.tokens_per_second
    assert "--no-precompute-reference" in train_flags(copy.workload) and "--precompute-reference" not in train_flags(precomputed.workload)
    sharded = planned("dpo", precompute_reference=False, strategy="fsdp", gpus_per_node=4, **full)
    assert sharded.memory.weights == pytest.approx(copy.memory.weights / 4, rel=0.01)


def test_forwards_without_gradients_per_objective():
    w = planned("dpo").workload
    counts = {name: replace(w, objective=name).forward_only_passes for name in ("sft", "dpo", "simpo", "orpo", "kto")}
    assert counts == {"sft": 0, "dpo": 1, "simpo": 0, "orpo": 0, "kto": 3}
    assert replace(w, objective="kto", precompute_reference=True).forward_only_passes == 1  # its mismatched rows
    assert estimate_speed(replace(w, precompute_reference=True)).tokens_per_second > estimate_speed(w).tokens_per_second


def test_preference_plans_have_no_tensor_or_context_parallel_layout_and_unknown_objectives_are_refused():
    plans, _ = plan(Request(model=catalog.get("llama-3.1-70b"), gpu=gpus.get("H100-80GB"), gpus_per_node=8, method="lora",
                            objective="dpo"))
    assert all(p.workload.model_parallel == 1 for p in plans)
    with pytest.raises(FinetuneError, match="--objective 'ppo' is not one of sft, dpo"):
        planned("ppo")


def test_a_dry_run_builds_the_frozen_copy_the_plan_counts(tmp_path):
    command = parse_command(["--model", "llama-3.2-1b", "--objective", "dpo", "--no-precompute-reference",
                             "--gpu", "H100-80GB", "--output-dir", str(tmp_path)])
    run = resolve_run(command.config, Launch(), H100)
    _, p = plan_run(run, gpus.get("H100-80GB"))
    built = built_states(run)
    assert built.reference == pytest.approx(p.memory.weights - built.frozen - built.trainable, rel=1e-6)
    assert built.reference / GIB == pytest.approx(2.30, abs=0.01)


CASES = {  # name → (catalog shape, layers, training flags, processes under FSDP or 1)
    "dpo lora, adapters off": ("llama-7b", 2, dict(method="lora", max_seq_len=1024)),
    "dpo lora, the model's own logits": ("llama-7b", 2, dict(method="lora", max_seq_len=1024, chunked_loss=False)),
    "dpo full, frozen copy": ("llama-3.2-1b", 4, dict(max_seq_len=512, precompute_reference=False)),
    "dpo full, precomputed": ("llama-3.2-1b", 4, dict(max_seq_len=512)),
    "simpo lora checkpointing": ("llama-7b", 2, dict(method="lora", max_seq_len=1024, gradient_checkpointing=True,
                                                     objective="simpo")),
    "kto lora": ("llama-7b", 2, dict(method="lora", max_seq_len=1024, objective="kto")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_analytic_peak_within_10_percent_of_simulated_preference_steps(name, tmp_path):
    shape, layers, flags = CASES[name]
    config = TrainConfig(model=shrunk_config_dir(tmp_path / "model", shape, layers), **{"objective": "dpo"} | flags)
    run = resolve_run(config, Launch(), H100)
    simulated = simulate(run).peak_bytes
    assert estimate(from_run(run, gpus.get("H100"))).allocated == pytest.approx(simulated, rel=0.10)


def test_the_planner_page_takes_the_objective_as_the_flag_does():
    from finetune.cli.plan import page_answer
    from finetune.plan import serve

    assert serve.catalog()["choices"]["objective"] == ["sft", "dpo", "simpo", "orpo", "kto"]
    status, body = page_answer({"model": "llama-3.1-8b", "gpu": "H100-80GB", "count": "1", "method": "lora",
                                "objective": "dpo"})
    assert status == 200 and "--objective dpo" in body["command"]
    assert {p["objective"] for p in body["result"]["plans"]} == {"dpo"}
    status, body = page_answer({"q": "what fits on 2×A100 40GB", "objective": "dpo"})
    assert status == 200 and all(p["objective"] == "dpo" for r in body["result"] for p in r["plans"])
