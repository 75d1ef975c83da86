"""The planner: query parsing, memory arithmetic, known cases, ranking, JSON contract, launch files."""

import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import yaml

from finetune.cli import main as cli_main
from finetune.errors import FinetuneError
from finetune.models import catalog
from finetune.models.source import resolve_model
from finetune.plan import gpus
from finetune.plan.choose import Request, plan, roomy
from finetune.plan.files import accelerate_config, deepspeed_config, launch_command, write_configs
from finetune.plan.memory import GIB, estimate
from finetune.plan.query import parse_gpus, parse_query
from finetune.plan.workload import Workload

LLAMA_7B = catalog.get("llama-2-7b")


def workload(**overrides) -> Workload:
    fields = dict(model=LLAMA_7B, gpu=gpus.get("A100-40GB"), gpus_per_node=2, method="full", strategy="ddp",
                  offload="none", precision="bf16-mixed", optimizer="adamw", micro_batch_size=1, seq_len=2048,
                  gradient_checkpointing=True)
    fields.update(overrides)
    return Workload(**fields)


def fits(w: Workload) -> bool:
    return estimate(w).device(w.world_size) <= w.gpu.memory_gib * GIB


# ---------------------------------------------------------------- query parsing

@pytest.mark.parametrize("text, gpu, count", [
    ("2xA100-40GB", "A100-40GB", 2), ("2×A100 40GB", "A100-40GB", 2), ("8xH100", "H100-80GB", 8),
    ("1xRTX4090", "RTX4090", 1), ("4x L40S", "L40S", 4), ("1xH200", "H200", 1), ("H100 x 4", "H100-80GB", 4),
    ("2 x rtx 3090", "RTX3090", 2), ("a10g", "A10G", 1),
])
def test_gpu_spellings(text, gpu, count):
    assert parse_gpus(text) == (gpu, count)


@pytest.mark.parametrize("text, expected", [
    ("what fits on 2×A100 40GB", {"gpu": "A100-40GB", "gpus_per_node": 2}),
    ("llama-70b on 8xH100", {"gpu": "H100-80GB", "gpus_per_node": 8, "model": "llama-2-70b"}),
    ("Llama 2 70B QLoRA on 2x RTX 4090", {"gpu": "RTX4090", "gpus_per_node": 2, "model": "llama-2-70b", "method": "qlora"}),
    ("mistral 7b lora zero-3 seq 4096 on 2x A100-80GB with optimizer offload",
     {"gpu": "A100-80GB", "gpus_per_node": 2, "model": "mistral-7b", "method": "lora", "strategy": "zero3",
      "offload": "optimizer", "seq_len": 4096}),
    ("llama-3.1-8b fsdp on 2 nodes of 8xH100, micro batch 4, checkpointing, context 8k",
     {"gpu": "H100-80GB", "gpus_per_node": 8, "model": "llama-3.1-8b", "strategy": "fsdp", "nodes": 2,
      "micro_batch_size": 4, "gradient_checkpointing": True, "seq_len": 8192}),
])
def test_query_spellings(text, expected):
    assert parse_query(text) == expected


@pytest.mark.parametrize("text, message", [
    ("hello world", "Cannot understand"),
    ("falcon-40b on 2xA100-40GB", "Unknown model 'falcon-40b'"),
    ("llama-7b on 2xA100", "A100-40GB or A100-80GB"),
])
def test_nonsense_queries_fail_clearly(text, message):
    with pytest.raises(FinetuneError, match=message):
        parse_query(text)


def test_unknown_gpu_flag_gives_clean_cli_error(capsys):
    assert cli_main(["plan", "--model", "llama-7b", "--gpus", "2xB900"]) == 2
    assert "Unknown GPU 'B900'" in capsys.readouterr().err


