"""The speed model against the committed GPU measurements (finetune's runs on an H100 and an H200, the
H200's per-layer profile, published A100 and 8-GPU runs), the terms that carry it to other GPUs and
models (per-GPU matmul efficiency, memory-bound bytes at the GPU's bandwidth, the vocabulary, the
head size, kernel launches), the range and basis of every plan, and the allocator setting that
makes reserved memory what is planned."""

import json
import math
import os
import subprocess
import sys
from dataclasses import fields, replace

import pytest
from helpers import REPO

from finetune.cli import ALLOCATOR_CONF, use_expandable_segments
from finetune.cli import main as cli_main
from finetune.config.switches import chunk_tokens
from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.memory import GIB, estimate
from finetune.plan.speed import (
    CALIBRATION,
    LAYER_ISSUE_RELATIVE,
    LOSS_CHUNK_ISSUE_RELATIVE,
    estimate_speed,
    gpu_seconds,
    issue_seconds,
    memory_bytes_per_s,
    micro_batch_seconds,
    update_seconds,
)
from finetune.plan.speed_range import LIKELY_Z, MEASURED, MEASURED_ARCHITECTURES, SPREAD, UNMEASURED_SPREAD
from finetune.plan.traffic import LOSS_BYTES, traffic
from finetune.plan.workload import Workload

sys.path.insert(0, str(REPO / "bench"))
import speed_data  # noqa: E402
import speed_fit  # noqa: E402

ROWS = speed_fit.all_rows(sorted(speed_fit.MEASURED.glob("*.csv")))
CASES = speed_fit.term_rows(speed_fit.TERMS)
FITTED = [r for r in ROWS if speed_data.fitted(r)]
SINGLE = [r for r in FITTED if not speed_data.multi_gpu(r)]
PUBLISHED_8_GPUS = [r for r in FITTED if speed_data.multi_gpu(r)]


def one_gpu(**overrides) -> Workload:
    fields = dict(model=catalog.get("llama-3.2-1b"), gpu=gpus.get("H100-80GB"), gpus_per_node=1, method="lora",
                  strategy="single", offload="none", precision="bf16-true", optimizer="adamw", micro_batch_size=1,
                  seq_len=512, gradient_checkpointing=False)
    return Workload(**(fields | overrides))


def tokens_per_second(**overrides) -> float:
    return estimate_speed(one_gpu(**overrides)).tokens_per_second


GPU_BOUND = dict(model=catalog.get("mistral-7b"), seq_len=4096, micro_batch_size=2, gradient_checkpointing=True)


def test_the_committed_measurements_cover_models_methods_shapes_and_three_gpus():
    own = [r for r in FITTED if r["framework"] == "finetune"]
    assert len(own) >= 12 and {r["method"] for r in own} == {"full", "lora", "qlora"}
    assert {r["seq_len"] for r in own} >= {"512", "2048", "4096"}
    assert {r["loss"] for r in own if r["device"] == "H200"} == {"finetune-chunked", "liger"}
    published = [r for r in FITTED if r["framework"] == "llamafactory"]
    assert [int(r["seq_len"]) for r in published] == [1024, 2048, 4096, 8192, 16384, 32768]
    assert [r["case"] for r in PUBLISHED_8_GPUS] == ["M13", "M15", "M26", "M27"]
    assert {speed_data.chip_of(r) for r in FITTED} == {"H100", "A100"}
    assert {r["device"] for r in own} == {"H100-80GB", "H200"} and set(CALIBRATION.matmul_efficiency) >= {"H100-80GB", "H200"}
    assert len(CASES) == 4 and all(case["per layer"]["busy_ms"] > 0 for case in CASES)
    assert all(r["device"] and r["model"] and r["tokens_per_second"] for r in ROWS)


