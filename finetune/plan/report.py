"""Plans → the JSON contract, a readable table, and a stacked-bar PNG. Formatting only."""

from __future__ import annotations

import math
from pathlib import Path

from finetune.config.objectives import OBJECTIVES
from finetune.models.catalog import ModelSpec
from finetune.plan import gpus, moe
from finetune.plan.choose import TIGHT_SHARE, Plan, Request, describe, refused
from finetune.plan.files import launch_command, ray_command
from finetune.plan.memory import GIB, trainable_params, unmeasured_terms
from finetune.plan.params import count_params
from finetune.plan.workload import Workload

TERMS = ("weights", "gradients", "optimizer", "activations", "buffers")


def _gib(value: float) -> float:
    return round(value / GIB, 3)


def plan_dict(p: Plan, tokens: float | None, config_dir: str) -> dict:
    w, m = p.workload, p.memory
    hours, cost = p.hours(tokens), p.cost_usd(tokens)
    return {
        "method": w.method, "strategy": w.strategy.name, "offload": w.offload, "precision": w.precision.name,
        "tp": w.tp, "cp": w.cp, "data_parallel": w.data_parallel_size,
        "optimizer": w.optimizer, "micro_batch_size": w.micro_batch_size, "seq_len": w.seq_len,
        "gradient_checkpointing": w.gradient_checkpointing,
        "gradient_checkpointing_layers": w.recomputed_layers,  # of model.num_layers; 0 without checkpointing
        "gradient_accumulation_steps": w.gradient_accumulation_steps,
        "objective": w.objective, "precompute_reference": w.precompute_reference,
        "liger": w.loss == "liger",
        "chunked_loss": w.loss == "finetune-chunked",
        "compile": w.compile,
        "fits": p.fits,
        "fits_device": p.fits_device,
        "fits_host": p.fits_host,
        "tight": p.tight,
        "margin_gib": round(p.margin_gib, 3),
        "memory_per_gpu_gib": {
            **{term: _gib(getattr(m, term)) for term in TERMS},
            "allocated": _gib(m.allocated),
            "reserved": _gib(m.reserved),
            "device": _gib(m.device(w.world_size)),
            "held": _gib(m.held(w.world_size)),
        },
        "peak_phase": m.peak_phase,
        "memory_unmeasured": unmeasured_terms(w),
        "host_memory_gib": _gib(m.host),
        "host_memory_detail_gib": {"offload": _gib(m.host_offload), "loading": _gib(m.host_loading)},
        "trainable_params": trainable_params(w),
        "tokens_per_second": round(p.speed.tokens_per_second, 1),
        "tokens_per_second_likely": [round(p.speed.low, 1), round(p.speed.high, 1)],
        "communication_bound": p.speed.comm_bound,
        "speed_calibrated": p.speed.calibrated,
        "speed_basis": p.speed_basis,
        "hours": round(hours, 2) if hours is not None else None,
        "hours_likely": _rounded(p.hours_likely(tokens), 2),
        "usd": round(cost, 2) if cost is not None else None,
        "usd_likely": _rounded(p.cost_likely(tokens), 2),
        "launch_command": launch_command(p, config_dir),
        "ray_command": ray_command(p, config_dir),
        "reasons": list(p.reasons),
        "with_experts": experts_dict(p.experts_variant),
    }


def experts_dict(variant: Plan | None) -> dict | None:
    """What a mixture of experts' LoRA plan that adapts no expert would cost with them (Plan.experts_variant)."""
    if variant is None:
        return None
    w = variant.workload
    return {"lora_targets": w.lora_targets, "trainable_params": trainable_params(w), "fits": variant.fits,
            "tight": variant.tight, "device_gib": round(variant.device_gib, 3), "held_gib": round(variant.held_gib, 3),
            "tokens_per_second": round(variant.speed.tokens_per_second, 1)}


def _rounded(pair: tuple[float, float] | None, digits: int) -> list[float] | None:
    return [round(v, digits) for v in pair] if pair else None


def gpu_note(gpu: gpus.GPUSpec) -> list[str]:
    """What a card given by its memory is planned as."""
    if not gpu.speed_of:
        return []
    return [f"{gpu.name}: a card given by its memory ({gpu.memory_gib:g} GiB); its speed, links, price and host RAM are "
            f"planned as the catalog's nearest in memory, {gpu.speed_of} (name the card in --gpus for its own)"]


