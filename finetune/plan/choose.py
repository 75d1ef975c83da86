"""From a request with open choices ("auto") to ranked plans, each with its reasons.

Enumerates method × strategy × offload × TP/CP layout, picks for each the largest micro batch that
fits, with checkpointing where it is needed or faster, of as few layers as leave headroom, then
recommends the fastest fitting plan. Every plan whose speed lies within the fastest plan's likely
range (plan/speed_range.py) is tied with it: the speed model cannot tell them apart. Ties go to
fewer GPUs, then smaller TP/CP groups (data parallelism alone first), then less offload (host RAM
and PCIe copies every step, unmeasured), then the method that changes the model least (full, then
LoRA, then QLoRA, which quantizes the base), then the simpler strategy (one GPU, DDP, then
sharding), then less memory per GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from finetune.config.names import (
    METHODS,
    OFFLOADS,
    OPTIMIZERS,
    PRECISIONS,
    STRATEGIES,
    Method,
    Offload,
    Optimizer,
    Precision,
    Strategy,
    check_precision,
    default_precision,
    named,
)
from finetune.config.objectives import OBJECTIVES, precomputes_reference
from finetune.config.switches import Switches, fp8_problem, resolve_switches
from finetune.errors import FinetuneError
from finetune.models.catalog import ModelSpec
from finetune.plan import gpus, moe, parallel, refusals
from finetune.plan.gpus import GPUSpec
from finetune.plan.memory import ALLOCATOR_SLACK, GIB, Breakdown, estimate, kept_layer_activations, trainable_params, unmeasured_terms
from finetune.plan.speed import CALIBRATION, Speed, dequantization_seconds, estimate_speed, gpu_seconds, issue_seconds
from finetune.plan.workload import Workload, runs_fp8

# Largest micro batch the search tries: beyond it a GPU is saturated and accumulation is free.
MAX_MICRO_BATCH = 64
# While settling one candidate's checkpointing: speeds within this fraction count as the same
# (between plans, the fastest plan's likely range decides ties: see `rank`).
SPEED_TIE = 0.03
# Tie-breaks, in order: the method that changes the model least (QLoRA trains on a quantized base),
# the simpler strategy (sharding adds a layer a model that fits without it does not need).
METHOD_RANK = {"full": 0, "lora": 1, "qlora": 2}
# Layers are left un-checkpointed only while the plan stays within this share of the GPU's memory:
# the memory model is within ~5 % of measured, and running out costs more than the recompute saves.
PARTIAL_CHECKPOINTING_HEADROOM = 0.9
# ... with the activations of the layers left un-checkpointed counted this much larger, since no GPU run
# has measured them (memory.unmeasured_terms): CPU fake-tensor runs are their only check, where the plan
# came out up to 6 % under (bench/RESULTS.md), and CUDA's kernels may hold more than CPU's. A judgment,
# not a fit: the GPU kit's "ckpt as planned" rows measure them, and this comes down to what they show.
KEPT_ACTIVATIONS_MARGIN = 0.25
OFFLOAD_RANK = {name: rank for rank, name in enumerate(OFFLOADS)}
# A plan fits when what it cannot give back (memory.Breakdown.held) fits the card; it is "tight" when the
# margin left is less than this share of what it allocates (finetune's own GPU runs measured −7 % … +9 % of
# their planned allocated memory: bench/RESULTS.md), or when it fits only once the allocator has given its
# cache back. The search picks micro batches and checkpointing that are not tight; a plan that is tight
# even at its smallest is shown as "fits, tight", and ranked after the plans with room.
TIGHT_SHARE = 0.07


@dataclass(frozen=True)
class Request:
    """What the user asked: fixed values, or "auto" / None where the planner should choose.
    `strategy` and `precision` may be given by name ("zero3", "auto"); the request holds the
    Strategy and Precision, or None for auto."""

    model: ModelSpec
    gpu: GPUSpec
    gpus_per_node: int
    nodes: int = 1
    method: Method | Literal["auto"] = "auto"
    strategy: Strategy | None = None
    offload: Offload | Literal["auto"] = "auto"
    precision: Precision | None = None
    optimizer: Optimizer | Literal["auto"] = "auto"
    micro_batch_size: int | None = None
    seq_len: int = 2048
    gradient_checkpointing: bool | None = None
    gradient_checkpointing_layers: int | None = None  # None: the planner chooses (all, or the fewest with headroom)
    lora_r: int = 16
    lora_targets: str = "all-linear"
    gradient_accumulation_steps: int = 1
    tokens: float | None = None  # training tokens, for hours and cost
    host_memory_gib: float | None = None  # host RAM per node; None: what the GPU's usual instance has
    liger: bool | None = None  # Liger kernels (--liger): no full-vocabulary logits, faster GPU clock; unset: as the trainer decides
    chunked_loss: bool | None = None  # the loss through the LM head in chunks; unset: where the trainer turns it on
    compile: bool = False  # regional compilation of the decoder blocks (--compile): less per-layer issue time
    fp8: bool = False  # LoRA's frozen base in float8 matmuls (--fp8): LoRA plans only, on GPUs with FP8 tensor cores
    tp: int | None = None  # tensor parallel size; None: the planner searches (plan/parallel.py)
    cp: int | None = None  # context parallel size; None: the planner searches long rows
    objective: str = "sft"  # config.objectives.OBJECTIVES: a preference pair runs two sequences, and maybe a reference
    precompute_reference: bool | None = None  # unset: as the trainer decides it (config.objectives.precomputes_reference)

    def __post_init__(self) -> None:
        for name, table in (("strategy", STRATEGIES), ("precision", PRECISIONS)):
            value = getattr(self, name)
            object.__setattr__(self, name, None if value == "auto" else named(table, value, f"--{name}"))

    @property
    def host_limit_gib(self) -> float:
        return self.host_memory_gib if self.host_memory_gib is not None else self.gpu.host_gib_per_gpu * self.gpus_per_node


@dataclass(frozen=True)
class Plan:
    workload: Workload
    memory: Breakdown
    speed: Speed
    reasons: tuple[str, ...]
    host_limit_gib: float = float("inf")  # host RAM per node the plan may use

    experts_variant: Plan | None = None  # a LoRA plan of a mixture of experts that adapts none: the same with them

    @property
    def device_gib(self) -> float:
        """Device memory at the peak as nvidia-smi would show it, the allocator's cache included."""
        return self.memory.device(self.workload.world_size) / GIB

    @property
    def held_gib(self) -> float:
        """Device memory that cannot be given back at the peak (memory.Breakdown.held)."""
        return self.memory.held(self.workload.world_size) / GIB

    @property
    def margin_gib(self) -> float:
        """The card's memory left beside `held_gib` (negative: does not fit)."""
        return self.workload.gpu.memory_gib - self.held_gib

    @property
    def host_gib(self) -> float:
        return self.memory.host / GIB

    @property
    def fits_device(self) -> bool:
        return self.margin_gib >= 0

    @property
    def tight(self) -> bool:
        """Fits, but without the room TIGHT_SHARE asks for (see `roomy`)."""
        return self.fits_device and not roomy(self.workload, self.memory)

    @property
    def fits_host(self) -> bool:
        return self.host_gib <= self.host_limit_gib

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    @property
    def speed_basis(self) -> str:
        """What the speed rests on (speed_range), and for a card given by its memory, whose speed it borrows."""
        gpu = self.workload.gpu
        if not gpu.speed_of:
            return self.speed.basis
        like = gpus.GPUS[gpu.speed_of]
        return (f"of a {gpu.memory_gib:g} GiB card given by its memory, planned as the catalog card nearest in memory, "
                f"{like.name} ({like.memory_gib:g} GiB, {like.bf16_tflops:g} TFLOP/s bf16; name the card for its own): "
                f"{self.speed.basis}")

    def hours(self, tokens: float | None, tokens_per_second: float | None = None) -> float | None:
        """Hours to train `tokens` at the plan's tokens/s (or at `tokens_per_second`, e.g. a bound of its range)."""
        return tokens / (tokens_per_second or self.speed.tokens_per_second) / 3600 if tokens else None

    def cost_usd(self, tokens: float | None, tokens_per_second: float | None = None) -> float | None:
        hours = self.hours(tokens, tokens_per_second)
        return hours * self.workload.world_size * self.workload.gpu.usd_per_hour if hours is not None else None

    def hours_likely(self, tokens: float | None) -> tuple[float, float] | None:
        """(fewest, most) hours over the likely range of tokens/s."""
        return (self.hours(tokens, self.speed.high), self.hours(tokens, self.speed.low)) if tokens else None

    def cost_likely(self, tokens: float | None) -> tuple[float, float] | None:
        return (self.cost_usd(tokens, self.speed.high), self.cost_usd(tokens, self.speed.low)) if tokens else None


