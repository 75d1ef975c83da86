"""Drop-in DeepSpeed JSON: load a user's file, adopt its optimizer and schedule, fill what the run owns.

A file written for the Hugging Face Trainer must work here as it does there, or fail before launch
with the fix. Three kinds of keys:

- **Run-owned** (micro batch, accumulation, train batch size, clipping, bf16/fp16): filled from the
  same numbers the loop uses, whether the file writes "auto" or leaves the key out (DeepSpeed would
  otherwise refuse a file without a batch size, or silently not clip). A fixed micro batch,
  accumulation or clipping value becomes the run's where the user gave no flag for it (`adopt`), and
  a fixed `bf16`/`fp16` `enabled` decides an `auto` precision (`precision_family`); a fixed value
  must agree with a flag the user gave and with the batch the run resolves (train_batch_size), and
  a conflict names file, key and flag ("zero3.json: gradient_accumulation_steps=8 but
  --gradient-accumulation-steps 4").
- **Adopted** (the `optimizer` and `scheduler` sections: lr, betas, eps, weight decay, warmup, length,
  schedule shape): under the HF Trainer these sections decide how training runs, so a fixed value
  becomes the run's setting wherever the user gave no flag for it (`adopt`); against a flag the user
  typed it is a conflict. "auto", or a missing key, takes the flag's value (or its default).
- **Tuning knobs** (bucket sizes): "auto" is filled from the hidden size, a fixed value is kept.

The loop owns the optimizer and the LR schedule under every strategy (that is what keeps the LR per
update identical across DDP, FSDP and ZeRO): once adopted and checked, the `optimizer` / `scheduler`
sections are left out of what DeepSpeed receives. An "auto" we do not know how to fill is an error,
so the resolved file written to the output dir holds numbers only.

No torch import: pure dictionaries in, dictionaries out.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.config.names import PRECISIONS, trains_pure_bf16
from finetune.config.options import BatchShape, TrainConfig
from finetune.errors import ConfigError


@dataclass(frozen=True)
class RunValues:
    """The numbers a DeepSpeed JSON may leave as "auto", as this run resolved them."""

    batch: BatchShape
    max_grad_norm: float
    precision: str  # --precision as resolved: bf16-mixed, fp32, ...
    method: str  # full | lora | qlora: bf16-true full fine-tuning keeps no fp32 master weights
    lr: float  # peak LR after --lr-scaling
    lr_scaling: str
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    warmup_steps: int
    lr_schedule: str
    min_lr_ratio: float
    max_steps: int | None  # None: the run's length comes from --epochs, known once the data is
    hidden_size: int | None  # None: DeepSpeed-side bucket sizes are left to Accelerate at prepare()
    save_final: bool  # under ZeRO-3 the final save gathers the weights

    @classmethod
    def from_config(cls, config: TrainConfig, batch: BatchShape, precision: str, lr: float,
                    hidden_size: int | None) -> RunValues:
        return cls(batch, config.max_grad_norm, precision, config.method, lr, config.lr_scaling, config.weight_decay,
                   (config.adam_beta1, config.adam_beta2), config.adam_epsilon, config.warmup_steps,
                   config.lr_schedule, config.min_lr_ratio, config.max_steps, hidden_size, config.save_final)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _count(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None and number >= 0 and number.is_integer() else None


def _pair(value: Any) -> tuple[float, float] | None:
    if isinstance(value, list) and len(value) == 2 and all(_number(v) is not None for v in value):
        return float(value[0]), float(value[1])
    return None


@dataclass(frozen=True)
class Owned:
    """A JSON key the run fills or checks: the option it corresponds to (`options`, TrainConfig
    field names; the flags in messages), its value for this run, whether a fixed value must agree
    (bucket sizes are tuning knobs: filled, never checked), and how a fixed value becomes the
    options' values when the file's choice is adopted (None: never adopted)."""

    options: tuple[str, ...]
    value: Callable[[RunValues], Any]
    checked: bool = True
    adopt: Callable[[Any], tuple | None] | None = None

    @property
    def flag(self) -> str:
        return "/".join("--" + option.replace("_", "-") for option in self.options)


def _batch_text(run: RunValues) -> str:
    b = run.batch
    return f"micro {b.micro_batch_size} × accumulation {b.gradient_accumulation_steps} × world {b.world_size}"


def _pure_bf16(run: RunValues) -> bool:
    return trains_pure_bf16(PRECISIONS[run.precision], run.method)


def _hidden(run: RunValues, formula: Callable[[int], int]) -> int | None:
    return None if run.hidden_size is None else formula(run.hidden_size)


def _as(convert: Callable[[Any], Any]) -> Callable[[Any], tuple | None]:
    """An adopter for one option: the file's value converted, or None when it has the wrong type."""
    return lambda value: None if convert(value) is None else (convert(value),)