def test_model_from_local_config_json(tmp_path):
    config = dict(LLAMA_7B.to_hf_config_dict(), num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = resolve_model(str(tmp_path))
    assert spec.num_layers == 2 and spec.hidden_size == 4096
    (tmp_path / "config.json").write_text(json.dumps(dict(config, model_type="mixtral", num_local_experts=8,
                                                          num_experts_per_tok=2)))
    moe = resolve_model(str(tmp_path))
    assert (moe.num_experts, moe.experts_per_token, moe.expert_intermediate_size) == (8, 2, 11008)
    (tmp_path / "config.json").write_text(json.dumps(dict(config, model_type="bert")))
    with pytest.raises(FinetuneError, match="model_type 'bert' is not supported"):
        resolve_model(str(tmp_path))


# ---------------------------------------------------------------- memory arithmetic

def test_model_states_bytes_per_parameter():
    p = 6_738_415_616
    ddp = estimate(workload(strategy="ddp"))  # fp32 weights + fp32 grads + 2 fp32 Adam states
    assert (ddp.weights, ddp.gradients) == (4 * p, 4 * p)
    zero3 = estimate(workload(strategy="zero3", gpus_per_node=8))  # DeepSpeed: 2 + 2 + 16 bytes, all / 8
    assert (zero3.weights, zero3.gradients, zero3.optimizer) == (2 * p / 8, 2 * p / 8, 16 * p / 8)
    zero1 = estimate(workload(strategy="zero1", gpus_per_node=8))
    assert (zero1.weights, zero1.gradients, zero1.optimizer) == (2 * p, 2 * p, 16 * p / 8)


def test_qlora_weights_are_nf4_with_double_quant():
    qlora = workload(method="qlora", strategy="single", gpus_per_node=1, precision="bf16-true")
    layers = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    rest = 6_738_415_616 - layers  # embeddings, norms, LM head
    adapters = 32 * 16 * (4 * 2 * 4096 + 3 * (4096 + 11008))  # r=16 on all 7 linears, fp32 (PEFT)
    nf4 = layers * (0.5 + 1 / 64 + 4 / 16384)
    # finetune keeps what is not 4-bit in the weight dtype: bf16 here, fp32 under bf16-mixed
    assert estimate(qlora).weights == pytest.approx(nf4 + rest * 2 + adapters * 4)
    assert estimate(replace(qlora, precision="bf16-mixed")).weights == pytest.approx(nf4 + rest * 4 + adapters * 4)
    # PEFT's prepare_model_for_kbit_training (as other trainers call it) casts every parameter that is not 4-bit to fp32
    assert estimate(replace(qlora, kbit_upcast=True)).weights == pytest.approx(nf4 + rest * 4 + adapters * 4)


def test_fp16_true_keeps_a_16_bit_base_and_residual_stream():
    lora = workload(method="lora", strategy="single", gpus_per_node=1, gpu=gpus.get("T4"), gradient_checkpointing=True)
    true, mixed = estimate(replace(lora, precision="fp16-true")), estimate(replace(lora, precision="fp16-mixed"))
    adapters = 32 * 16 * (4 * 2 * 4096 + 3 * (4096 + 11008))
    assert true.weights == pytest.approx(6_738_415_616 * 2 + adapters * 4)  # fp16 base, fp32 adapters
    assert mixed.weights == pytest.approx(6_738_415_616 * 4 + adapters * 4)
    # checkpointing keeps each layer's input: fp16 under fp16-true, fp32 under fp16-mixed
    assert mixed.activations - true.activations >= 32 * 2048 * 4096 * 2


def test_qlora_residual_stream_is_fp32_after_the_kbit_upcast():
    qlora = workload(method="qlora", strategy="single", gpus_per_node=1, precision="bf16-true")
    upcast, kept = estimate(replace(qlora, kbit_upcast=True)), estimate(qlora)
    # checkpointing keeps each layer's input: fp32 from the upcast embedding, else bf16
    assert upcast.activations - kept.activations >= 32 * 2048 * 4096 * 2


def test_more_gpus_never_raise_zero3_memory():
    sizes = [estimate(workload(strategy="zero3", gpus_per_node=n)).allocated for n in (2, 4, 8, 16)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def test_checkpointing_never_raises_activations():
    for method in ("full", "lora", "qlora"):
        for seq_len in (512, 4096):
            on = estimate(workload(method=method, seq_len=seq_len, gradient_checkpointing=True, precision="bf16-true"))
            off = estimate(workload(method=method, seq_len=seq_len, gradient_checkpointing=False, precision="bf16-true"))
            assert on.activations <= off.activations


def test_activations_grow_linearly_with_tokens_under_sdpa():
    one = estimate(workload(strategy="single", gpus_per_node=1, method="lora", precision="bf16-true", micro_batch_size=1))
    four = estimate(workload(strategy="single", gpus_per_node=1, method="lora", precision="bf16-true", micro_batch_size=4))
    assert four.activations == pytest.approx(4 * one.activations)


# ---------------------------------------------------------------- known cases

def test_llama_7b_full_does_not_fit_2xA100_40GB_under_ddp_or_zero2():
    for strategy in ("ddp", "zero2"):
        assert not fits(workload(strategy=strategy, micro_batch_size=1, gradient_checkpointing=True))


def test_llama_7b_full_fits_2xA100_40GB_under_zero3_with_optimizer_offload():
    assert fits(workload(strategy="zero3", offload="optimizer", micro_batch_size=1, gradient_checkpointing=True))
    assert not fits(workload(strategy="zero3", offload="none", micro_batch_size=1, gradient_checkpointing=True))


def test_llama_70b_qlora_fits_2x24GB_with_fsdp_and_param_offload():
    w = workload(model=catalog.get("llama-2-70b"), gpu=gpus.get("RTX4090"), method="qlora", strategy="fsdp",
                 offload="params", precision="bf16-true", seq_len=512)
    assert fits(w)
    assert not fits(replace(w, strategy="ddp", offload="none"))


def test_recommendation_is_tied_with_the_fastest_fitting_and_reasons_name_losers():
    request = Request(model=LLAMA_7B, gpu=gpus.get("A100-40GB"), gpus_per_node=2, method="full")
    plans, best = plan(request)
    assert best == 0 and plans[0].fits
    fastest = max((p for p in plans if p.fits), key=lambda p: p.speed.tokens_per_second)
    assert fastest.speed.low <= plans[0].speed.tokens_per_second <= fastest.speed.tokens_per_second
    zero2 = next(p for p in plans if p.workload.strategy.name == "zero2" and p.workload.offload == "none")
    assert not zero2.fits and "optimizer states alone" in zero2.reasons[0]


def test_pinned_request_gives_exactly_one_plan():
    request = Request(model=LLAMA_7B, gpu=gpus.get("H100"), gpus_per_node=4, method="lora", strategy="fsdp",
                      offload="none", precision="bf16-true", optimizer="adamw", micro_batch_size=2,
                      seq_len=1024, gradient_checkpointing=True)
    plans, best = plan(request)
    assert len(plans) == 1 and best == 0 and plans[0].workload.micro_batch_size == 2


def test_open_micro_batch_is_the_largest_that_fits():
    # every layer checkpointed: with the layers open too, fewer layers at a smaller micro batch may be faster
    request = Request(model=LLAMA_7B, gpu=gpus.get("A100-80GB"), gpus_per_node=1, method="lora",
                      gradient_checkpointing=True, gradient_checkpointing_layers=32, seq_len=4096)
    plans, best = plan(request)
    chosen = plans[best].workload
    assert 1 < chosen.micro_batch_size < 64
    assert roomy(chosen) and not roomy(chosen.with_micro_batch(chosen.micro_batch_size + 1))  # the largest with room


def test_invalid_combinations_are_rejected_with_fixes():
    with pytest.raises(FinetuneError, match="ddp cannot offload params") as error:
        plan(Request(model=LLAMA_7B, gpu=gpus.get("T4"), gpus_per_node=1, strategy="ddp", offload="params",
                     precision="bf16-true"))
    message = str(error.value)
    assert "needs at least 2 GPUs" in message and "T4 has no bf16" in message


# ---------------------------------------------------------------- output contract

def test_json_contract(capsys):
    assert cli_main(["plan", "llama-7b on 2xA100-40GB", "--json", "--tokens", "1e8"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["params"] == 6_738_415_616
    assert data["hardware"] | {"gpu": "A100-40GB", "count": 2, "memory_gib": 40.0} == data["hardware"]
    keys = {"method", "strategy", "offload", "precision", "optimizer", "micro_batch_size", "seq_len",
            "gradient_checkpointing", "fits", "memory_per_gpu_gib", "host_memory_gib", "tokens_per_second",
            "launch_command", "reasons"}
    for p in data["plans"]:
        assert keys <= set(p)
        memory = p["memory_per_gpu_gib"]
        parts = sum(memory[k] for k in ("weights", "gradients", "optimizer", "activations", "buffers"))
        assert memory["allocated"] == pytest.approx(parts, abs=0.01)
        assert memory["device"] > memory["allocated"]
        assert p["fits"] == (memory["device"] <= 40.0)
    best = data["plans"][data["recommended"]]
    assert best["fits"] and best["launch_command"].startswith("accelerate launch --config_file plan/accelerate.yaml -m finetune")
    assert best["hours"] > 0 and best["usd"] > 0


def test_write_config_files_load_and_match(tmp_path):
    request = Request(model=LLAMA_7B, gpu=gpus.get("A100-40GB"), gpus_per_node=2, method="full",
                      strategy="zero3", offload="optimizer", micro_batch_size=2, gradient_accumulation_steps=4)
    plans, best = plan(request)
    paths = write_configs(plans[best], tmp_path)
    accelerate = yaml.safe_load(paths[0].read_text())
    assert accelerate["distributed_type"] == "DEEPSPEED" and accelerate["num_processes"] == 2
    assert accelerate["deepspeed_config"]["deepspeed_config_file"] == f"{tmp_path}/ds_config.json"
    ds = json.loads(paths[1].read_text())
    # what the run owns is filled from the launch command's flags (tests/plan/test_plan_run.py resolves it)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == ("auto",) * 3
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "--micro-batch-size 2 --gradient-accumulation-steps 4" in launch_command(plans[best])


def test_fsdp_accelerate_config_is_fsdp2_sharded():
    request = Request(model=catalog.get("qwen2.5-7b"), gpu=gpus.get("H100"), gpus_per_node=8, nodes=2,
                      method="full", strategy="fsdp", offload="params")
    plans, best = plan(request)
    config = accelerate_config(plans[best])
    assert config["num_processes"] == 16 and config["num_machines"] == 2
    assert config["fsdp_config"] | {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                    "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_offload_params": True,
                                    } == config["fsdp_config"]
    assert deepspeed_config(plans[best]) is None
    assert "--main_process_ip $MASTER_ADDR" in launch_command(plans[best])


def test_png_has_one_bar_per_plan(tmp_path):
    png = tmp_path / "plan.png"
    assert cli_main(["plan", "--model", "llama-7b", "--gpus", "2xA100-40GB", "--method", "lora", "--png", str(png)]) == 0
    assert png.stat().st_size > 10_000


def test_plan_is_fast_and_imports_no_torch():
    code = (
        "import sys, time; t = time.perf_counter(); from finetune.cli import main; "
        "main(['plan', 'llama-70b on 8xH100', '--json']); "
        "print(time.perf_counter() - t, file=sys.stderr); "
        "print(sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules), file=sys.stderr)"
    )
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    assert result.stderr.strip().splitlines()[-1] == "[]"
    # the answer's time is a benchmark (bench/RESULTS.md); these bounds, three times the 0.5 s target,
    # only catch what importing torch or a model library would cost (seconds), on a shared, loaded machine
    assert wall < 0.5 * 3 + 1.0
    assert float(result.stderr.strip().splitlines()[-2]) < 0.5 * 3


def test_hub_id_whose_config_is_in_the_local_cache_is_planned(tmp_path):
    """A Hub id resolves to the config.json of the cached `main` revision (no download)."""
    import os
    import subprocess
    import sys

    repo = tmp_path / "hub" / "models--acme--llama-like"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (snapshot / "config.json").write_text(json.dumps(catalog.get("llama-7b").to_hf_config_dict()))
    done = subprocess.run([sys.executable, "-m", "finetune", "plan", "--model", "acme/llama-like", "--gpus", "1xA100-80GB",
                           "--json"], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"]["params"] == 6_738_415_616


def test_speed_switches_are_planned_and_pinned_in_the_launch_command(capsys):
    """`finetune plan --liger --compile --no-chunked-loss`: the chunked loss (on by default) and Liger's
    fused loss hold no full-vocabulary logits, and Liger runs the GPU faster (a GPU-bound 7B shape),
    compiled blocks cut the per-layer issue time (an issue-bound 1B shape); the launch command and
    the plan command carry the flags, so the run is the one planned."""
    def planned(model: str, seq_len: int, micro_batch: int, *flags: str) -> dict:
        argv = ["plan", "--model", model, "--gpus", "1xH100", "--method", "lora", "--seq-len", str(seq_len),
                "--micro-batch-size", str(micro_batch), "--gradient-checkpointing", "--gradient-checkpointing-layers", "99",
                "--json", *flags]  # every layer checkpointed (99 ≥ any model's): the loss's memory alone differs
        assert cli_main(argv) == 0
        result = json.loads(capsys.readouterr().out)
        return result["plans"][result["recommended"]]

    plain, liger = planned("mistral-7b", 4096, 2), planned("mistral-7b", 4096, 2, "--liger")
    logits = planned("mistral-7b", 4096, 2, "--no-chunked-loss")
    assert (plain["liger"], liger["liger"]) == (False, True)
    assert (plain["chunked_loss"], liger["chunked_loss"], logits["chunked_loss"]) == (True, False, False)
    activations = {name: p["memory_per_gpu_gib"]["activations"] for name, p in (("plain", plain), ("liger", liger),
                                                                                   ("logits", logits))}
    assert activations["liger"] <= activations["plain"] < activations["logits"]
    assert liger["tokens_per_second"] > plain["tokens_per_second"]
    assert "--liger" in liger["launch_command"].split() and "--liger" not in plain["launch_command"].split()
    assert "--no-chunked-loss" in logits["launch_command"].split()
    assert "chunked-loss" not in plain["launch_command"] + liger["launch_command"]
    eager, compiled = planned("llama-3.2-1b", 512, 1), planned("llama-3.2-1b", 512, 1, "--compile")
    assert (eager["compile"], compiled["compile"]) == (False, True)
    assert compiled["memory_per_gpu_gib"] == eager["memory_per_gpu_gib"]
    assert compiled["tokens_per_second"] > eager["tokens_per_second"] and not compiled["speed_calibrated"]
    assert compiled["launch_command"].split()[-1] == "--compile"


def test_plan_takes_the_training_name_of_the_sequence_length(capsys):
    """`finetune plan` reads `--max-seq-len` (what `finetune` calls it) as `--seq-len`."""
    for flag in ("--seq-len", "--max-seq-len"):
        assert cli_main(["plan", "--model", "llama-7b", "--gpus", "1xH100", "--method", "lora", flag, "3072", "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["plans"][result["recommended"]]["seq_len"] == 3072
