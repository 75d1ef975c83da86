"""Command line: `finetune [train] FLAGS` (default) | prepare | plan | rehearse | export | slurm | ray | doctor | scaling.

Each subcommand lives in the module that owns it and is imported only when used, so
`finetune plan` never imports torch, and training flags are read and checked before it is.
"""

from __future__ import annotations

import importlib
import os
import sys

from finetune.errors import FinetuneError, ReportedElsewhere, report
from finetune.library_logs import library_logs_to_stderr

# subcommand → "module:function"; each function takes argv and returns an exit code
SUBCOMMANDS = {
    "train": "finetune.cli:train",
    "prepare": "finetune.cli.prepare:main",
    "plan": "finetune.cli.plan:main",
    "export": "finetune.export.command:main",
    "rehearse": "finetune.launch.rehearse:main",
    "slurm": "finetune.launch.slurm:main",
    "ray": "finetune.launch.ray_train:main",
    "doctor": "finetune.launch.doctor.command:main",
    "scaling": "finetune.launch.scaling:main",
}

# What runs out on a GPU is reserved memory; expandable segments keep it close to what is allocated
# (plan.memory.ALLOCATOR_SLACK). CUDA reads it once, when it initialises: set before torch loads.
ALLOCATOR_CONF = "expandable_segments:True"


def use_expandable_segments(environ=None) -> None:
    """Set PYTORCH_CUDA_ALLOC_CONF unless the user set it (or torch ≥ 2.9's PYTORCH_ALLOC_CONF). The
    environment is looked up at call time: a default bound at import would keep whatever
    `os.environ` was then."""
    environ = os.environ if environ is None else environ
    if "PYTORCH_CUDA_ALLOC_CONF" not in environ and "PYTORCH_ALLOC_CONF" not in environ:
        environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_CONF


def main(argv: list[str] | None = None) -> int:
    use_expandable_segments()
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else "train"
    module_name, function_name = SUBCOMMANDS[name].split(":")
    command = getattr(importlib.import_module(module_name), function_name)
    library_logs_to_stderr()  # stdout is finetune's (--json), whatever the launcher or --verbose
    try:
        return command(argv)
    except ReportedElsewhere:
        return 2
    except FinetuneError as e:
        report(f"finetune {name}: error: {e}")
        return 2


def train(argv: list[str]) -> int:
    """Parse and validate the flags torch-free, so `--help` and mistakes answer in well under a second,
    then plan (--dry-run) or train."""
    from finetune.config.flags import parse_command
    from finetune.library_logs import quiet_libraries, quiet_transformers_bars

    command = parse_command(argv)
    if not command.config.verbose:
        quiet_libraries()
        quiet_transformers_bars()
    try:
        from finetune.train import fit_check, run

        if not command.dry_run:
            fit_check.check_cpu_run(command.config)  # before the Hub is asked for weights
        return run.main(command)
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0":  # every rank gets the Ctrl-C; one message is enough
            print(interrupted_message(command.config.output_dir), file=sys.stderr, flush=True)
        return 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended


def interrupted_message(output_dir: str) -> str:
    """One line for Ctrl-C instead of the traceback: where the run can continue from, if anywhere."""
    from finetune.checkpoint.layout import checkpoints_dir, complete_checkpoints

    saved = complete_checkpoints(checkpoints_dir(output_dir))
    if saved:
        return (f"finetune: interrupted (Ctrl-C). Continue from {saved[-1]} by running the same command "
                "with --resume auto.")
    return ("finetune: interrupted (Ctrl-C) before any checkpoint was saved; rerun to start again "
            "(--save-every N saves checkpoints that --resume auto continues from).")
