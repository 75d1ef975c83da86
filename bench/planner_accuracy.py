"""Planner memory estimates vs published measured peaks (../shared/planner_calibration/measurements.csv).

    python bench/planner_accuracy.py [--csv PATH] [--markdown]

Each measured row becomes a Workload with the settings its source states (litgpt: bf16-true with
bf16 adapters, LoRA dropout 0.05 and chunked loss; Qwen: HF Trainer + PEFT, flash attention,
checkpointing). litgpt reports torch.cuda.max_memory_allocated() in GB (1e9), so it is compared
with the planner's `allocated`; Qwen does not say, so it is compared with `device` (allocated +
slack + CUDA context) read as GiB. Rows whose value is a sum over GPUs are divided by the GPU
count. OOM rows check that the planner predicts more than the card holds. Estimated rows
(DeepSpeed's estimator, LLaMA-Factory's rule of thumb) are skipped: they are not measurements;
so are Qwen's "LoRA (emb)" rows, which also train the embedding and head in full.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from finetune.catalog import gpus, models
from finetune.catalog.models import ModelSpec
from finetune.planner.memory import GIB, estimate
from finetune.planner.workload import Workload

DEFAULT_CSV = Path(__file__).resolve().parents[2] / "shared" / "planner_calibration" / "measurements.csv"


def _spec(name, layers, hidden, heads, kv, inter, vocab, tied, **shape) -> ModelSpec:
    return ModelSpec(name=name, hf_id=None, model_type="llama", num_layers=layers, hidden_size=hidden, num_heads=heads,
                     num_kv_heads=kv, intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tied,
                     max_position_embeddings=8192, source=f"{name} config.json", **shape)


NEOX_LIKE = dict(mlp_gated=False, linear_bias=True, norm_bias=True, attention_bias=True)
# Architectures of the calibration models outside finetune's catalog, from their config.json.
SPECS = {
    "microsoft/phi-1_5": _spec("phi-1.5", 24, 2048, 32, 32, 8192, 51200, False, norms_per_layer=1, **NEOX_LIKE),
    "microsoft/phi-2": _spec("phi-2", 32, 2560, 32, 32, 10240, 51200, False, norms_per_layer=1, **NEOX_LIKE),
    "stabilityai/stablelm-base-alpha-3b": _spec("stablelm-alpha-3b", 16, 4096, 32, 32, 16384, 50688, False, **NEOX_LIKE),
    "tiiuae/falcon-7b": _spec("falcon-7b", 32, 4544, 71, 1, 18176, 65024, True, mlp_gated=False, norm_bias=True, norms_per_layer=1),
    "tiiuae/falcon-40b": _spec("falcon-40b", 60, 8192, 128, 8, 32768, 65024, True, mlp_gated=False, norm_bias=True),
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": _spec("tinyllama-1.1b", 22, 2048, 32, 4, 5632, 32000, False),
    "Qwen/Qwen-1_8B": _spec("qwen-1.8b", 24, 2048, 16, 16, 5504, 151936, False, attention_bias=True),
    "Qwen/Qwen-7B": _spec("qwen-7b", 32, 4096, 32, 32, 11008, 151936, False, attention_bias=True),
    "Qwen/Qwen-14B": _spec("qwen-14b", 40, 5120, 40, 40, 13696, 152064, False, attention_bias=True),
    "Qwen/Qwen-72B": _spec("qwen-72b", 80, 8192, 64, 64, 24576, 152064, False, attention_bias=True),
}
CATALOG_IDS = {"meta-llama/Meta-Llama-3-8B": "llama-3.1-8b"}


@dataclass
class Case:
    row: dict
    workload: Workload
    source: str  # litgpt | qwen | qwen-gptq
    metric: str  # allocated | device
    measured_gib: float | None  # None for OOM bounds
    predicted_gib: float

    @property
    def error(self) -> float:
        return self.predicted_gib / self.measured_gib - 1


def model_for(row: dict) -> ModelSpec:
    model_id = row["model_id"].replace("-Chat-Int4", "")
    if model_id in SPECS:
        return SPECS[model_id]
    return models.get(CATALOG_IDS.get(model_id, model_id))


def workload_for(row: dict) -> tuple[Workload, str, str]:
    litgpt = "litgpt" in row["source"].lower()
    method = row["method"].lower()
    gptq = "gptq" in method
    qlora = "qlora" in method.replace("-", "") or gptq
    lora = "lora" in method
    parallel = row["parallelism"].lower()
    count = int(row["num_gpus"] or 1)
    if "zero-3" in parallel or "zero 3" in parallel:
        strategy = "zero3"
    elif "fsdp" in parallel:
        # Lightning's FSDP (FSDP1) of that commit did not shard the frozen base ("FSDP with frozen
        # base params did not reduce per-GPU memory vs 1 GPU"): every rank held the whole model.
        strategy = "ddp" if lora else "fsdp"
    elif "zero-2" in parallel or count > 1:
        strategy = "zero2"  # Qwen's DeepSpeed scripts default to ZeRO-2
    else:
        strategy = "single"
    if strategy == "zero2" and count == 1 and not gptq and lora:
        strategy = "single"
    if not lora and not litgpt and count == 1:
        strategy = "zero2"  # Qwen's full-parameter recipe runs through DeepSpeed (finetune_ds.sh)
    targets = "all-linear"
    if "query+value" in row["lora_targets"] or "query,value only" in row["lora_targets"] or row["lora_targets"] == "query+value only":
        targets = "q_proj,v_proj"
    mixed = "mixed" in row["compute_precision"] or (strategy.startswith("zero") and not lora)
    precision = "fp16-mixed" if gptq else "bf16-mixed" if mixed else "bf16-true"
    w = Workload(
        model=model_for(row), gpu=gpus.get("A100-80GB"), gpus_per_node=count,
        method="qlora" if qlora else "lora" if lora else "full", strategy=strategy, offload="none",
        precision=precision, optimizer="adamw", micro_batch_size=int(row["micro_batch_size"]),
        seq_len=int(re.match(r"\d+", row["seq_len"]).group()),
        gradient_checkpointing=row["grad_checkpointing"].lower().startswith("on"),
        lora_r=int(row["lora_r"] or 8), lora_targets=targets,
        gradient_accumulation_steps=2,
        adapter_bytes=2 if litgpt else 4,
        lora_dropout=0.05 if litgpt and lora else 0.0,
        double_quant="double quant" in row["quantization"] and "no double" not in row["quantization"],
        chunked_loss=litgpt,
    )
    source = "litgpt" if litgpt else "qwen-gptq" if gptq else "qwen"
    return w, source, "allocated" if litgpt else "device"


def measured_gib(row: dict) -> float | None:
    if not row["peak_mem_value"]:
        return None
    value = float(row["peak_mem_value"])
    if "sum" in row["mem_scope"].lower():
        value /= int(row["num_gpus"])
    return value * (1e9 / GIB if row["peak_mem_unit"].startswith("GB") else 1.0)


def cases(path: Path) -> list[Case]:
    result = []
    for row in csv.DictReader(path.open()):
        if row["measured_or_estimated"] != "MEASURED":
            continue
        if "modules_to_save" in row["extra_trainable"]:
            continue  # fully trained embedding and head beside LoRA: not a plan finetune makes
        w, source, metric = workload_for(row)
        memory = estimate(w)
        predicted = memory.allocated if metric == "allocated" else memory.device(w.world_size)
        result.append(Case(row, w, source, metric, measured_gib(row), predicted / GIB))
    return result


def summary(errors: list[float]) -> str:
    absolute = sorted(abs(e) for e in errors)
    within = sum(e <= 0.25 for e in absolute) / len(absolute)
    return f"n={len(absolute)}, median |error| {statistics.median(absolute):.1%}, within 25 %: {within:.0%}, max {absolute[-1]:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    parser.add_argument("--markdown", action="store_true", help="print the per-row table as markdown")
    args = parser.parse_args()
    all_cases = cases(args.csv)
    points = [c for c in all_cases if c.measured_gib is not None]
    bounds = [c for c in all_cases if c.measured_gib is None]
    print("| id | model | method | strategy × GPUs | mbs × seq | ckpt | metric | measured GiB | predicted GiB | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in points:
        w = c.workload
        print(f"| {c.row['id']} | {w.model.name} | {w.method} | {w.strategy} × {w.world_size} | {w.micro_batch_size} × {w.seq_len} "
              f"| {'yes' if w.gradient_checkpointing else 'no'} | {c.metric} | {c.measured_gib:.2f} | {c.predicted_gib:.2f} | {c.error:+.1%} |")
    print()
    for source in sorted({c.source for c in points}):
        print(f"- {source}: {summary([c.error for c in points if c.source == source])}")
    main_set = [c.error for c in points if c.source != "qwen-gptq"]
    print(f"- all measured points except GPTQ: {summary(main_set)}")
    print(f"- all measured points: {summary([c.error for c in points])}")
    for c in bounds:
        capacity = 40.0 * 1e9 / GIB
        verdict = "predicted OOM ✓" if c.predicted_gib > capacity else "predicted to fit ✗"
        print(f"- OOM bound {c.row['id']} ({c.workload.model.name} {c.workload.method} mbs {c.workload.micro_batch_size}): "
              f"planner {c.predicted_gib:.1f} GiB vs 40 GB card → {verdict}")


if __name__ == "__main__":
    main()
