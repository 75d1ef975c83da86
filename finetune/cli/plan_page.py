"""The backend of `finetune plan`'s web page (`--serve`, `--html`): form fields are the flags without
dashes; the answer is what --json prints plus each plan's files, computed by the same functions as
the terminal's. plan/serve.py owns HTTP and hands each request's fields to `page_answer`.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from finetune.cli.plan_flags import build_parser, build_request, model_dir, note
from finetune.errors import FinetuneError
from finetune.models import catalog as model_catalog
from finetune.models.catalog import ModelSpec
from finetune.models.source import resolve_model, spec_from_config
from finetune.plan import report
from finetune.plan.choose import Plan, plan
from finetune.plan.files import ACCELERATE_FILE, DEFAULT_CONFIG_DIR, config_texts, train_flags
from finetune.plan.query import parse_gpus

PAGE_FLAGS = {
    "model": "--model", "nodes": "--nodes", "method": "--method", "strategy": "--strategy", "offload": "--offload",
    "precision": "--precision", "optimizer": "--optimizer", "lora_r": "--lora-r", "lora_targets": "--lora-targets",
    "micro_batch_size": "--micro-batch-size", "gradient_accumulation_steps": "--gradient-accumulation-steps",
    "seq_len": "--seq-len", "tokens": "--tokens", "host_memory": "--host-memory", "tp": "--tp", "cp": "--cp",
    "objective": "--objective",
}
# q: the free-text query; gpu × count: --gpus; config: a pasted config.json; gradient_checkpointing: on/off
PAGE_FIELDS = {"q", "gpu", "count", "config", "gradient_checkpointing", *PAGE_FLAGS}
# which field a message is about, from the first flag it names
FLAG_FIELDS = {**{flag: name for name, flag in PAGE_FLAGS.items()}, "--gpus": "gpu", "--gpus-per-node": "count",
               "--gradient-checkpointing": "gradient_checkpointing"}
PASTED_MODEL = "pasted-config"
SBATCH_FILE = "finetune.sbatch"


def page_answer(fields: dict[str, str]) -> tuple[int, dict]:
    """One request of the web page → (HTTP status, body): 200 with `page_data`, or 400 with
    {"errors": [{"field", "message"}]}, each message the CLI's, aimed at the field it is about."""
    unknown = sorted(set(fields) - PAGE_FIELDS)
    if unknown:
        return 400, {"errors": [{"field": None, "message": f"unknown fields: {', '.join(unknown)}"}]}
    given = {name: value.strip() for name, value in fields.items() if value.strip() not in ("", "auto")}
    errors: list[dict] = []
    argv, pasted = _page_argv(given, errors)
    if errors:
        return 400, {"errors": errors}
    parser = build_parser()
    parser.error = _raise  # argparse's own messages ("argument --seq-len: invalid int value"), as errors
    try:
        return 200, page_data(parser.parse_args(argv), _page_command(argv, pasted), _page_resolver(pasted))
    except FinetuneError as e:
        default = "q" if "q" in given else None
        return 400, {"errors": [{"field": _field_of(line, default), "message": line} for line in _problems(str(e))]}


def page_data(args: argparse.Namespace, command: str, resolve: Callable[[str], ModelSpec] = resolve_model) -> dict:
    """What the page shows: `result` is exactly what `--json` prints for these flags; `files[i]` holds
    the files of plan i (without a model: of model i's recommended plan): those --write-config writes,
    and an sbatch script; `command` is the terminal command."""
    request = build_request(args, resolve)
    many = isinstance(request, list)
    results = [(r, *plan(r)) for r in (request if many else [request])]
    directories = [model_dir(args.write_config, r) if many else args.write_config or DEFAULT_CONFIG_DIR for r, *_ in results]
    contracts = [report.to_json(r, p, i, d) for (r, p, i), d in zip(results, directories)]
    if many:
        files = [_plan_files(p[i], d) if i is not None else {} for (_, p, i), d in zip(results, directories)]
    else:
        files = [_plan_files(p, directories[0]) for p in results[0][1]]
    return {"result": contracts if many else contracts[0], "files": files, "command": command}


def write_html(args: argparse.Namespace, argv: list[str]) -> None:
    """--html FILE: the page with this answer inlined."""
    if args.html:
        from finetune.plan import serve

        shown = [word for i, word in enumerate(argv)  # the command that plans it, not the one that wrote the file
                 if not (word == "--html" or word.startswith("--html=") or (i and argv[i - 1] == "--html"))]
        Path(args.html).write_text(serve.standalone_html(page_data(args, shlex.join(["finetune", "plan", *shown]))), encoding="utf-8")
        note(f"wrote {args.html}")


