"""The planner's verdicts at the edges: the fit verdict on what cannot be given back (tight plans shown
as such, the slack fitted to finetune's own reserved/allocated rows), 2025-26 GPUs and any card by its
memory, a refused layout answered with the trainer's own sentence, and what a mixture of experts' LoRA
reaches."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
from helpers import REPO

from finetune.cli import main as cli_main
from finetune.cli.plan import page_answer
from finetune.config.options import TrainConfig
from finetune.config.parallelism import Parallelism, parallelism_problems
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.errors import ConfigError
from finetune.models import catalog
from finetune.plan import gpus, serve
from finetune.plan.choose import TIGHT_SHARE, Request, plan, refused, roomy
from finetune.plan.memory import ALLOCATOR_SLACK, GIB, VOCABULARY_CACHE, estimate
from finetune.plan.query import parse_gpus
from finetune.plan.report import table, to_json
from finetune.plan.workload import Workload
from finetune.train.fit_check import fit_problem

sys.path.insert(0, str(REPO / "bench"))
import planner_accuracy  # noqa: E402

GPU = Device(cuda=True, name="NVIDIA H100 80GB HBM3", bf16=True)


def mistral_lora(**fields) -> Workload:
    settings = dict(model=catalog.get("mistral-7b"), gpu=gpus.get("H200"), gpus_per_node=1, method="lora",
                    strategy="single", offload="none", precision="bf16-true", optimizer="adamw", micro_batch_size=2,
                    seq_len=4096, gradient_checkpointing=True, loss="finetune-chunked")
    return Workload(**settings | fields)


# ---------------------------------------------------------------- the allocator's slack and the fit verdict

def test_the_slack_constants_are_the_fit_of_the_committed_allocator_rows():
    assert planner_accuracy.slack_fit(planner_accuracy.allocator_rows()) == (ALLOCATOR_SLACK, VOCABULARY_CACHE)


def test_reserved_grows_with_the_logits_only_when_the_peak_is_at_the_loss():
    chunked, logits = estimate(mistral_lora()), estimate(mistral_lora(loss="transformers"))
    assert chunked.cached == 0 and chunked.reserved == pytest.approx(chunked.allocated * (1 + ALLOCATOR_SLACK))
    fp32_logits = 2 * 4096 * catalog.get("mistral-7b").vocab_size * 4
    assert logits.cached == pytest.approx(VOCABULARY_CACHE * fp32_logits)
    assert logits.reserved == pytest.approx(logits.allocated * (1 + ALLOCATOR_SLACK) + logits.cached)
    step = estimate(mistral_lora(method="full", precision="bf16-mixed", loss="transformers", seq_len=512, micro_batch_size=1))
    assert step.peak_phase == "optimizer step" and step.cached == 0  # the logits are long gone by the step
    for m in (chunked, logits):  # the verdict's bytes: what is allocated and the context, not the cache
        assert m.held(1) == pytest.approx(m.allocated + 0.5 * GIB) and m.held(1) < m.device(1)


def test_a_run_that_fits_only_once_the_cache_is_given_back_is_shown_tight_not_refused(capsys):
    # a notebook's gpt-oss-20b QLoRA on a 16 GB T4: ran; every byte × 1.16 said 17.0 GiB and "does not fit"
    request = Request(model=catalog.get("gpt-oss-20b"), gpu=gpus.get("T4"), gpus_per_node=1, method="qlora",
                      seq_len=1024, lora_r=8)
    plans, best = plan(request)
    chosen = plans[best]
    assert chosen.fits and chosen.tight and 0 < chosen.margin_gib < TIGHT_SHARE * chosen.memory.allocated / GIB
    assert chosen.device_gib > gpus.get("T4").memory_gib  # the allocator's cache is what does not fit
    assert chosen.reasons[0].startswith(f"fits, tight (margin {chosen.margin_gib:.1f} GiB): ")
    assert "gives back before it runs out" in chosen.reasons[0]
    data = to_json(request, plans, best, "plan")["plans"][best]
    assert data["tight"] and data["margin_gib"] == round(chosen.margin_gib, 3)
    assert data["memory_per_gpu_gib"]["held"] < gpus.get("T4").memory_gib < data["memory_per_gpu_gib"]["device"]
    assert f"tight ({chosen.margin_gib:.1f} GiB)" in table(request, plans, best, "plan")


def test_a_moe_full_fine_tuning_at_16k_tokens_on_8_h100_fits_as_it_ran():
    # prime-rl's Qwen3-30B-A3B full FSDP2 at 16,384 tokens reserved 74.6 GiB per H100
    request = Request(model=catalog.get("qwen3-30b-a3b"), gpu=gpus.get("H100"), gpus_per_node=8, method="full",
                      strategy="fsdp", precision="bf16-mixed", seq_len=16384, micro_batch_size=1,
                      gradient_checkpointing=True, liger=True)
    plans, best = plan(request)
    assert best is not None and plans[best].fits
    assert plans[best].memory.reserved / GIB == pytest.approx(74.6, rel=0.05)


def test_the_search_leaves_room_and_a_tight_plan_ranks_after_those_with_room():
    plans, best = plan(Request(model=catalog.get("llama-3.1-8b"), gpu=gpus.get("A100-40GB"), gpus_per_node=1))
    fitting = [p for p in plans if p.fits]
    assert not plans[best].tight and all(roomy(p.workload) for p in fitting if not p.tight)
    assert [p.tight for p in fitting] == sorted(p.tight for p in fitting)


def test_the_fit_check_stops_on_what_cannot_be_given_back():
    w = mistral_lora(loss="transformers")
    memory = estimate(w)
    between = int((memory.held(1) + memory.device(1)) / 2)  # the cache does not fit, what is held does
    assert fit_problem(w, memory, between, None) is None
    message = fit_problem(w, memory, int(memory.held(1)) - GIB, None)
    assert message.startswith(f"This run will not fit: it needs {memory.held(1) / GIB:.1f} GiB per GPU")


def test_fit_verdicts_agree_with_the_published_runs():
    """bench/planner_accuracy.py's fit/no-fit table: every posable published run (ran: fits; OOM: does not)."""
    posed = planner_accuracy.verdicts(planner_accuracy.cases(planner_accuracy.CALIBRATION_CSV, "calibration")
                                      + planner_accuracy.cases(planner_accuracy.HELD_OUT_CSV, "held-out"))
    from finetune.plan.choose import fits

    now = sum(fits(w) == ran for _, _, w, ran in posed) / len(posed)
    before = sum(planner_accuracy.old_fits(w) == ran for _, _, w, ran in posed) / len(posed)
    assert len(posed) > 80 and now >= 0.9 and now > before
    assert all(fits(w) for run_id, _, w, _ in posed if run_id in {"M15-RL", "T4-OSS", "PD01", "QW13"})


