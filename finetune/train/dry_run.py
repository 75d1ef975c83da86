"""The plan of one resolved run: what `finetune plan` predicts for exactly these flags, what the
trainer's own construction holds per GPU (`finetune --dry-run`). fit_check.py holds the check every
run makes at launch.

`plan.workload.from_run` is the one translation of a run into the planner's `Workload`, so a
plan's launch command, `--dry-run` of that command and `plan --simulate` describe the same run.
`built_states` builds the model and optimizer exactly as training does (skeleton.build_skeleton:
same dtype, quantization, PEFT wrapping; optim.build_optimizer stepped once) on fake tensors at full
size and measures them, so every model-state term the planner promises is checked against the
trainer's construction rather than against a second model of it.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from finetune.config.flags import command_line
from finetune.config.names import trains_pure_bf16
from finetune.config.objectives import reference_kind
from finetune.config.resolve import Device, ResolvedRun
from finetune.errors import FinetuneError
from finetune.plan import gpus as gpu_catalog
from finetune.plan import report
from finetune.plan.choose import Plan, Request, explain
from finetune.plan.files import ACCELERATE_FILE, DEEPSPEED_FILE, DEFAULT_CONFIG_DIR, launch_command, plan_command
from finetune.plan.gpus import GPUSpec
from finetune.plan.memory import GIB, ModelStates, deepspeed_optimizer_bytes, estimate, place_states
from finetune.plan.params import params_by_kind, resolve_lora_targets
from finetune.plan.speed import estimate_speed
from finetune.plan.workload import Workload, from_run, runs_fp8

BUILT_TERMS = ("weights", "gradients", "optimizer")


def gpu_of(run: ResolvedRun, device: Device) -> GPUSpec:
    """The GPU the run is planned for: --gpu, else the catalog entry of the GPU this process sees."""
    if run.config.gpu:
        return gpu_catalog.get(run.config.gpu)
    found = gpu_catalog.identify(device.name, (device.total_bytes or 0) / GIB) if device.cuda and device.name else None
    if found is None:
        seen = f"this process sees {device.name!r}, which is not in the GPU catalog" if device.cuda else "no GPU is visible"
        raise FinetuneError(f"Which GPU should this run be planned for? {seen}: pass --gpu NAME, e.g. --gpu A100-40GB "
                            f"(catalog: {', '.join(gpu_catalog.GPUS)}).")
    return found


def device_of(gpu: GPUSpec) -> Device:
    """The Device a run on `gpu` sees: with `--dry-run --gpu NAME` every choice (precision `auto`,
    whether bf16 or fp16 can run) resolves as on that GPU rather than on the machine planning it."""
    return Device(cuda=True, name=gpu.name, bf16=gpu.bf16, fp8=runs_fp8(gpu), total_bytes=int(gpu.memory_gib * GIB))


def plan_run(run: ResolvedRun, gpu: GPUSpec) -> tuple[Request, Plan]:
    """The planner's request and plan for exactly this run on `gpu`."""
    w = from_run(run, gpu)
    request = Request(model=w.model, gpu=gpu, gpus_per_node=w.gpus_per_node, nodes=w.nodes, method=w.method,
                      strategy=w.strategy, offload=w.offload, precision=w.precision, optimizer=w.optimizer,
                      micro_batch_size=w.micro_batch_size, seq_len=w.seq_len,
                      gradient_checkpointing=w.gradient_checkpointing, gradient_checkpointing_layers=w.checkpointed_layers,
                      lora_r=w.lora_r, lora_targets=w.lora_targets,
                      gradient_accumulation_steps=w.gradient_accumulation_steps, tp=w.tp, cp=w.cp, fp8=w.fp8,
                      objective=w.objective, precompute_reference=w.precompute_reference)
    plan = Plan(w, estimate(w), estimate_speed(w), (), request.host_limit_gib)
    return request, replace(plan, reasons=explain(plan, None, [plan]))


