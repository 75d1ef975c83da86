"""Drop-in DeepSpeed JSON: load a user's file, fill every "auto" from the run's config, report conflicts.

DeepSpeed configs written for the Hugging Face Trainer mark the values the trainer owns as "auto".
We fill them before any process loads weights, from the same numbers the loop uses (micro batch,
accumulation, world size, clipping, precision), so DeepSpeed can never train with a batch or
clipping the run did not ask for. A fixed value that disagrees with the run is an error naming the
file, the key and the flag ("zero3.json: gradient_accumulation_steps=8 but
--gradient-accumulation-steps 4"). An "auto" we do not know how to fill is an error too, so the
resolved file written to the output dir holds numbers only.

The loop owns the optimizer and the LR schedule under every strategy (that is what keeps the LR per
update identical across DDP, FSDP and ZeRO). A JSON `optimizer` / `scheduler` section is checked
for agreement with the run's flags and then left out of what DeepSpeed receives.

No torch import: pure dictionaries in, dictionaries out.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.config import BatchShape, ConfigError, TrainConfig


@dataclass(frozen=True)
class RunValues:
    """The numbers a DeepSpeed JSON may leave as "auto", as this run resolved them."""

    batch: BatchShape
    max_grad_norm: float
    mixed_precision: str  # the Accelerate value: no | bf16 | fp16
    lr: float  # peak LR after --lr-scaling
    weight_decay: float
    warmup_steps: int
    lr_schedule: str
    min_lr_ratio: float
    max_steps: int | None
    hidden_size: int | None  # None: DeepSpeed-side bucket sizes are left to Accelerate at prepare()

    @classmethod
    def from_config(cls, config: TrainConfig, batch: BatchShape, mixed_precision: str, lr: float,
                    hidden_size: int | None) -> RunValues:
        return cls(batch, config.max_grad_norm, mixed_precision, lr, config.weight_decay, config.warmup_steps,
                   config.lr_schedule, config.min_lr_ratio, config.max_steps, hidden_size)


@dataclass(frozen=True)
class Owned:
    """A JSON key whose "auto" the run fills: where the value comes from (`flag`), what it is, and
    whether a fixed value must agree (bucket sizes are tuning knobs: filled, never checked)."""

    flag: str
    value: Callable[[RunValues], Any]
    checked: bool = True


def _batch_text(run: RunValues) -> str:
    b = run.batch
    return f"micro {b.micro_batch_size} × accumulation {b.gradient_accumulation_steps} × world {b.world_size}"


def _hidden(run: RunValues, formula: Callable[[int], int]) -> int | None:
    return None if run.hidden_size is None else formula(run.hidden_size)


# dotted JSON key → the run value it must equal. Same three bucket formulas as Accelerate/Transformers.
OWNED: dict[str, Owned] = {
    "train_micro_batch_size_per_gpu": Owned("--micro-batch-size", lambda r: r.batch.micro_batch_size),
    "gradient_accumulation_steps": Owned("--gradient-accumulation-steps", lambda r: r.batch.gradient_accumulation_steps),
    "train_batch_size": Owned("--global-batch-size", lambda r: r.batch.global_batch_size),
    "gradient_clipping": Owned("--max-grad-norm", lambda r: r.max_grad_norm),
    "bf16.enabled": Owned("--mixed-precision", lambda r: r.mixed_precision == "bf16"),
    "fp16.enabled": Owned("--mixed-precision", lambda r: r.mixed_precision == "fp16"),
    "zero_optimization.reduce_bucket_size": Owned("hidden_size", lambda r: _hidden(r, lambda h: h * h), False),
    "zero_optimization.stage3_prefetch_bucket_size": Owned("hidden_size", lambda r: _hidden(r, lambda h: int(0.9 * h * h)), False),
    "zero_optimization.stage3_param_persistence_threshold": Owned("hidden_size", lambda r: _hidden(r, lambda h: 10 * h), False),
    # checked, then dropped: the loop's optimizer and schedule run under every strategy
    "optimizer.params.lr": Owned("--lr", lambda r: r.lr),
    "optimizer.params.weight_decay": Owned("--weight-decay", lambda r: r.weight_decay),
    "scheduler.params.warmup_max_lr": Owned("--lr", lambda r: r.lr),
    "scheduler.params.warmup_num_steps": Owned("--warmup-steps", lambda r: r.warmup_steps),
    "scheduler.params.total_num_steps": Owned("--max-steps", lambda r: r.max_steps),
    "scheduler.params.cos_min_ratio": Owned("--min-lr-ratio", lambda r: r.min_lr_ratio),
}
# values in these sections that finetune's AdamW / LambdaLR do not expose as flags
FOLLOWS_LOOP = {"optimizer.params.betas", "optimizer.params.eps", "optimizer.params.torch_adam",
                "optimizer.params.adam_w_mode", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_type",
                "scheduler.params.warmup_min_ratio", "scheduler.params.last_batch_iteration"}
OPTIMIZER_TYPES = {"adam", "adamw"}  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
SCHEDULER_TYPES = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
LOOP_SECTIONS = ("optimizer", "scheduler")


def load(path: str | Path) -> dict[str, Any]:
    """Parse a DeepSpeed JSON file; errors name the file, line and column."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config not found: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"Invalid JSON in {path} line {e.lineno}, column {e.colno}: {e.msg}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of DeepSpeed settings, got {type(data).__name__}")
    if "zero_optimization" not in data:
        raise ConfigError(f'{path}: no "zero_optimization" section; add e.g. "zero_optimization": {{"stage": 2}}')
    return data