def validate(request: Request) -> None:
    """Every problem with the request at once, each with its fix."""
    problems = []
    choices = {
        "method": ("auto", *METHODS), "offload": ("auto", *OFFLOADS), "optimizer": ("auto", *OPTIMIZERS),
        "objective": tuple(OBJECTIVES),
    }
    for name, allowed in choices.items():
        if getattr(request, name) not in allowed:
            problems.append(f"--{name} {getattr(request, name)!r} is not one of {', '.join(allowed)}")
    world = request.gpus_per_node * request.nodes
    strategy, precision = request.strategy, request.precision
    if strategy is not None:
        problems.extend(_strategy_problems(strategy, request, world))
    if precision is not None and precision.compute == "bfloat16" and not request.gpu.bf16:
        problems.append(f"{request.gpu.name} has no bf16: use --precision fp16-true (LoRA/QLoRA), fp16-mixed or fp32")
    if precision is not None and request.method in METHODS:
        try:
            check_precision(precision, request.method, strategy, request.offload if request.offload != "auto" else "none")
        except FinetuneError as e:
            problems.append(str(e))
    for name in ("gpus_per_node", "nodes", "seq_len", "lora_r", "gradient_accumulation_steps", "tp", "cp"):
        value = getattr(request, name)
        if value is not None and value < 1:
            problems.append(f"--{name.replace('_', '-')} must be ≥ 1, got {value}")
    if request.micro_batch_size is not None and request.micro_batch_size < 1:
        problems.append(f"--micro-batch-size must be ≥ 1, got {request.micro_batch_size}")
    if request.host_memory_gib is not None and request.host_memory_gib <= 0:
        problems.append(f"--host-memory must be > 0 GiB, got {request.host_memory_gib:g}")
    if request.fp8:
        problems += fp8_request_problems(request)
    if request.tokens is not None and not 0 < request.tokens < math.inf:  # inf: no hours, and not JSON
        problems.append(f"--tokens must be a finite number > 0 (e.g. 1e9), got {request.tokens:g}")
    if problems:
        raise FinetuneError("Cannot plan this request:\n  - " + "\n  - ".join(problems))


