"""Command line: `finetune [train] FLAGS` (default) | plan | rehearse | export | slurm.

Each subcommand lives in the module that owns it and is imported only when used, so
`finetune plan` never imports torch.
"""

from __future__ import annotations

import importlib
import sys

from finetune.errors import FinetuneError

# subcommand → "module:function"; each function takes argv and returns an exit code
SUBCOMMANDS = {
    "train": "finetune.run:main",
    "plan": "finetune.planner.command:main",
    "export": "finetune.export:main",
    "rehearse": "finetune.rehearse:main",
    "slurm": "finetune.slurm:main",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else "train"
    module_name, function_name = SUBCOMMANDS[name].split(":")
    command = getattr(importlib.import_module(module_name), function_name)
    try:
        return command(argv)
    except FinetuneError as e:
        print(f"finetune {name}: error: {e}", file=sys.stderr)
        return 2
