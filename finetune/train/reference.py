"""The reference model of DPO and KTO (the weights before training), at the memory it needs.

Three ways to have its log-probabilities, decided once per run (config/objectives.reference_kind):

- adapters off (LoRA, QLoRA): the policy itself with its adapters disabled (PEFT's
  `disable_adapter()`), under no_grad: the base it adapts is the reference, so no second copy exists.
- a frozen copy (full fine-tuning): the base weights loaded again in the compute dtype, without
  gradients or optimizer states, sharded as the policy is (FSDP2: a unit per decoder layer over the
  same ranks; ZeRO-3: a DeepSpeed inference engine of stage 3), replicated otherwise.
- precomputed (`--precompute-reference`): one pass over train and eval before training, with the
  policy as it loaded (the reference itself: adapters off, or the full model before its first update,
  since it runs before a resumed checkpoint loads), and no reference held afterwards. The values are
  cached beside the tokenized data (data/cache.py), under a key of the data's entry, the model's
  content (content.py's digest of its folder, or the Hub revision) and the precision and method that
  change them, so a later run of the same data and model reads them back.

Every rank computes its share of the rows and all gather them, so the pass works under every
strategy (its forwards are collectives under FSDP2 and ZeRO-3). It runs under a forked RNG: a run that
finds the values cached and one that computes them train identically.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from finetune.config.objectives import OBJECTIVES, reference_kind
from finetune.data import content
from finetune.train.log_probs import sequence_log_probs

if TYPE_CHECKING:
    from accelerate import Accelerator

    from finetune.config.resolve import ResolvedRun
    from finetune.data import PreparedData
    from finetune.data.collate import PreferenceCollator


class Reference:
    """The reference log-probabilities of a batch's sequences, from where `kind` says."""

    def __init__(self, kind: str, accelerator: Accelerator, model: torch.nn.Module | None = None):
        self.kind, self.accelerator, self.model = kind, accelerator, model

    def log_probs(self, policy: torch.nn.Module, batch: dict, prefix: str = "") -> torch.Tensor:
        """Per-sequence log-probability sums of `batch`'s sequences under `prefix` (`kl_`: KTO's
        mismatched ones), without gradients."""
        if self.kind == "precomputed":
            return batch[f"reference_{prefix}logps"]
        with torch.no_grad(), self.adapters_off(policy):
            return sequence_log_probs(self.model if self.kind == "frozen copy" else policy, batch, prefix)[0]

    def adapters_off(self, policy: torch.nn.Module):
        """PEFT's disable_adapter() on the policy when the reference is its base, else nothing."""
        if self.kind == "frozen copy" or self.model is not None:
            return contextlib.nullcontext()
        return self.accelerator.unwrap_model(policy).disable_adapter()


def build_reference(run: ResolvedRun, accelerator: Accelerator, model: torch.nn.Module, data: PreparedData,
                    collators: tuple[PreferenceCollator, PreferenceCollator]) -> Reference | None:
    """The run's Reference (None without one). Precomputed: the values are computed (or read from the
    cache) now, with the policy as loaded, and handed to the train and eval `collators`."""
    config = run.config
    kind = reference_kind(config.objective, config.precompute_reference, config.method)
    if kind is None:
        return None
    if kind == "frozen copy":
        return Reference(kind, accelerator, frozen_copy(run, accelerator, model))
    if kind == "precomputed":
        passing = Reference("frozen copy" if config.method == "full" else "adapters off", accelerator,
                            model if config.method == "full" else None)
        for rows, collator in zip((data.train, data.eval), collators):
            collator.reference = precomputed(run, accelerator, model, passing, rows, data, collator)
    return Reference(kind, accelerator)


def frozen_copy(run: ResolvedRun, accelerator: Accelerator, policy: torch.nn.Module) -> torch.nn.Module:
    """The base weights again, in the compute dtype, frozen, in eval mode, sharded as `policy` is."""
    from finetune.train import loading, log_probs

    dtype = getattr(torch, run.precision.compute)
    model = loading.load_frozen(run, dtype)
    log_probs.install(model, log_probs.form_of(run))
    if run.strategy.fsdp:
        return shard_like(model, policy, accelerator.device)
    if run.strategy.zero_stage == 3:
        return zero3_engine(model, run)
    return model.to(accelerator.device)