def fp8_request_problems(request: Request) -> list[str]:
    """What `--fp8` cannot plan: a GPU without float8 matmuls, or a method, precision or strategy the
    run would refuse (config.switches.fp8_problem)."""
    problems = []
    if not runs_fp8(request.gpu):
        problems.append(f"--fp8: {request.gpu.name} cannot run finetune's float8 matmuls (NVIDIA GPUs of compute "
                        "capability 8.9 or newer: L40S, RTX 4090, RTX 6000 Ada, H100, H200)")
    method = "lora" if request.method == "auto" else request.method
    precision = (request.precision or default_precision(method, request.gpu.bf16)).name
    strategy = request.strategy or STRATEGIES["ddp" if request.gpus_per_node * request.nodes > 1 else "single"]
    why = fp8_problem(method, precision, strategy, True, request.tp or 1)
    return problems + ([why] if why else [])


def _strategy_problems(strategy: Strategy, request: Request, world: int) -> list[str]:
    """What a fixed --strategy cannot do with the request's GPUs and offload."""
    problems = []
    if not strategy.distributed and world > 1:
        problems.append(f"--strategy {strategy.name} uses one GPU, but {world} were given: "
                        f"use --gpus 1x{request.gpu.name} or a multi-GPU strategy")
    if strategy.distributed and world == 1:
        problems.append(f"--strategy {strategy.name} needs at least 2 GPUs: use --gpus 2x{request.gpu.name} or --strategy single")
    if request.offload not in ("auto", *strategy.offloads):
        problems.append(
            f"--strategy {strategy.name} cannot offload {request.offload}: it supports "
            f"{', '.join(strategy.offloads)} (parameter offload needs fsdp or zero3)"
        )
    return problems


def candidates(request: Request) -> list[Workload]:
    """Every method × strategy × offload the request leaves open, with micro batch 1. Combinations
    the trainer would refuse (names.check_precision, config/parallelism.py) are left out: `refused` says why."""
    return _enumerate(request)[0]


def refused(request: Request) -> list[str]:
    """Why combinations the request asked for are left out, in the trainer's words, each once: a
    precision or a TP/CP layout fixed by the request that it refuses for some method, strategy or
    offload. Refusals of what the planner chose itself are not listed (with --tp and strategy auto, a
    ZeRO strategy is simply not tried), unless they are all there is to say."""
    workloads, reasons, every = _enumerate(request)
    return list(dict.fromkeys(reasons or ([] if workloads else every)))