def row_id(r: dict) -> str:
    return (f"{r['device']}-{r['model'].split('/')[-1]}-{r['method']}-s{r['seq_len']}-b{r['micro_batch_size']}"
            f"-{r.get('loss', '')}-ckpt{r.get('gradient_checkpointing_layers') or r['gradient_checkpointing']}")


@pytest.mark.parametrize("row", SINGLE, ids=row_id)
def test_planned_tokens_per_second_within_25_percent_of_every_fitted_row(row):
    assert speed_data.planned(row) == pytest.approx(float(row["tokens_per_second"]), rel=speed_fit.TOLERANCE)


def inside_likely_range(row: dict) -> bool:
    likely, planned = estimate_speed(speed_data.workload_of(row)).likely, speed_data.planned(row)
    return planned * likely.low <= float(row["tokens_per_second"]) <= planned * likely.high


def test_the_likely_ranges_hold_what_was_measured():
    """A likely range is the central 80 % of the cross-validated error: it holds at least that share of
    the single-GPU rows (all but LLaMA-Factory's 16k row, which runs faster than its 8k and 32k
    neighbours), and every H200 row and every published 8-GPU row."""
    inside = [inside_likely_range(r) for r in SINGLE]
    assert sum(inside) >= 0.8 * len(inside)
    assert all(inside_likely_range(r) for r in SINGLE + PUBLISHED_8_GPUS if r["device"] == "H200" or speed_data.multi_gpu(r))


H200_ROWS = [r for r in SINGLE if r["device"] == "H200"]


@pytest.mark.parametrize("row", H200_ROWS, ids=row_id)
def test_the_h200_rows_are_planned_within_10_percent_in_speed_and_allocated_memory(row):
    """finetune's four Mistral-7B LoRA s4096 b2 runs on the H200 (every layer or 1 of 32 recomputed, the
    chunked loss or Liger's), as the GPU kit posed them (throughput.py): 0.81 of plan before the H200
    joined the fit, and Liger's run with 31 layers keeping activations 9.5 % under its planned memory."""
    assert speed_data.planned(row) == pytest.approx(float(row["tokens_per_second"]), rel=0.10)
    assert estimate(speed_data.workload_of(row)).allocated / GIB == pytest.approx(float(row["allocated_gib"]), rel=0.10)


def test_the_published_moe_and_context_parallel_runs_are_planned_near_their_published_speed():
    """The four 8-GPU runs (prime-rl's Qwen3-30B-A3B LoRA and full FSDP2 at 16k; torchtitan's Llama-3.1-8B
    at CP 1 / 32k and CP 2 / 64k): planned ÷ published had a median of ×1.8 with this posing before the
    expert and attention terms; now within 0.8–1.25, each within 30 %."""
    ratios = sorted(speed_data.planned(r) / float(r["tokens_per_second"]) for r in PUBLISHED_8_GPUS)
    assert 0.8 <= (ratios[1] + ratios[2]) / 2 <= 1.25
    assert all(0.7 < ratio < 1.3 for ratio in ratios)


def test_the_kits_two_layer_cuts_are_planned_though_not_fitted():
    """bench/gpu_kit/defaults.py on the H200: Mistral-7B and Llama-3.1-8B cut to 2 layers. LoRA and QLoRA
    at 4096 × 2 with the model's own loss, the chunked loss and Liger's (GPU-bound): within 10 %;
    Mistral's (a masked attention) were 11–19 % under before its sliding window was a term. Full
    fine-tuning at 512 × 1 (the host's clock, whose fitted cost per layer is the H100 host's): within
    25 %, and foreach AdamW's extra time over fused (7.8 and 16.2 ms measured) within 10 %."""
    cases = {case["case"]: case for case in speed_data.default_cases()}
    planned = {name: 1000 * update_seconds(speed_data.workload_of(case, 2)) for name, case in cases.items()}
    assert len(cases) == 16
    for name, case in cases.items():
        assert planned[name] == pytest.approx(case["ms_per_update"], rel=0.25 if case["method"] == "full" else 0.10), name
    for shape in ("mistral-7b", "llama-3.1-8b"):
        foreach, fused = f"{shape} full foreach", f"{shape} full fused"
        extra = cases[foreach]["ms_per_update"] - cases[fused]["ms_per_update"]
        assert planned[foreach] - planned[fused] == pytest.approx(extra, rel=0.10)