def shard_like(model: torch.nn.Module, policy: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """FSDP2 over the mesh the policy is sharded on: a unit per decoder layer (the classes Accelerate's
    transformer-based wrap names), then the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = next(p for p in policy.parameters() if isinstance(p, DTensor)).device_mesh
    model.to(device)
    for layer in [m for m in model.modules() if type(m).__name__ in model._no_split_modules]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def zero3_engine(model: torch.nn.Module, run: ResolvedRun):
    """A DeepSpeed stage-3 engine without optimizer: the copy partitioned over the ranks as the policy's
    weights are, gathered layer by layer in its forward."""
    import deepspeed

    policy_config = run.deepspeed.config
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": run.batch.micro_batch_size,
              **{key: policy_config[key] for key in ("bf16", "fp16") if key in policy_config}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def precomputed(run: ResolvedRun, accelerator: Accelerator, model: torch.nn.Module, reference: Reference, rows,
                data: PreparedData, collator: PreferenceCollator) -> dict[str, torch.Tensor]:
    """The reference log-probabilities of every row of `rows` (a split of `data`, batched by `collator`),
    by row index: from the cache, else computed on every rank's share and gathered (and cached)."""
    path = cache_path(run, data, len(rows), model)
    if path is not None and path.is_file():
        return load_file(path)
    with torch.random.fork_rng(devices=[accelerator.device] if accelerator.device.type == "cuda" else []):
        values = compute(accelerator, model, reference, rows, collator, run.batch.micro_batch_size)
    if path is not None and accelerator.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.tmp-{accelerator.process_index}")
        save_file({name: value.contiguous() for name, value in values.items()}, partial)
        partial.replace(path)
    accelerator.wait_for_everyone()
    return values


def compute(accelerator: Accelerator, model: torch.nn.Module, reference: Reference, rows, collator: PreferenceCollator,
            micro_batch_size: int) -> dict[str, torch.Tensor]:
    """Every row's reference log-probabilities: each rank the rows of its contiguous share (`share`),
    then gathered in row order. Pairs: `chosen`, `rejected`; labelled rows: `own`, `kl`."""
    paired = "chosen_input_ids" in rows.column_names
    names = ("chosen", "rejected") if paired else ("own", "kl")
    if len(rows) == 0:  # every rank has the same (empty) split: nothing to compute or gather
        return {name: torch.zeros(0) for name in names}
    mine = share(len(rows), accelerator.num_processes, accelerator.process_index)
    parts = []
    for start in range(0, len(mine), micro_batch_size):
        batch = collator([rows[i] for i in mine[start:start + micro_batch_size]])
        batch = {key: value.to(accelerator.device) for key, value in batch.items()}
        logps = reference.log_probs(model, batch)
        if paired:  # the batch's chosen sequences, then its rejected ones
            first, second = logps.view(2, -1)
        else:
            first, second = logps, reference.log_probs(model, batch, "kl_")
        parts.append(torch.stack([first, second], dim=1).float())
    gathered = accelerator.gather(torch.cat(parts))[: len(rows)].cpu()
    return {name: gathered[:, column].contiguous() for column, name in enumerate(names)}


def cache_path(run: ResolvedRun, data: PreparedData, rows: int, model: torch.nn.Module) -> Path | None:
    """Where a split's precomputed values are cached (None when the data cache is off)."""
    if data.cache_entry is None:
        return None
    weights = Path(run.model.weights)
    base = accelerator_free_base(model)
    model_key = content.digest(weights) if weights.exists() else getattr(base.config, "_commit_hash", None) or str(weights)
    key = {"data": data.cache_entry.name, "rows": rows, "model": model_key, "precision": run.precision.name,
           "quantized": run.config.method == "qlora", "objective": OBJECTIVES[run.config.objective].rows}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return data.cache_entry.parent / "reference" / f"{digest}.safetensors"


def accelerator_free_base(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "module", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def share(rows: int, ranks: int, rank: int) -> list[int]:
    """The contiguous rows one rank computes, padded with row 0 to ceil(rows / ranks)."""
    size = math.ceil(rows / ranks)
    mine = list(range(rank * size, min(rows, (rank + 1) * size)))
    return mine + [0] * (size - len(mine))