def _enumerate(request: Request) -> tuple[list[Workload], list[str], list[str]]:
    """(candidates, refusals of what the request fixed, refusals of every kind)."""
    world = request.gpus_per_node * request.nodes
    methods = METHODS if request.method == "auto" else (request.method,)
    if request.strategy is not None:
        strategies = (request.strategy,)
    else:
        strategies = tuple(s for s in STRATEGIES.values() if s.distributed == (world > 1))
    workloads, reasons, every = [], [], []
    for method in methods:
        precision = request.precision or default_precision(method, request.gpu.bf16)
        for strategy in strategies:
            offloads = strategy.offloads if request.offload == "auto" else (request.offload,)
            for offload in offloads:
                # what the request fixed refuses this combination, rather than a choice of the planner's
                asked = (request.strategy is not None or strategy.fsdp) and (request.offload != "auto" or offload == "none")
                try:
                    check_precision(precision, method, strategy, offload)
                except FinetuneError as e:
                    every.append(str(e))
                    reasons += [str(e)] if asked and request.precision is not None else []
                    continue
                workload = base_workload(request, method, strategy, offload, precision)
                why_not_fp8 = fp8_problem(method, precision.name, strategy, True) if request.fp8 else None
                if why_not_fp8:  # --fp8 plans only what runs with it (LoRA in bf16-true, one GPU or DDP)
                    every.append(why_not_fp8)
                    reasons += [why_not_fp8] if asked else []
                    continue
                laid_out = layouts(request, workload)
                if not laid_out:
                    problems = refusals.layout_problems(replace(workload, tp=request.tp or 1, cp=request.cp or 1))
                    every += problems
                    reasons += problems if asked else []
                workloads += [replace(workload, tp=tp, cp=cp, loss=workload.loss if tp == cp == 1 else planned_switches(
                    request, strategy, method, workload.optimizer, tp, cp).loss) for tp, cp in laid_out]
    return workloads, reasons, every


def base_workload(request: Request, method: str, strategy: Strategy, offload: str, precision: Precision) -> Workload:
    """The request as one method × strategy × offload, at micro batch 1, data parallel only."""
    optimizer = "adamw" if request.optimizer == "auto" else request.optimizer
    switches = planned_switches(request, strategy, method, optimizer)
    return Workload(
        model=request.model, gpu=request.gpu, gpus_per_node=request.gpus_per_node, nodes=request.nodes,
        method=method, strategy=strategy, offload=offload, precision=precision, optimizer=optimizer,
        micro_batch_size=request.micro_batch_size or 1, seq_len=request.seq_len,
        gradient_checkpointing=bool(request.gradient_checkpointing),
        checkpointed_layers=request.gradient_checkpointing_layers,
        lora_r=request.lora_r, lora_targets=request.lora_targets,
        gradient_accumulation_steps=request.gradient_accumulation_steps,
        loss=switches.loss, fused_optimizer=switches.fused_adamw, compile=request.compile, fp8=request.fp8,
        objective=request.objective,
        precompute_reference=precomputes_reference(request.objective, request.precompute_reference, method),
    )


def planned_switches(request: Request, strategy: Strategy, method: str, optimizer: str, tp: int = 1,
                     cp: int = 1) -> Switches:
    """Liger, the chunked loss and fused AdamW as the trainer will decide them on the request's GPUs
    with this machine's packages (config.switches); an asked-for Liger that is not installed here is
    planned as on a machine that has it."""
    return resolve_switches(liger=request.liger, chunked_loss=request.chunked_loss, optimizer=optimizer, method=method,
                            lora_targets=request.lora_targets, cuda=True, strategy=strategy,
                            model_type=request.model.model_type, assume_liger=True, tp=tp, cp=cp)


def layouts(request: Request, w: Workload) -> list[tuple[int, int]]:
    """(tp, cp) of each layout to plan `w` with: the request's unless refusals.layout_problems refuses
    it, else data parallelism alone plus every TP size the trainer runs it with, and the CP sizes for
    long rows (parallel.CP_MIN_SEQ_LEN). The trainer runs TP or CP, not both."""
    if request.tp is not None or request.cp is not None:
        tp, cp = request.tp or 1, request.cp or 1
        return [] if refusals.layout_problems(replace(w, tp=tp, cp=cp)) else [(tp, cp)]
    if w.objective_row.preference:  # the trainer runs preference objectives without TP or CP (config/objectives.py)
        return [(1, 1)]
    long_rows = request.seq_len >= parallel.CP_MIN_SEQ_LEN
    return [(1, 1), *((tp, 1) for tp in parallel.tensor_parallel_sizes(w)),
            *((1, cp) for cp in parallel.context_parallel_sizes(w) if long_rows)]


