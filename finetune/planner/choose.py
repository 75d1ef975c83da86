"""From a request with open choices ("auto") to ranked plans, each with its reasons.

Enumerates method × strategy × offload, picks for each the cheapest settings that fit (no
checkpointing if possible) and the largest micro batch that fits, then recommends the fastest
fitting plan; ties go to fewer GPUs and less offload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from finetune.catalog.gpus import GPUSpec
from finetune.catalog.models import ModelSpec
from finetune.errors import FinetuneError
from finetune.planner.memory import GIB, Breakdown, estimate
from finetune.planner.speed import Speed, estimate_speed
from finetune.planner.workload import METHODS, OFFLOADS, OPTIMIZERS, PRECISIONS, STRATEGIES, VALID_OFFLOADS, Workload

# Largest micro batch the search tries: beyond it a GPU is saturated and accumulation is free.
MAX_MICRO_BATCH = 64
# Plans whose speed differs by less than this fraction count as tied.
SPEED_TIE = 0.03
OFFLOAD_RANK = {name: rank for rank, name in enumerate(OFFLOADS)}
STRATEGY_LABEL = {"single": "1 GPU", "ddp": "DDP", "fsdp": "FSDP2", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}


@dataclass(frozen=True)
class Request:
    """What the user asked: fixed values, or "auto" / None where the planner should choose."""

    model: ModelSpec
    gpu: GPUSpec
    gpus_per_node: int
    nodes: int = 1
    method: str = "auto"
    strategy: str = "auto"
    offload: str = "auto"
    precision: str = "auto"
    optimizer: str = "auto"
    micro_batch_size: int | None = None
    seq_len: int = 2048
    gradient_checkpointing: bool | None = None
    lora_r: int = 16
    lora_targets: str = "all-linear"
    gradient_accumulation_steps: int = 1
    tokens: float | None = None  # training tokens, for hours and cost


@dataclass(frozen=True)
class Plan:
    workload: Workload
    memory: Breakdown
    speed: Speed
    reasons: tuple[str, ...]

    @property
    def device_gib(self) -> float:
        return self.memory.device(self.workload.world_size) / GIB

    @property
    def fits(self) -> bool:
        return self.device_gib <= self.workload.gpu.memory_gib

    def hours(self, tokens: float | None) -> float | None:
        return tokens / self.speed.tokens_per_second / 3600 if tokens else None

    def cost_usd(self, tokens: float | None) -> float | None:
        hours = self.hours(tokens)
        return hours * self.workload.world_size * self.workload.gpu.usd_per_hour if hours is not None else None


def validate(request: Request) -> None:
    """Every problem with the request at once, each with its fix."""
    problems = []
    choices = {
        "method": ("auto", *METHODS), "strategy": ("auto", *STRATEGIES), "offload": ("auto", *OFFLOADS),
        "precision": ("auto", *PRECISIONS), "optimizer": ("auto", *OPTIMIZERS),
    }
    for name, allowed in choices.items():
        if getattr(request, name) not in allowed:
            problems.append(f"--{name} {getattr(request, name)!r} is not one of {', '.join(allowed)}")
    world = request.gpus_per_node * request.nodes
    if request.strategy == "single" and world > 1:
        problems.append(f"--strategy single uses one GPU, but {world} were given: use --gpus 1x{request.gpu.name} or a multi-GPU strategy")
    if request.strategy not in ("auto", "single") and world == 1:
        problems.append(f"--strategy {request.strategy} needs at least 2 GPUs: use --gpus 2x{request.gpu.name} or --strategy single")
    if request.strategy in VALID_OFFLOADS and request.offload not in ("auto", *VALID_OFFLOADS[request.strategy]):
        problems.append(
            f"--strategy {request.strategy} cannot offload {request.offload}: it supports "
            f"{', '.join(VALID_OFFLOADS[request.strategy])} (parameter offload needs fsdp or zero3)"
        )
    if request.precision.startswith("bf16") and not request.gpu.bf16:
        problems.append(f"{request.gpu.name} has no bf16: use --precision fp16-mixed or fp32")
    for name in ("gpus_per_node", "nodes", "seq_len", "lora_r", "gradient_accumulation_steps"):
        if getattr(request, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(request, name)}")
    if request.micro_batch_size is not None and request.micro_batch_size < 1:
        problems.append(f"--micro-batch-size must be ≥ 1, got {request.micro_batch_size}")
    if problems:
        raise FinetuneError("Cannot plan this request:\n  - " + "\n  - ".join(problems))


def default_precision(method: str, gpu: GPUSpec) -> str:
    """Full fine-tuning keeps fp32 master weights (bf16-mixed); LoRA and QLoRA train fp32 adapters
    over a frozen 16-bit base, so storing that base in fp32 would only waste memory."""
    if not gpu.bf16:
        return "fp16-mixed"
    return "bf16-mixed" if method == "full" else "bf16-true"


def candidates(request: Request) -> list[Workload]:
    """Every method × strategy × offload the request leaves open, with micro batch 1."""
    world = request.gpus_per_node * request.nodes
    methods = METHODS if request.method == "auto" else (request.method,)
    if request.strategy != "auto":
        strategies = (request.strategy,)
    else:
        strategies = ("single",) if world == 1 else STRATEGIES[1:]
    workloads = []
    for method in methods:
        for strategy in strategies:
            offloads = VALID_OFFLOADS[strategy] if request.offload == "auto" else (request.offload,)
            for offload in offloads:
                workloads.append(Workload(
                    model=request.model, gpu=request.gpu, gpus_per_node=request.gpus_per_node, nodes=request.nodes,
                    method=method, strategy=strategy, offload=offload,
                    precision=default_precision(method, request.gpu) if request.precision == "auto" else request.precision,
                    optimizer="adamw" if request.optimizer == "auto" else request.optimizer,
                    micro_batch_size=request.micro_batch_size or 1, seq_len=request.seq_len,
                    gradient_checkpointing=bool(request.gradient_checkpointing),
                    lora_r=request.lora_r, lora_targets=request.lora_targets,
                    gradient_accumulation_steps=request.gradient_accumulation_steps,
                ))
    return workloads


def fits(w: Workload) -> bool:
    return estimate(w).device(w.world_size) <= w.gpu.memory_gib * GIB


def largest_micro_batch(w: Workload) -> int:
    """Largest micro batch ≤ MAX_MICRO_BATCH that fits (memory grows with it), 0 if none does."""
    if not fits(w.with_micro_batch(1)):
        return 0
    low, high = 1, MAX_MICRO_BATCH
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(w.with_micro_batch(middle)) else (low, middle - 1)
    return low


def settle(request: Request, w: Workload) -> Workload:
    """Fill the open knobs of one candidate: checkpointing only when needed, largest micro batch."""
    options = (False, True) if request.gradient_checkpointing is None else (request.gradient_checkpointing,)
    for checkpointing in options:
        candidate = replace(w, gradient_checkpointing=checkpointing)
        if request.micro_batch_size is not None:
            if fits(candidate):
                return candidate
            continue
        micro = largest_micro_batch(candidate)
        if micro:
            return candidate.with_micro_batch(micro)
    return replace(w, gradient_checkpointing=options[-1])  # the smallest footprint, shown as not fitting


def plan(request: Request) -> tuple[list[Plan], int | None]:
    """Ranked plans (fitting ones fastest first) and the index of the recommended one."""
    validate(request)
    settled = [settle(request, w) for w in candidates(request)]
    plans = [Plan(w, estimate(w), estimate_speed(w), ()) for w in settled]
    plans = _drop_needless_offload(plans, explicit=request.offload != "auto")
    fitting = sorted((p for p in plans if p.fits), key=_preference)
    failing = sorted((p for p in plans if not p.fits), key=lambda p: p.device_gib)
    ranked = fitting + failing
    best = ranked[0] if fitting else None
    return [replace(p, reasons=explain(p, best)) for p in ranked], (0 if best else None)


def _drop_needless_offload(plans: list[Plan], explicit: bool) -> list[Plan]:
    """Offload trades speed for memory: show an offload variant only when the same method and
    strategy with less offload does not fit."""
    if explicit:
        return plans
    fitting = {(p.workload.method, p.workload.strategy, p.workload.offload) for p in plans if p.fits}
    def needed(p: Plan) -> bool:
        w = p.workload
        return not any((w.method, w.strategy, o) in fitting for o in OFFLOADS[: OFFLOAD_RANK[w.offload]])
    return [p for p in plans if needed(p)]


def _preference(p: Plan) -> tuple:
    """Fastest first (speeds within SPEED_TIE share a bucket), then fewer GPUs, less offload, less memory."""
    speed_bucket = round(math.log(p.speed.tokens_per_second) / math.log(1 + SPEED_TIE))
    return (-speed_bucket, p.workload.world_size, OFFLOAD_RANK[p.workload.offload], p.device_gib)


def explain(p: Plan, best: Plan | None) -> tuple[str, ...]:
    """Why this plan fits or not, and why it is or is not the recommendation."""
    w, m = p.workload, p.memory
    capacity = w.gpu.memory_gib
    label = describe(w)
    reasons = []
    if p.fits:
        reasons.append(f"fits: {p.device_gib:.1f} of {capacity:.1f} GiB per GPU, peak in the {m.peak_phase}")
    else:
        terms = {"weights": m.weights, "gradients": m.gradients, "optimizer states": m.optimizer,
                 "activations": m.activations, "buffers": m.buffers}
        name, largest = max(terms.items(), key=lambda item: item[1])
        if largest / GIB > capacity:
            reasons.append(f"{label}: {name} alone {largest / GIB:.1f} GiB > {capacity:.1f} GiB")
        else:
            reasons.append(f"{label}: needs {p.device_gib:.1f} GiB per GPU > {capacity:.1f} GiB even at micro batch 1"
                           + (" with checkpointing" if w.gradient_checkpointing else ""))
    if p.speed.comm_bound:
        reasons.append(
            f"communication-bound over {w.gpu.interconnect if w.nodes == 1 else 'the network'}: "
            f"{p.speed.comm_s_per_token * 1e6:.0f} µs of communication vs {p.speed.compute_s_per_token * 1e6:.0f} µs compute per token"
        )
    if w.offload != "none":
        reasons.append(f"offload: {m.host_offload / GIB:.0f} GiB of host RAM per node, PCIe copies every step")
    if best is p:
        reasons.append(f"recommended: fastest plan that fits ({p.speed.tokens_per_second:,.0f} tokens/s)")
    elif best is not None and p.fits:
        if _preference(p)[0] == _preference(best)[0]:
            reasons.append(f"as fast as {describe(best.workload)} but needs more GPUs, offload or memory")
        else:
            reasons.append(f"slower than {describe(best.workload)}: {p.speed.tokens_per_second:,.0f} vs {best.speed.tokens_per_second:,.0f} tokens/s")
    return tuple(reasons)


def describe(w: Workload) -> str:
    offload = "" if w.offload == "none" else f" + {w.offload} offload"
    return f"{w.method} {STRATEGY_LABEL[w.strategy]}{offload}"