def test_liger_speedup_follows_from_the_bytes_its_kernels_save():
    """No Liger coefficient: fusing the norm, rotary embedding, SwiGLU and loss removes bytes, and the
    planned speed-up is within 5 % of TRL's three measured pairs (H100 LoRA and QLoRA, H200 LoRA)."""
    pairs = speed_data.liger_pairs(ROWS)
    assert len(pairs) == 3 and "liger" not in {f.name for f in fields(CALIBRATION)}
    for off, on in pairs:
        measured = float(on["tokens_per_second"]) / float(off["tokens_per_second"])
        assert speed_data.planned(on) / speed_data.planned(off) == pytest.approx(measured, rel=0.05)
    plain = one_gpu(**GPU_BOUND)
    assert traffic(replace(plain, loss="liger")).per_token < 0.8 * traffic(plain).per_token


def test_refitting_the_committed_measurements_gives_the_committed_coefficients():
    refit = speed_fit.fit(ROWS, CASES)
    for field in fields(CALIBRATION):
        ours, theirs = getattr(refit, field.name), getattr(CALIBRATION, field.name)
        if isinstance(ours, dict):
            assert ours.keys() == theirs.keys()
            assert list(ours.values()) == pytest.approx(list(theirs.values()), rel=0.02), field.name
        else:
            assert ours == pytest.approx(theirs, rel=0.02), field.name
    assert all(0 < v <= speed_fit.CEILING["matmul_efficiency"] for v in refit.matmul_efficiency.values())
    assert 0 < refit.memory_efficiency <= 1 and all(0 < v <= 1 for v in refit.attention_speed.values())
    assert 0 < refit.masked_attention_speed <= 1


def test_the_profiled_layers_are_planned_class_by_class():
    """The H200 profile of four cuts (fitted): per decoder layer, the GPU's busy time within 20 % and
    each kernel class within 45 % (before: busy planned at 2× measured, the other kernels 3.2×, from
    11.5 µs of GPU time per kernel); the host's issue time per layer (a check) within 35 %."""
    for case in CASES:
        plan, measured = speed_data.per_layer(case, CALIBRATION), case["per layer"]
        assert sum(plan.values()) == pytest.approx(measured["busy_ms"], rel=0.20), case["case"]
        for k in ("matmul", "attention", "other"):
            assert plan[k] == pytest.approx(measured[f"{k}_ms"], rel=0.45), (case["case"], k)
        host = [issue_seconds(speed_data.workload_of(case, n), CALIBRATION) for n in speed_data.CUTS]
        assert 1000 * (host[1] - host[0]) / 2 == pytest.approx(measured["host_ms"], rel=0.35), case["case"]
    assert CALIBRATION.kernel_gpu_s < 5e-6


def test_the_committed_shape_families_are_the_measured_ones():
    assert {chip: set(families) for chip, families in MEASURED.items()} == \
        {chip: set(families) for chip, families in speed_fit.measured_families(ROWS).items()}
    assert set(MEASURED) == set(CALIBRATION.chips)
    assert MEASURED_ARCHITECTURES == speed_fit.measured_architectures(ROWS)


@pytest.mark.slow
def test_the_committed_spreads_are_the_cross_validated_errors():
    """~40 refits (leave one row, one shape family, one chip out): the spreads every range rests on."""
    spreads = speed_fit.spreads(ROWS, speed_fit.cross_validation(ROWS, CASES))
    assert spreads == pytest.approx(SPREAD, abs=0.01)
    assert spreads["measured"] <= spreads["chip"]


