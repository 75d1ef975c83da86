"""`finetune plan --simulate`: run training steps of a plan's launch command on fake tensors and
measure the per-GPU peak with PyTorch's MemTracker (FSDPMemTracker on a fake process group for FSDP2).

The model and optimizer are the trainer's own construction (skeleton.build_skeleton,
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

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from finetune.errors import FinetuneError
from finetune.plan import gpus as gpu_catalog
from finetune.plan.memory import GIB, backward_activations, estimate
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
    activations: int  # saved activations and temporaries at the peak of forward/backward, wherever the step's peak is


def simulate(run: ResolvedRun) -> Simulation:
    """Peak tracked memory of one GPU over two accumulation micro-steps of `run` (of one rank's share,
    `one_rank`, under TP or CP). Raises FinetuneError for a run outside CHECKS."""
    w = from_run(run, gpu_catalog.get("H100"))  # the checks do not depend on the GPU
    if (reason := cannot_simulate(w)) is not None:
        raise FinetuneError(f"--simulate checks {CHECKS}, not {reason}.")
    if run.parallelism.tp > 1:
        return _simulate_tensor_parallel(run, w.dense_mask)
    run = one_rank(run)
    if run.strategy.fsdp:
        return _simulate_fsdp(run, w.dense_mask)
    from torch.distributed._tools.mem_tracker import MemTracker

    from finetune.train import skeleton
    from finetune.train.optim import build_optimizer

    model, fake_mode = skeleton.build_skeleton(run)
    reference = skeleton.build_frozen_skeleton(run, fake_mode) if _holds_copy(run) else None
    with fake_mode:
        optimizer = _as_on_cuda(build_optimizer(run.config, model, run.peak_lr, fused=run.switches.fused_adamw))
        tracker = _frozen_aware(MemTracker)()
        tracker.track_external(model, optimizer, *([] if reference is None else [reference]))
        with tracker:
            _steps(run, model, optimizer, tracker, w.dense_mask, reference)
        return _result(tracker)


def _holds_copy(run: ResolvedRun) -> bool:
    """Whether the run holds a frozen copy of the weights as its reference (train/reference.py)."""
    from finetune.config.objectives import reference_kind

    config = run.config
    return reference_kind(config.objective, config.precompute_reference, config.method) == "frozen copy"


# How a TP or CP rank is simulated, printed beside the comparison.
ONE_TP_RANK = ("rank 0 of the whole layout as the trainer builds it (transformers' TP plan with the sequence-parallel "
               "rules, FSDP2 over the data-parallel ranks) on a fake process group")
ONE_CP_RANK = "one CP rank, with 1/cp of each row"


def one_rank(run: ResolvedRun) -> ResolvedRun:
    """`run` as one rank of its TP/CP group computes it, without the group's collectives: the slice of
    each layer a TP rank holds (plan.parallel.rank_spec) and its rows of the vocabulary, 1/cp of each
    row, FSDP2 over the ranks that shard that slice, and the loss the run resolves
    (config/switches.py). What `--dry-run` builds to count a TP rank's model states, and what a CP
    rank is simulated as (ring attention does not run on CPU)."""
    from dataclasses import replace

    from finetune.config.parallelism import Parallelism
    from finetune.plan.parallel import rank_spec

    p = run.parallelism
    if p.model_parallel == 1:
        return run
    config = replace(run.config, max_seq_len=run.config.max_seq_len // p.cp, tp=1, cp=1,
                     chunked_loss=run.switches.chunked_loss)
    batch = replace(run.batch, world_size=run.world_size // p.tp, model_parallel=1)
    spec = replace(rank_spec(run.spec, p.tp), vocab_size=-(-run.spec.vocab_size // p.tp))
    return replace(run, spec=spec, config=config, batch=batch, parallelism=Parallelism())


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


def _unit_aware(tracker_class):
    """FSDPMemTracker opens a module's statistics in its forward; an FSDP2 unit whose forward never
    runs (the LM head, which transformers shards as its own unit under FSDP2 × TP and the chunked loss
    reads outside its forward) still gathers its weight for backward: open them there."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModMemStats

    class UnitAwareTracker(tracker_class):
        def _fsdp_param_group_pre_backward(self, fsdp_mod, orig_pre_backward):
            tracked = super()._fsdp_param_group_pre_backward(fsdp_mod, orig_pre_backward)

            def pre_backward(*args, **kwargs):
                if fsdp_mod not in self.memory_tracking:
                    self.memory_tracking[fsdp_mod] = _FSDPModMemStats(self._mod_tracker.get_known_fqn(fsdp_mod))
                return tracked(*args, **kwargs)

            return pre_backward

    return UnitAwareTracker