def resolve(raw: dict[str, Any], source: str, run: RunValues) -> tuple[dict[str, Any], list[str]]:
    """Fill every "auto" in `raw` from `run` and check the fixed values against it.

    Returns (the config DeepSpeed should receive, notes for the setup printout). Raises one
    ConfigError listing every conflict and every unfillable "auto", each prefixed with `source`.
    """
    resolved = copy.deepcopy(raw)
    problems = []
    for key, parent, leaf, value in _leaves(resolved):
        owned = OWNED.get(key)
        if owned is None:
            if value == "auto" and key not in FOLLOWS_LOOP:
                problems.append(f'{source}: {key} is "auto" but finetune does not set it; write a value')
            continue
        if owned.value(run) is None:
            # unknown hidden size: Accelerate fills the bucket sizes from model.config at prepare();
            # unknown --max-steps: only in the scheduler section, which is dropped
            continue
        expected = owned.value(run)
        if value == "auto":
            parent[leaf] = expected
        elif owned.checked and not _same(value, expected):
            problems.append(f"{source}: {key}={_show(value)} but {_run_side(key, owned, expected, run)}")
    if _enabled(resolved, "bf16") and _enabled(resolved, "fp16"):
        problems.append(f"{source}: bf16.enabled and fp16.enabled are both true; keep one")
    problems += _check_loop_sections(resolved, source, run)
    if problems:
        raise ConfigError("DeepSpeed config does not match the run:\n  - " + "\n  - ".join(problems))
    notes = [f"{source}: {name} section checked against finetune's flags; the training loop runs its own {name}"
             for name in LOOP_SECTIONS if resolved.pop(name, None) is not None]
    return resolved, notes


def write(resolved: dict[str, Any], path: str | Path) -> None:
    """Save the resolved config; Accelerate's `steps_per_print: inf` (not valid JSON) is left out."""
    data = {key: value for key, value in resolved.items() if not (isinstance(value, float) and math.isinf(value))}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def zero_stage(resolved: dict[str, Any]) -> int:
    return int(resolved.get("zero_optimization", {}).get("stage", 0))


def offload_devices(resolved: dict[str, Any]) -> dict[str, str]:
    """{'optimizer': 'cpu', 'param': 'nvme'} for the offloads that are on (device not none)."""
    zero = resolved.get("zero_optimization", {})
    devices = {name: (zero.get(f"offload_{name}") or {}).get("device", "none") for name in ("optimizer", "param")}
    return {name: device for name, device in devices.items() if device not in (None, "none")}


def _leaves(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, dict, str, Any]]:
    for leaf, value in list(tree.items()):
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{leaf}.")
        else:
            yield f"{prefix}{leaf}", tree, leaf, value


def _same(value: Any, expected: Any) -> bool:
    if isinstance(expected, bool) or isinstance(value, bool):
        return str(value).lower() == str(expected).lower()
    if isinstance(value, (int, float)) and isinstance(expected, (int, float)):
        return math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-12)
    return value == expected


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)


def _run_side(key: str, owned: Owned, expected: Any, run: RunValues) -> str:
    """The run's value as the flag that sets it, so the user knows what to change."""
    if key == "train_batch_size":
        return f"{owned.flag} {expected} ({_batch_text(run)})"
    if key.endswith(".enabled"):
        return f"{owned.flag} resolves to '{run.mixed_precision}'"
    return f"{owned.flag} {expected}"


def _enabled(config: dict[str, Any], section: str) -> bool:
    return str((config.get(section) or {}).get("enabled", False)).lower() == "true"


def _check_loop_sections(config: dict[str, Any], source: str, run: RunValues) -> list[str]:
    problems = []
    optimizer_type = (config.get("optimizer") or {}).get("type")
    if optimizer_type is not None and optimizer_type.lower() not in OPTIMIZER_TYPES:
        problems.append(f"{source}: optimizer.type={optimizer_type} but finetune trains with AdamW (--optimizer); "
                        "remove the optimizer section")
    scheduler_type = (config.get("scheduler") or {}).get("type")
    if scheduler_type is not None and SCHEDULER_TYPES.get(scheduler_type) != run.lr_schedule:
        problems.append(f"{source}: scheduler.type={scheduler_type} but --lr-schedule {run.lr_schedule}; "
                        f"use --lr-schedule {SCHEDULER_TYPES.get(scheduler_type, '...')} or remove the scheduler section")
    return problems