def test_more_work_per_update_is_slower_per_token():
    assert tokens_per_second(model=replace(catalog.get("llama-3.2-1b"), num_layers=32)) < tokens_per_second()
    assert tokens_per_second(method="qlora") < tokens_per_second() < tokens_per_second(method="full") * 1.5
    assert tokens_per_second(lora_targets="q_proj,v_proj") > tokens_per_second()
    assert tokens_per_second(gradient_checkpointing=True) < tokens_per_second()
    assert tokens_per_second(precision="fp32", method="full", seq_len=4096) < tokens_per_second(method="full", seq_len=4096)


def test_small_shapes_are_launch_bound_and_longer_rows_amortise_it():
    small, large = estimate_speed(one_gpu()), estimate_speed(one_gpu(seq_len=4096, micro_batch_size=4))
    assert small.launch_bound and not large.launch_bound
    assert large.tokens_per_second > 5 * small.tokens_per_second
    # attention grows with the sequence: at a fixed token count, longer rows are slower
    assert tokens_per_second(seq_len=16384, micro_batch_size=1) < tokens_per_second(seq_len=4096, micro_batch_size=4)


def test_host_and_gpu_clocks_overlap_in_part():
    """Both clocks count, the shorter one least: the 1B full rows measured at seq 512 and 2048 took
    99 and 121 ms per update, though the host's issue time is the larger clock in both."""
    p = CALIBRATION.overlap_exponent
    assert speed_fit.FLOOR["overlap_exponent"] < p < 10
    equal_clocks = micro_batch_seconds(0.1, 0.1, CALIBRATION) / 0.1
    assert equal_clocks == pytest.approx(2 ** (1 / p)) and 1.05 < equal_clocks < 2
    assert micro_batch_seconds(0.1, 0.01, CALIBRATION) == pytest.approx(0.1, rel=1e-3)
    assert micro_batch_seconds(0.0, 0.3, CALIBRATION) == 0.3 and micro_batch_seconds(0.0, 0.0, CALIBRATION) == 0.0
    short, long = (one_gpu(method="full", precision="bf16-mixed", seq_len=s) for s in (512, 2048))
    assert estimate_speed(short).launch_bound and estimate_speed(long).launch_bound
    per_update = [w.seq_len / estimate_speed(w).tokens_per_second for w in (short, long)]
    assert per_update[0] * 1.05 < per_update[1] < per_update[0] * 2


def test_each_model_codes_layer_costs_the_host_what_the_bench_measured():
    """bench/layer_issue.py measures every model type of the catalog against Llama's; a layer of Qwen3
    code costs the host that ratio of a Llama layer of the same shape."""
    measured = {spec.model_type for spec in catalog.REAL_MODELS.values()}
    assert measured == set(LAYER_ISSUE_RELATIVE) and LAYER_ISSUE_RELATIVE["llama"] == 1.0
    llama = one_gpu(method="full", precision="bf16-mixed")
    qwen3 = replace(llama, model=replace(llama.model, model_type="qwen3"))
    layers = llama.model.num_layers * CALIBRATION.layer_issue_s
    assert issue_seconds(qwen3, CALIBRATION) - issue_seconds(llama, CALIBRATION) == pytest.approx(
        layers * (LAYER_ISSUE_RELATIVE["qwen3"] - 1))


def test_compile_helps_launch_bound_shapes_and_liger_gpu_bound_ones():
    assert tokens_per_second(compile=True) > 1.5 * tokens_per_second()
    assert tokens_per_second(**GPU_BOUND, loss="liger") > 1.1 * tokens_per_second(**GPU_BOUND)
    assert estimate(one_gpu(**GPU_BOUND, loss="liger")).activations < estimate(one_gpu(**GPU_BOUND)).activations