def _steps(run: ResolvedRun, model, optimizer, tracker, dense_mask: bool = False, reference=None) -> None:
    """Two micro-steps as the loop runs them, under the autocast Accelerate applies for the precision,
    on rows of whole examples (no padding, no packing), or with `dense_mask` (packed rows under SDPA)
    on rows of two examples each, whose block-diagonal mask transformers builds as for a packed run;
    the objective's rows (a pair's two sequences) and forwards (the reference's: adapters off, the
    frozen copy `reference`, or none when precomputed)."""
    import contextlib
    from unittest import mock

    import torch

    spec, batch, length = run.spec, run.batch, run.config.max_seq_len
    objective = objective_of(run, reference)
    rows = batch.micro_batch_size * objective.objective.sequences
    tokens = torch.randint(0, spec.vocab_size, (rows, length))
    positions = torch.cat([torch.arange(length // 2), torch.arange(length - length // 2)]).expand_as(tokens) if dense_mask else None
    micro_batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens}
    if objective.objective.policy_no_grad_sequences:  # KTO: each row's mismatched sequence, and its label
        micro_batch.update(kl_input_ids=tokens, kl_attention_mask=torch.ones_like(tokens), kl_labels=tokens,
                           desirable=torch.ones(rows, dtype=torch.bool))
    micro_batch.update(reference_logps=torch.zeros(rows), reference_kl_logps=torch.zeros(rows))  # when precomputed
    autocast = torch.autocast("cpu", dtype=getattr(torch, run.precision.compute), enabled=run.precision.autocast)
    # transformers looks for packed examples in the positions, which fake tensors cannot show it: it would
    # build a seq × seq mask (2 GiB at 32,768 tokens) and SDPA would repeat the KV heads; rows of one
    # example each have no packed examples, as transformers finds on real positions
    whole = contextlib.nullcontext() if dense_mask else mock.patch("transformers.masking_utils.find_packed_sequence_indices",
                                                                   return_value=None)
    with whole:
        for _ in range(2):
            tracker.reset_mod_stats()  # module stats are per iteration; the global peak is kept
            with autocast:
                if objective.objective.preference:
                    loss = _preference_loss(objective, model, micro_batch, tracker, torch.tensor(batch.micro_batch_size))
                else:
                    loss = model(input_ids=tokens, labels=tokens, position_ids=positions).loss
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


def _simulate_fsdp(run: ResolvedRun, dense_mask: bool) -> Simulation:
    """FSDP2 on a fake process group: rank 0's view of a `world_size`-rank job, sharded per decoder
    layer as Accelerate's transformer-based wrap does, with its mixed-precision policy."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from finetune.train import skeleton

    with _fake_process_group(run.world_size):
        mesh = init_device_mesh("cpu", (run.world_size,))  # outside fake mode: the mesh needs real ranks
        model, fake_mode = skeleton.build_skeleton(run)
        reference = skeleton.build_frozen_skeleton(run, fake_mode) if _holds_copy(run) else None
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
            return _tracked_steps(run, model, dense_mask, reference)


def _simulate_tensor_parallel(run: ResolvedRun, dense_mask: bool) -> Simulation:
    """TP as loading.load_model lays it out (train/skeleton.py: transformers' plan with the sequence-parallel
    rules, its FSDP2 over the data-parallel ranks, LoRA, FSDP2 around what it left), on fake tensors
    and a fake process group of the run's world size: rank 0's view, collectives included."""
    with _fake_process_group(run.world_size):
        model, fake_mode = _tensor_parallel_skeleton(run)
        with fake_mode:
            return _tracked_steps(run, model, dense_mask)


def _tracked_steps(run: ResolvedRun, model, dense_mask: bool, reference=None) -> Simulation:
    """Two micro-steps of an FSDP2-wrapped `model` (and a preference objective's FSDP2-wrapped frozen copy
    `reference`), tracked by FSDPMemTracker (inside the fake mode)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from finetune.train.optim import build_optimizer

    # per-tensor AdamW: FSDPMemTracker books foreach temporaries over DTensor shards as several
    # copies of the optimizer states (the planner's step scratch accounts for foreach)
    optimizer = build_optimizer(run.config, model, run.peak_lr)
    tracker = _unit_aware(_frozen_aware(FSDPMemTracker))(model, optimizer)
    if reference is not None:
        tracker.track_external(reference)
    with tracker:
        _steps(run, model, optimizer, tracker, dense_mask, reference)
    return _result(tracker)


@contextmanager
def _fake_process_group(world_size: int) -> Iterator[None]:
    """A process group of `world_size` ranks in which this process is rank 0 and no collective
    moves data (torch's fake backend)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _tensor_parallel_skeleton(run: ResolvedRun):
    """The model load_model builds for a --tp run, on fake tensors from the start (a DTensor layout
    cannot be moved onto fake storage afterwards), over CPU meshes of the fake process group.
    Returns (model, fake_mode)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from finetune.models import families
    from finetune.train import chunked_loss, skeleton
    from finetune.train.speedups import with_model

    hf_config = skeleton.skeleton_config(run)
    layout = skeleton.tensor_parallel_layout(run, hf_config)
    meshes = _cpu_meshes(layout)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode, _meshes_made_outside():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, run.precision.weights),
                                                 attn_implementation=families.attention_implementation(hf_config.model_type))
        model = type(model).maybe_distribute_model(model, layout, meshes)
        model = skeleton.prepare_for_training(model, run.config)
        skeleton.finish_tensor_parallel(model, run)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if with_model(run, base).switches.chunked_loss:
            chunked_loss.install(base)
    return model, fake_mode