# ---------------------------------------------------------------- GPUs

NEW_CARDS = {  # name: (GiB as nvidia-smi / rocm-smi reports it, bf16 dense TFLOP/s, FP8 dense TFLOP/s)
    "B200": (179.1, 2250, 4500), "B300": (268.6, 2250, 4500), "GB200": (185.0, 2500, 5000), "H20": (95.6, 148, 296),
    "H100-NVL": (93.6, 835, 1670), "RTX5090": (31.8, 209.5, 419), "RTX-PRO-6000": (95.6, 500, 1000),
    "L40": (45.0, 181, 362), "A40": (45.0, 150, 0), "RTX-A6000": (48.0, 155, 0), "MI325X": (256.0, 1307, 2615),
    "MI355X": (288.0, 2500, 5000),
}


@pytest.mark.parametrize("name", list(NEW_CARDS))
def test_2026_cards_carry_memory_speed_bandwidth_link_price_and_host_ram(name):
    spec = gpus.get(name)
    assert (spec.memory_gib, spec.bf16_tflops, spec.fp8_tflops) == NEW_CARDS[name]
    assert spec.memory_tb_per_s > 0.5 and spec.link_gb_per_s > 0 and spec.usd_per_hour > 0 and spec.host_gib_per_gpu > 0
    assert spec.chip and spec.bf16


