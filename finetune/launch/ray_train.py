"""`finetune ray`: the same training run on a Ray Train worker group (a local Ray, or a cluster).

    finetune ray --workers 2 --output-dir runs/ray                      # a local Ray on this machine
    finetune ray --address HEAD:6379 --workers 16 --gpus-per-worker 1 --accelerate-config plan/accelerate.yaml ...

Every worker runs what `python -m finetune FLAGS` runs (`run.main`: setup, then fit), in a process
group Ray Train formed; the strategy comes from the accelerate config, translated by Accelerate's own
launcher code into the variables `accelerate launch` would set. Checkpoints go to --output-dir as
usual (on a cluster: a filesystem every node mounts). When a worker dies, Ray's FailureConfig
starts a new group, which continues from the newest checkpoint exactly as `--resume auto` does.
Flags are checked here, before Ray starts, so a mistake is one line rather than an actor traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from finetune.checkpoint.layout import checkpoints_dir, find_checkpoint, step_of, take_inventory
from finetune.config.flags import OneLineParser, parse_command
from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.errors import ConfigError, FinetuneError, ReportedElsewhere

# what the workers need besides the flags: quiet Ray Train's print patch (it repeats each line of rank 0)
WORKER_ENVIRONMENT = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
DEFAULT_MAX_FAILURES = 3
WORKER_ERROR_PREFIX = "finetune train: error: "  # how a worker's rank-synchronised sections word an error
RAY_STORAGE_DIR = "ray"  # Ray's record of the run, under --output-dir unless --storage-path names another place
# what Accelerate's launcher computes that Ray Train sets for its workers itself (or that is this machine's)
RAY_OWNED = {"MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "PYTHONPATH"}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="finetune ray", allow_abbrev=False,
        description="Train on a Ray Train worker group: every worker runs the same setup and loop as "
        "`finetune FLAGS`. Every other flag is a training flag (see `finetune --help`); they may also follow `--`.",
    )
    parser.add_argument("--workers", type=int, required=True, help="Training processes (one per GPU on a GPU cluster).")
    parser.add_argument("--address", help="An existing Ray cluster: HOST:6379 of its `ray start --head`, or `auto` on one "
                        "of its nodes (as under `ray job submit`). Default: a local Ray on this machine, for this run.")
    parser.add_argument("--gpus-per-worker", type=float, help="GPUs each worker reserves (default: 1 when the cluster "
                        "has GPUs, else 0).")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs each worker reserves (default 1).")
    parser.add_argument("--memory-per-worker", type=float, metavar="GiB",
                        help="Host RAM each worker reserves (the plan's host RAM per GPU; default: none reserved).")
    parser.add_argument("--accelerate-config", metavar="FILE",
                        help="The accelerate config whose strategy the workers run (FSDP, DeepSpeed; default DDP).")
    parser.add_argument("--max-failures", type=int, default=DEFAULT_MAX_FAILURES,
                        help=f"Worker-group failures to recover from by restarting at the newest checkpoint "
                        f"(default {DEFAULT_MAX_FAILURES}; 0: none).")
    parser.add_argument("--storage-path", help=f"Where Ray keeps its record of the run (default: "
                        f"OUTPUT_DIR/{RAY_STORAGE_DIR}; a URI such as s3://bucket/path works).")
    return parser


def split_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our flags, and the training flags (everything else, or what follows `--`)."""
    ours, after = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args, train_args = build_parser().parse_known_args(ours)
    return args, train_args + after


def main(argv: list[str]) -> int:
    args, train_args = split_argv(argv)
    command = parse_command(train_args)
    if command.dry_run:
        raise ConfigError("--dry-run plans this machine's run: use `finetune --dry-run FLAGS` (with --gpu NAME for a GPU's).")
    config = command.config
    problems = [f"--{name.replace('_', '-')} must be ≥ {low}, got {getattr(args, name)}"
                for name, low in (("workers", 1), ("cpus_per_worker", 0), ("gpus_per_worker", 0),
                                  ("memory_per_worker", 0), ("max_failures", -1))
                if getattr(args, name) is not None and getattr(args, name) < low]
    if problems:
        raise ConfigError("invalid options:\n  - " + "\n  - ".join(problems))
    launch = (Launch.from_accelerate_config(args.accelerate_config, args.workers) if args.accelerate_config
              else Launch(world_size=args.workers))
    resolve_run(config, launch, Device(), command.given)  # batch shape, strategy and precision conflicts, now
    check_output_dir(config)
    environment = WORKER_ENVIRONMENT | launcher_environment(args.accelerate_config, args.workers)
    return train_on_ray(args, train_args, config, environment)


def check_output_dir(config: TrainConfig) -> None:
    """A restarted worker group continues with --resume auto, so a run without --resume must start
    from an output dir without checkpoints (as `finetune` itself insists), and one resumed from a
    checkpoint must not find a newer one there (a restart would pick that one instead)."""
    found = take_inventory(checkpoints_dir(config.output_dir))
    existing = sorted(found.complete + [path for path, _ in found.damaged], key=step_of)
    if not existing or config.resume == "auto":
        return
    if config.resume is None:
        raise ConfigError(f"{config.output_dir} already holds checkpoints of an earlier run (newest: {existing[-1].name}). "
                          "Continue it with --resume auto, or use another --output-dir.")
    if step_of(existing[-1]) > step_of(find_checkpoint(config.resume)):
        raise ConfigError(f"--resume {config.resume}: {config.output_dir} holds a later checkpoint ({existing[-1].name}), "
                          "which a restarted worker group would continue from instead; resume into another --output-dir.")