def test_each_gpu_has_its_matmul_efficiency_each_chip_its_attention_and_each_gpu_its_bandwidth():
    """Each GPU measured has its own matmul efficiency (the H200 ran the same TRL step 7–13 % slower
    than the H100 though it has 1.4× the bandwidth); a GPU never measured takes its chip's measured GPUs,
    or every measured GPU when its chip is new. Flash attention's speed is the chip's (FlashAttention 2,
    written for Ampere, runs at a smaller share of a Hopper's matmul rate than of an A100's)."""
    efficiency = CALIBRATION.matmul_efficiency
    assert efficiency["H200"] < efficiency["H100-80GB"]
    assert CALIBRATION.attention("H100") < CALIBRATION.attention("A100")
    assert memory_bytes_per_s(one_gpu(gpu=gpus.get("H200"))) == 4.8e12 and gpus.get("H200").chip == "H100"
    assert CALIBRATION.efficiency(gpus.get("A100-80GB")) == efficiency["A100-40GB"]
    assert CALIBRATION.efficiency(gpus.by_memory(79.6)) == efficiency["H100-80GB"]  # planned like the H100 80GB
    assert CALIBRATION.efficiency(gpus.get("L40S")) == pytest.approx(math.prod(efficiency.values()) ** (1 / len(efficiency)))
    assert CALIBRATION.attention("L40S") == pytest.approx(math.prod(CALIBRATION.attention_speed.values()) ** 0.5)
    assert set(CALIBRATION.chips) == {"A100", "H100"}
    assert all(g.memory_tb_per_s > 0 and g.chip for g in gpus.GPUS.values())


def test_a_larger_vocabulary_costs_its_loss_bytes_and_head_flops():
    """The vocabulary term, not a constant: widening only the vocabulary adds exactly the loss's
    bytes over it and the LM head's matmul FLOPs to the GPU clock, and more chunks of the chunked
    loss to the host's."""
    small = one_gpu(**GPU_BOUND)
    large = replace(small, model=replace(small.model, vocab_size=152064))
    added_vocab = 152064 - small.model.vocab_size
    tokens, h = small.tokens_per_micro_batch, small.model.hidden_size
    flops = 2 * h * added_vocab * 2  # the head's forward and its input gradient (frozen head under LoRA)
    rate = small.gpu.bf16_tflops * 1e12 * CALIBRATION.efficiency(small.gpu)
    loss_seconds = tokens * added_vocab * LOSS_BYTES["eager"] / (memory_bytes_per_s(small) * CALIBRATION.memory_efficiency)
    assert gpu_seconds(large, CALIBRATION) - gpu_seconds(small, CALIBRATION) == pytest.approx(
        tokens * flops / rate + loss_seconds, rel=1e-6)
    chunked_small, chunked_large = replace(small, loss="finetune-chunked"), replace(large, loss="finetune-chunked")
    chunks = math.ceil(tokens / chunk_tokens(152064)) - math.ceil(tokens / chunk_tokens(32000))
    assert issue_seconds(chunked_large, CALIBRATION) - issue_seconds(chunked_small, CALIBRATION) == pytest.approx(
        chunks * LOSS_CHUNK_ISSUE_RELATIVE * CALIBRATION.layer_issue_s)
    assert estimate_speed(large).tokens_per_second < estimate_speed(small).tokens_per_second


def test_small_heads_run_attention_slower_at_the_same_width():
    flash = replace(GPU_BOUND["model"], sliding_window=None)  # no mask: SDPA's flash kernel
    wide = one_gpu(**(GPU_BOUND | dict(model=flash, seq_len=16384, micro_batch_size=1)))
    halved = replace(wide, model=replace(wide.model, num_heads=64, num_kv_heads=16, head_dim=64))
    assert wide.model.num_heads * wide.model.resolved_head_dim == halved.model.num_heads * halved.model.resolved_head_dim
    assert gpu_seconds(halved, CALIBRATION) > gpu_seconds(wide, CALIBRATION)
    eager = replace(wide, attention="eager")
    assert traffic(eager).per_token > traffic(wide).per_token + wide.model.num_layers * wide.model.num_heads * 16384