def _cpu_meshes(layout):
    """transformers' meshes for `layout` (distributed.utils.initialize_distributed_mesh), on CPU
    whatever accelerator this machine has: the fake tensors are CPU tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.utils import TransformersDeviceMesh

    dense = init_device_mesh("cpu", (1, layout.dp_replicate_size, layout.fsdp_size, layout.tp_size),
                             mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
    experts = init_device_mesh("cpu", (1, layout.dp_replicate_size, layout.efsdp_size, layout.ep_size),
                               mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    return TransformersDeviceMesh(dense, experts)


@contextmanager
def _meshes_made_outside() -> Iterator[None]:
    """FSDP2 over TP-sharded parameters joins the two meshes into one (DeviceMesh._concatenate), whose
    rank arithmetic runs on tensors: made under the fake mode it fails (nonzero has no fake shape)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = DeviceMesh._concatenate

    def outside(meshes):
        with unset_fake_temporarily():
            return concatenate(meshes)

    DeviceMesh._concatenate = staticmethod(outside)
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(concatenate)


def _result(tracker) -> Simulation:
    device_stats = _largest(tracker.get_tracker_snapshot("peak").values())
    terms = _terms(device_stats)
    # where the optimizer step sets the peak, the modules' own peaks in their forward and backward
    moments = [stats for module_stats in tracker.memory_tracking.values() for state, snapshots in module_stats.snapshots.items()
               if state.name in ("PEAK_FW", "PEAK_BW") for snapshot in snapshots for stats in snapshot.values()]
    activations = max(terms.get("activations", 0), _terms(_largest(moments)).get("activations", 0))
    return Simulation(peak_bytes=device_stats["Total"], terms=terms, activations=activations)


def _largest(device_stats):
    return max(device_stats, key=lambda stats: stats.get("Total", 0))


def _terms(device_stats: dict) -> dict[str, int]:
    """MemTracker's bytes by reference type → bytes by planner term."""
    terms: dict[str, int] = {}
    for reftype, size in device_stats.items():
        if reftype == "Total":
            continue
        term = CATEGORIES.get(getattr(reftype, "value", str(reftype)), "buffers")
        terms[term] = terms.get(term, 0) + size
    return terms


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
    lines.append(f"  activations at the forward/backward peak: simulated {simulated.activations / GIB:.2f}, "
                 f"analytic {backward_activations(w) / GIB:.2f} GiB")
    return "\n".join(lines)

