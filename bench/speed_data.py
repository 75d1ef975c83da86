"""The speed model's calibration data, read from the planner's package data and posed as Workloads.

Four kinds of measurement (finetune/plan/calibration/, README.md there says where each came from):
- runs: finetune's own GPU runs and the programs run beside it (measured/*.csv, written by the GPU
  kit), tokens/s per GPU of one whole training run each;
- LLaMA-Factory's published Llama-2-7B QLoRA runs on one A100 40GB (speed_llamafactory_a100_40gb.csv);
- published 8-GPU runs of a mixture of experts and of context parallelism (speed_published_moe_cp.csv:
  prime-rl's Qwen3-30B-A3B with FSDP2, torchtitan's Llama-3.1-8B with FSDP2 and CP), posed as the
  closest plan finetune makes (`POSES`);
- the GPU kit's profile of 2- and 4-layer cuts (speed_terms_h200.csv): per decoder layer, the GPU's
  busy time by kernel class and the host's issue time, and the rest (embedding, head, loss).

Rows are dicts in the measured files' columns (multi-GPU rows add `gpus`, `strategy`, `cp`,
`gradient_accumulation_steps`); `workload_of` turns any of them into the planner's Workload. A row's
`inert_window` is "kept" where the run kept a sliding window as long as its rows, with the mask
transformers builds for it (Workload.inert_window_kept): measured/*.csv say so per row; the defaults
file's runs (the GPU kit at 2a8c76e, before train.speedups switched such a window off) and the
profile's cuts (no train.speedups) kept it.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import replace
from pathlib import Path

import finetune.plan
from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.speed import CALIBRATION, Calibration, estimate_speed, kernel_classes
from finetune.plan.speed_range import shape_family
from finetune.plan.workload import Workload

CALIBRATION_DIR = Path(finetune.plan.__file__).parent / "calibration"  # the planner's package data
MEASURED = CALIBRATION_DIR / "measured"
PUBLISHED = CALIBRATION_DIR / "speed_llamafactory_a100_40gb.csv"
PUBLISHED_MOE_CP = CALIBRATION_DIR / "speed_published_moe_cp.csv"
TERMS = CALIBRATION_DIR / "speed_terms_h200.csv"

# How each published multi-GPU row is posed: the catalog model and GPU it is planned on, and the
# settings its columns state in words. torchtitan's H100 96GB (a 500 W Grand Teton card) is not in the
# GPU catalog: it is planned as the 80GB card. prime-rl's fused LM head is finetune's chunked loss; its
# FlashAttention 3, torchtitan's Float8 linears and both programs' torch.compile are not posed (the
# plan runs SDPA's flash kernel, bf16 matmuls and eager elementwise kernels): each row's `notes` say so.
POSES = {
    "M13": dict(model="qwen3-30b-a3b", device="H100-80GB", method="lora", lora_targets="all-linear+experts",
                loss="finetune-chunked", cp="1"),
    "M15": dict(model="qwen3-30b-a3b", device="H200", method="full", lora_targets="all-linear", loss="transformers", cp="1"),
    "M26": dict(model="llama-3.1-8b", device="H100-80GB", method="full", lora_targets="all-linear", loss="transformers", cp="1"),
    "M27": dict(model="llama-3.1-8b", device="H100-80GB", method="full", lora_targets="all-linear", loss="transformers", cp="2"),
}
# The profile's cases ran the trainer's pieces without train.speedups: the model's own loss and any
# sliding window kept (bench/gpu_kit/speed_terms.py), bf16-mixed for full fine-tuning, bf16-true for LoRA
# and QLoRA.
TERM_CASE = re.compile(r"(?P<model>\S+) (?P<method>\w+) s(?P<seq>\d+) b(?P<micro>\d+)(?P<ckpt> ckpt)?")
CUTS = (2, 4)


def read_rows(paths: list[Path]) -> list[dict]:
    """Rows of the GPU kit's measured files (finetune and the programs it ran beside)."""
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            rows += [row | {"file": path.name} for row in csv.DictReader(f)]
    return rows


