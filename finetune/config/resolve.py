"""A run resolved once: every value the flags leave open, decided before any weights load.

`resolve_run(config, launch, device)` turns the flags, what the launcher announced (processes,
machines, strategy, offload, the DeepSpeed JSON) and the device into one frozen `ResolvedRun`.
Everything downstream reads it instead of re-deriving values: the Accelerator builder, model
loading, the DeepSpeed resolver, resume identity, the checkpoint manifest, `--dry-run`, the fit
check and the planner's translation of the run (`plan.workload.from_run`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from finetune.config import deepspeed_json
from finetune.config.names import PRECISIONS, STRATEGIES, Precision, Strategy, check_precision, default_precision, zero_strategy
from finetune.config.objectives import layout_problems
from finetune.config.options import EVERY_OPTION, BatchShape, TrainConfig, resolve_batch_shape, scaled_lr, validate
from finetune.config.parallelism import Asked, Parallelism, parallelism_problems, resolve_parallelism
from finetune.config.switches import Switches, attention_problem, fp8_problem, resolve_switches
from finetune.errors import ConfigError
from finetune.models import source as model_source
from finetune.models.catalog import ModelSpec
from finetune.models.source import ModelSource

# how conflicts name DeepSpeed settings that came from the accelerate config rather than a JSON file
LAUNCH_DEEPSPEED = "accelerate config (deepspeed_config section; delete a key there to let finetune set it)"


@dataclass(frozen=True)
class Launch:
    """What the launcher (accelerate launch / torchrun, or none) decided for this process's job."""

    world_size: int = 1
    num_machines: int = 1
    fsdp: bool = False
    fsdp_version: int = 2
    fsdp_offload_params: bool = False
    fsdp_cpu_ram_efficient_loading: bool = False
    deepspeed: bool = False  # accelerate launch --use_deepspeed / a DEEPSPEED config
    deepspeed_config_file: str | None = None
    deepspeed_zero_stage: int | None = None  # the accelerate config's own zero_stage, if it sets one
    mixed_precision: str | None = None  # the accelerate config's bf16 | fp16; None when unset or "no"
    rank: int = 0
    parallelism: Asked = Asked()  # the accelerate config's parallelism_config sizes, if it has that section

    @property
    def gpus_per_node(self) -> int:
        return max(1, self.world_size // self.num_machines)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Launch:
        """Read the variables `accelerate launch` and torchrun set for each process (`environ`:
        this process's environment, looked up at call time since libraries may rebind os.environ)."""
        environ = os.environ if environ is None else environ
        def flag(name: str) -> bool:
            return environ.get(name, "false").lower() == "true"

        world = int(environ.get("WORLD_SIZE", "1"))
        local_world = int(environ.get("LOCAL_WORLD_SIZE", world))
        mixed = environ.get("ACCELERATE_MIXED_PRECISION", "no")
        ds_file = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        return cls(
            world_size=world,
            num_machines=int(environ.get("GROUP_WORLD_SIZE", max(1, world // max(1, local_world)))),
            fsdp=flag("ACCELERATE_USE_FSDP"),
            fsdp_version=int(environ.get("FSDP_VERSION", "1")),  # Accelerate's default when the config names none
            fsdp_offload_params=flag("FSDP_OFFLOAD_PARAMS"),
            fsdp_cpu_ram_efficient_loading=flag("FSDP_CPU_RAM_EFFICIENT_LOADING"),
            deepspeed=flag("ACCELERATE_USE_DEEPSPEED"),
            deepspeed_config_file=None if ds_file == "none" else ds_file,
            deepspeed_zero_stage=int(environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"]) if "ACCELERATE_DEEPSPEED_ZERO_STAGE" in environ else None,
            mixed_precision=None if mixed == "no" else mixed,
            rank=int(environ.get("RANK", "0")),
            parallelism=Asked(**{name: int(environ[f"PARALLELISM_CONFIG_{name.upper()}_SIZE"]) for name in PARALLEL_SIZES
                                 if f"PARALLELISM_CONFIG_{name.upper()}_SIZE" in environ})
            if flag("ACCELERATE_USE_PARALLELISM_CONFIG") else Asked(),
        )

    @classmethod
    def from_accelerate_config(cls, path: str | None, num_processes: int) -> Launch:
        """What `accelerate launch [--config_file path] --num_processes N` announces to each
        process, read from the file instead of the environment (no file: `--multi_gpu`)."""
        settings = read_accelerate_config(path) if path else {}
        kind = str(settings.get("distributed_type", "MULTI_GPU")).upper()
        fsdp, deepspeed = settings.get("fsdp_config") or {}, settings.get("deepspeed_config") or {}
        sizes = settings.get("parallelism_config") or {}
        mixed = str(settings.get("mixed_precision") or "no")
        return cls(
            world_size=num_processes,
            num_machines=int(settings.get("num_machines", 1)),
            fsdp=kind == "FSDP",
            fsdp_version=int(fsdp.get("fsdp_version", 1)),
            fsdp_offload_params=bool(fsdp.get("fsdp_offload_params")),
            fsdp_cpu_ram_efficient_loading=bool(fsdp.get("fsdp_cpu_ram_efficient_loading")),
            deepspeed=kind == "DEEPSPEED",
            deepspeed_config_file=deepspeed.get("deepspeed_config_file"),
            deepspeed_zero_stage=deepspeed.get("zero_stage"),
            mixed_precision=None if mixed == "no" else mixed,
            parallelism=Asked(**{name: sizes[f"parallelism_config_{name}_size"] for name in PARALLEL_SIZES
                                 if f"parallelism_config_{name}_size" in sizes}),
        )


# the ParallelismConfig sizes finetune reads, as `accelerate launch` passes them (PARALLELISM_CONFIG_TP_SIZE)
# and an accelerate config writes them (parallelism_config: {parallelism_config_tp_size: 2})
PARALLEL_SIZES = ("dp_replicate", "dp_shard", "tp", "cp")
# settings of an accelerate config that are counts; Accelerate's loader leaves their types unchecked
ACCELERATE_INTEGERS = ("num_processes", "num_machines", "machine_rank", "fsdp_config.fsdp_version",
                       "deepspeed_config.zero_stage",
                       *(f"parallelism_config.parallelism_config_{name}_size" for name in PARALLEL_SIZES))


def read_accelerate_config(path: str | Path) -> dict:
    """The accelerate config file at `path` as `accelerate launch` reads it (Accelerate's own loader:
    YAML or JSON, defaults filled in, distributed_type checked), as a dict without `num_processes`
    when the file sets none. Raises ConfigError naming the file and the setting, instead of a yaml
    or ValueError traceback. Accelerate's loader imports torch: only runs that read a file pay it."""
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        settings = load_config_from_file(str(path)).to_dict()
    except FileNotFoundError as e:
        raise ConfigError(f"accelerate config {path}: no such file.") from e
    except (yaml.YAMLError, ValueError, TypeError, AttributeError) as e:
        detail = " ".join(str(e).split()) if not isinstance(e, AttributeError) else "it is not a mapping of settings"
        raise ConfigError(f"accelerate config {path}: {detail}") from e
    for key in ACCELERATE_INTEGERS:
        section, _, name = key.rpartition(".")
        value = (settings.get(section) or {}).get(name) if section else settings.get(key)
        if value is not None and type(value) is not int:
            raise ConfigError(f"accelerate config {path}: {key} must be a whole number, got {value!r}.")
    if settings.get("num_processes") == -1:  # Accelerate's marker for "not set"
        del settings["num_processes"]
    return settings


@dataclass(frozen=True)
class Device:
    """The accelerator this process trains on, as far as choosing a precision and a plan needs."""

    cuda: bool = False
    name: str | None = None  # e.g. "NVIDIA A100-SXM4-40GB"
    bf16: bool = False
    fp8: bool = False  # runs NVIDIA's float8 matmuls (compute capability ≥ 8.9): --fp8
    free_bytes: int | None = None
    total_bytes: int | None = None


@dataclass(frozen=True)
class DeepSpeedSetup:
    """A resolved DeepSpeed configuration and where it came from."""

    source: str  # the JSON path, or LAUNCH_DEEPSPEED for `--use_deepspeed --zero_stage N` launches
    config: dict
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """How messages name it: the file's name, or the accelerate config."""
        return self.source if self.source == LAUNCH_DEEPSPEED else Path(self.source).name


@dataclass(frozen=True)
class ResolvedRun:
    """One training run with nothing left open (see the module docstring)."""

    config: TrainConfig  # as given, with what a DeepSpeed JSON's optimizer/scheduler decided (see resolve_run)
    model: ModelSource  # what --model is, decided once: where its weights load from (`model.weights`), what writes them
    # the model's architecture, the run's one: the catalog entry's, else read from the model's config.json, its
    # GGUF metadata or the Hugging Face cache (models.source.architecture_of); None when that needs a download
    spec: ModelSpec | None
    batch: BatchShape
    peak_lr: float
    precision: Precision
    strategy: Strategy
    offload: str  # none | optimizer | params
    launch: Launch
    deepspeed: DeepSpeedSetup | None
    # Liger, the chunked loss, fused AdamW and the attention kernel as this run turns them on (config.switches),
    # resolved once by resolve_run; `with_loaded_model` adds what only the loaded model tells
    switches: Switches
    parallelism: Parallelism = Parallelism()  # data-parallel × tp × cp = the launch's processes
    max_steps: int | None = None  # known once the data is prepared (see `with_max_steps`)
    given: frozenset[str] = EVERY_OPTION  # the options the user set (flags, YAML); the rest are defaults
    cuda: bool = False  # trains on a GPU (`--dry-run --gpu NAME`: as on that GPU)

    @property
    def world_size(self) -> int:
        return self.batch.world_size

    def with_loaded_model(self, model_type: str, head_problem: str | None) -> ResolvedRun:
        """The run once its model is built: the switches resolved again only where the model tells what
        resolving could not know, an LM head no loss may read (`head_problem`,
        train.chunked_loss.head_problem) or an architecture read only from the weights (`model_type`)."""
        known = self.spec.model_type if self.spec is not None else None
        if head_problem is None and model_type == known:
            return self
        return replace(self, switches=run_switches(self.config, self.strategy, self.cuda, model_type, head_problem))

    def with_max_steps(self, max_steps: int) -> ResolvedRun:
        return replace(self, max_steps=max_steps)


def resolve_run(config: TrainConfig, launch: Launch, device: Device, given: frozenset[str] = EVERY_OPTION) -> ResolvedRun:
    """Decide every open value of `config` for this launch and device.

    `given` names the options the user set (`config.flags.Command.given`); for the others, a DeepSpeed
    JSON's optimizer and scheduler choices (lr, betas, eps, weight decay, schedule, warmup, length)
    are adopted into the run's config, so the loop, run.yaml, resume identity and the planner all
    see them. By default every option counts as given: a config built in code means what it says.

    Raises ConfigError when the batch sizes do not multiply out, the precision cannot run here or
    contradicts the launch config, or a DeepSpeed JSON disagrees with the run.
    """
    written = deepspeed_as_written(config, launch)
    adopted = {} if written is None else deepspeed_json.adopt(written.config, config, given)
    config = with_adopted(config, adopted, written)
    model = model_source.model_source(config.model, config.output_dir)
    spec = model_source.architecture_of(config.model)
    flags = Asked(tp=config.tp if config.tp > 1 else None, cp=config.cp if config.cp > 1 else None)
    parallelism = resolve_parallelism(flags, launch.parallelism, launch.world_size)
    config = replace(config, tp=parallelism.tp, cp=parallelism.cp)  # as laid out, whichever way it was asked
    batch = resolve_batch_shape(config, launch.world_size, parallelism.model_parallel)
    family = launch.mixed_precision or (None if written is None else deepspeed_json.precision_family(written.config))
    precision = resolve_precision(config.precision, config.method, device, family)
    peak_lr = scaled_lr(config, batch.global_batch_size)
    deepspeed = None
    if written is not None:
        deepspeed = resolve_deepspeed(written, config, batch, precision, peak_lr, spec, adopted)
        stage = deepspeed_json.zero_stage(deepspeed.config)
        strategy = zero_strategy(stage, written.name)
        if written.source != LAUNCH_DEEPSPEED and launch.deepspeed_zero_stage not in (None, stage):
            raise ConfigError(
                f"The accelerate config sets zero_stage {launch.deepspeed_zero_stage} but {written.name} says stage {stage}; "
                "delete zero_stage from the accelerate config (the JSON decides it) or make them agree."
            )
        devices = deepspeed_json.offload_devices(deepspeed.config)
        offload = "params" if "param" in devices else "optimizer" if devices else "none"
    elif launch.fsdp:
        if launch.fsdp_version != 2:  # FSDP1 cannot save optimizer state of sharded models reliably; legacy in Accelerate
            raise ConfigError(
                f"The accelerate config sets fsdp_version {launch.fsdp_version}; finetune runs FSDP2. "
                "Set `fsdp_version: 2` under fsdp_config (see accelerate_configs/fsdp.yaml)."
            )
        strategy, offload = STRATEGIES["fsdp"], "params" if launch.fsdp_offload_params else "none"
    elif parallelism.model_parallel > 1:  # TP and CP compose with FSDP2 only: it shards over the data-parallel ranks
        strategy, offload = STRATEGIES["fsdp"], "none"
    else:
        strategy, offload = STRATEGIES["ddp" if launch.world_size > 1 else "single"], "none"
    check_precision(precision, config.method, strategy, offload)
    check_speed_switches(config, precision, strategy, device, parallelism.tp)
    check_seq_len(config.max_seq_len, spec)
    check_checkpointed_layers(config.gradient_checkpointing_layers, spec)
    problems = parallelism_problems(parallelism, spec=spec, method=config.method, lora_targets=config.lora_target_modules,
                                    deepspeed=strategy.deepspeed, offload=offload, cuda=device.cuda,
                                    max_seq_len=config.max_seq_len, packing=config.packing,
                                    attention=config.attention) + layout_problems(config.objective, parallelism.model_parallel)
    if problems:
        raise ConfigError("This run cannot be laid out as asked:\n  - " + "\n  - ".join(problems))
    switches = run_switches(config, strategy, device.cuda, spec.model_type if spec is not None else None)
    return ResolvedRun(config=config, model=model, spec=spec, batch=batch, peak_lr=peak_lr, precision=precision,
                       strategy=strategy, offload=offload, launch=launch, deepspeed=deepspeed, switches=switches,
                       parallelism=parallelism, given=given, cuda=device.cuda)


def run_switches(config: TrainConfig, strategy: Strategy, cuda: bool, model_type: str | None,
                 head_problem: str | None = None) -> Switches:
    """The speed switches of a run of `config` (config.switches.resolve_switches): the one place a
    run's flags are handed to it. `head_problem`: what the built model's LM head rules out, once known."""
    return resolve_switches(liger=config.liger, chunked_loss=config.chunked_loss, optimizer=config.optimizer,
                            method=config.method, lora_targets=config.lora_targets, cuda=cuda, strategy=strategy,
                            model_type=model_type, head_problem=head_problem, tp=config.tp, cp=config.cp,
                            attention=config.attention)


def check_speed_switches(config: TrainConfig, precision: Precision, strategy: Strategy, device: Device, tp: int) -> None:
    """The switches a run cannot turn on here are refused before anything loads: flex attention on CPU,
    varlen attention off CUDA or in fp32, --fp8, where config.switches says why."""
    if why := attention_problem(config.attention, device.cuda, precision.compute):
        raise ConfigError(why)
    if config.fp8 and (why := fp8_problem(config.method, precision.name, strategy, device.fp8, tp)):
        raise ConfigError(why)


def check_seq_len(max_seq_len: int, spec: ModelSpec | None) -> None:
    """Positions past the model's maximum have no trained (or any) position embedding."""
    if spec is not None and max_seq_len > spec.max_position_embeddings:
        raise ConfigError(f"--max-seq-len {max_seq_len} is beyond {spec.name}'s maximum of {spec.max_position_embeddings:,} "
                          f"positions (max_position_embeddings); use --max-seq-len {spec.max_position_embeddings} or less.")


def check_checkpointed_layers(layers: int | None, spec: ModelSpec | None) -> None:
    if spec is not None and layers is not None and layers > spec.num_layers:
        raise ConfigError(f"--gradient-checkpointing-layers {layers}: {spec.name} has {spec.num_layers} decoder layers; "
                          f"use {spec.num_layers} or less (or leave it unset: all).")


def resolve_precision(requested: str, method: str, device: Device, launcher: str | None) -> Precision:
    """The run's Precision. `auto`: fp32 on CPU (so CPU rehearsals compare exact numbers); on a GPU
    the launch's family if it fixes one (the accelerate config's mixed_precision, or a DeepSpeed
    JSON's bf16/fp16 section set to true, or both off: fp32), else bf16 where supported, else fp16 (see
    `names.default_precision`). An explicit precision must agree with the launch's family."""
    if requested == "auto":
        if not device.cuda:
            precision = PRECISIONS["fp32"]
        elif launcher in ("bf16", "fp16"):
            precision = default_precision(method, bf16=launcher == "bf16")
        elif launcher == "fp32":  # a DeepSpeed JSON that turns 16-bit off
            precision = PRECISIONS["fp32"]
        else:
            precision = default_precision(method, bf16=device.bf16)
    else:
        precision = PRECISIONS[requested]
        # a DeepSpeed JSON's 16-bit turned off, against a flag: its check names file, key and flag
        if launcher not in (None, "fp32") and precision.accelerate != launcher:
            raise ConfigError(
                f"--precision {requested} computes in {precision.compute}, but the launch fixes {launcher} (the "
                f"accelerate config's mixed_precision, or the DeepSpeed JSON's {launcher}.enabled). Remove that setting "
                "(finetune sets it from --precision) or make them agree."
            )
    if device.cuda and precision.compute == "bfloat16" and not device.bf16:
        raise ConfigError(f"--precision {precision.name}: {device.name or 'this GPU'} has no bf16; use fp16-mixed or fp16-true.")
    if not device.cuda and precision.compute == "float16":
        raise ConfigError(f"--precision {precision.name} needs a GPU (fp16 loss scaling); on CPU use fp32 or bf16-*.")
    return precision


def deepspeed_as_written(config: TrainConfig, launch: Launch) -> DeepSpeedSetup | None:
    """The run's DeepSpeed configuration before resolution, or None when DeepSpeed is off.

    Sources, in order: --deepspeed, the accelerate config's `deepspeed_config_file`, or the config
    Accelerate builds from `--use_deepspeed --zero_stage N` (its "auto" batch values are filled too,
    so packed or batch-sampler dataloaders never reach Accelerate's `None * int`, accelerate#841).
    """
    path = config.deepspeed or launch.deepspeed_config_file
    if path is not None:
        return DeepSpeedSetup(source=str(path), config=deepspeed_json.load(path))
    if launch.deepspeed:
        from accelerate.utils import DeepSpeedPlugin  # reads the launch's DeepSpeed variables

        return DeepSpeedSetup(source=LAUNCH_DEEPSPEED, config=DeepSpeedPlugin().deepspeed_config)
    return None


def with_adopted(config: TrainConfig, adopted: dict, written: DeepSpeedSetup | None) -> TrainConfig:
    """`config` with the options a DeepSpeed JSON decided (see `deepspeed_json.adopt`), validated
    like flags, with errors that name the file."""
    if not adopted:
        return config
    config = replace(config, **{option: value for option, (value, _) in adopted.items()})
    try:
        validate(config)
    except ConfigError as e:
        raise ConfigError(f"{written.name}: values adopted from it are invalid. {e}") from e
    return config


def resolve_deepspeed(written: DeepSpeedSetup, config: TrainConfig, batch: BatchShape, precision: Precision,
                      peak_lr: float, spec: ModelSpec | None, adopted: dict) -> DeepSpeedSetup:
    """`written` with every "auto" and missing run-owned key filled from the run, checked against
    it, and a note of what the run adopted from it."""
    hidden_size = spec.hidden_size if spec is not None else model_source.model_hidden_size(config.model)
    run = deepspeed_json.RunValues.from_config(config, batch, precision.name, peak_lr, hidden_size)
    resolved, notes = deepspeed_json.resolve(written.config, written.name, run)
    if adopted:
        flags = ", ".join(f"--{option.replace('_', '-')} {format(value, 'g') if isinstance(value, float) else value} ({key})"
                          for option, (value, key) in adopted.items())
        notes = [f"{written.name}: adopted where no flag was given: {flags}", *notes]
    return replace(written, config=resolved, notes=notes)
