"""The tables `python bench/speed_fit.py` prints: planned beside measured for every run, the 8-GPU
published runs, the profiled kernel classes and the checks, the out-of-sample errors by chip and shape
family, and the coefficients to paste into finetune/plan/speed.py and speed_range.py."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

from speed_data import (
    CUTS,
    KERNEL_CLASSES,
    family_of,
    fitted,
    liger_pairs,
    log_error,
    multi_gpu,
    ours,
    per_layer,
    planned,
    rms,
    workload_of,
)

from finetune.plan.speed import Calibration, estimate_speed, gpu_seconds, issue_seconds, update_seconds


def percent(log_error: float | None) -> str:
    return "" if log_error is None else f"{math.exp(log_error) - 1:+.0%}"


def out_of_sample(cv: dict | None, i: int) -> list[str]:
    return [percent(cv[tier].get(i)) if cv else "" for tier in ("measured", "shape", "chip")]


def runs_table(rows: list[dict], calibration: Calibration, cv: dict | None) -> list[str]:
    """One line per single-GPU run: measured, planned, in and out of sample, what bounds it."""
    lines = ["| program | GPU | model | method | seq | mbs | ckpt | loss | measured tok/s | planned tok/s | error "
             "| left out: row | family | chip | bound | loss share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        if multi_gpu(r):
            continue
        w = workload_of(r)
        speed = estimate_speed(w, calibration)
        program = r["framework"] + ("" if fitted(r) else " (not fitted)")
        bound = "GPU" if not ours(r) or not speed.launch_bound else "host (launch)"
        layers = r.get("gradient_checkpointing_layers")
        ckpt = f"{layers} of {w.model.num_layers}" if layers else r["gradient_checkpointing"]
        lines.append(f"| {program} | {r['device']} | {r['model']} | {r['method']} | {r['seq_len']} | {r['micro_batch_size']} | "
                     f"{ckpt} | {w.loss} | {float(r['tokens_per_second']):,.0f} | {planned(r, calibration):,.0f} | "
                     f"{percent(log_error(r, calibration))} | {' | '.join(out_of_sample(cv, i))} | {bound} | "
                     f"{loss_share(w, calibration):.0%} |")
    return lines


def published_table(rows: list[dict], calibration: Calibration, cv: dict | None) -> list[str]:
    """The 8-GPU published runs: per GPU measured and planned, out of sample, and the likely range."""
    lines = ["| case | program | GPUs (planned as) | model | method | seq | CP | published tok/s per GPU | planned | "
             "planned ÷ published | left out: row | family | chip | likely range | inside |", "|" + "---|" * 15]
    for i, r in enumerate(rows):
        if not multi_gpu(r):
            continue
        w, measured, plan = workload_of(r), float(r["tokens_per_second"]), planned(r, calibration)
        likely = estimate_speed(w, calibration).likely
        low, high = plan * likely.low, plan * likely.high
        lines.append(f"| {r['case']} | {r['framework']} | {w.world_size}× {w.gpu.name} | {r['model']} | {r['method']} | "
                     f"{r['seq_len']} | {w.cp} | {measured:,.0f} | {plan:,.0f} | {plan / measured:.2f} | "
                     f"{' | '.join(out_of_sample(cv, i))} | {low:,.0f}–{high:,.0f} | {'yes' if low <= measured <= high else 'NO'} |")
    return lines


def terms_table(cases: list[dict], calibration: Calibration) -> list[str]:
    """Per profiled case, per decoder layer: the kernel classes measured and planned (fitted), and the
    host's issue time (a check)."""
    lines = ["| case | " + " | ".join(f"{k} ms" for k in KERNEL_CLASSES) + " | busy ms | host ms (check) |",
             "|---|" + "---|" * (len(KERNEL_CLASSES) + 2)]
    for case in cases:
        plan, measured = per_layer(case, calibration), case["per layer"]
        cells = [f"{measured[f'{k}_ms']:.2f} / {plan[k]:.2f}" for k in KERNEL_CLASSES]
        host = [1000 * issue_seconds(workload_of(case, n), calibration) for n in CUTS]
        host_layer = (host[1] - host[0]) / (CUTS[1] - CUTS[0])
        lines.append(f"| {case['case']} | {' | '.join(cells)} | {measured['busy_ms']:.2f} / {sum(plan.values()):.2f} | "
                     f"{measured['host_ms']:.2f} / {host_layer:.2f} |")
    return lines