def fits(w: Workload) -> bool:
    """What `w` cannot give back at its peak fits the card (memory.Breakdown.held)."""
    return estimate(w).held(w.world_size) <= w.gpu.memory_gib * GIB


def roomy(w: Workload, memory: Breakdown | None = None) -> bool:
    """`w` fits with room: its reserved peak (the allocator's cache included) within the card, and a
    margin of TIGHT_SHARE of what it allocates beside what it cannot give back."""
    memory = memory or estimate(w)
    capacity = w.gpu.memory_gib * GIB
    return (memory.device(w.world_size) <= capacity
            and memory.held(w.world_size) + TIGHT_SHARE * memory.allocated <= capacity)


def largest_micro_batch(w: Workload) -> int:
    """Largest micro batch ≤ MAX_MICRO_BATCH that fits with room (memory grows with it), 0 if none does."""
    if not roomy(w.with_micro_batch(1)):
        return 0
    low, high = 1, MAX_MICRO_BATCH
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if roomy(w.with_micro_batch(middle)) else (low, middle - 1)
    return low


def settle(request: Request, w: Workload) -> Workload:
    """Fill the open knobs of one candidate: the largest micro batch that fits with room (`roomy`),
    with checkpointing when it is needed or faster (fewer layers kept at a larger micro batch), of as
    few layers as leave headroom. Without checkpointing where that is as fast (SPEED_TIE). When
    nothing has room, the smallest footprint, which may still fit, tight."""
    options = (False, True) if request.gradient_checkpointing is None else (request.gradient_checkpointing,)
    open_layers = request.gradient_checkpointing_layers is None
    without = None  # the plan without checkpointing, once it fits
    for checkpointing in options:
        candidate = replace(w, gradient_checkpointing=checkpointing)
        if request.micro_batch_size is not None:  # at one micro batch, no checkpointing is faster
            if roomy(candidate):
                return fewest_checkpointed(candidate) if checkpointing and open_layers else candidate
            continue
        micro = largest_micro_batch(candidate)
        if not checkpointing:
            without = candidate.with_micro_batch(micro) if micro else None
            continue
        smallest = without.micro_batch_size + 1 if without else 1  # up to without's, without is faster
        if micro < smallest:
            return without or replace(w, gradient_checkpointing=True)  # the smallest footprint: tight, or not fitting
        settled = fastest_partial_checkpointing(candidate, smallest, micro) if open_layers else candidate.with_micro_batch(micro)
        if without is None:
            return settled
        faster = estimate_speed(settled).tokens_per_second > (1 + SPEED_TIE) * estimate_speed(without).tokens_per_second
        return settled if faster else without
    return without or replace(w, gradient_checkpointing=options[-1])  # the smallest footprint: tight, or not fitting


def fewest_checkpointed(w: Workload) -> Workload:
    """`w` (checkpointing, fitting) with as few of its first layers checkpointed as keep the plan
    within PARTIAL_CHECKPOINTING_HEADROOM of the GPU with the kept layers' activations
    KEPT_ACTIVATIONS_MARGIN larger; all of them when even that is too much. Memory falls as layers
    are added, so a bisection finds the count."""
    budget = PARTIAL_CHECKPOINTING_HEADROOM * w.gpu.memory_gib * GIB
    layers = w.model.num_layers

    def within(recomputed: int) -> bool:
        candidate = replace(w, checkpointed_layers=recomputed)
        margin = KEPT_ACTIVATIONS_MARGIN * kept_layer_activations(candidate) * (1 + ALLOCATOR_SLACK)
        return estimate(candidate).device(w.world_size) + margin <= budget

    if not within(layers):
        return replace(w, checkpointed_layers=None)
    low, high = 1, layers
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if within(middle) else (middle + 1, high)
    return replace(w, checkpointed_layers=None if low == layers else low)


