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
    w = from_run(run, gpu_catalog.get("H100"))  # the checks do not depend on the GPU
    if (reason := cannot_simulate(w)) is not None:
        raise FinetuneError(f"--simulate checks {CHECKS}, not {reason}.")
    run = one_rank(run)
    if run.strategy.fsdp:
        return _simulate_fsdp(run, w)
    from torch.distributed._tools.mem_tracker import MemTracker

    from finetune.train import loading
    from finetune.train.optim import build_optimizer

    model, fake_mode = loading.build_skeleton(run)
    _mask_as_the_run_builds_it(model, w.masked_sdpa)
    with fake_mode:
        optimizer = _as_on_cuda(build_optimizer(run.config, model, run.peak_lr, fused=run.switches().fused_adamw))
        tracker = _frozen_aware(MemTracker)()
        tracker.track_external(model, optimizer)
        with tracker:
            _steps(run, model, optimizer, tracker, w.dense_mask)
        return _result(tracker)


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


# What transformers' SDPA path runs without a mask, under a name with no mask builder (transformers then builds none)
CAUSAL_SDPA = "finetune_causal_sdpa"


def _mask_as_the_run_builds_it(model, masked: bool) -> None:
    """On fake tensors transformers cannot read the position ids, so it takes every row for packed and
    builds a dense mask. Where the run builds none (`masked`: Workload.masked_sdpa; full-length rows, or
    packed rows under varlen, flex or flash), the simulated SDPA runs causal without one, as the run's
    does (or as its kernel saves)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not masked and base.config._attn_implementation == "sdpa":
        AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
        base.set_attn_implementation(CAUSAL_SDPA)


def _steps(run: ResolvedRun, model, optimizer, tracker, dense_mask: bool = False) -> None:
    """Two micro-steps as the loop runs them, under the autocast Accelerate applies for the precision.
    `dense_mask` (packed rows under SDPA): two examples a row, whose position ids make transformers
    build its block-diagonal mask as for a packed run."""
    import torch

    spec, batch, length = run.spec, run.batch, run.config.max_seq_len
    tokens = torch.randint(0, spec.vocab_size, (batch.micro_batch_size, length))
    positions = torch.cat([torch.arange(length // 2), torch.arange(length - length // 2)]).expand_as(tokens) if dense_mask else None
    autocast = torch.autocast("cpu", dtype=getattr(torch, run.precision.compute), enabled=run.precision.autocast)
    for _ in range(2):
        tracker.reset_mod_stats()  # module stats are per iteration; the global peak is kept
        with autocast:
            loss = model(input_ids=tokens, labels=tokens, position_ids=positions).loss
        loss.backward()
        optimizer.step()  # the first step creates the states; gradients stay, as under accumulation


def _simulate_fsdp(run: ResolvedRun, w: Workload) -> Simulation:
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
        _mask_as_the_run_builds_it(model, w.masked_sdpa)
        with fake_mode:
            compute = getattr(torch, run.precision.compute)
            policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=compute) if run.precision.autocast else MixedPrecisionPolicy()
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            # the units Accelerate's transformer-based wrap makes: every module of a _no_split_modules class
            for layer in [m for m in base.modules() if type(m).__name__ in base._no_split_modules]:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            # per-tensor AdamW: FSDPMemTracker books foreach temporaries over DTensor shards as several
            # copies of the optimizer states (the planner's step scratch accounts for foreach)
            optimizer = build_optimizer(run.config, model, run.peak_lr)
            tracker = _frozen_aware(FSDPMemTracker)(model, optimizer)
            with tracker:
                _steps(run, model, optimizer, tracker, w.dense_mask)
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