def model_notes(spec: ModelSpec) -> list[str]:
    """What the plans of this model assume that a reader would not guess: experts all resident and no
    expert parallelism, MXFP4 weights planned dequantized, a vision tower left frozen."""
    notes = list(moe.NOTES) if spec.moe else []
    if spec.quantized == "mxfp4":
        notes.append(moe.MXFP4_NOTE.format(name=spec.name))
    if spec.tower_params:
        notes.append(f"the vision tower ({spec.tower_params / 1e9:.2f}B params) loads with the model and stays frozen: "
                     "text fine-tuning trains the language model")
    return notes


def size_text(spec: ModelSpec) -> str:
    """'30.53B params (3.35B active: 8 of 128 experts per token)', or '8.19B params'."""
    counts = count_params(spec)
    active = (f" ({counts.active / 1e9:.2f}B active: {spec.experts_per_token} of {spec.num_experts} experts per token)"
              if spec.moe else "")
    return f"{counts.total / 1e9:.2f}B params{active}"


def to_json(request: Request, plans: list[Plan], recommended: int | None, config_dir: str) -> dict:
    """The JSON contract of `finetune plan --json` (see the README)."""
    spec, gpu = request.model, request.gpu
    return {
        "model": {
            "name": spec.name, "hf_id": spec.hf_id, "params": count_params(spec).total,
            "active_params": count_params(spec).active, "experts": spec.num_experts,
            "experts_per_token": spec.experts_per_token,
            "layers": spec.num_layers, "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size,
            "source": spec.source, "notes": model_notes(spec),
        },
        "hardware": {
            "gpu": gpu.name, "count": request.gpus_per_node * request.nodes, "gpus_per_node": request.gpus_per_node,
            "nodes": request.nodes, "memory_gib": gpu.memory_gib, "bf16_tflops": gpu.bf16_tflops,
            "fp8_tflops": gpu.fp8_tflops, "memory_tb_per_s": gpu.memory_tb_per_s,
            "interconnect": gpu.interconnect, "usd_per_hour": gpu.usd_per_hour,
            "host_memory_gib_per_node": round(request.host_limit_gib, 1), "speed_of": gpu.speed_of or None,
        },
        "tokens": request.tokens,
        "plans": [plan_dict(p, request.tokens, config_dir) for p in plans],
        "recommended": recommended,
        "refused": refused(request),
    }


def header_lines(request: Request) -> list[str]:
    """What the table is of, how to read its columns, and the notes on the GPU and the model."""
    spec, gpu = request.model, request.gpu
    host_source = "--host-memory" if request.host_memory_gib is not None else f"typical for {gpu.name} hosts"
    return [
        f"{spec.name}: {size_text(spec)} on {request.gpus_per_node * request.nodes}× {gpu.name} "
        f"({gpu.memory_gib:.0f} GiB, {gpu.interconnect}), seq len {request.seq_len}{objective_text(request)}; "
        f"host RAM {request.host_limit_gib:.0f} GiB per node ({host_source})",
        "tp, cp: GPUs of one tensor- / context-parallel group; "
        "memory per GPU in GiB: W weights, G gradients, O optimizer, A activations, B buffers; device = allocated + "
        "the allocator's cache + CUDA context (nvidia-smi at the peak); fits: allocated + CUDA context, what cannot be "
        f"given back, within the card; tight: less than {TIGHT_SHARE:.0%} of it to spare; host = GiB per node (offload, "
        "or loading the weights); "
        "tok/s~ = not measured on this chip and shape family (see the speed reason); likely = the range the "
        "speed model's cross-validated errors support (80 %), hours and $ over it",
        *(f"note: {note}" for note in gpu_note(gpu) + model_notes(spec)),
        "",
    ]