def _page_argv(given: dict[str, str], errors: list[dict]) -> tuple[list[str], ModelSpec | None]:
    """The flags the form's fields stand for, and the pasted config's spec; problems go to `errors`."""
    argv: list[str] = []
    for name, flag in PAGE_FLAGS.items():
        if name in given:
            argv += [flag, given[name]]
    if given.get("host_memory") == "local":
        errors.append({"field": "host_memory", "message": "The page reads no files of this machine: give GiB per node "
                       "(`--host-memory local` works in the terminal)."})
    checkpointing = given.get("gradient_checkpointing")
    if checkpointing in ("on", "off"):
        argv.append("--gradient-checkpointing" if checkpointing == "on" else "--no-gradient-checkpointing")
    elif checkpointing is not None:
        errors.append({"field": "gradient_checkpointing", "message": "--gradient-checkpointing: on, off or auto"})
    if "gpu" in given or "count" in given:
        argv += ["--gpus", _page_gpus(given, errors)]
    if "model" in given:
        try:
            _page_resolver(None)(given["model"])
        except FinetuneError as e:
            errors.append({"field": "model", "message": str(e)})
    pasted = None
    if "config" in given:
        try:
            pasted = _pasted_spec(given["config"], "model" in given)
            argv += ["--model", pasted.name]
        except FinetuneError as e:
            errors.append({"field": "config", "message": str(e)})
    if "q" in given:
        argv += ["--", given["q"]]  # after --, a query starting with "-" is still the query
    return argv, pasted


def _page_command(argv: list[str], pasted: ModelSpec | None) -> str:
    """The terminal command the page's fields stand for (a pasted config as ./config.json)."""
    flags, query = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    if pasted is not None:
        flags = [word if word != pasted.name else "./config.json" for word in flags]
    return shlex.join(["finetune", "plan", *query, *flags])


def _page_gpus(given: dict[str, str], errors: list[dict]) -> str:
    """GPU type × count as --gpus text."""
    count = given.get("count", "1")
    if not count.isdigit() or int(count) < 1:
        errors.append({"field": "count", "message": f"GPU count must be a whole number ≥ 1, got {count!r}"})
        return ""
    if "gpu" not in given:
        errors.append({"field": "count", "message": "Pick the GPU type too (or name the GPUs in the query)."})
        return ""
    text = f"{count}x{given['gpu']}"
    try:
        parse_gpus(text)
    except FinetuneError as e:
        errors.append({"field": "gpu", "message": str(e)})
    return text


def _pasted_spec(text: str, model_given: bool) -> ModelSpec:
    """A pasted config.json, parsed as JSON only (no code runs), named by its Hub id when it has one."""
    if model_given:
        raise FinetuneError("Either a catalog model or a pasted config.json, not both.")
    try:
        config = json.loads(text)
    except ValueError as e:
        raise FinetuneError(f"The pasted config.json is not JSON: {e}.") from None
    if not isinstance(config, dict):
        raise FinetuneError("The pasted config.json must be a JSON object, as transformers writes it.")
    spec = spec_from_config(config, PASTED_MODEL)
    hub_id = config.get("_name_or_path")
    if isinstance(hub_id, str) and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", hub_id):
        spec = replace(spec, name=hub_id, hf_id=hub_id, source=f"{hub_id} (pasted config.json)")
    return spec


def _page_resolver(pasted: ModelSpec | None) -> Callable[[str], ModelSpec]:
    """Model names the page accepts: the pasted config and catalog names. Hub ids and paths would
    read this machine's disk (the Hugging Face cache, files), which a web request must not."""
    def resolve(name: str) -> ModelSpec:
        if pasted is not None and name == pasted.name:
            return pasted
        if model_catalog.lookup(name) is None and ("/" in name or model_catalog.looks_like_path(name)):
            raise FinetuneError(f"--model {name}: the page plans catalog models and pasted config.json files; "
                                f"for this one run `finetune plan --model {name}` in a terminal.")
        return model_catalog.get(name)
    return resolve


def _plan_files(p: Plan, directory: str) -> dict[str, str]:
    """The files that launch plan `p` from `directory`: --write-config's, and an sbatch script."""
    from finetune.launch.slurm import SlurmJob, sbatch_script

    w = p.workload
    job = SlurmJob(accelerate_config=f"{directory}/{ACCELERATE_FILE}", nodes=w.nodes, gpus_per_node=w.gpus_per_node,
                   train_args=train_flags(w))
    return {**config_texts(p, directory), SBATCH_FILE: sbatch_script(job)}


def _raise(message: str) -> None:
    raise FinetuneError(message)


def _problems(message: str) -> list[str]:
    """validate()'s "Cannot plan this request:\n  - a\n  - b" → [a, b]; other messages whole."""
    head, *items = message.split("\n  - ")
    return items if items else [head]


def _field_of(message: str, default: str | None) -> str | None:
    flag = re.search(r"--[a-z][a-z-]*", message)
    return FLAG_FIELDS.get(flag.group(), default) if flag else default