def published_rows(path: Path = PUBLISHED) -> list[dict]:
    """LLaMA-Factory's rows, in the measured files' columns (kernels: 'unsloth' marks a peer's kernels)."""
    with open(path, newline="") as f:
        return [{"file": path.name, "framework": "llamafactory" if r["kernels"] == "none" else f"llamafactory+{r['kernels']}",
                 "device": r["gpu"], "model": r["model"], "method": r["method"], "precision": "bf16-true",
                 "seq_len": r["seq_len"], "micro_batch_size": r["micro_batch"], "gradient_accumulation_steps": r["grad_accum"],
                 "gradient_checkpointing": "true", "lora_r": r["lora_rank"], "lora_targets": "all-linear", "liger": "off",
                 "loss": "transformers", "compile": "off", "tokens_per_second": r["tokens_per_s_per_gpu"], "case": r["case"]}
                for r in csv.DictReader(f)]


def moe_cp_rows(path: Path = PUBLISHED_MOE_CP) -> list[dict]:
    """The published 8-GPU rows, posed (`POSES`): FSDP2 over every GPU (÷ CP), one row of seq_len
    tokens per GPU per step (their tokens/s × step time ÷ GPUs), full recompute, bf16 compute on
    FSDP2's copies of fp32 weights; tokens/s per GPU as published."""
    with open(path, newline="") as f:
        return [{"file": path.name, "case": r["case"], "framework": r["tool"].split()[0], "precision": "bf16-mixed",
                 "seq_len": r["seq_len"], "micro_batch_size": "1", "gradient_accumulation_steps": "1",
                 "gradient_checkpointing": "true", "lora_r": r["lora_rank"] or "16", "liger": "off", "compile": "on",
                 "gpus": r["gpu_count"], "strategy": "fsdp", "tokens_per_second": r["tokens_per_s"], **POSES[r["case"]]}
                for r in csv.DictReader(f)]


def term_rows(path: Path = TERMS) -> list[dict]:
    """The profile's cases that ran: per case its two parts (per layer, rest) with their measured
    and planned columns, and the case's settings in the measured files' columns."""
    with open(path, newline="") as f:
        found = [r for r in csv.DictReader(f) if r["status"] == "ok"]
    cases = {}
    for r in found:
        m = TERM_CASE.fullmatch(r["case"])
        case = cases.setdefault(r["case"], {
            "case": r["case"], "file": path.name, "framework": "finetune", "device": "H200", "model": m["model"],
            "method": m["method"], "precision": "bf16-mixed" if m["method"] == "full" else "bf16-true",
            "seq_len": m["seq"], "micro_batch_size": m["micro"], "gradient_checkpointing": "true" if m["ckpt"] else "false",
            "lora_r": "16", "lora_targets": "all-linear", "liger": "off", "loss": "transformers", "compile": "off",
            "inert_window": "kept"})
        case[r["part"]] = {key[len("measured_"):]: float(value) for key, value in r.items()
                           if key.startswith("measured_") and value}
    return list(cases.values())


def workload_of(row: dict, layers: int | None = None) -> Workload:
    """The planner's Workload for one row (`layers`: a cut of the model that deep, for the profile)."""
    spec = catalog.get(row["model"])
    layers_ckpt = row.get("gradient_checkpointing_layers")
    return Workload(
        model=spec if layers is None else replace(spec, num_layers=layers), gpu=gpus.get(row["device"]),
        gpus_per_node=int(row.get("gpus") or 1), method=row["method"], strategy=row.get("strategy") or "single",
        offload="none", precision=row["precision"], optimizer="adamw", micro_batch_size=int(row["micro_batch_size"]),
        seq_len=int(row["seq_len"]), gradient_accumulation_steps=int(row.get("gradient_accumulation_steps") or 1),
        gradient_checkpointing=row["gradient_checkpointing"] == "true",
        checkpointed_layers=int(layers_ckpt) if layers_ckpt else None, lora_r=int(row["lora_r"]),
        lora_targets=row["lora_targets"], cp=int(row.get("cp") or 1),
        loss=row.get("loss") or ("liger" if row["liger"] == "on" else "transformers"),
        fused_optimizer=row.get("fused_adamw") == "true", compile=row["compile"] == "on",
        inert_window_kept=row.get("inert_window") == "kept",
    )