# dotted JSON key → the run value it must equal. Same three bucket formulas as Accelerate/Transformers.
OWNED: dict[str, Owned] = {
    "train_micro_batch_size_per_gpu": Owned(("micro_batch_size",), lambda r: r.batch.micro_batch_size, adopt=_as(_count)),
    "gradient_accumulation_steps": Owned(("gradient_accumulation_steps",), lambda r: r.batch.gradient_accumulation_steps,
                                         adopt=_as(_count)),
    "train_batch_size": Owned(("global_batch_size",), lambda r: r.batch.global_batch_size),
    "gradient_clipping": Owned(("max_grad_norm",), lambda r: r.max_grad_norm, adopt=_as(_number)),
    "bf16.enabled": Owned(("precision",), lambda r: PRECISIONS[r.precision].accelerate == "bf16"),
    "fp16.enabled": Owned(("precision",), lambda r: PRECISIONS[r.precision].accelerate == "fp16"),
    # bf16-true full fine-tuning: master weights, gradients and Adam states stay bf16 (DeepSpeed ≥ 0.18)
    "bf16.bf16_master_weights_and_grads": Owned(("precision",), _pure_bf16),
    "bf16.bf16_optimizer_states": Owned(("precision",), _pure_bf16),
    "zero_optimization.reduce_bucket_size": Owned(("hidden_size",), lambda r: _hidden(r, lambda h: h * h), False),
    "zero_optimization.stage3_prefetch_bucket_size": Owned(("hidden_size",), lambda r: _hidden(r, lambda h: int(0.9 * h * h)), False),
    "zero_optimization.stage3_param_persistence_threshold": Owned(("hidden_size",), lambda r: _hidden(r, lambda h: 10 * h), False),
    # adopted where no flag was given, then dropped: the loop's optimizer and schedule run under every strategy
    "optimizer.params.lr": Owned(("lr",), lambda r: r.lr, adopt=_as(_number)),
    "optimizer.params.betas": Owned(("adam_beta1", "adam_beta2"), lambda r: list(r.betas), adopt=_pair),
    "optimizer.params.eps": Owned(("adam_epsilon",), lambda r: r.eps, adopt=_as(_number)),
    "optimizer.params.weight_decay": Owned(("weight_decay",), lambda r: r.weight_decay, adopt=_as(_number)),
    "scheduler.params.warmup_max_lr": Owned(("lr",), lambda r: r.lr, adopt=_as(_number)),
    "scheduler.params.warmup_num_steps": Owned(("warmup_steps",), lambda r: r.warmup_steps, adopt=_as(_count)),
    "scheduler.params.total_num_steps": Owned(("max_steps",), lambda r: r.max_steps, adopt=_as(_count)),
    "scheduler.params.cos_min_ratio": Owned(("min_lr_ratio",), lambda r: r.min_lr_ratio, adopt=_as(_number)),
}
# keys DeepSpeed needs that a file may leave out: filled from the run as if they said "auto"
FILLED_WHEN_MISSING = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                       "gradient_clipping", "bf16.enabled", "fp16.enabled")
# filled only for a pure bf16 run, so other runs' files stay readable by DeepSpeed versions without them
PURE_BF16_KEYS = ("bf16.bf16_master_weights_and_grads", "bf16.bf16_optimizer_states")
# optimizer/scheduler settings with no flag: the one value the loop's AdamW / LambdaLR implements
# ("auto" or missing means it too); another fixed value is refused rather than silently ignored
LOOP_FIXED = {"optimizer.params.adam_w_mode": (True, "AdamW (decoupled weight decay)"),
              "scheduler.params.warmup_type": ("linear", "warmup (linear)"),
              "scheduler.params.warmup_min_lr": (0, "warmup (from 0)"),
              "scheduler.params.warmup_min_ratio": (0, "warmup (from 0)")}