def test_fp8_peaks_of_the_cards_that_have_fp8():
    assert {name: gpus.get(name).fp8_tflops for name in ("H100", "H200", "L40S", "RTX4090", "RTX6000-Ada", "MI300X",
                                                         "A100-80GB", "T4")} == {
        "H100": 1979, "H200": 1979, "L40S": 733, "RTX4090": 330, "RTX6000-Ada": 728, "MI300X": 2615, "A100-80GB": 0, "T4": 0}


@pytest.mark.parametrize("text, name, count", [
    ("8xB200", "B200", 8), ("4x GB200", "GB200", 4), ("2x H100 NVL", "H100-NVL", 2), ("1xRTX PRO 6000", "RTX-PRO-6000", 1),
    ("2xRTX 5090", "RTX5090", 2), ("2x A6000", "RTX-A6000", 2), ("8xA40", "A40", 8), ("4xL40", "L40", 4),
    ("8xH20", "H20", 8), ("8xH200", "H200", 8), ("8x MI355X", "MI355X", 8), ("2x48GB", "48GB", 2), ("4 × 80 GB", "80GB", 4),
])
def test_gpu_spellings_of_the_new_cards_and_of_a_card_given_by_its_memory(text, name, count):
    assert parse_gpus(text) == (name, count)


@pytest.mark.parametrize("device, memory_gib, name", [
    ("NVIDIA B200", 179.1, "B200"), ("NVIDIA B300 SXM6 AC", 268.6, "B300"), ("NVIDIA GB200", 185.0, "GB200"),
    ("NVIDIA H100 NVL", 93.6, "H100-NVL"), ("NVIDIA H20", 95.6, "H20"), ("NVIDIA H200", 140.4, "H200"),
    ("NVIDIA GeForce RTX 5090", 31.8, "RTX5090"), ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 95.6, "RTX-PRO-6000"),
    ("NVIDIA RTX A6000", 48.0, "RTX-A6000"), ("NVIDIA RTX 6000 Ada Generation", 48.0, "RTX6000-Ada"),
    ("NVIDIA A40", 45.0, "A40"), ("NVIDIA L40", 45.0, "L40"), ("NVIDIA L40S", 45.0, "L40S"), ("AMD Instinct MI325X", 256.0, "MI325X"),
])
def test_cuda_device_names_find_their_catalog_entry(device, memory_gib, name):
    assert gpus.identify(device, memory_gib).name == name