def run_of_plan(plan: Plan, config_dir: str | Path, output_dir: str | Path) -> ResolvedRun:
    """The run a plan's launch command resolves to on the plan's GPUs: its training flags parsed as
    `finetune` parses them, its strategy as its accelerate config announces it to each process
    (the DeepSpeed JSON is read from `config_dir`, where `write_configs` put it)."""
    from finetune.config.flags import parse_config
    from finetune.config.resolve import Launch, resolve_run
    from finetune.plan.files import DEEPSPEED_FILE, train_flags

    w = plan.workload
    config = parse_config([*train_flags(w), "--gpu", w.gpu.name, "--output-dir", str(output_dir)])
    launch = Launch(world_size=w.world_size, num_machines=w.nodes, fsdp=w.strategy.fsdp,
                    fsdp_offload_params=w.strategy.fsdp and w.offload == "params",
                    fsdp_cpu_ram_efficient_loading=w.strategy.fsdp, deepspeed=w.deepspeed,
                    deepspeed_config_file=str(Path(config_dir) / DEEPSPEED_FILE) if w.deepspeed else None)
    return resolve_run(config, launch, device_of(w.gpu))


@dataclass(frozen=True)
class Built:
    """What the trainer's construction of a run holds, measured on fake tensors (one process, unsharded)."""

    frozen_bytes: int
    frozen_float_numel: int  # frozen floating-point elements: what DeepSpeed casts to 16 bits
    frozen_other_bytes: int  # frozen elements it leaves alone
    trainable_numel: int
    trainable_bytes: int
    optimizer_bytes: int  # states the optimizer created on its first step
    buffer_bytes: int  # 4-bit quantization state, rotary tables: replicated on every GPU
    kinds: dict[str, tuple[int, int]]  # kind → (trainable, total) parameters (train/inventory.by_kind)


def build(run: ResolvedRun) -> Built:
    """Build the model and optimizer exactly as training does (skeleton.build_skeleton,
    optim.build_optimizer) on fake tensors, step the optimizer once, and measure them."""
    import torch

    from finetune.train import inventory, skeleton
    from finetune.train.optim import build_optimizer

    model, fake_mode = skeleton.build_skeleton(run)
    kinds = inventory.by_kind(model, (model.get_base_model() if hasattr(model, "get_base_model") else model).config.model_type)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    # bitsandbytes builds real code tables here
    optimizer = build_optimizer(run.config, model, run.peak_lr, fused=run.switches.fused_adamw)
    with fake_mode:
        for param in trainable:
            param.grad = torch.zeros_like(param)
        _create_states(optimizer)
        states = {id(t): t for state in optimizer.state.values() for t in state.values()  # shared code tables once
                  if isinstance(t, torch.Tensor) and t.dim() > 0}
        optimizer_bytes = sum(map(_bytes, states.values()))
        return Built(
            frozen_bytes=sum(map(_bytes, frozen)),
            frozen_float_numel=sum(p.numel() for p in frozen if p.is_floating_point()),
            frozen_other_bytes=sum(_bytes(p) for p in frozen if not p.is_floating_point()),
            trainable_numel=sum(p.numel() for p in trainable),
            trainable_bytes=sum(map(_bytes, trainable)),
            optimizer_bytes=optimizer_bytes,
            buffer_bytes=sum(map(_bytes, model.buffers())),
            kinds=kinds,
        )


def _create_states(optimizer) -> None:
    """Make the optimizer allocate its states as its first step would: torch's by stepping once,
    bitsandbytes' 8-bit ones (whose update kernels need real values) through their own init_state."""
    if not hasattr(optimizer, "init_state"):
        optimizer.step()
        return
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            optimizer.init_state(group, param, group_index, param_index)


def built_states(run: ResolvedRun, built: Built | None = None) -> ModelStates:
    """The planner's model-state terms of what `build` measured (unsharded). Under DeepSpeed with
    16-bit compute the engine casts the module to that dtype and keeps master weights and a gradient
    partition beside the optimizer states (fp32, or bf16 for pure bf16 full fine-tuning): applied
    here as the layout measured on the engine (`memory.deepspeed_optimizer_bytes`), since the engine
    itself cannot start on fake tensors. A 4-bit weight stored in a 16-bit dtype is
    already 16-bit, so the cast leaves its packed size alone."""
    built = built or build(run)
    pure_bf16 = trains_pure_bf16(run.precision, run.config.method)
    e = run.precision.compute_bytes
    # a frozen copy of every weight the trainer built, in the compute dtype (train/reference.frozen_copy)
    copy = reference_kind(run.config.objective, run.config.precompute_reference, run.config.method) == "frozen copy"
    reference = (built.frozen_float_numel + built.trainable_numel) * e if copy else 0.0
    if run.strategy.deepspeed and (run.precision.autocast or pure_bf16):
        states = built.optimizer_bytes / built.trainable_bytes  # optimizer-state bytes per trainable weight byte
        return ModelStates(frozen=built.frozen_float_numel * e + built.frozen_other_bytes,
                           quant_constants=built.buffer_bytes, trainable=built.trainable_numel * e,
                           gradients=built.trainable_numel * e, reference=reference,
                           optimizer=built.trainable_numel * deepspeed_optimizer_bytes(pure_bf16, states), step_scratch=0.0)
    return ModelStates(frozen=built.frozen_bytes, quant_constants=built.buffer_bytes, trainable=built.trainable_bytes,
                       gradients=built.trainable_bytes, optimizer=built.optimizer_bytes, step_scratch=0.0, reference=reference)


