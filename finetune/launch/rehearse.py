"""`finetune rehearse`: run a training configuration on CPU processes before renting GPUs.

    finetune rehearse --config_file accelerate_configs/fsdp_qlora.yaml --model llama-70b --method qlora

The model is shrunk to 2 layers and a small width but keeps its architecture class (so the same
FSDP wrap policy, `_no_split_modules` and LoRA target names), and everything else runs as given:
the accelerate config, the DeepSpeed JSON with its "auto" resolution, the method and quantization,
the dataset and its formatting. A few optimizer steps run on 2 CPU processes (gloo), then a
checkpoint and the final model are saved and checked (rehearsal_outcome.py). The report says
pass or fail, and why.

Before anything runs, the real run is resolved as the GPUs will see it (the accelerate config's
num_processes, a GPU device, the user's DeepSpeed JSON as written): every conflict the real run
would stop on is reported, even one a 2-process CPU rehearsal could not show. Only then is the
JSON relaxed, and only where the rehearsal runs another value than the real run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from finetune.config import deepspeed_json
from finetune.config.flags import parse_command, save_yaml
from finetune.config.options import EVERY_OPTION, TrainConfig, base_lr, resolve_batch_shape, scaled_lr
from finetune.config.resolve import LAUNCH_DEEPSPEED, Device, Launch, ResolvedRun, read_accelerate_config, resolve_run
from finetune.errors import FinetuneError
from finetune.launch.rehearsal_outcome import Rehearsal, explain_failure, format_report, inspect_run
from finetune.library_logs import quiet_libraries
from finetune.models import families
from finetune.plan import gpus
from finetune.train.accelerator import free_port

# the rehearsal model: small enough for a laptop CPU, big enough for 4 heads and GQA
SHRUNK_LAYERS, SHRUNK_HIDDEN, SHRUNK_POSITIONS = 2, 64, 512
REHEARSAL_VOCAB = 128  # the builtin char-level tokenizer's 100 tokens, rounded up like the `tiny` model
MAX_REHEARSAL_SEQ_LEN = 64
REHEARSAL_GLOBAL_BATCH = 8
PINNABLE = ("micro_batch_size", "gradient_accumulation_steps")  # a flag the user gave is rehearsed as given


def shrunk_model_config(config: TrainConfig):
    """The model's own Hugging Face config shrunk (`families.shrink`) to SHRUNK_LAYERS layers of width
    SHRUNK_HIDDEN, and the builtin tokenizer it is paired with.

    Raises FinetuneError when the config cannot be read (an uncached Hub id offline) or is not a
    decoder config with the usual size fields.
    """
    from transformers import AutoConfig, AutoTokenizer

    from finetune.data import BUILTIN_DIR
    from finetune.models import catalog, gguf_import
    from finetune.models import source as model_source

    model = model_source.model_source(config.model, config.output_dir)
    source, spec = model.weights, catalog.lookup(config.model)
    if spec is None and model.kind == "gguf":  # a .gguf path: its config is the converted folder's, written once
        gguf_import.convert(model.gguf, Path(source))
    try:
        original = (spec.to_hf_config_dict() if spec is not None else
                    AutoConfig.from_pretrained(source, trust_remote_code=config.trust_remote_code).to_dict())
    except OSError as e:
        raise FinetuneError(f"rehearse: cannot read the config of '{source}' ({str(e).splitlines()[0]}); "
                            "pass a catalog name or a local model directory") from e
    language = families.language_config(original)
    missing = [name for name in ("num_hidden_layers", "hidden_size", "num_attention_heads") if name not in language]
    if missing:
        raise FinetuneError(f"rehearse: the config of '{source}' has no {', '.join(missing)}; "
                            "only decoder configs with the usual size fields can be shrunk")
    tokenizer = AutoTokenizer.from_pretrained(BUILTIN_DIR)
    shrunk = families.shrink(original, SHRUNK_LAYERS, SHRUNK_HIDDEN, overrides={
        "max_position_embeddings": SHRUNK_POSITIONS, "vocab_size": REHEARSAL_VOCAB,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    })
    return AutoConfig.for_model(**shrunk), tokenizer


def write_shrunk_model(config: TrainConfig, directory: Path, seed: int = 0) -> Path:
    """Save a seeded random-init shrunk model and the builtin tokenizer to `directory`."""
    from finetune.train.loading import write_random_init

    hf_config, tokenizer = shrunk_model_config(config)
    write_random_init(hf_config, tokenizer, directory, seed)
    return directory


def real_run(config: TrainConfig, accelerate_config: str | None, given: frozenset[str] = EVERY_OPTION) -> ResolvedRun:
    """The run as `accelerate launch` with `accelerate_config` would resolve it on its GPUs: the
    file's num_processes (2 when no file names one), a bf16-capable GPU unless --gpu names one in
    the catalog, the DeepSpeed JSON as written. Raises what that run would stop on before training."""
    gpu = gpus.lookup(config.gpu) if config.gpu else None
    device = Device(cuda=True, name=gpu.name, bf16=gpu.bf16) if gpu else Device(cuda=True, bf16=True)
    launch = Launch.from_accelerate_config(accelerate_config, real_world_size(accelerate_config) or processes_for(accelerate_config))
    return resolve_run(config, launch, device, given)


def real_world_size(accelerate_config: str | None) -> int | None:
    """num_processes of the accelerate config (all machines together), None when it names none."""
    if accelerate_config is None:
        return None
    return read_accelerate_config(accelerate_config).get("num_processes")


def describe_real_run(real: ResolvedRun, accelerate_config: str | None) -> str:
    """One line saying what the real run was checked as."""
    b = real.batch
    where = (f"num_processes of {accelerate_config}" if real_world_size(accelerate_config)
             else "no accelerate config names num_processes: pass --config_file with yours")
    return (f"conflicts checked against the real run: {real.strategy.label}, {b.world_size} processes ({where}), "
            f"{real.precision.name}, micro {b.micro_batch_size} × accumulation {b.gradient_accumulation_steps} × "
            f"world {b.world_size} = global {b.global_batch_size}")


def rehearsal_deepspeed_json(real: ResolvedRun, rehearsal: TrainConfig, processes: int, workdir: Path) -> tuple[str | None, list[str]]:
    """The DeepSpeed JSON to rehearse `rehearsal` with, and a note when it had to be adapted.

    `real` (the resolved real run) has already been checked against the user's file. A fixed value
    the rehearsal runs differently (the batch on 2 processes, 3 updates, fp32 on CPU) is written as
    "auto" in a copy, every other setting is kept; with nothing to change the file is used as is.
    """
    if real.deepspeed is None or real.deepspeed.source == LAUNCH_DEEPSPEED:
        return rehearsal.deepspeed, []
    batch = resolve_batch_shape(rehearsal, processes)
    rehearsed = deepspeed_json.RunValues.from_config(rehearsal, batch, rehearsal.precision,
                                                     scaled_lr(rehearsal, batch.global_batch_size), None)
    actual = deepspeed_json.RunValues.from_config(real.config, real.batch, real.precision.name, real.peak_lr, None)
    relaxed, changed = deepspeed_json.rehearsable(deepspeed_json.load(real.deepspeed.source), actual, rehearsed)
    if not changed:
        return rehearsal.deepspeed, []
    copy = workdir / "deepspeed_rehearsal.json"
    copy.write_text(json.dumps(relaxed, indent=2))
    return str(copy), [f'{real.deepspeed.name}: rehearsed as "auto" where the rehearsal runs another value than '
                       f"the real run: {', '.join(changed)}"]


def rehearsal_config(config: TrainConfig, model_dir: Path, output_dir: Path, steps: int, *,
                     pinned: frozenset[str]) -> TrainConfig:
    """The user's config with the sizes that only cost time scaled down; everything that decides
    which code runs (method, LoRA targets, quantization, DeepSpeed JSON, data) kept, and the micro
    batch and accumulation the user `pinned` with a flag. The precision becomes fp32, what a CPU
    runs (the resolution and conflicts of the real one are checked before launching; see `rehearse`)."""
    micro = config.micro_batch_size if "micro_batch_size" in pinned else 2
    accumulation = config.gradient_accumulation_steps if "gradient_accumulation_steps" in pinned else None
    return dataclasses.replace(
        config,
        model=str(model_dir),
        lr=base_lr(config),  # the real model's default, which the shrunk copy (not in the catalog) would lose
        output_dir=str(output_dir),
        max_steps=steps,
        # unpinned: the same global batch on 1 or 2 processes (accumulation 4 or 2), so rehearsals of
        # different strategies must give the same losses
        micro_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        global_batch_size=None if pinned else REHEARSAL_GLOBAL_BATCH,
        max_seq_len=min(config.max_seq_len, MAX_REHEARSAL_SEQ_LEN),
        warmup_steps=min(config.warmup_steps, 1),
        precision="fp32",  # what the CPU runs: bf16/fp16 numerics cannot be rehearsed here
        max_eval_examples=8,
        num_samples=1,
        eval_every=0,
        log_every=1,
        save_every=steps,  # one resumable checkpoint at the end, through the strategy's sharded save
        save_final=True,
        resume=None,
        report_to="none",
        preflight_timeout=min(config.preflight_timeout, 120.0),
    )


def shrunk_checkpointed_layers(recomputed: int | None, layers: int | None) -> int | None:
    """--gradient-checkpointing-layers for the shrunk model: all of them stays all (unset); some of
    them (a plan's partial checkpointing) stays some, the first of its SHRUNK_LAYERS."""
    if recomputed is None or layers is None or recomputed >= layers:
        return None
    return min(recomputed, SHRUNK_LAYERS - 1)


def launch_command(accelerate_config: str | None, num_processes: int, port: int, run_yaml: Path,
                   mixed_precision: str | None = None) -> list[str]:
    """`accelerate launch` of the training CLI on one machine, optionally overriding the config's
    mixed_precision (rehearsals run fp32 on CPU whatever the file says)."""
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if accelerate_config:
        command += ["--config_file", accelerate_config]
    elif num_processes > 1:
        command += ["--multi_gpu"]  # without a config, accelerate launch would start a single process
    if mixed_precision is not None:
        command += ["--mixed_precision", mixed_precision]
    command += ["--num_processes", str(num_processes), "--num_machines", "1", "--machine_rank", "0",
                "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--gpu_ids", "all"]
    if num_processes > 1:
        command += ["--rdzv_backend", "static"]
    return command + ["-m", "finetune", "--config", str(run_yaml)]


def rehearsal_env() -> dict[str, str]:
    """Hide GPUs and point DeepSpeed at its CPU accelerator, so the rehearsal runs where it would
    run without a GPU even on a machine that has one."""
    return os.environ | {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
                         "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def launch_config(accelerate_config: str | None) -> str | None:
    """The accelerate config a plain `accelerate launch` would use: the given file, else the user's
    default config (`accelerate config`) if there is one, else None (DDP)."""
    from accelerate.commands.config import default_config_file

    if accelerate_config is None and Path(default_config_file).is_file():
        return default_config_file
    return accelerate_config


def processes_for(accelerate_config: str | None) -> int:
    """2 processes, or 1 for an accelerate config that runs a single process."""
    if accelerate_config is None:
        return 2
    path = Path(accelerate_config)
    if not path.is_file():
        raise FinetuneError(f"rehearse: --config_file {accelerate_config}: no such file (see accelerate_configs/)")
    return 1 if read_accelerate_config(path)["distributed_type"] == "NO" else 2


def rehearse(config: TrainConfig, accelerate_config: str | None, workdir: Path, steps: int = 3,
             timeout_s: float = 900.0, given: frozenset[str] = EVERY_OPTION) -> Rehearsal:
    """Check the real run, then shrink the model, run `steps` updates with a save on CPU processes,
    and check what came out. `given`: the options the user set (`config.flags.Command.given`)."""
    try:
        real = real_run(config, accelerate_config, given)
    except FinetuneError as e:
        return Rehearsal(passed=False, problems=[f"the real run would stop before training: {e}"],
                         output_dir=str(workdir / "run"))
    processes = processes_for(accelerate_config)
    model_dir = write_shrunk_model(config, workdir / "model", seed=config.seed)
    run_dir = workdir / "run"
    run_yaml = workdir / "rehearsal.yaml"
    pinned = frozenset(name for name in PINNABLE if name in given and getattr(real.config, name) is not None)
    rehearsal = rehearsal_config(real.config, model_dir, run_dir, steps, pinned=pinned)
    rehearsal = dataclasses.replace(rehearsal, gradient_checkpointing_layers=shrunk_checkpointed_layers(
        real.config.gradient_checkpointing_layers, real.spec.num_layers if real.spec is not None else None))
    deepspeed, notes = rehearsal_deepspeed_json(real, rehearsal, processes, workdir)
    save_yaml(dataclasses.replace(rehearsal, deepspeed=deepspeed), run_yaml)
    command = launch_command(accelerate_config, processes, free_port(), run_yaml, mixed_precision="no")
    try:
        finished = subprocess.run(command, env=rehearsal_env(), capture_output=True, text=True, timeout=timeout_s)
        log, returncode = finished.stdout + finished.stderr, finished.returncode
    except subprocess.TimeoutExpired as e:
        log, returncode = f"{e.stdout or ''}{e.stderr or ''}\nrehearsal timed out after {timeout_s:g} s", -1
    (workdir / "rehearsal.log").write_text(log)
    result = inspect_run(run_dir, steps, log)
    result.notes = [describe_real_run(real, accelerate_config), *notes]
    if returncode != 0:
        result.passed = False
        result.problems.insert(0, explain_failure(log, returncode))
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="finetune rehearse",
        description="Run a training configuration on CPU processes with the model shrunk to 2 layers: "
        "same architecture class, wrap policy, LoRA targets, quantization and DeepSpeed JSON. "
        "Every other flag is a training flag (see `finetune --help`).",
    )
    parser.add_argument("--config_file", help="The accelerate config you will launch with (accelerate_configs/*.yaml).")
    parser.add_argument("--steps", type=int, default=3, help="Optimizer steps to run (a checkpoint is saved after the last).")
    parser.add_argument("--workdir", help="Where the shrunk model, log and outputs go (default: a new temporary dir, kept).")
    parser.add_argument("--timeout", type=float, default=900.0, help="Seconds before the rehearsal is stopped.")
    args, train_args = parser.parse_known_args(argv)
    command = parse_command(train_args)
    if not command.config.verbose:
        quiet_libraries()
    accelerate_config = launch_config(args.config_file)
    processes_for(accelerate_config)  # a missing accelerate config fails before any work
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="finetune-rehearse-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result = rehearse(command.config, accelerate_config, workdir, steps=args.steps, timeout_s=args.timeout,
                      given=command.given)
    print(format_report(result, args.steps))
    return 0 if result.passed else 1
