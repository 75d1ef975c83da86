"""The files and the commands that run a plan: an Accelerate config, a DeepSpeed JSON with every
batch value resolved to an integer, the `accelerate launch ... -m finetune ...` line (and the
cluster jobs that run it, plan/cluster.py), and the `finetune ray` line.

Pure functions of the plan; `write_configs` is the only one that touches the disk.
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import yaml

from finetune.config.objectives import precomputes_reference
from finetune.config.switches import resolve_switches
from finetune.plan.choose import Plan
from finetune.plan.cluster import SAFE_DUMPER, cluster_texts
from finetune.plan.memory import DS_BUCKET_ELEMENTS
from finetune.plan.workload import Workload

ACCELERATE_FILE = "accelerate.yaml"
DEEPSPEED_FILE = "ds_config.json"
DEFAULT_CONFIG_DIR = "plan"
# Port of the rank-0 rendezvous on multi-node launches (Accelerate's default).
MAIN_PROCESS_PORT = 29500
# Values the run fills from its flags (micro batch, accumulation, world size, clipping, --precision);
# leaving them "auto" means the JSON can never disagree with the launch command.
RUN_OWNED_AUTO = "auto"


def accelerate_config(plan: Plan, config_dir: str = DEFAULT_CONFIG_DIR) -> dict:
    """The Accelerate config (the YAML `accelerate config` writes) that runs `plan`. It sets no
    mixed_precision: the run's --precision decides it (and Accelerate refuses one beside a
    DeepSpeed config file)."""
    w = plan.workload
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": w.strategy.distributed_type,
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_training_function": "main",
        "num_machines": w.nodes,
        "num_processes": w.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if w.strategy.fsdp:
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # the block class comes from the model's _no_split_modules
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_offload_params": w.offload == "params",
            "fsdp_reshard_after_forward": True,
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_activation_checkpointing": False,  # finetune checkpoints through transformers instead
        }
    if w.deepspeed:
        config["deepspeed_config"] = {
            "deepspeed_config_file": f"{config_dir}/{DEEPSPEED_FILE}",
            "zero3_init_flag": w.strategy.shards_weights,
        }
    return config


def deepspeed_config(plan: Plan) -> dict | None:
    """DeepSpeed JSON for a ZeRO plan (None otherwise). The values the run owns are "auto" (filled
    from the launch command's flags and the world size); the ZeRO layout is written out."""
    w = plan.workload
    if not w.deepspeed:
        return None
    stage = w.strategy.zero_stage
    zero: dict = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": DS_BUCKET_ELEMENTS}
    if stage < 3:
        zero.update(allgather_bucket_size=DS_BUCKET_ELEMENTS, reduce_scatter=True)
    else:
        zero.update(
            stage3_prefetch_bucket_size=DS_BUCKET_ELEMENTS,
            stage3_param_persistence_threshold=10 * w.model.hidden_size,  # keep norms and biases gathered
            stage3_max_live_parameters=1_000_000_000,
            stage3_max_reuse_distance=1_000_000_000,
            stage3_gather_16bit_weights_on_model_save=True,
        )
    if w.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if w.offload == "params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": RUN_OWNED_AUTO,
        "gradient_accumulation_steps": RUN_OWNED_AUTO,
        "train_batch_size": RUN_OWNED_AUTO,
        "gradient_clipping": RUN_OWNED_AUTO,
        "bf16": {"enabled": RUN_OWNED_AUTO},
        "fp16": {"enabled": RUN_OWNED_AUTO, "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }
    if w.offload != "none":
        config["zero_force_ds_cpu_optimizer"] = False  # finetune builds its own AdamW; DeepSpeed steps it on the host
    return config


def train_flags(w: Workload) -> list[str]:
    """finetune's TrainConfig flags for this workload."""
    flags = [
        "--model", w.model.name, "--method", w.method,
        "--micro-batch-size", str(w.micro_batch_size),
        "--gradient-accumulation-steps", str(w.gradient_accumulation_steps),
        "--max-seq-len", str(w.seq_len),
        "--precision", w.precision.name,
    ]
    if w.optimizer != "adamw":
        flags += ["--optimizer", w.optimizer]
    if w.method != "full":
        flags += ["--lora-r", str(w.lora_r), "--lora-targets", w.lora_targets]
    return flags + objective_flags(w) + layout_flags(w) + checkpointing_flags(w) + speed_flags(w)


def objective_flags(w: Workload) -> list[str]:
    """--objective, and --precompute-reference where the plan's differs from the trainer's default."""
    if w.objective == "sft":
        return []
    flags = ["--objective", w.objective]
    if w.objective_row.reference and w.precompute_reference != precomputes_reference(w.objective, None, w.method):
        flags.append("--precompute-reference" if w.precompute_reference else "--no-precompute-reference")
    return flags


def layout_flags(w: Workload) -> list[str]:
    """--tp / --cp of a plan that splits its groups' work (the written accelerate config is FSDP2)."""
    return [word for name, size in (("--tp", w.tp), ("--cp", w.cp)) if size > 1 for word in (name, str(size))]


def checkpointing_flags(w: Workload) -> list[str]:
    """--gradient-checkpointing, with how many layers when the plan recomputes only some."""
    if not w.gradient_checkpointing:
        return []
    layers = ["--gradient-checkpointing-layers", str(w.recomputed_layers)] if w.partial_checkpointing else []
    return ["--gradient-checkpointing", *layers]


def speed_flags(w: Workload) -> list[str]:
    """The speed switches the plan counted on (each changes its memory or speed terms), where the
    trainer left to itself would decide otherwise (config.switches, on a GPU with this machine's
    packages): --liger, or --no-liger and the chunked loss pinned as planned; --compile and --fp8, off
    unless given."""
    def loss(liger: bool | None, chunked: bool | None = None) -> str:
        return resolve_switches(liger=liger, chunked_loss=chunked, optimizer=w.optimizer, method=w.method,
                                lora_targets=w.lora_targets, cuda=True, strategy=w.strategy,
                                model_type=w.model.model_type, tp=w.tp, cp=w.cp).loss

    flags, default = [], loss(None)
    if w.loss == "liger" and default != "liger":
        flags.append("--liger")
    if w.loss != "liger" and default == "liger":
        flags.append("--no-liger")
        default = loss(False)
    if w.loss != "liger" and w.loss != default:
        flags.append("--chunked-loss" if w.loss == "finetune-chunked" else "--no-chunked-loss")
    return flags + ["--compile"] * w.compile + ["--fp8"] * w.fp8


def launch_command(plan: Plan, config_dir: str = DEFAULT_CONFIG_DIR, flags: list[str] | None = None) -> str:
    """`accelerate launch --config_file DIR/accelerate.yaml [multi-node flags] -m finetune FLAGS`
    (FLAGS: the plan's `train_flags`, or a run's own `flags`)."""
    w = plan.workload
    words = ["accelerate", "launch", "--config_file", f"{config_dir}/{ACCELERATE_FILE}"]
    if w.nodes > 1:
        words += ["--machine_rank", "$NODE_RANK", "--main_process_ip", "$MASTER_ADDR", "--main_process_port", str(MAIN_PROCESS_PORT)]
    words += ["-m", "finetune", *(train_flags(w) if flags is None else flags)]
    return " ".join(word if word.startswith("$") else shlex.quote(word) for word in words)


def plan_command(w: Workload, model: str, config_dir: str = DEFAULT_CONFIG_DIR) -> str:
    """The `finetune plan ... --write-config DIR` that pins every choice of `w` (`model` as the run
    names it), so the files it writes are the ones `w`'s launch command names."""
    words = ["finetune", "plan", "--model", model, "--gpus", f"{w.gpus_per_node}x{w.gpu.name}", "--nodes", str(w.nodes),
             "--method", w.method, "--strategy", w.strategy.name, "--offload", w.offload, "--precision", w.precision.name,
             "--optimizer", w.optimizer, "--micro-batch-size", str(w.micro_batch_size),
             "--gradient-accumulation-steps", str(w.gradient_accumulation_steps), "--seq-len", str(w.seq_len),
             *objective_flags(w), *layout_flags(w), *(checkpointing_flags(w) or ["--no-gradient-checkpointing"])]
    if w.method != "full":
        words += ["--lora-r", str(w.lora_r), "--lora-targets", w.lora_targets]
    return shlex.join([*words, *speed_flags(w), "--write-config", config_dir])


def ray_command(plan: Plan, config_dir: str = DEFAULT_CONFIG_DIR) -> str:
    """`finetune ray` for the plan on a Ray cluster: a worker per GPU, each reserving one GPU and its
    share of the node's host RAM, running the strategy of the plan's accelerate config."""
    w = plan.workload
    words = ["finetune", "ray", "--workers", str(w.world_size), "--gpus-per-worker", "1",
             "--memory-per-worker", str(math.ceil(plan.host_gib / w.gpus_per_node)),
             "--accelerate-config", f"{config_dir}/{ACCELERATE_FILE}", *train_flags(w)]
    return shlex.join(words)


def config_texts(plan: Plan, directory: str = DEFAULT_CONFIG_DIR) -> dict[str, str]:
    """File name → text of the accelerate YAML (and the DeepSpeed JSON for ZeRO plans), as they
    read when saved in `directory` (the YAML names the JSON by its path there), and the Kubernetes,
    SkyPilot and dstack jobs that run the launch command (plan/cluster.py)."""
    texts = {ACCELERATE_FILE: yaml.dump(accelerate_config(plan, directory), Dumper=SAFE_DUMPER, sort_keys=False)}
    ds = deepspeed_config(plan)
    if ds is not None:
        texts[DEEPSPEED_FILE] = json.dumps(ds, indent=2) + "\n"
    return texts | cluster_texts(plan, directory, launch_files=dict(texts), launch=launch_command(plan, directory))


def write_configs(plan: Plan, directory: str | Path) -> list[Path]:
    """Write the accelerate YAML (and the DeepSpeed JSON for ZeRO plans) and the cluster jobs into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in config_texts(plan, str(directory)).items():
        (directory / name).write_text(text)
        written.append(directory / name)
    return written