def test_every_plan_has_a_range_and_basis_that_widen_as_it_rests_on_less():
    measured = estimate_speed(one_gpu())  # lora <2B seq ≤1k was measured on the H100
    other_shape = estimate_speed(one_gpu(seq_len=16384))
    other_chip = estimate_speed(one_gpu(gpu=gpus.get("L40S")))
    two_gpus = estimate_speed(one_gpu(gpus_per_node=2, strategy="ddp"))
    compiled = estimate_speed(one_gpu(compile=True))
    qwen = estimate_speed(one_gpu(model=catalog.get("qwen2.5-1.5b")))  # the same shape family, other model code
    assert measured.calibrated and measured.basis == "measured on H100 (lora <2B seq ≤1k)"
    assert not qwen.calibrated and qwen.basis == "measured on H100 (lora <2B seq ≤1k); qwen2 model code modelled, not measured"
    assert qwen.high / qwen.tokens_per_second == pytest.approx(
        math.exp(LIKELY_Z * math.hypot(SPREAD["measured"], UNMEASURED_SPREAD["model code"])))
    assert not other_shape.calibrated and "from other shapes (no lora <2B seq ≥8k run)" in other_shape.basis
    assert not other_chip.calibrated and other_chip.basis.startswith("extrapolated: no runs on L40S")
    assert not two_gpus.calibrated and "communication modelled, not measured" in two_gpus.basis
    assert not compiled.calibrated and "compiled blocks" in compiled.basis
    assert measured.high / measured.tokens_per_second == pytest.approx(math.exp(LIKELY_Z * SPREAD["measured"]))
    assert two_gpus.high / two_gpus.tokens_per_second == pytest.approx(
        math.exp(LIKELY_Z * math.hypot(SPREAD["measured"], UNMEASURED_SPREAD["communication"])))
    widths = [s.high / s.low for s in (measured, other_shape, other_chip)]
    assert widths == sorted(widths) and widths[0] < widths[-1]
    assert all(s.low < s.tokens_per_second < s.high for s in (measured, other_shape, other_chip, two_gpus, compiled))


def test_json_table_and_hours_carry_the_range(capsys):
    assert cli_main(["plan", "llama-3.2-1b on 1xH100", "--tokens", "1e9", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    for p in plans:
        low, high = p["tokens_per_second_likely"]
        assert low < p["tokens_per_second"] < high and p["speed_basis"]
        assert p["hours_likely"] == pytest.approx([1e9 / high / 3600, 1e9 / low / 3600], rel=1e-3)
        assert p["usd_likely"][0] < p["usd"] < p["usd_likely"][1]
    assert any(p["speed_calibrated"] and p["speed_basis"].startswith("measured on H100") for p in plans)
    assert cli_main(["plan", "llama-3.2-1b on 1xA100-80GB", "--tokens", "1e9"]) == 0
    table = capsys.readouterr().out
    assert "likely" in table.splitlines()[3] and any(cell.endswith("~") for cell in table.split())
    assert "speed extrapolated on A100 from other shapes" in table


def test_expandable_segments_are_set_unless_the_user_chose():
    environ = {}
    use_expandable_segments(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": ALLOCATOR_CONF}
    for user in ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}):
        environ = dict(user)
        use_expandable_segments(environ)
        assert environ == user


@pytest.mark.parametrize("user", [None, "max_split_size_mb:64"])
def test_the_cli_entry_sets_the_allocator_before_torch_loads(user):
    code = ("import os, sys; from finetune.cli import main; main(['plan', 'llama-3.2-1b on 1xH100', '--json']); "
            "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'), 'torch' in sys.modules, file=sys.stderr)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    if user:
        env["PYTORCH_CUDA_ALLOC_CONF"] = user
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stderr.split()[-2:] == [user or ALLOCATOR_CONF, "False"]