def rest_table(cases: list[dict], calibration: Calibration) -> list[str]:
    """The checks: each profiled case's rest (the 2-layer cut beyond its layers: embedding, head, the
    model's own loss), GPU busy and host, measured / planned."""
    lines = ["| case | rest: GPU busy ms | rest: host ms |", "|---|---|---|"]
    for case in cases:
        w2 = workload_of(case, CUTS[0])
        busy = 1000 * gpu_seconds(w2, calibration) - CUTS[0] * sum(per_layer(case, calibration).values())
        host = [1000 * issue_seconds(workload_of(case, n), calibration) for n in CUTS]
        host_rest = host[0] - CUTS[0] * (host[1] - host[0]) / (CUTS[1] - CUTS[0])
        measured = case["rest"]
        lines.append(f"| {case['case']} | {measured['busy_ms']:.2f} / {busy:.2f} | {measured['host_ms']:.2f} / {host_rest:.2f} |")
    return lines


def defaults_table(cases: list[dict], calibration: Calibration) -> list[str]:
    """The GPU kit's 2-layer cuts of the defaults and their alternatives (checks, not fitted): ms per
    update measured and planned (the micro-batch's clocks and the optimizer step)."""
    lines = ["| case (2 layers; LoRA/QLoRA 4096 × 2, full 512 × 1) | measured ms | planned ms | error |", "|---|---|---|---|"]
    for case in cases:
        plan = 1000 * update_seconds(workload_of(case, 2), calibration)
        lines.append(f"| {case['case']} | {case['ms_per_update']:.1f} | {plan:.1f} | {plan / case['ms_per_update'] - 1:+.0%} |")
    return lines


def loss_share(w, calibration: Calibration) -> float:
    """The share of the GPU clock the LM head and loss take: their matmul FLOPs and the loss's bytes
    over the vocabulary (what a larger vocabulary adds), from the model without them."""
    headless = replace(w, model=replace(w.model, vocab_size=1))
    return 1 - gpu_seconds(headless, calibration) / gpu_seconds(w, calibration)


def summary(rows: list[dict], cv: dict[str, dict[int, float]]) -> list[str]:
    """RMS out-of-sample error per chip and shape family, for each kind of leaving out."""
    groups = defaultdict(list)
    for i, r in enumerate(rows):
        if fitted(r) and not multi_gpu(r):
            groups[family_of(r)].append(i)
    lines = ["| chip | shape family | rows | left out: row (RMS) | family (RMS) | chip (RMS) |", "|---|---|---|---|---|---|"]

    def cells(members):
        return " | ".join(f"±{math.exp(rms([cv[t][i] for i in members])) - 1:.0%}" for t in ("measured", "shape", "chip"))

    for (chip, family), members in sorted(groups.items()):
        lines.append(f"| {chip} | {family} | {len(members)} | {cells(members)} |")
    for chip in sorted({k[0] for k in groups}):
        members = [i for (c, _), m in groups.items() if c == chip for i in m]
        lines.append(f"| {chip} | all | {len(members)} | {cells(members)} |")
    return lines


def liger_lines(rows: list[dict], calibration: Calibration) -> list[str]:
    return [f"Liger speed-up, {on['framework']} on {on['device']}, {on['model']} {on['method']}: measured "
            f"{float(on['tokens_per_second']) / float(off['tokens_per_second']):.3f}×, "
            f"planned {planned(on, calibration) / planned(off, calibration):.3f}×" for off, on in liger_pairs(rows)]


def calibration_source(calibration: Calibration, families: dict, spread: dict, architectures: tuple[str, ...]) -> str:
    """CALIBRATION as finetune/plan/speed.py writes it, and speed_range.py's MEASURED, SPREAD and MEASURED_ARCHITECTURES."""
    def table(values: dict[str, float]) -> str:
        return "{" + ", ".join(f'"{k}": {v:.3f}' for k, v in values.items()) + "}"

    c = calibration
    return (f"CALIBRATION = Calibration(\n    layer_issue_s={c.layer_issue_s:.3e}, adapter_issue_s={c.adapter_issue_s:.3e}, "
            f"dequant_issue_s={c.dequant_issue_s:.3e},\n    matmul_efficiency={table(c.matmul_efficiency)},\n"
            f"    attention_speed={table(c.attention_speed)}, masked_attention_speed={c.masked_attention_speed:.3f},\n"
            f"    memory_efficiency={c.memory_efficiency:.3f}, kernel_gpu_s={c.kernel_gpu_s:.3e}, "
            f"expert_tokens_half={c.expert_tokens_half:.0f}, overlap_exponent={c.overlap_exponent:.2f},\n)\n"
            f"MEASURED = {families!r}\nSPREAD = {spread!r}\nMEASURED_ARCHITECTURES = {architectures!r}")
