"""A run's configuration as the user writes it: the flags and a YAML file (defaults < YAML file <
CLI flags), parsed into a validated TrainConfig (options.py); and run.yaml written back.

One flag per TrainConfig field, its help the field's `help` metadata. No torch import: `--help`
and mistakes answer in well under a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml

from finetune.config.options import EVERY_OPTION, TrainConfig, flag_name, validate
from finetune.config.run_folder import RESOLVED
from finetune.errors import ConfigError


def _base_type(annotation: Any) -> type:
    """int for `int | None`, etc. (annotations are strings under `from __future__ import annotations`)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.startswith(name):
            return kind
    origin = get_origin(annotation)
    if origin is not None:
        return next(a for a in get_args(annotation) if a is not type(None))
    raise TypeError(f"unsupported config annotation {annotation!r}")


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a run YAML; errors name the file, line and the unknown keys."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"Invalid YAML in {path}{where}: {getattr(e, 'problem', e)}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of option: value, got {type(data).__name__}")
    data = {key.replace("-", "_"): value for key, value in data.items()}
    data.pop(RESOLVED, None)  # a run.yaml's record of what the flags resolved to (config/run_folder.py), not options
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown option(s) {', '.join(unknown)}. See `python -m finetune --help`.")
    for f in dataclasses.fields(TrainConfig):
        if f.name in data and data[f.name] is not None:
            kind = _base_type(f.type)
            value = data[f.name]
            if kind is float and isinstance(value, str):
                try:  # PyYAML reads exponents without a dot (1e-3) as strings
                    value = data[f.name] = float(value)
                except ValueError:
                    pass
            ok = isinstance(value, kind) or (kind is float and isinstance(value, int) and not isinstance(value, bool))
            if not ok or (kind is int and isinstance(value, bool)):
                raise ConfigError(f"{path}: key '{f.name}' should be {kind.__name__}, got {value!r}")
    return data


# what users coming from other trainers type, and the flag that means it here
FLAG_SYNONYMS = {"--learning-rate": "--lr", "--batch-size": "--micro-batch-size", "--per-device-train-batch-size":
                 "--micro-batch-size", "--num-train-epochs": "--epochs", "--num-epochs": "--epochs",
                 "--model-name-or-path": "--model", "--data": "--dataset", "--data-path": "--dataset",
                 "--out": "--output-dir", "--output": "--output-dir", "--seq-len": "--max-seq-len",
                 "--max-length": "--max-seq-len", "--grad-accum": "--gradient-accumulation-steps",
                 "--warmup": "--warmup-steps", "--steps": "--max-steps", "--lora-rank": "--lora-r"}


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes are one line (a ConfigError the CLI prints) instead of the whole usage,
    and whose unknown flags get a "did you mean"."""

    def error(self, message: str):
        raise ConfigError(f"{message} (see --help)")

    def parse_args(self, args=None, namespace=None):
        args, unknown = self.parse_known_args(glue_negative_values(args), namespace)
        if unknown:
            raise ConfigError(f"unrecognized arguments: {' '.join(unknown)}{self.suggestion(unknown)}")
        return args

    def suggestion(self, unknown: list[str]) -> str:
        flags = [flag for action in self._actions for flag in action.option_strings if flag.startswith("--")]
        guesses = []
        for word in unknown:
            name = word.split("=")[0]
            if name.startswith("-"):
                guess = FLAG_SYNONYMS.get(name) or next(iter(difflib.get_close_matches(name, flags, n=1)), None)
                if guess:
                    guesses.append(f"{guess} instead of {name}")
        return f"; did you mean {', '.join(guesses)}?" if guesses else " (see --help)"


def glue_negative_values(argv: list[str] | None) -> list[str] | None:
    """`--lr -1e-4` as `--lr=-1e-4`: argparse reads a value like -1e-4 as a flag ("expected one
    argument"), so a negative number reaches validation, which says what the value must be."""
    if argv is None:
        return None
    glued: list[str] = []
    for word in argv:
        if glued and glued[-1].startswith("--") and "=" not in glued[-1] and is_number(word) and word.startswith("-"):
            glued[-1] = f"{glued[-1]}={word}"
        else:
            glued.append(word)
    return glued


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def build_parser(prog: str = "finetune") -> argparse.ArgumentParser:
    """An argparse parser with one flag per TrainConfig field; defaults are left as None so that
    only flags the user typed override the YAML file."""
    parser = OneLineParser(
        prog=prog,
        description="Fine-tune a language model with one Accelerate training loop. "
        "Subcommands: prepare, plan, rehearse, export, slurm, ray, doctor, scaling (see `finetune SUBCOMMAND --help`).",
    )
    parser.add_argument("--config", help="YAML file of options; flags given on the command line override it.")
    parser.add_argument("--dry-run", action="store_true", help="Build the run on fake tensors, print its plan "
                        "(per-GPU memory as planned and as built) and exit without loading weights.")
    parser.add_argument("--json", action="store_true", help="With --dry-run: print the plan as `finetune plan --json` does.")
    for f in dataclasses.fields(TrainConfig):
        kind = _base_type(f.type)
        help_text = f.metadata["help"] + (f" (default: {f.default})" if f.default is not None else "")
        if kind is bool:
            parser.add_argument(f"--{flag_name(f.name)}", action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(
                f"--{flag_name(f.name)}", type=kind, default=None, choices=f.metadata["choices"], help=help_text,
                metavar=None if f.metadata["choices"] else kind.__name__.upper(),
            )
    return parser


@dataclass(frozen=True)
class Command:
    """A training command line: the run it describes, whether to only plan it, and which options
    the user set (a flag or a --config YAML key) rather than left at their defaults. A DeepSpeed
    JSON's optimizer and scheduler choices are adopted only for options not in `given`."""

    config: TrainConfig
    dry_run: bool = False
    json: bool = False
    given: frozenset[str] = EVERY_OPTION


def parse_command(argv: list[str] | None) -> Command:
    """defaults < --config YAML < flags, then validated."""
    args = vars(build_parser().parse_args(argv))
    modes = {name: args.pop(name) for name in ("dry_run", "json")}
    values = load_yaml(args.pop("config")) if args.get("config") else {}
    values.update({key: value for key, value in args.items() if value is not None})
    config = TrainConfig(**values)
    validate(config)
    return Command(config, **modes, given=frozenset(key for key, value in values.items() if value is not None))


def command_line(config: TrainConfig, given: frozenset[str]) -> list[str]:
    """The flags that make `parse_command` give `config` back for the options in `given` (those the
    user set, by flag or --config YAML): a run's own command line, without the YAML it may have read."""
    words = []
    for f in dataclasses.fields(TrainConfig):
        value = getattr(config, f.name)
        if f.name not in given or value is None:
            continue
        if isinstance(value, bool):
            words.append(f"--{'' if value else 'no-'}{flag_name(f.name)}")
        else:
            words += [f"--{flag_name(f.name)}", str(value)]
    return words


def parse_config(argv: list[str] | None) -> TrainConfig:
    return parse_command(argv).config


def save_yaml(config: TrainConfig, path: str | Path) -> None:
    """Write `config` as a YAML file `--config` loads back (a run's own run.yaml: run_folder.RunFolder)."""
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