# implementation choices that do not change the numbers
IGNORED = {"optimizer.params.torch_adam", "optimizer.params.fused", "scheduler.params.last_batch_iteration"}
OPTIMIZER_TYPES = {"adam", "adamw"}  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
SCHEDULER_TYPES = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
DECAYS_TO_ZERO = "WarmupDecayLR"  # DeepSpeed's linear decay ends at 0: --min-lr-ratio 0
# under ZeRO-3, saving the final model (--save-final) gathers the sharded weights, which DeepSpeed
# refuses at the end of training unless this is true
GATHER_ON_SAVE = "zero_optimization.stage3_gather_16bit_weights_on_model_save"
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


def adopt(raw: dict[str, Any], config: TrainConfig, given: frozenset[str]) -> dict[str, tuple[Any, str]]:
    """The options the file decides for this run (its micro batch, accumulation and clipping, and its
    `optimizer` and `scheduler` sections): option → (value, the key it came from).

    An option is adopted when the file fixes it with a value of the right type and the user gave no
    flag for it (`given`); the first key naming an option wins (optimizer.params.lr before
    scheduler.params.warmup_max_lr), so a second one that disagrees is reported by `resolve`, as is
    every fixed value that contradicts a flag the user gave. Not adopted: the file's lr under
    --lr-scaling (the file's is the LR of every update, --lr the one before scaling), and
    total_num_steps when --epochs sets the run's length.
    """
    adopted: dict[str, tuple[Any, str]] = {}

    def take(options: tuple[str, ...], values: tuple, key: str) -> None:
        if not any(option in given or option in adopted for option in options):
            adopted.update({option: (value, key) for option, value in zip(options, values)})

    scheduler_type = (raw.get("scheduler") or {}).get("type")
    if scheduler_type in SCHEDULER_TYPES:
        take(("lr_schedule",), (SCHEDULER_TYPES[scheduler_type],), "scheduler.type")
        if scheduler_type == DECAYS_TO_ZERO:
            take(("min_lr_ratio",), (0.0,), "scheduler.type")
    for key, _, _, value in _leaves(raw):
        owned = OWNED.get(key)
        if owned is None or owned.adopt is None or value == "auto":
            continue
        if (owned.options == ("lr",) and config.lr_scaling != "none") or (owned.options == ("max_steps",) and "epochs" in given):
            continue
        values = owned.adopt(value)
        if values is not None:
            take(owned.options, values, key)
    return adopted