def launcher_environment(accelerate_config: str | None, workers: int) -> dict[str, str]:
    """The variables `accelerate launch --config_file FILE --num_processes N` gives each process
    (strategy, FSDP and DeepSpeed settings, mixed precision), computed by Accelerate's own launcher
    code, less the rendezvous, which Ray Train sets up itself."""
    if accelerate_config is None:
        return {}
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", accelerate_config, "--num_processes", str(workers),
                                               "--num_machines", "1", "--main_process_port", "0", "-m", "finetune"])
    args, defaults, precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate's launch_command does before its DeepSpeed launcher
        fields = list(defaults.deepspeed_config) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * precision_from_config)
        environment = prepare_deepspeed_cmd_env(args)[1]
    else:
        environment = prepare_multi_gpu_env(args)
    return {name: value for name, value in environment.items()
            if os.environ.get(name) != value and name not in RAY_OWNED}


def train_on_ray(args: argparse.Namespace, train_args: list[str], config: TrainConfig, environment: dict[str, str]) -> int:
    """Start (or join) Ray, run the worker group to the end, and turn a failed run into one line."""
    import ray
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    output_dir = Path(config.output_dir).resolve()
    ray.init(address=args.address, runtime_env={"env_vars": environment},
             logging_config=ray.LoggingConfig(log_level="INFO" if config.verbose else "ERROR"))
    try:
        gpus = args.gpus_per_worker if args.gpus_per_worker is not None else float(ray.cluster_resources().get("GPU", 0) > 0)
        per_worker = {"CPU": args.cpus_per_worker, "GPU": gpus}
        if args.memory_per_worker:
            per_worker["memory"] = args.memory_per_worker * 2**30
        if args.address is None:
            check_local_resources(per_worker, args.workers, ray.cluster_resources())
        trainer = TorchTrainer(
            train_worker,
            train_loop_config={"argv": train_args, "cwd": os.getcwd(), "resume": config.resume},
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=gpus > 0, resources_per_worker=per_worker),
            run_config=RunConfig(name=output_dir.name, storage_path=args.storage_path or str(output_dir / RAY_STORAGE_DIR),
                                 failure_config=FailureConfig(max_failures=args.max_failures),
                                 logging_config=LoggingConfig("INFO" if config.verbose else "WARNING")),
        )
        try:
            trainer.fit()
        except ray.train.TrainingFailedError as e:
            raise FinetuneError(failure_message(e)) from None
        except KeyboardInterrupt:
            print(f"finetune ray: interrupted (Ctrl-C). Continue from the newest checkpoint in {config.output_dir} "
                  "by running the same command with --resume auto.", file=sys.stderr, flush=True)
            return 130  # 128 + SIGINT, as `finetune` itself
    finally:
        ray.shutdown()
    return 0


def check_local_resources(per_worker: dict[str, float], workers: int, available: dict[str, float]) -> None:
    """A local Ray cannot grow: say now when the workers cannot all start, instead of waiting forever."""
    short = [f"{workers} × {amount:g} {name} = {workers * amount:g} of {available.get(name, 0):g}"
             for name, amount in per_worker.items() if name != "memory" and workers * amount > available.get(name, 0)]
    if short:
        raise ConfigError(f"the local Ray on this machine cannot start {workers} workers: {'; '.join(short)}. Use fewer "
                          "--workers, a smaller --cpus-per-worker, or --address of a larger cluster.")


def failure_message(error: Exception) -> str:
    """The workers' own message when one of them stopped on a FinetuneError (lowest rank first),
    else Ray's summary of the failure."""
    failures = getattr(error, "worker_failures", {}) or {}
    ours = [failures[rank] for rank in sorted(failures) if isinstance(failures[rank], FinetuneError)]
    reported = [e for e in ours if not isinstance(e, ReportedElsewhere)] or ours
    if reported:  # a rank-synchronised section's error arrives as the message the failing rank printed
        return str(reported[0].args[0] if reported[0].args else reported[0]).removeprefix(WORKER_ERROR_PREFIX)
    return f"the Ray worker group failed: {' '.join(str(error).split())[:2000]}"


def train_worker(job: dict) -> None:
    """One Ray Train worker: what `python -m finetune FLAGS` runs, in the driver's directory, resuming
    from the newest checkpoint when this group replaces one that failed."""
    if os.path.isdir(job["cwd"]):
        os.chdir(job["cwd"])  # relative paths mean what they meant to the driver (on a cluster: shared paths)
    from finetune.library_logs import quiet_libraries, quiet_transformers_bars
    from finetune.train import fit_check, run

    command = parse_command(job["argv"])
    command = replace(command, config=replace(command.config, resume=resume_point(job["resume"], command.config.output_dir)))
    if not command.config.verbose:
        quiet_libraries()
        quiet_transformers_bars()
    fit_check.check_cpu_run(command.config)
    run.main(command)
    sys.stdout.flush()


def resume_point(asked: str | None, output_dir: str) -> str:
    """--resume for this worker group: auto, unless the run was asked to resume from a checkpoint
    and nothing newer has been saved in this run's output dir yet (`check_output_dir` made sure that
    anything newer is this run's)."""
    if asked in (None, "auto"):
        return "auto"
    saved = take_inventory(checkpoints_dir(output_dir)).complete
    return "auto" if saved and step_of(saved[-1]) > step_of(find_checkpoint(asked)) else asked