def test_a_card_given_by_its_memory_borrows_the_nearest_cards_speed_and_says_so(capsys):
    card = gpus.get("48GB")
    assert (card.name, card.memory_gib, card.speed_of) == ("48GB", 48.0, "RTX-A6000")  # 48 GiB: the slower of two
    assert replace(card, name="RTX-A6000", memory_gib=48.0, aliases=gpus.get("RTX-A6000").aliases, speed_of="") == gpus.get("RTX-A6000")
    assert gpus.speed_class(23.0).name == "A10G" and gpus.speed_class(1000).name == "MI355X"
    assert cli_main(["plan", "--model", "llama-3.1-8b", "--gpus", "2x48GB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["hardware"]["memory_gib"], result["hardware"]["speed_of"], result["hardware"]["count"]) == (48.0, "RTX-A6000", 2)
    best = result["plans"][result["recommended"]]
    assert best["fits"] and best["speed_basis"].startswith("of a 48 GiB card given by its memory")
    assert "RTX-A6000 (48 GiB, 155 TFLOP/s bf16" in best["speed_basis"]
    assert cli_main(["plan", "--model", "llama-3.1-8b", "--gpus", "2x48GB"]) == 0
    assert "note: 48GB: a card given by its memory" in capsys.readouterr().out


def test_llama_8b_plans_on_8_b200(capsys):
    assert cli_main(["plan", "--model", "llama-3.1-8b", "--gpus", "8xB200", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["hardware"]["gpu"] == "B200" and result["hardware"]["fp8_tflops"] == 4500
    assert result["recommended"] is not None and "no runs on B200" in result["plans"][result["recommended"]]["speed_basis"]


def test_the_page_offers_the_new_cards_and_cards_by_memory():
    offered = serve.catalog()
    assert set(NEW_CARDS) <= {g["name"] for g in offered["gpus"]} and 48 in offered["memory_sizes"]
    status, body = page_answer({"model": "llama-3.1-8b", "gpu": "48GB", "count": "2"})
    assert status == 200 and body["result"]["hardware"]["speed_of"] == "RTX-A6000"
    assert body["command"] == "finetune plan --model llama-3.1-8b --gpus 2x48GB"


# ---------------------------------------------------------------- refusals in the trainer's words

def trainer_refusal(world: int, **flags) -> str | None:
    """What `finetune` stops with for these flags on `world` GPUs, or None when it runs them."""
    try:
        resolve_run(TrainConfig(**{"output_dir": "/tmp/finetune-test-edges"} | flags), Launch(world_size=world), GPU)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("model, gpus_per_node, fields, trainer_flags", [
    ("qwen3-30b-a3b", 8, dict(method="full", tp=2), dict(method="full", tp=2)),
    ("llama-3.1-8b", 4, dict(method="lora", tp=4), dict(method="lora", tp=4)),
    ("llama-3.1-8b", 8, dict(method="full", tp=2, cp=2, seq_len=8192), dict(method="full", tp=2, cp=2, max_seq_len=8192)),
])
def test_a_refused_layout_answers_with_the_trainers_own_sentence(model, gpus_per_node, fields, trainer_flags):
    request = Request(model=catalog.get(model), gpu=gpus.get("H100"), gpus_per_node=gpus_per_node, **fields)
    plans, best = plan(request)
    reasons = refused(request)
    trainer = trainer_refusal(gpus_per_node, model=model, **trainer_flags)
    if trainer is None:  # the trainer lays it out (a mixture of experts under TP may be): so does the planner
        assert plans and not reasons
        return
    assert plans == [] and best is None and reasons
    assert reasons[0] in trainer  # one source for the sentence: config/parallelism.py
    result = to_json(request, plans, best, "plan")
    assert result["plans"] == [] and result["refused"] == reasons
    text = table(request, plans, best, "plan")
    assert "the trainer refuses what was asked" in text and reasons[0] in text and "Try more hosts" not in text


def test_cp_with_zero_or_ddp_is_refused_with_what_to_use_instead():
    spec = catalog.get("llama-3.1-8b")
    zero = Request(model=spec, gpu=gpus.get("H100"), gpus_per_node=8, strategy="zero3", cp=2, seq_len=16384)
    assert plan(zero)[0] == []
    expected = parallelism_problems(Parallelism(dp_shard=4, cp=2), spec=spec, method="full", lora_targets="all-linear",
                                    deepspeed=True, offload="none", cuda=True, max_seq_len=16384, packing=False,
                                    attention="auto")
    assert refused(zero) == expected[:1] and "runs on FSDP2, not DeepSpeed ZeRO" in expected[0]
    ddp = replace(zero, strategy="ddp")
    assert plan(ddp)[0] == [] and refused(ddp) == [refused(ddp)[0]] and "use --strategy fsdp" in refused(ddp)[0]


def test_left_out_methods_are_listed_beside_the_plans_and_on_the_page():
    request = Request(model=catalog.get("llama-3.1-8b"), gpu=gpus.get("H100"), gpus_per_node=8, tp=2)
    plans, best = plan(request)
    assert best is not None and {p.workload.method for p in plans} == {"full"}
    assert any("--tp 2 with QLoRA" in reason for reason in refused(request))
    assert "Left out (the trainer refuses them):" in table(request, plans, best, "plan")
    status, body = page_answer({"model": "llama-3.1-8b", "gpu": "H100", "count": "8", "tp": "2"})
    assert status == 200 and body["result"]["refused"] == refused(request)


def test_the_json_and_the_page_carry_an_empty_answers_refusal(capsys):
    assert cli_main(["plan", "--model", "llama-3.1-8b", "--gpus", "8xH100", "--method", "qlora", "--tp", "2", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert cli["plans"] == [] and cli["recommended"] is None
    assert cli["refused"] == ["--tp 2 with QLoRA: bitsandbytes' 4-bit weights cannot be split into tensor-parallel slices; "
                              "use --method lora (or QLoRA under FSDP2 without --tp)"]
    status, body = page_answer({"model": "llama-3.1-8b", "gpu": "H100", "count": "8", "method": "qlora", "tp": "2"})
    assert status == 200 and body["result"] == cli and body["files"] == []


def test_a_switch_the_layout_turns_on_or_off_is_among_the_plans_reasons():
    request = Request(model=catalog.get("llama-3.1-8b"), gpu=gpus.get("H100"), gpus_per_node=4, method="full", tp=4,
                      strategy="fsdp", seq_len=8192)
    plans, best = plan(request)
    chosen = plans[best]
    assert chosen.workload.loss == "finetune-chunked"  # full fine-tuning's own loss elsewhere; per vocabulary shard under TP
    assert any(reason.startswith("--tp 4 runs the chunked loss on each GPU's vocabulary shard instead of the model's own loss")
               for reason in chosen.reasons)
    plain, _ = plan(replace(request, tp=1))
    assert not any("chunked loss on each GPU's vocabulary shard" in reason for p in plain for reason in p.reasons)
    lora, best = plan(replace(request, method="lora", lora_targets="q_proj,k_proj,v_proj,gate_proj,up_proj"))
    assert lora[best].workload.loss == "finetune-chunked"  # on by default for LoRA, with or without TP: nothing said
    assert not any("vocabulary shard instead" in reason for reason in lora[best].reasons)


# ---------------------------------------------------------------- what a mixture of experts' LoRA reaches

def test_a_moe_lora_plan_says_it_adapts_no_expert_and_what_adapting_them_costs(capsys):
    request = Request(model=catalog.get("qwen3-30b-a3b"), gpu=gpus.get("H100"), gpus_per_node=1, method="lora")
    plans, best = plan(request)
    chosen = plans[best]
    variant = chosen.experts_variant
    assert variant is not None and variant.workload.lora_targets == "all-linear+experts"
    assert variant.workload.micro_batch_size == chosen.workload.micro_batch_size
    assert variant.memory.allocated > chosen.memory.allocated
    reach = next(reason for reason in chosen.reasons if reason.startswith("LoRA adapts attention"))
    assert "no expert of this mixture-of-experts model trains" in reach and "With --lora-targets all-linear+experts" in reach
    data = to_json(request, plans, best, "plan")["plans"][best]["with_experts"]
    assert data["lora_targets"] == "all-linear+experts" and data["device_gib"] == round(variant.device_gib, 3)
    assert data["trainable_params"] > 10 * to_json(request, plans, best, "plan")["plans"][best]["trainable_params"]
    with_experts, best_with = plan(replace(request, lora_targets="all-linear+experts"))
    assert with_experts[best_with].experts_variant is None
    dense, best_dense = plan(replace(request, model=catalog.get("llama-3.1-8b")))
    assert dense[best_dense].experts_variant is None
    assert to_json(request, dense, best_dense, "plan")["plans"][best_dense]["with_experts"] is None


def test_what_fits_names_the_refusal_of_a_model_it_cannot_plan(capsys):
    assert cli_main(["plan", "what fits on 8xH100", "--method", "qlora", "--tp", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  llama-3.1-8b ")]
    assert lines and "nothing planned: --tp 2 with QLoRA: bitsandbytes' 4-bit weights cannot be split" in lines[0]