def resolve(raw: dict[str, Any], source: str, run: RunValues) -> tuple[dict[str, Any], list[str]]:
    """Fill every "auto" (and every missing run-owned key) in `raw` from `run` and check the fixed
    values against it.

    Returns (the config DeepSpeed should receive, notes for the setup printout). Raises one
    ConfigError listing every conflict and every unfillable "auto", each prefixed with `source`.
    """
    resolved = copy.deepcopy(raw)
    stage3 = zero_stage(resolved) == 3
    needed = FILLED_WHEN_MISSING + ((GATHER_ON_SAVE,) if stage3 else ()) + (PURE_BF16_KEYS if _pure_bf16(run) else ())
    missing = [key for key in needed if not _has(resolved, key)]
    for key in missing:
        _set(resolved, key, "auto")
    problems = []
    for key, parent, leaf, value in _leaves(resolved):
        owned = OWNED.get(key)
        if owned is None:
            problems += _check_unowned(key, parent, leaf, value, source, run, stage3)
            continue
        expected = owned.value(run)
        if value == "auto":
            # None: an unknown hidden size (Accelerate fills the bucket sizes from model.config at
            # prepare()), or a length --epochs sets (in the scheduler section, which is dropped)
            if expected is not None:
                parent[leaf] = expected
        elif owned.checked and not _same(value, expected):
            problems.append(f"{source}: {key}={_show(value)} but {_run_side(key, owned, expected, run)}")
    if _enabled(resolved, "bf16") and _enabled(resolved, "fp16"):
        problems.append(f"{source}: bf16.enabled and fp16.enabled are both true; keep one")
    problems += _check_loop_sections(resolved, source, run)
    if problems:
        raise ConfigError("DeepSpeed config does not match the run:\n  - " + "\n  - ".join(problems))
    notes = [f"{source}: no {', '.join(missing)}; filled from the run"] if missing else []
    notes += [f"{source}: {name} section checked against finetune's flags; the training loop runs its own {name}"
              for name in LOOP_SECTIONS if resolved.pop(name, None) is not None]
    return resolved, notes


def rehearsable(raw: dict[str, Any], real: RunValues, rehearsal: RunValues) -> tuple[dict[str, Any], list[str]]:
    """`raw` with "auto" in place of each fixed run-owned value that the rehearsal runs differently
    from the real run (its world size, its small batch and few updates, fp32 on CPU), and those
    keys with both values. Conflicts with the real run are `resolve`'s business: check them first."""
    relaxed = copy.deepcopy(raw)
    changed = []
    for key, parent, leaf, value in _leaves(relaxed):
        owned = OWNED.get(key)
        if owned is None or not owned.checked or value == "auto":
            continue
        real_value, rehearsal_value = owned.value(real), owned.value(rehearsal)
        if not _same(real_value, rehearsal_value):
            parent[leaf] = "auto"
            changed.append(f"{key} (real run {_show(real_value)}, rehearsal {_show(rehearsal_value)})")
    return relaxed, changed


def write(resolved: dict[str, Any], path: str | Path) -> None:
    """Save the resolved config; Accelerate's `steps_per_print: inf` (not valid JSON) is left out."""
    data = {key: value for key, value in resolved.items() if not (isinstance(value, float) and math.isinf(value))}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def precision_family(raw: dict[str, Any]) -> str | None:
    """"bf16" or "fp16" when the file fixes that section's `enabled` to true (not "auto"); "fp32"
    when it fixes one to false and neither to true (a file that turns 16-bit off asks for fp32);
    else None."""
    enabled = {family: str((raw.get(family) or {}).get("enabled", "auto")).lower() for family in ("bf16", "fp16")}
    for family, value in enabled.items():
        if value == "true":
            return family
    return "fp32" if "false" in enabled.values() else None


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


def _has(tree: Mapping[str, Any], key: str) -> bool:
    head, _, rest = key.partition(".")
    if not rest:
        return head in tree
    return isinstance(tree.get(head), Mapping) and _has(tree[head], rest)


def _set(tree: dict[str, Any], key: str, value: Any) -> None:
    head, _, rest = key.partition(".")
    if rest:
        _set(tree.setdefault(head, {}), rest, value)
    else:
        tree[head] = value


def _same(value: Any, expected: Any) -> bool:
    if isinstance(expected, bool) or isinstance(value, bool):
        return str(value).lower() == str(expected).lower()
    if isinstance(value, (int, float)) and isinstance(expected, (int, float)):
        return math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(value, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(value) == len(expected) and all(_same(v, e) for v, e in zip(value, expected))
    return value == expected


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, list, str)) else str(value)


