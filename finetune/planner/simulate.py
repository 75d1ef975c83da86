"""`finetune plan --simulate`: run real training steps of a plan on fake tensors and measure the
per-GPU peak with PyTorch's MemTracker (FSDPMemTracker on a fake process group for FSDP).

Fake CPU tensors carry shapes and dtypes but no data, so a 7B step takes seconds-to-a-minute of CPU
and almost no memory. The step mirrors finetune's loop with gradient accumulation: two
forward/backward passes with an optimizer step after each, so the second pass runs with
gradients and optimizer states allocated, as every pass after the first does in a real run.
Supports full and LoRA fine-tuning on one device or FSDP2; QLoRA's 4-bit kernels cannot run on
fake tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.errors import FinetuneError
from finetune.planner.memory import GIB, estimate
from finetune.planner.workload import Workload

# MemTracker's reference types → the planner's terms.
CATEGORIES = {
    "Parameter": "weights", "Sharded Param": "weights", "Unsharded Param": "buffers", "Buffer": "weights",
    "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "buffers",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Temp": "activations", "Inputs": "activations",
    "All Gather": "buffers", "Reduce Scatter": "buffers",
}


@dataclass(frozen=True)
class Simulation:
    peak_bytes: int
    terms: dict[str, int]  # planner term → bytes at the peak


def simulate(w: Workload) -> Simulation:
    """Peak tracked memory of one GPU over two accumulation micro-steps of `w`."""
    if w.method == "qlora":
        raise FinetuneError("--simulate supports full and LoRA plans: bitsandbytes' 4-bit kernels do not run on fake tensors.")
    if w.strategy not in ("single", "fsdp") or w.offload != "none":
        raise FinetuneError(f"--simulate supports one GPU and FSDP2 without offload, not {w.strategy} with offload {w.offload}.")
    if w.optimizer not in ("adamw", "sgd"):
        raise FinetuneError(f"--simulate runs torch optimizers (adamw, sgd), not {w.optimizer}.")
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    if w.strategy == "fsdp":
        return _simulate_fsdp(w, torch, FakeTensorMode)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _build_model(w, torch)
        optimizer = _optimizer(w, model, torch)
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = _frozen_aware(MemTracker)()
        tracker.track_external(model, optimizer)
        with tracker:
            _steps(w, model, optimizer, torch, tracker)
        return _result(tracker)


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


def _build_model(w: Workload, torch):
    """The plan's model (with LoRA adapters) built on the meta device, then given fake CPU storage.

    Building under FakeTensorMode directly fails once PEFT moves adapters (fake parameters must be
    swapped, and transformers holds weak references to them); tied weights stay tied.
    """
    import transformers

    config = transformers.AutoConfig.for_model(**w.model.to_hf_config_dict())
    config._attn_implementation = "eager" if w.attention == "eager" else "sdpa"
    dtype = torch.bfloat16 if w.precision == "bf16-true" else torch.float32
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        if w.method == "lora":
            import peft

            targets = "all-linear" if w.lora_targets == "all-linear" else w.lora_targets.split(",")
            lora = peft.LoraConfig(r=w.lora_r, lora_alpha=2 * w.lora_r, target_modules=targets, lora_dropout=w.lora_dropout)
            model = peft.get_peft_model(model, lora)
    fakes: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, wrap in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in fakes:
                    fake = torch.empty_like(tensor, device="cpu")
                    fakes[id(tensor)] = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad) if wrap else fake
                table[name] = fakes[id(tensor)]
    model.train()
    if w.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _optimizer(w: Workload, model, torch):
    trainable = [p for p in model.parameters() if p.requires_grad]
    if w.optimizer == "sgd":
        return torch.optim.SGD(trainable, lr=1e-3)
    # foreach=True is torch's default on CUDA; on CPU it would fall back to the per-tensor loop.
    return torch.optim.AdamW(trainable, lr=1e-4, foreach=not w.fused_optimizer, fused=w.fused_optimizer or None)


def _steps(w: Workload, model, optimizer, torch, tracker) -> None:
    batch = torch.randint(0, w.model.vocab_size, (w.micro_batch_size, w.seq_len))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=w.precision_spec.autocast)
    for _ in range(2):
        tracker.reset_mod_stats()  # module stats are per iteration; the global peak is kept
        with autocast:
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()  # the first step creates the states; gradients stay, as under accumulation


def _simulate_fsdp(w: Workload, torch, FakeTensorMode):
    """FSDP2 on a fake process group: rank 0's view of a `world_size`-rank job."""
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=w.world_size, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (w.world_size,))  # outside fake mode: the mesh needs real ranks
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = _build_model(w, torch)
            # Accelerate's FSDP2 mixed precision: bf16 compute copies of fp32 shards, fp32 reduction
            mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            policy = mixed if w.precision_spec.autocast else MixedPrecisionPolicy()
            for layer in _decoder_layers(model):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            optimizer = _optimizer(w, model, torch)
            tracker = _frozen_aware(FSDPMemTracker)(model, optimizer)
            with tracker:
                _steps(w, model, optimizer, torch, tracker)
            return _result(tracker)
    finally:
        dist.destroy_process_group()


def _decoder_layers(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


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


def compare_text(w: Workload) -> str:
    """Simulated vs analytic per-GPU peak, term by term (allocated memory, no slack or context)."""
    simulated = simulate(w)
    analytic = estimate(w)
    lines = [f"Simulated one step on fake tensors ({w.method}, {w.strategy}, {w.world_size} rank(s), micro batch {w.micro_batch_size} × {w.seq_len}):",
             f"  {'term':<12} {'simulated':>10} {'analytic':>10}  GiB"]
    for term in ("weights", "gradients", "optimizer", "activations", "buffers"):
        lines.append(f"  {term:<12} {simulated.terms.get(term, 0) / GIB:>10.2f} {getattr(analytic, term) / GIB:>10.2f}")
    error = analytic.allocated / simulated.peak_bytes - 1
    lines.append(f"  {'allocated':<12} {simulated.peak_bytes / GIB:>10.2f} {analytic.allocated / GIB:>10.2f}  (analytic {error:+.1%})")
    return "\n".join(lines)
