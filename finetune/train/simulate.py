"""`finetune plan --simulate`: run training steps of a plan's launch command on fake tensors and
measure the per-GPU peak with PyTorch's MemTracker (FSDPMemTracker on a fake process group for FSDP2).

The model and optimizer are the trainer's own construction (loading.build_skeleton,
optim.build_optimizer), not a copy: what is simulated is what `python -m finetune` with the same
flags would build. Fake CPU tensors carry shapes and dtypes but no data, so a 7B step takes
seconds-to-a-minute of CPU and almost no memory. The step mirrors the loop with gradient
accumulation: two forward/backward passes with an optimizer step after each, so the second pass
runs with gradients and optimizer states allocated, as every pass after the first does in a real
run. What it checks is `CHECKS`; `cannot_simulate` names why any other plan is left out (QLoRA's
4-bit kernels and the DeepSpeed engine do not run on fake tensors; DDP's reducer and host offload
are not tracked), and `finetune plan --simulate` then simulates the best plan it can check and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from finetune.errors import FinetuneError
from finetune.plan import gpus as gpu_catalog
from finetune.plan.memory import GIB, estimate
from finetune.plan.moe import expert_bytes
from finetune.plan.workload import Workload, from_run

if TYPE_CHECKING:
    from finetune.config.names import Strategy
    from finetune.config.resolve import ResolvedRun

# MemTracker's reference types → the planner's terms.
CATEGORIES = {
    "Parameter": "weights", "Sharded Param": "weights", "Unsharded Param": "buffers", "Buffer": "weights",
    "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "buffers",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Temp": "activations", "Inputs": "activations",
    "All Gather": "buffers", "Reduce Scatter": "buffers",
}


# The plans --simulate runs; the output names it whenever the plan asked about is not one of them.
CHECKS = "full and LoRA fine-tuning with torch's AdamW, on one GPU or FSDP2 without offload"


def cannot_simulate(w: Workload) -> str | None:
    """Why the plan `w` is outside CHECKS, or None when --simulate can run it."""
    return _outside_checks(w.method, w.strategy, w.offload, w.optimizer, w.model.moe and expert_bytes(w) == 4)


def _outside_checks(method: str, strategy: Strategy, offload: str, optimizer: str, fp32_experts: bool = False) -> str | None:
    if fp32_experts:  # -mixed and fp32 runs: the grouped matmuls take the experts' fp32 weights
        return "a mixture of experts computing in fp32 (torch's fake grouped matmul takes bf16 only)"
    if method == "qlora":
        return "QLoRA (bitsandbytes' 4-bit kernels do not run on fake tensors)"
    if strategy.ddp or strategy.deepspeed:
        return f"{strategy.label} (DDP's reducer and the DeepSpeed engine are not simulated)"
    if offload != "none":
        return f"{offload} offload (host memory is not tracked)"
    if optimizer != "adamw":
        return f"the {optimizer} optimizer (bitsandbytes kernels)"
    return None


@dataclass(frozen=True)
class Simulation:
    peak_bytes: int
    terms: dict[str, int]  # planner term → bytes at the peak


def simulate(run: ResolvedRun) -> Simulation:
    """Peak tracked memory of one GPU over two accumulation micro-steps of `run` (of one rank's share,
    `one_rank`, under TP or CP). Raises FinetuneError for a run outside CHECKS."""
    reason = cannot_simulate(from_run(run, gpu_catalog.get("H100")))  # the checks do not depend on the GPU
    if reason is not None:
        raise FinetuneError(f"--simulate checks {CHECKS}, not {reason}.")
    run = one_rank(run)
    if run.strategy.fsdp:
        return _simulate_fsdp(run)
    from torch.distributed._tools.mem_tracker import MemTracker

    from finetune.train import loading
    from finetune.train.optim import build_optimizer

    model, fake_mode = loading.build_skeleton(run)
    reference = loading.build_frozen_skeleton(run, fake_mode) if _holds_copy(run) else None
    with fake_mode:
        optimizer = _as_on_cuda(build_optimizer(run.config, model, run.peak_lr, fused=run.switches().fused_adamw))
        tracker = _frozen_aware(MemTracker)()
        tracker.track_external(model, optimizer, *([] if reference is None else [reference]))
        with tracker:
            _steps(run, model, optimizer, tracker, reference)
        return _result(tracker)


def _holds_copy(run: ResolvedRun) -> bool:
    """Whether the run holds a frozen copy of the weights as its reference (train/reference.py)."""
    from finetune.config.objectives import reference_kind

    config = run.config
    return reference_kind(config.objective, config.precompute_reference, config.method) == "frozen copy"


# How a TP or CP rank is simulated, printed beside the comparison.
ONE_TP_RANK = ("one TP rank, as the slice of the model it holds (1/tp of the heads, KV heads and MLP width), with the LM "
               "head whole, which TP splits by vocabulary rows: the analytic weights hold 1/tp of it")
ONE_CP_RANK = "one CP rank, with 1/cp of each row"


def one_rank(run: ResolvedRun) -> ResolvedRun:
    """`run` as one rank of its TP/CP group computes it, without the group's collectives: the slice of
    each layer a TP rank holds (plan.parallel.rank_spec), 1/cp of each row, FSDP2 over the ranks that
    shard that slice, and the loss the run resolves (the model's own under TP: config/switches.py)."""
    from dataclasses import replace

    from finetune.config.parallelism import Parallelism
    from finetune.plan.parallel import rank_spec

    p = run.parallelism
    if p.model_parallel == 1:
        return run
    config = replace(run.config, max_seq_len=run.config.max_seq_len // p.cp, tp=1, cp=1,
                     chunked_loss=run.switches().chunked_loss)
    batch = replace(run.batch, world_size=run.world_size // p.tp, model_parallel=1)
    return replace(run, spec=rank_spec(run.spec, p.tp), config=config, batch=batch, parallelism=Parallelism())


def _as_on_cuda(optimizer):
    """An AdamW that is not fused runs foreach on CUDA (torch's default there); on CPU tensors it
    would loop per tensor. A fused one runs its one kernel on the fake CPU tensors too."""
    for group in optimizer.param_groups:
        group["foreach"] = not group.get("fused")
    return optimizer


class _NoHook:
    def remove(self) -> None:
        pass


def _frozen_aware(tracker_class):
    """MemTracker registers a gradient hook on every parameter, which raises for frozen ones (the
    LoRA base): mark those as already hooked."""

    class FrozenAwareTracker(tracker_class):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            for param in module.parameters():
                if not param.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(param, (_NoHook(), _NoHook()))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return FrozenAwareTracker


def _steps(run: ResolvedRun, model, optimizer, tracker, reference=None) -> None:
    """Two micro-steps as the loop runs them, under the autocast Accelerate applies for the precision:
    the objective's rows (a pair's two sequences) and forwards (the reference's: adapters off, the
    frozen copy `reference`, or none when precomputed)."""
    import torch

    spec, batch = run.spec, run.batch
    objective = objective_of(run, reference)
    rows = batch.micro_batch_size * objective.objective.sequences
    tokens = torch.randint(0, spec.vocab_size, (rows, run.config.max_seq_len))
    micro_batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens}
    if objective.objective.policy_no_grad_sequences:  # KTO: each row's mismatched sequence, and its label
        micro_batch.update(kl_input_ids=tokens, kl_attention_mask=torch.ones_like(tokens), kl_labels=tokens,
                           desirable=torch.ones(rows, dtype=torch.bool))
    micro_batch.update(reference_logps=torch.zeros(rows), reference_kl_logps=torch.zeros(rows))  # when precomputed
    autocast = torch.autocast("cpu", dtype=getattr(torch, run.precision.compute), enabled=run.precision.autocast)
    for _ in range(2):
        tracker.reset_mod_stats()  # module stats are per iteration; the global peak is kept
        with autocast:
            if objective.objective.preference:
                loss = _preference_loss(objective, model, micro_batch, tracker, torch.tensor(batch.micro_batch_size))
            else:
                loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()  # the first step creates the states; gradients stay, as under accumulation


def _preference_loss(objective, model, micro_batch: dict, tracker, total):
    """The loop's passes of one micro-batch, in its order: KTO's mismatched rows (policy, reference), the
    reference, then the policy's forward and loss. MemTracker takes one call of a module per iteration,
    so each pass of the policy before the last is one (the global peak is kept across them); a frozen
    copy, another module, runs its forward in the loss as in the loop."""
    from finetune.train.reference import Reference

    reference = objective.reference
    if reference is not None and reference.kind == "adapters off":
        for prefix in ("", "kl_")[: 1 + objective.objective.policy_no_grad_sequences]:
            micro_batch[f"reference_{prefix}logps"] = reference.log_probs(model, micro_batch, prefix)
            tracker.reset_mod_stats()
        objective.reference = Reference("precomputed", reference.accelerator)
    if objective.objective.policy_no_grad_sequences:
        objective.start_window(model, [micro_batch], _OneRank())
        tracker.reset_mod_stats()
    loss = objective.loss(model, micro_batch, total)[0]
    objective.reference = reference
    return loss


class _OneRank:
    """LossRanks of a simulated rank: what it sums over ranks is its own."""

    def sum_over_rows(self, tensor):
        return tensor


def objective_of(run: ResolvedRun, reference=None):
    """The loop's objective for `run` (train/objectives.py), its reference simulated as the run holds it."""
    from types import SimpleNamespace

    from finetune.config.objectives import reference_kind
    from finetune.train.objectives import build_objective
    from finetune.train.reference import Reference

    config = run.config
    kind = reference_kind(config.objective, config.precompute_reference, config.method)
    unwrapped = SimpleNamespace(unwrap_model=lambda model: model)  # no Accelerator wraps a simulated model
    return build_objective(config, None if kind is None else Reference(kind, unwrapped, reference))


def _simulate_fsdp(run: ResolvedRun) -> Simulation:
    """FSDP2 on a fake process group: rank 0's view of a `world_size`-rank job, sharded per decoder
    layer as Accelerate's transformer-based wrap does, with its mixed-precision policy."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from finetune.train import loading
    from finetune.train.optim import build_optimizer

    dist.init_process_group("fake", rank=0, world_size=run.world_size, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (run.world_size,))  # outside fake mode: the mesh needs real ranks
        model, fake_mode = loading.build_skeleton(run)
        reference = loading.build_frozen_skeleton(run, fake_mode) if _holds_copy(run) else None
        with fake_mode:
            compute = getattr(torch, run.precision.compute)
            policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=compute) if run.precision.autocast else MixedPrecisionPolicy()
            for module, unit_policy in ((model, policy), (reference, MixedPrecisionPolicy())):
                if module is None:
                    continue
                base = module.get_base_model() if hasattr(module, "get_base_model") else module
                # the units Accelerate's transformer-based wrap makes: every module of a _no_split_modules class
                for layer in [m for m in base.modules() if type(m).__name__ in base._no_split_modules]:
                    fully_shard(layer, mesh=mesh, mp_policy=unit_policy)
                fully_shard(module, mesh=mesh, mp_policy=unit_policy)
            # per-tensor AdamW: FSDPMemTracker books foreach temporaries over DTensor shards as several
            # copies of the optimizer states (the planner's step scratch accounts for foreach)
            optimizer = build_optimizer(run.config, model, run.peak_lr)
            tracker = _frozen_aware(FSDPMemTracker)(model, optimizer)
            if reference is not None:
                tracker.track_external(reference)
            with tracker:
                _steps(run, model, optimizer, tracker, reference)
            return _result(tracker)
    finally:
        dist.destroy_process_group()


def _result(tracker) -> Simulation:
    snapshot = tracker.get_tracker_snapshot("peak")
    device_stats = max(snapshot.values(), key=lambda stats: stats.get("Total", 0))
    terms: dict[str, int] = {}
    for reftype, size in device_stats.items():
        if reftype == "Total":
            continue
        term = CATEGORIES.get(getattr(reftype, "value", str(reftype)), "buffers")
        terms[term] = terms.get(term, 0) + size
    return Simulation(peak_bytes=device_stats["Total"], terms=terms)


def compare_text(run: ResolvedRun, w: Workload) -> str:
    """Simulated vs analytic per-GPU peak, term by term (allocated memory, no slack or context)."""
    simulated = simulate(run)
    analytic = estimate(w)
    lines = [f"Simulated two micro-steps of this run on fake tensors ({w.method}, {w.strategy.label}, "
             f"{w.world_size} rank(s), micro batch {w.micro_batch_size} × {w.seq_len}"
             + (f"; {ONE_TP_RANK}" if w.tp > 1 else f"; {ONE_CP_RANK}" if w.cp > 1 else "") + "):",
             f"  {'term':<12} {'simulated':>10} {'analytic':>10}  GiB"]
    for term in ("weights", "gradients", "optimizer", "activations", "buffers"):
        lines.append(f"  {term:<12} {simulated.terms.get(term, 0) / GIB:>10.2f} {getattr(analytic, term) / GIB:>10.2f}")
    error = analytic.allocated / simulated.peak_bytes - 1
    lines.append(f"  {'allocated':<12} {simulated.peak_bytes / GIB:>10.2f} {analytic.allocated / GIB:>10.2f}  (analytic {error:+.1%})")
    return "\n".join(lines)