def chip_of(row: dict) -> str:
    return gpus.get(row["device"]).chip


def family_of(row: dict) -> tuple[str, str]:
    return chip_of(row), shape_family(workload_of(row))


DEFAULTS = CALIBRATION_DIR / "speed_defaults_h200.csv"


def default_cases(path: Path = DEFAULTS) -> list[dict]:
    """The GPU kit's defaults on 2-layer cuts of full-width shapes on the H200 (bench/gpu_kit/defaults.py
    with its defaults: LoRA and QLoRA bf16-true at 4096 × 2 with each loss, full fine-tuning bf16-mixed at
    512 × 1 with fused or foreach AdamW; no checkpointing), in the measured files' columns, with the
    median ms per update (forward, backward and the optimizer step, the GPU drained at both ends)."""
    with open(path, newline="") as f:
        found = [r for r in csv.DictReader(f) if r["status"] == "ok" and r["method"] in ("lora", "qlora", "full")]
    return [{"case": f"{r['shape']} {r['method']} {r['variant']}", "file": path.name, "framework": "finetune",
             "device": "H200", "model": r["shape"], "method": r["method"],
             "precision": "bf16-mixed" if r["method"] == "full" else "bf16-true",
             "seq_len": "512" if r["method"] == "full" else "4096", "micro_batch_size": "1" if r["method"] == "full" else "2",
             "gradient_checkpointing": "false", "lora_r": "16", "lora_targets": "all-linear", "liger": "off",
             "loss": "transformers" if r["method"] == "full" else r["variant"], "compile": "off",
             "fused_adamw": "false" if r["variant"] == "foreach" else "true", "inert_window": "kept",
             "ms_per_update": float(r["ms_per_update"])}
            for r in found]


# How the model plans the rows: what the fit, the tables and the tests compare with what was measured.
# The host-clock coefficients: another program's row is planned on the GPU clock alone.
HOST = ("layer_issue_s", "adapter_issue_s", "dequant_issue_s")
KERNEL_CLASSES = ("matmul", "attention", "dequant", "other")


def fitted(row: dict) -> bool:
    """finetune's own rows and other programs' rows with plain kernels (not TRL's, fitted as Liger ratios)."""
    return row["framework"] in ("finetune", "llamafactory", "prime-rl", "torchtitan")


def ours(row: dict) -> bool:
    """Run by finetune on the host the issue-time coefficients describe."""
    return row["framework"] == "finetune"


def multi_gpu(row: dict) -> bool:
    return int(row.get("gpus") or 1) > 1


def planned(row: dict, calibration: Calibration = CALIBRATION) -> float:
    """Tokens/s per GPU the model plans for the row; another program's row on the GPU clock alone."""
    if not ours(row):
        calibration = replace(calibration, **{name: 0.0 for name in HOST})
    w = workload_of(row)
    return estimate_speed(w, calibration).tokens_per_second / w.world_size


def liger_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(without, with) Liger rows of the same program, GPU and shape, for the programs not fitted row by row."""
    def key(row):
        return row["framework"], row["device"], row["model"], row["method"], row["seq_len"], row["micro_batch_size"]
    off = {key(r): r for r in rows if r["liger"] == "off" and not fitted(r)}
    return [(off[key(r)], r) for r in rows if r["liger"] == "on" and not fitted(r) and key(r) in off]


def log_error(row: dict, calibration: Calibration) -> float:
    return math.log(planned(row, calibration) / float(row["tokens_per_second"]))


def per_layer(case: dict, calibration: Calibration) -> dict[str, float]:
    """The plan's kernel classes of one decoder layer of a profiled case, ms: half the difference of
    the 4- and 2-layer cuts' plans, as the profile measures them."""
    shallow, deep = (kernel_classes(workload_of(case, layers), calibration) for layers in CUTS)
    return {k: 1000 * (deep[k] - shallow[k]) / (CUTS[1] - CUTS[0]) for k in KERNEL_CLASSES}


def rms(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else float("nan")