def _bytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def run_command(run: ResolvedRun, plan: Plan, given: frozenset[str]) -> tuple[str, str | None]:
    """This run's launch line (every flag the user gave, less --dry-run and --json) and the command
    that writes the launcher files it names (None when it needs none: one process, no strategy)."""
    flags = command_line(run.config, given)
    w = plan.workload
    if w.world_size == 1 and not w.strategy.distributed:
        return shlex.join(["finetune", *flags]), None
    files = [f"{DEFAULT_CONFIG_DIR}/{ACCELERATE_FILE}"] + ([f"{DEFAULT_CONFIG_DIR}/{DEEPSPEED_FILE}"] if w.deepspeed else [])
    writer = f"`{plan_command(w, run.config.model)}` writes {' and '.join(files)}"
    if run.config.deepspeed:
        writer += f" (the run reads its DeepSpeed settings from your --deepspeed {run.config.deepspeed})"
    return launch_command(plan, DEFAULT_CONFIG_DIR, flags), writer


def dry_run_report(run: ResolvedRun, device: Device, as_json: bool, given: frozenset[str] = frozenset()) -> str:
    """`finetune --dry-run`: the plan of this run (the `finetune plan` table or JSON, one plan) with
    the per-GPU bytes the trainer's construction actually holds beside the planned ones, and this
    run's own launch command (the options in `given`) with the command that writes its files."""
    from finetune.train import inventory
    from finetune.train.simulate import one_rank

    gpu = gpu_of(run, device)
    request, plan = plan_run(run, gpu)
    construction = build(run)
    rank = one_rank(run)  # under TP or CP, the slice of the model one rank holds
    built = place_states(plan.workload, built_states(rank, construction if rank is run else None))
    planned_kinds = planned_by_kind(plan.workload)
    command, writer = run_command(run, plan, given)
    if as_json:
        data = report.to_json(request, [plan], 0 if plan.fits else None, config_dir=DEFAULT_CONFIG_DIR)
        data["plans"][0].update(launch_command=command, config_files_command=writer)
        data["plans"][0]["built_per_gpu_gib"] = {term: round(getattr(built, term) / GIB, 3) for term in BUILT_TERMS}
        data["plans"][0]["parameters_by_kind"] = {
            kind: {"trainable": trainable, "total": total, "planned": list(planned_kinds.get(kind, (0, 0)))}
            for kind, (trainable, total) in construction.kinds.items()}
        return json.dumps(data, indent=2)
    launch = command + (f"\n  files: {writer}" if writer else "")
    lines = [report.table(request, [plan], 0 if plan.fits else None, config_dir=DEFAULT_CONFIG_DIR, heading="This run",
                          launch=launch)]
    if not plan.fits:
        lines.append(f"  launch: {launch}")
    lines += ["", "Built by the trainer's own construction (fake tensors, full size), per GPU:",
             f"  {'term':<12} {'built':>9} {'planned':>9}  GiB"]
    for term in BUILT_TERMS:
        lines.append(f"  {term:<12} {getattr(built, term) / GIB:>9.2f} {getattr(plan.memory, term) / GIB:>9.2f}")
    lines += ["", "Parameters by kind, as built:", inventory.table(construction.kinds, planned_kinds)]
    warnings = inventory.lora_warnings(run.config, run.spec.model_type) if run.spec is not None else []
    return "\n".join(lines + warnings)


def planned_by_kind(w: Workload) -> dict[str, tuple[int, int]]:
    """The planner's trainable / total parameters by kind for `w` (params.params_by_kind)."""
    targets = None if w.method == "full" else resolve_lora_targets(w.model, w.lora_targets, w.method)
    return params_by_kind(w.model, w.method, w.lora_r, targets)