def table(request: Request, plans: list[Plan], recommended: int | None, config_dir: str,
          heading: str = "Recommended", launch: str | None = None) -> str:
    """One row per plan, then the recommendation (or `heading`) with its reasons and launch command
    (`launch`: what to print instead of the plan's own, e.g. a dry run's command and its files)."""
    gpu = request.gpu
    world = request.gpus_per_node * request.nodes
    lines = header_lines(request)
    header = ("", "method", "strategy", "offload", "tp", "cp", "mbs", "ckpt", "W", "G", "O", "A", "B", "device", "host", "fits",
              "tok/s", "likely", "hours", "$")
    rows = [header]
    for i, p in enumerate(plans):
        w, m = p.workload, p.memory
        hours, cost = p.hours(request.tokens), p.cost_usd(request.tokens)
        rows.append((
            "*" if i == recommended else "", w.method, w.strategy.label, w.offload, str(w.tp), str(w.cp),
            str(w.micro_batch_size), checkpointing_cell(w),
            *(f"{getattr(m, term) / GIB:.1f}" for term in TERMS),
            f"{p.device_gib:.1f}", f"{p.host_gib:.0f}", _fits_cell(p),
            f"{p.speed.tokens_per_second:,.0f}{'' if p.speed.calibrated else '~'}", short_span(p.speed.low, p.speed.high),
            with_range(hours, p.hours_likely(request.tokens), ".1f"), with_range(cost, p.cost_likely(request.tokens), ",.0f"),
        ))
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines += ["  ".join(cell.rjust(width) if c >= 4 else cell.ljust(width) for c, (cell, width) in enumerate(zip(row, widths)))
              for row in rows]
    lines.append("")
    left_out = refused(request)
    if not plans:
        lines.append(f"Nothing is planned on {world}× {gpu.name}: the trainer refuses what was asked:")
        return "\n".join(lines + [f"  - {reason}" for reason in left_out])
    if left_out:
        lines += ["Left out (the trainer refuses them):", *(f"  - {reason}" for reason in left_out), ""]
    if recommended is None:
        lines.append(f"Nothing fits on {world}× {gpu.name}. Closest:")
        lines += [f"  - {why_not(p)}" for p in plans[:3]]
        lines.append("Try more hosts (host RAM is per node), less offload, or --host-memory with your hosts' RAM."
                     if all(p.fits_device for p in plans[:3]) else "Try more GPUs, QLoRA, a shorter --seq-len, or offload.")
        return "\n".join(lines)
    best = plans[recommended]
    lines.append(f"{heading}: {describe(best.workload)}, micro batch {best.workload.micro_batch_size}"
                 + (f", gradient checkpointing ({checkpointing_cell(best.workload)} layers)"
                    if best.workload.gradient_checkpointing else ""))
    lines += [f"  - {reason}" for reason in best.reasons]
    lines.append(f"  launch: {launch or launch_command(best, config_dir)}")
    if launch is None:
        lines.append(f"  on Ray: {ray_command(best, config_dir)}")
    losers = [p for p in plans if not p.fits]
    if losers:
        lines.append("Why others lose:")
        lines += [f"  - {why_not(p)}" for p in losers]
    return "\n".join(lines)


def short_span(low: float, high: float) -> str:
    """'4.8k–8.0k': a range in three significant digits."""
    return f"{_short(low)}–{_short(high)}"


def _short(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.{max(0, 2 - int(math.log10(value / scale)))}f}{unit}"
    return f"{value:.0f}"


def with_range(value: float | None, likely: tuple[float, float] | None, form: str) -> str:
    """'6.8 (4.7–9.9)', or '-' without training tokens."""
    if value is None:
        return "-"
    return f"{value:{form}} ({likely[0]:{form}}–{likely[1]:{form}})"


def _fits_cell(p: Plan) -> str:
    """The table's fits column: yes, tight with its margin, or NO with the constraints that failed."""
    failed = [name for name, ok in (("GPU", p.fits_device), ("host RAM", p.fits_host)) if not ok]
    if failed:
        return f"NO ({', '.join(failed)})"
    return f"tight ({p.margin_gib:.1f} GiB)" if p.tight else "yes"


def why_not(p: Plan) -> str:
    """Every constraint a plan fails, with both numbers (`explain` puts its failures first)."""
    return "; ".join(p.reasons[: (not p.fits_device) + (not p.fits_host)] or p.reasons[:1])


def objective_text(request: Request) -> str:
    """How a heading names a preference objective: each micro batch counts pairs (or labelled rows)."""
    if request.objective == "sft":
        return ""
    o = OBJECTIVES[request.objective]
    unit = "pairs, 2 sequences each" if o.rows == "paired" else "labelled rows"
    return f", --objective {o.name} (micro batch in {unit})"