def _run_side(key: str, owned: Owned, expected: Any, run: RunValues) -> str:
    """The run's value as the flag that sets it, so the user knows what to change."""
    if key == "train_batch_size":
        return f"{owned.flag} {expected} ({_batch_text(run)})"
    if key.endswith(".enabled"):
        return f"{owned.flag} resolves to {run.precision}"
    if owned.options == ("lr",) and run.lr_scaling != "none":
        return (f"the run's peak LR is {expected:g} (--lr scaled by --lr-scaling {run.lr_scaling}); "
                "pass --lr-scaling none to take the file's LR, or write \"auto\"")
    if owned.options == ("max_steps",) and expected is None:
        return "--epochs sets the run's length; pass --max-steps instead, or write \"auto\""
    if len(owned.options) > 1:
        return f"{owned.flag} {' '.join(f'{v:g}' for v in expected)}"
    return f"{owned.flag} {expected}"


def _enabled(config: dict[str, Any], section: str) -> bool:
    return str((config.get(section) or {}).get("enabled", False)).lower() == "true"


def _check_unowned(key: str, parent: dict, leaf: str, value: Any, source: str, run: RunValues, stage3: bool) -> list[str]:
    """A key with no flag: the final save's gather, a setting of the loop's AdamW or schedule (only
    the loop's own value passes), or anything else (kept as written; "auto" is refused)."""
    if key == GATHER_ON_SAVE:
        return _check_gather_on_save(parent, leaf, value, source, run, stage3)
    if key in LOOP_FIXED:
        expected, what = LOOP_FIXED[key]
        if value == "auto":
            parent[leaf] = expected
        elif not _same(value, expected):
            return [f"{source}: {key}={_show(value)} but finetune's {what} runs with {_show(expected)}; "
                    "write that or remove the key"]
    elif value == "auto" and key not in IGNORED:
        return [f'{source}: {key} is "auto" but finetune does not set it; write a value']
    return []


def _check_gather_on_save(parent: dict, leaf: str, value: Any, source: str, run: RunValues, stage3: bool) -> list[str]:
    """"auto" (or missing under ZeRO-3) follows --save-final; false with --save-final would fail
    under ZeRO-3 after training (stages 1-2 hold whole weights and never gather)."""
    if value == "auto":
        parent[leaf] = run.save_final
    elif stage3 and run.save_final and not _same(value, True):
        return [f"{source}: {GATHER_ON_SAVE}={_show(value)} but --save-final gathers the ZeRO-3 weights at the end "
                "of training; set it true (accelerate config: zero3_save_16bit_model: true) or pass --no-save-final "
                "(and `finetune export` a checkpoint)"]
    return []


def _check_loop_sections(config: dict[str, Any], source: str, run: RunValues) -> list[str]:
    problems = []
    optimizer_type = (config.get("optimizer") or {}).get("type")
    if optimizer_type is not None and str(optimizer_type).lower() not in OPTIMIZER_TYPES:
        problems.append(f"{source}: optimizer.type={optimizer_type} but finetune trains with AdamW (--optimizer); "
                        "remove the optimizer section")
    scheduler_type = (config.get("scheduler") or {}).get("type")
    if scheduler_type is not None and SCHEDULER_TYPES.get(scheduler_type) != run.lr_schedule:
        problems.append(f"{source}: scheduler.type={scheduler_type} but --lr-schedule {run.lr_schedule}; "
                        f"use --lr-schedule {SCHEDULER_TYPES.get(scheduler_type, '...')} or remove the scheduler section")
    elif scheduler_type == DECAYS_TO_ZERO and run.min_lr_ratio != 0:
        problems.append(f"{source}: scheduler.type={scheduler_type} decays to 0 but --min-lr-ratio {run.min_lr_ratio}; "
                        "pass --min-lr-ratio 0 or remove the scheduler section")
    return problems