def fastest_partial_checkpointing(w: Workload, smallest: int, largest: int) -> Workload:
    """Fewer checkpointed layers or a larger micro batch: the fastest of the micro batches from
    `smallest` to `largest` (which fits with every layer checkpointed; powers of two between), each
    with its fewest."""
    micro_batches = sorted({2**k for k in range(largest.bit_length()) if 2**k >= smallest} | {smallest, largest})
    settled = [fewest_checkpointed(w.with_micro_batch(micro)) for micro in micro_batches]
    return max(settled, key=lambda s: estimate_speed(s).tokens_per_second)


def plan(request: Request) -> tuple[list[Plan], int | None]:
    """Ranked plans (fitting ones first, see `rank`) and the index of the recommended one. No plan
    at all when the request asks for what the trainer refuses: `refused(request)` says why."""
    validate(request)
    settled = [settle(request, w) for w in candidates(request)]
    plans = [Plan(w, estimate(w), estimate_speed(w), (), request.host_limit_gib) for w in settled]
    plans = _drop_needless_offload(plans, explicit=request.offload != "auto")
    plans = _drop_needless_layouts(plans)
    ranked = [replace(p, experts_variant=experts_variant(p)) for p in rank(plans)]
    best = ranked[0] if ranked and ranked[0].fits else None
    return [replace(p, reasons=explain(p, best, ranked, switch_reasons(request, p.workload))) for p in ranked], (0 if best else None)


def switch_reasons(request: Request, w: Workload) -> tuple[str, ...]:
    """What the trainer turns off in `w` that was asked for or is on by default (refusals.switch_reasons)."""
    at_layout = planned_switches(request, w.strategy, w.method, w.optimizer, w.tp, w.cp)
    plain = at_layout if w.model_parallel == 1 else planned_switches(request, w.strategy, w.method, w.optimizer)
    return tuple(refusals.switch_reasons(w, at_layout, plain))


def experts_variant(p: Plan) -> Plan | None:
    """For a LoRA plan of a mixture of experts that adapts no expert: the same plan (micro batch,
    checkpointing, layout) with the experts adapted too (moe.with_experts), else None."""
    w = p.workload
    if not moe.misses_experts(w):
        return None
    variant = replace(w, lora_targets=moe.with_experts(w.lora_targets))
    return Plan(variant, estimate(variant), estimate_speed(variant), (), p.host_limit_gib)


def rank(plans: list[Plan]) -> list[Plan]:
    """Fitting plans first, those with room (not `tight`) before the tight ones. Among each, every
    plan within the fastest plan's likely range counts as tied with it, and ties go by `preference`;
    slower plans follow, fastest first. Plans that do not fit come last, smallest first."""
    fitting = [p for p in plans if p.fits]
    fastest = _fastest(fitting)

    def order(p: Plan) -> tuple:
        return (p.tight, 0, 0.0, *preference(p)) if _tied(p, fastest) else (p.tight, 1, -p.speed.tokens_per_second, *preference(p))

    failing = sorted((p for p in plans if not p.fits), key=lambda p: (p.held_gib, p.host_gib))
    return sorted(fitting, key=order) + failing


def _fastest(plans: list[Plan]) -> Plan | None:
    """The fastest fitting plan with room, else the fastest tight one."""
    fitting = [p for p in plans if p.fits]
    pool = [p for p in fitting if not p.tight] or fitting
    return max(pool, key=lambda p: p.speed.tokens_per_second, default=None)


def preference(p: Plan) -> tuple:
    """What decides between tied plans, in order (TIE_BREAKS names each)."""
    w = p.workload
    return (w.world_size, w.model_parallel, OFFLOAD_RANK[w.offload], METHOD_RANK[w.method], strategy_rank(w.strategy),
            p.device_gib)


def strategy_rank(strategy: Strategy) -> int:
    """One GPU, DDP (a full copy per GPU), then any sharding (FSDP2, ZeRO-1/2/3)."""
    return 0 if not strategy.distributed else 1 if strategy.ddp else 2


def tie_break(chosen: Plan, other: Plan) -> str:
    """Which preference put `chosen` before `other`, in words."""
    a, b = chosen.workload, other.workload
    reasons = (
        f"fewer GPUs ({a.world_size} vs {b.world_size})",
        f"smaller TP/CP groups ({a.model_parallel} vs {b.model_parallel} GPUs)",
        f"less offload ({a.offload} vs {b.offload})",
        f"the method that changes the model least ({a.method} before {b.method})",
        f"the simpler strategy ({a.strategy.label} before {b.strategy.label})",
        f"less memory ({chosen.device_gib:.1f} vs {other.device_gib:.1f} GiB per GPU)",
    )
    decided = next((i for i, (x, y) in enumerate(zip(preference(chosen), preference(other))) if x != y), len(reasons) - 1)
    return reasons[decided]