def what_fits_table(results: list[tuple[Request, list[Plan], int | None]]) -> str:
    """One line per model: its recommended plan on these GPUs, or how far the closest plan misses."""
    request = results[0][0]
    world = request.gpus_per_node * request.nodes
    lines = [f"What fits on {world}× {request.gpu.name} ({request.gpu.memory_gib:.0f} GiB, host RAM "
             f"{request.host_limit_gib:.0f} GiB per node), seq len {request.seq_len}{objective_text(request)}:",
             *(f"note: {note}" for note in gpu_note(request.gpu))]
    for req, plans, recommended in results:
        name = f"{req.model.name} ({count_params(req.model).total / 1e9:.1f}B)"
        if not plans:
            lines.append(f"  {name:<24} nothing planned: {refused(req)[0] if refused(req) else 'no combination applies'}")
            continue
        if recommended is None:
            closest = plans[0]
            lines.append(f"  {name:<24} nothing fits (closest: {describe(closest.workload)}, {closest.held_gib:.0f} GiB "
                         f"per GPU, {closest.host_gib:.0f} GiB host)")
            continue
        best = plans[recommended]
        fitting = sorted({p.workload.method for p in plans if p.fits})
        hours, cost = best.hours(req.tokens), best.cost_usd(req.tokens)
        time_and_cost = (f"  {with_range(hours, best.hours_likely(req.tokens), ',.1f')} h "
                         f"${with_range(cost, best.cost_likely(req.tokens), ',.0f')}") if hours is not None else ""
        lines.append(
            f"  {name:<24} {describe(best.workload):<30} micro batch {best.workload.micro_batch_size:<3} "
            f"{best.device_gib:5.1f} GiB{' tight' if best.tight else ''}  {best.speed.tokens_per_second:>9,.0f} tok/s "
            f"(likely {short_span(best.speed.low, best.speed.high)}){time_and_cost}   methods that fit: {', '.join(fitting)}"
        )
    lines.append("Details for one model: finetune plan --model NAME --gpus ...")
    return "\n".join(lines)


def draw_png(request: Request, plans: list[Plan], recommended: int | None, path: str | Path) -> Path:
    """Stacked bars of per-GPU memory per plan, with the GPU's capacity as a line."""
    labels = [describe(p.workload) + ("  ★" if i == recommended else "") for i, p in enumerate(plans)]
    title = f"{request.model.name} on {request.gpus_per_node * request.nodes}× {request.gpu.name}, seq {request.seq_len}"
    return _draw_bars(plans, labels, request, title, path)


def draw_what_fits_png(results: list[tuple[Request, list[Plan], int | None]], path: str | Path) -> Path:
    """Stacked bars of each model's recommended plan (or its closest miss), one bar per model."""
    chosen = [(req, plans[recommended if recommended is not None else 0]) for req, plans, recommended in results if plans]
    labels = [f"{req.model.name}: {describe(p.workload)}" + ("" if p.fits else " (does not fit)") for req, p in chosen]
    request = results[0][0]
    title = f"What fits on {request.gpus_per_node * request.nodes}× {request.gpu.name}, seq {request.seq_len}"
    return _draw_bars([p for _, p in chosen], labels, request, title, path)


def _draw_bars(plans: list[Plan], labels: list[str], request: Request, title: str, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(max(6, 0.7 * len(plans) + 2), 5))
    bottom = [0.0] * len(plans)
    for term in TERMS:
        values = [getattr(p.memory, term) / GIB for p in plans]
        axis.bar(range(len(plans)), values, bottom=bottom, label=term)
        bottom = [b + v for b, v in zip(bottom, values)]
    overhead = [p.device_gib - b for p, b in zip(plans, bottom)]
    axis.bar(range(len(plans)), overhead, bottom=bottom, label="allocator cache + CUDA context", color="lightgrey")
    axis.axhline(request.gpu.memory_gib, color="red", linestyle="--", label=f"{request.gpu.name} ({request.gpu.memory_gib:.0f} GiB)")
    axis.set_xticks(range(len(plans)), labels, rotation=60, ha="right", fontsize=8)
    axis.set_ylabel("GiB per GPU")
    axis.set_title(title)
    axis.legend(fontsize=8)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def checkpointing_cell(w: Workload) -> str:
    """no, all, or N/L: how many of the decoder layers recompute in the backward."""
    if not w.gradient_checkpointing:
        return "no"
    return f"{w.recomputed_layers}/{w.model.num_layers}" if w.partial_checkpointing else "all"
