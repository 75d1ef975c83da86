"""`finetune slurm`: write an sbatch script that runs one training job over several machines.

Slurm starts one task per node; each runs `accelerate launch`, which starts one process per GPU.
The rendezvous is taken from Slurm's variables: the first host of the allocation hosts the c10d
store, every node passes its own `$SLURM_NODEID` as --machine_rank. The preflight in
`startup.start_accelerator` then checks the job before weights load.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from finetune.config.flags import parse_config
from finetune.errors import FinetuneError


@dataclass(frozen=True)
class SlurmJob:
    """What the sbatch script needs besides the training flags."""

    accelerate_config: str
    nodes: int = 2
    gpus_per_node: int = 8
    job_name: str = "finetune"
    time: str = "24:00:00"
    partition: str | None = None
    account: str | None = None
    port: int = 29500
    train_args: list[str] = field(default_factory=list)

    @property
    def num_processes(self) -> int:
        return self.nodes * self.gpus_per_node


def sbatch_script(job: SlurmJob) -> str:
    """The sbatch script text; pure, so `finetune plan` can emit it too."""
    optional = [f"#SBATCH --{name}={value}" for name, value in (("partition", job.partition), ("account", job.account)) if value]
    # (flag, value) pairs; Slurm variables expand in the script, everything the user typed is quoted
    launch_args = [
        ("--config_file", shlex.quote(job.accelerate_config)),
        ("--num_machines", '"$SLURM_NNODES"'),
        ("--num_processes", "$((SLURM_NNODES * GPUS_PER_NODE))"),
        ("--main_process_ip", '"$MAIN_HOST"'),
        ("--main_process_port", '"$MAIN_PORT"'),
        ("--rdzv_backend", "c10d"),
        ("-m", "finetune"),
    ]
    lines = [f"{flag} {value}" for flag, value in launch_args] + _flag_lines(job.train_args)
    rendered = " \\\n    ".join(lines)
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1          # one accelerate launcher per node; it starts one process per GPU",
        f"#SBATCH --gpus-per-node={job.gpus_per_node}",
        f"#SBATCH --time={job.time}",
        "#SBATCH --output=%x-%j.out",
        *optional,
        "# Written by `finetune slurm`. Submit from the directory that holds your configs: sbatch THIS_FILE",
        "set -euo pipefail",
        "",
        f"GPUS_PER_NODE={job.gpus_per_node}",
        "# rendezvous: the first host of the allocation hosts the c10d store on MAIN_PORT",
        'MAIN_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"MAIN_PORT=${{MAIN_PORT:-{job.port}}}",
        "# NCCL errors end the job instead of hanging it",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "",
        "# one task per node; $SLURM_NODEID (0 .. nodes-1) is expanded on each node as its --machine_rank",
        "srun --kill-on-bad-exit=1 bash -c 'exec accelerate launch --machine_rank \"$SLURM_NODEID\" \"$@\"' accelerate-launch \\",
        f"    {rendered}",
        "",
    ])


def _flag_lines(args: list[str]) -> list[str]:
    """Training flags one per line, each followed by its values, quoted for bash."""
    lines: list[list[str]] = []
    for arg in args:
        if arg.startswith("-") or not lines:
            lines.append([])
        lines[-1].append(shlex.quote(arg))
    return [" ".join(line) for line in lines]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetune slurm",
        description="Write an sbatch script that runs `accelerate launch -m finetune` on every node of a Slurm "
        "allocation. Training flags go after `--`: finetune slurm --nodes 2 -- --model llama-70b --method qlora",
    )
    defaults = SlurmJob(accelerate_config="")
    parser.add_argument("--config-file", required=True, help="Accelerate config for each node, e.g. accelerate_configs/fsdp.yaml.")
    parser.add_argument("--nodes", type=int, default=defaults.nodes, help="Machines in the job.")
    parser.add_argument("--gpus-per-node", type=int, default=defaults.gpus_per_node, help="GPUs (processes) per machine.")
    parser.add_argument("--job-name", default=defaults.job_name, help="Slurm job name.")
    parser.add_argument("--time", default=defaults.time, help="Slurm time limit (HH:MM:SS).")
    parser.add_argument("--partition", help="Slurm partition.")
    parser.add_argument("--account", help="Slurm account.")
    parser.add_argument("--port", type=int, default=defaults.port, help="Rendezvous port on the first node.")
    parser.add_argument("--output", default="finetune.sbatch", help="Where to write the script (- for stdout).")
    return parser


def main(argv: list[str]) -> int:
    """Validate the flags (including the training flags, so typos fail now, not on the cluster) and
    write the script."""
    ours, train_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(ours)
    problems = [f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}"
                for name in ("nodes", "gpus_per_node") if getattr(args, name) < 1]
    if not Path(args.config_file).is_file():
        problems.append(f"--config-file {args.config_file}: no such file (see accelerate_configs/)")
    if problems:
        raise FinetuneError("invalid options:\n  - " + "\n  - ".join(problems))
    parse_config(train_args)
    job = SlurmJob(accelerate_config=args.config_file, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                   job_name=args.job_name, time=args.time, partition=args.partition, account=args.account,
                   port=args.port, train_args=train_args)
    text = sbatch_script(job)
    if args.output == "-":
        print(text, end="")
    else:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}: {job.nodes} nodes × {job.gpus_per_node} GPUs = {job.num_processes} processes; "
              f"submit with `sbatch {args.output}`")
    return 0