def _tied(p: Plan, fastest: Plan | None) -> bool:
    return fastest is not None and p.speed.tokens_per_second >= fastest.speed.low


def _drop_needless_offload(plans: list[Plan], explicit: bool) -> list[Plan]:
    """Offload trades speed for memory: show an offload variant only when the same method and
    strategy with less offload does not fit with room."""
    if explicit:
        return plans
    fitting = {(p.workload.method, p.workload.strategy, p.workload.offload) for p in plans if p.fits and not p.tight}
    def needed(p: Plan) -> bool:
        w = p.workload
        return not any((w.method, w.strategy, o) in fitting for o in OFFLOADS[: OFFLOAD_RANK[w.offload]])
    return [p for p in plans if needed(p)]


def _drop_needless_layouts(plans: list[Plan]) -> list[Plan]:
    """TP and CP trade communication for memory: show a layout only where the same method, strategy and
    offload without it does not fit with room, or where it is faster by more than parallel.LAYOUT_SPEEDUP."""
    plain = {(p.workload.method, p.workload.strategy, p.workload.offload): p for p in plans if p.workload.model_parallel == 1}

    def needed(p: Plan) -> bool:
        sibling = plain.get((p.workload.method, p.workload.strategy, p.workload.offload))
        if p.workload.model_parallel == 1 or sibling is None or not sibling.fits or sibling.tight:
            return True
        return p.fits and p.speed.tokens_per_second > (1 + parallel.LAYOUT_SPEEDUP) * sibling.speed.tokens_per_second
    return [p for p in plans if needed(p)]


def explain(p: Plan, best: Plan | None, ranked: list[Plan] = (), switches: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Why this plan fits or not, and why it is or is not the recommendation; `switches`: what the
    run turns off (`switch_reasons`)."""
    w = p.workload
    reasons = memory_reasons(p)
    if w.partial_checkpointing:
        every_layer = replace(w, checkpointed_layers=None)
        more_gib = p.device_gib - estimate(every_layer).device(w.world_size) / GIB
        speedup = p.speed.tokens_per_second / estimate_speed(every_layer).tokens_per_second
        reasons.append(f"checkpointing: the first {w.recomputed_layers} of {w.model.num_layers} layers recompute in the "
                       f"backward, the others keep their activations ({more_gib:.1f} GiB more than checkpointing all, "
                       f"{speedup:.2f}× the tokens/s; as few as fit within {PARTIAL_CHECKPOINTING_HEADROOM:.0%} of the GPU "
                       f"with those activations counted {KEPT_ACTIVATIONS_MARGIN:.0%} larger)")
    if w.method == "qlora":
        reasons.append(dequantization_reason(w, p.speed))
    if p.experts_variant is not None:
        reasons.append(experts_reason(p))
    unmeasured = unmeasured_terms(w)
    if unmeasured:
        reasons.append("not yet measured on a GPU: " + "; ".join(unmeasured))
    if p.fits_host and w.offload != "none":
        reasons.append(f"offload: {host_text(p)}, PCIe copies every step")
    reasons += parallel.reasons(w)
    reasons += switches
    if p.speed.comm_bound:
        reasons.append(
            f"communication-bound over {w.gpu.interconnect if w.nodes == 1 else 'the network'}: "
            f"{p.speed.comm_s_per_token * 1e6:.0f} µs of communication vs {p.speed.compute_s_per_token * 1e6:.0f} µs compute per token"
        )
    return tuple(reasons + recommendation_reasons(p, best, ranked))


def host_text(p: Plan) -> str:
    m = p.memory
    return f"{p.host_gib:.0f} GiB of host RAM per node ({m.host_offload / GIB:.0f} offload, {m.host_loading / GIB:.0f} while loading)"


def memory_reasons(p: Plan) -> list[str]:
    """Whether the plan fits the host and the GPU, failures first ("Closest" and "why others lose" quote
    the first reasons): roomy, tight with its margin, or what does not fit."""
    w, m = p.workload, p.memory
    capacity, label = w.gpu.memory_gib, describe(w)
    reasons = [] if p.fits_host else [f"{label}: needs {host_text(p)} > {p.host_limit_gib:.0f} GiB available (--host-memory)"]
    fits = "GPU memory fits" if not p.fits_host else "fits"
    held = (f"{p.held_gib:.1f} of {capacity:.1f} GiB per GPU allocated at the peak in the {m.peak_phase}, CUDA context "
            f"included ({p.device_gib:.2f} with the allocator's cache")
    if p.tight:
        cache = ", which it gives back before it runs out)" if p.device_gib > capacity else ")"
        reasons.append(f"{fits}, tight (margin {p.margin_gib:.1f} GiB): {held}{cache}; the memory model may miss by "
                       f"{TIGHT_SHARE:.0%}: check it with `finetune --dry-run` and a first step")
    elif p.fits_device:
        reasons.append(f"{fits}: {held})")
    else:
        terms = {"weights": m.weights, "gradients": m.gradients, "optimizer states": m.optimizer,
                 "activations": m.activations, "buffers": m.buffers}
        name, largest = max(terms.items(), key=lambda item: item[1])
        if largest / GIB > capacity:
            reasons.append(f"{label}: {name} alone {largest / GIB:.1f} GiB > {capacity:.1f} GiB")
        else:
            reasons.append(f"{label}: needs {p.held_gib:.1f} GiB per GPU > {capacity:.1f} GiB even at micro batch 1"
                           + (" with checkpointing" if w.gradient_checkpointing else ""))
    return reasons


def experts_reason(p: Plan) -> str:
    """What a mixture of experts' LoRA plan adapts, and what adapting its experts would cost beside it."""
    variant = p.experts_variant
    verdict = "fits" if variant.fits and not variant.tight else "fits, tight" if variant.fits else "does not fit"
    return (f"{moe.lora_reach(p.workload)} With --lora-targets {variant.workload.lora_targets} at this micro batch "
            f"and checkpointing: {trainable_params(variant.workload) / 1e6:,.0f}M trainable (vs "
            f"{trainable_params(p.workload) / 1e6:,.0f}M), {variant.device_gib:.1f} GiB per GPU ({verdict}), "
            f"{variant.speed.tokens_per_second:,.0f} tokens/s")


def recommendation_reasons(p: Plan, best: Plan | None, ranked: list[Plan]) -> list[str]:
    """Why `p` is the recommendation (and what its speed rests on), or why another plan is."""
    speed = f"{p.speed.tokens_per_second:,.0f} tokens/s (likely {speed_span(p.speed)})"
    fastest = _fastest(list(ranked))
    if best is p:
        if fastest is not None and fastest is not p:
            first = (f"recommended: {speed}; tied with the fastest fitting plan ({describe(fastest.workload)}, "
                     f"{fastest.speed.tokens_per_second:,.0f} tokens/s, likely from {fastest.speed.low:,.0f}): "
                     f"the speed model cannot tell them apart; tie-break: {tie_break(p, fastest)}")
        else:
            first = f"recommended: fastest plan that fits{'' if p.tight else ' with room'}: {speed}"
        return [first, f"speed {p.speed_basis}"]
    if best is None or not p.fits:
        return []
    if p.tight and not best.tight:
        return [f"ranked after the plans that fit with room: {speed}"]
    if _tied(p, fastest):
        return [f"tied on speed with {describe(best.workload)} ({speed}, within the fastest plan's likely range); "
                f"tie-break: {tie_break(best, p)}"]
    return [f"slower than {describe(best.workload)}: {speed} vs {best.speed.tokens_per_second:,.0f} tokens/s"]


def speed_span(speed: Speed) -> str:
    """'4,800–8,000 tokens/s' style bounds of the likely range (without the unit)."""
    return f"{speed.low:,.0f}–{speed.high:,.0f}"


def dequantization_reason(w: Workload, speed: Speed) -> str:
    """What dequantizing the 4-bit base in every forward, backward and recompute costs, on the clock
    that sets the pace."""
    host, gpu = dequantization_seconds(w)
    clock, name = (issue_seconds(w, CALIBRATION), "host's") if speed.launch_bound else (gpu_seconds(w, CALIBRATION), "GPU's")
    spent = host if speed.launch_bound else gpu
    return (f"QLoRA dequantizes the 4-bit base in every forward and backward: {spent * 1e3:,.0f} of the {name} "
            f"{clock * 1e3:,.0f} ms per micro-batch ({spent / clock:.0%})")


def describe(w: Workload) -> str:
    offload = "" if w.offload == "none" else f" + {w.offload} offload"
    layout = "".join(f" + {name} {size}" for name, size in (("TP", w.tp), ("CP", w.cp)) if size > 1)
    return f"{w.method} {w.strategy.label}{layout}{offload}"
