"""`finetune plan [QUERY] [flags]`: what fits, how fast, what it costs, and how to launch it.

Imports no torch, transformers or accelerate unless --simulate asks for a simulated step.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path

from finetune.plan import gpus as gpu_catalog
from finetune.models import catalog as model_catalog
from finetune.models.catalog import ModelSpec
from finetune.errors import FinetuneError
from finetune.library_logs import quiet_libraries
from finetune.plan import report
from finetune.plan.choose import PARTIAL_CHECKPOINTING_HEADROOM, Plan, Request, plan
from finetune.plan.parallel import CP_MIN_SEQ_LEN
from finetune.plan.files import ACCELERATE_FILE, DEFAULT_CONFIG_DIR, config_texts, train_flags, write_configs
from finetune.models.source import resolve_model, spec_from_config
from finetune.plan.query import parse_gpus, parse_query
from finetune.config.names import METHODS, OFFLOADS, OPTIMIZERS, PRECISIONS, STRATEGIES

# Sequence length when neither the query nor --seq-len gives one (capped by the model's context).
DEFAULT_SEQ_LEN = 2048
# --serve: this machine only unless --host says otherwise (--host 0.0.0.0 shares the page on the network)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetune plan",
        description="Plan a fine-tuning run: per-GPU memory of every method × strategy, speed, cost, "
        "the recommended plan and the files to launch it. Flags override the free-text QUERY.",
    )
    parser.add_argument("query", nargs="*", help='free text, e.g. "llama-70b qlora on 2xRTX4090" or "what fits on 2×A100 40GB"')
    parser.add_argument("--model", help="catalog name, Hub id (config.json in the local cache), local dir or config.json path")
    parser.add_argument("--gpus", help="e.g. 2xA100-40GB, 8xH100, 1xRTX4090 (GPUs per node with --nodes)")
    parser.add_argument("--nodes", type=int, help="number of nodes (default 1)")
    parser.add_argument("--method", choices=("auto", *METHODS), help="default auto: all")
    parser.add_argument("--strategy", choices=("auto", *STRATEGIES), help="default auto: all that apply")
    parser.add_argument("--offload", choices=("auto", *OFFLOADS), help="params implies optimizer (default auto)")
    parser.add_argument("--precision", choices=("auto", *PRECISIONS),
                        help="auto: bf16-mixed for full, bf16-true for LoRA/QLoRA (fp16-mixed / fp16-true without bf16)")
    parser.add_argument("--optimizer", choices=("auto", *OPTIMIZERS), help="auto: adamw")
    parser.add_argument("--lora-r", type=int, help="LoRA rank (default 16)")
    parser.add_argument("--lora-targets", help="all-linear (default), all-linear+experts (a mixture of experts' experts "
                        "too), or a comma list such as q_proj,v_proj")
    parser.add_argument("--micro-batch-size", type=int, help="default: the largest that fits")
    parser.add_argument("--gradient-accumulation-steps", type=int, help="micro-batches per update (default 1)")
    parser.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {DEFAULT_SEQ_LEN})")
    parser.add_argument("--max-seq-len", dest="seq_len", type=int, help=argparse.SUPPRESS)  # training's name for it
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="default: only when needed to fit")
    parser.add_argument("--gradient-checkpointing-layers", type=int, metavar="N",
                        help="with checkpointing: recompute only the first N decoder layers (default: the fewest that "
                        f"keep the plan within {PARTIAL_CHECKPOINTING_HEADROOM * 100:.0f} %% of the GPU)")
    parser.add_argument("--liger", action=argparse.BooleanOptionalAction, default=None,
                        help="plan with Liger kernels (no full-vocabulary logits, faster GPU clock), also where "
                        "liger-kernel is not installed here; default: as the trainer decides it (on where liger-kernel "
                        "is installed here and imports, not under ZeRO-3 or with LoRA on lm_head)")
    parser.add_argument("--chunked-loss", action=argparse.BooleanOptionalAction, default=None,
                        help="plan the loss through the LM head in chunks (no full-vocabulary logits); default: as "
                        "the trainer decides it (on for LoRA/QLoRA, not with Liger, ZeRO-3 or LoRA on lm_head)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="plan with regional compilation of the decoder blocks (less per-layer overhead); default off")
    parser.add_argument("--tp", type=int, help="tensor parallel size: GPUs of a node that split every linear layer "
                        "(default: searched; 1: none)")
    parser.add_argument("--cp", type=int, help="context parallel size: GPUs that split every row's tokens (default: "
                        f"searched for rows of {CP_MIN_SEQ_LEN:,} tokens or more; 1: none)")
    parser.add_argument("--tokens", type=float, help="training tokens, for hours and cost (e.g. 1e9)")
    parser.add_argument("--host-memory", metavar="GiB|local",
                        help="host RAM per node a plan may use (default: what the GPU's usual cloud instance has; "
                        "local: this machine's)")
    add_output_flags(parser)
    return parser


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    """What to do with the plans: print them (table, JSON, chart), write their files, serve the page, simulate."""
    parser.add_argument("--json", action="store_true", help="print the plans as JSON")
    parser.add_argument("--png", metavar="FILE", help="draw per-GPU memory per plan as a stacked bar chart")
    parser.add_argument("--write-config", metavar="DIR", help="write the recommended plan's accelerate YAML (and DeepSpeed JSON)")
    parser.add_argument("--html", metavar="FILE", help="write the result as one self-contained HTML page (opens without network)")
    parser.add_argument("--serve", action="store_true", help="serve the planner as a local web page (opened on QUERY if given)")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"with --serve: address to bind (default {DEFAULT_HOST}, "
                        "this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"with --serve: port (default {DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--simulate", action="store_true",
                        help="also run the recommended plan's launch command for two steps on fake tensors, through the "
                        "trainer's own model and optimizer construction, and compare memory (needs torch). Checks full "
                        "and LoRA with AdamW on one GPU or FSDP2 without offload; for other plans it simulates the "
                        "best-ranked plan it checks and says so")
    parser.add_argument("--verbose", action="store_true", help="with --simulate: also show the libraries' logs and warnings")


def build_request(args: argparse.Namespace, resolve: Callable[[str], ModelSpec] = resolve_model) -> Request | list[Request]:
    """Query fields, overridden by flags. Without a model, one request per catalog model. `resolve`
    turns a model name into its spec (the web page passes one that never reads the disk)."""
    fields_from_query = parse_query(" ".join(args.query)) if args.query else {}
    if args.gpus:
        fields_from_query["gpu"], fields_from_query["gpus_per_node"] = parse_gpus(args.gpus)
    if args.model:
        fields_from_query["model"] = args.model
    if args.host_memory is not None:
        fields_from_query["host_memory_gib"] = host_memory_gib(args.host_memory)
    names = {f.name for f in fields(Request)}
    for name in names - {"model", "gpu", "gpus_per_node", "host_memory_gib"}:
        value = getattr(args, name, None)
        if value is not None:
            fields_from_query[name] = value
    if "gpu" not in fields_from_query:
        raise FinetuneError("Say which GPUs: --gpus 2xA100-40GB, or a query such as \"llama-7b on 8xH100\".")
    fields_from_query["gpu"] = gpu_catalog.get(fields_from_query["gpu"])
    split_into_nodes(fields_from_query)

    def request_for(name: str) -> Request:
        spec = resolve(name)
        seq_len = fields_from_query.get("seq_len")
        seq_len = min(DEFAULT_SEQ_LEN, spec.max_position_embeddings) if seq_len is None else seq_len
        return Request(model=spec, **{**fields_from_query, "seq_len": seq_len})

    if "model" in fields_from_query:
        return request_for(fields_from_query.pop("model"))
    return [request_for(name) for name in model_catalog.MODELS if name not in model_catalog.CPU_DEMOS]


def split_into_nodes(request_fields: dict) -> None:
    """More GPUs than one host holds, with no --nodes: plan them as nodes of the GPU's usual host
    (and say so), not as one impossible node with all their host RAM."""
    gpu, count = request_fields["gpu"], request_fields["gpus_per_node"]
    usual = gpu_catalog.usual_gpus_per_node(gpu.name)
    if request_fields.get("nodes") is not None or count <= usual:
        return
    per_node = max(n for n in range(1, usual + 1) if count % n == 0)  # whole nodes, as full as a host allows
    request_fields.update(gpus_per_node=per_node, nodes=count // per_node)
    note(f"planning {count}× {gpu.name} as {count // per_node} nodes × {per_node} GPUs ({gpu.name} hosts usually hold "
         f"{usual}): --gpus {per_node}x{gpu.name} --nodes {count // per_node}; --nodes sets another split")


def host_memory_gib(text: str) -> float:
    """--host-memory: a number of GiB, or `local` for this machine's RAM."""
    if text == "local":
        import psutil  # torch-free; only `local` needs it

        return psutil.virtual_memory().total / 2**30
    try:
        return float(text)
    except ValueError:
        raise FinetuneError(f"--host-memory {text!r}: give GiB per node (e.g. 512) or `local`.") from None


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.serve:
        from finetune.plan import serve  # http.server: imported only when asked for

        return serve.run(args.host, args.port, page_answer, " ".join(args.query))
    request = build_request(args)
    if isinstance(request, list):
        return _what_fits(request, args, argv)
    plans, recommended = plan(request)
    config_dir = args.write_config or DEFAULT_CONFIG_DIR
    print(json.dumps(report.to_json(request, plans, recommended, config_dir), indent=2) if args.json
          else report.table(request, plans, recommended, config_dir))
    try:
        if args.png:
            note(f"wrote {report.draw_png(request, plans, recommended, args.png)}")
        if args.write_config:
            if recommended is None:
                raise FinetuneError("No plan fits, so there is no config to write.")
            for path in write_configs(plans[recommended], args.write_config):
                note(f"wrote {path}")
        write_html(args, argv)
    except OSError as e:
        raise FinetuneError(f"Cannot write {e.filename or args.write_config or args.png}: {e.strerror or e}.") from e
    if recommended is not None and not args.write_config:
        note(files_hint(argv, config_dir))
    if args.simulate:
        if not args.verbose:
            quiet_libraries()
        note(simulation_text(plans, recommended))
    return 0


def files_hint(argv: list[str], config_dir: str) -> str:
    """The launch command reads files this run of `plan` did not write; the command that writes them."""
    command = shlex.join(["finetune", "plan", *argv, "--write-config", config_dir])
    return f"The launch command reads {config_dir}/; write its files first with: {command}"


def note(text: str) -> None:
    """Messages beside the plan go to stderr, so `--json` output stays machine-readable."""
    print(text, file=sys.stderr)


def simulation_text(plans: list, recommended: int | None) -> str:
    """Two fake-tensor steps of the recommended (else closest) plan's launch command, built as the
    trainer builds it; when --simulate cannot run that plan, of the best-ranked plan it can, saying so."""
    import tempfile

    from finetune.plan.choose import describe
    from finetune.train import simulate
    from finetune.train.dry_run import run_of_plan  # imports torch

    asked = plans[recommended if recommended is not None else 0]
    reason = simulate.cannot_simulate(asked.workload)
    chosen = asked if reason is None else next((p for p in plans if simulate.cannot_simulate(p.workload) is None), None)
    which = "recommended" if recommended is not None else "closest"
    heading = "" if reason is None else f"--simulate checks {simulate.CHECKS}; the {which} plan is {reason}."
    if chosen is None:
        return f"{heading} None of these plans is one it checks: nothing simulated."
    if heading:
        heading += f" Simulating the best plan it checks instead: {describe(chosen.workload)}.\n"
    with tempfile.TemporaryDirectory(prefix="finetune-simulate-") as workdir:
        write_configs(chosen, workdir)
        run = run_of_plan(chosen, workdir, workdir)
        return heading + simulate.compare_text(run, chosen.workload)


def _what_fits(requests: list[Request], args: argparse.Namespace, argv: list[str]) -> int:
    """No model named: the best plan of every catalog model on these GPUs. --write-config writes one
    folder per model that fits, --png one chart with each model's recommended plan."""
    if args.simulate:
        raise FinetuneError("--simulate needs one model: add --model NAME.")
    results = [(request, *plan(request)) for request in requests]
    print(json.dumps([report.to_json(r, p, i, _model_dir(args.write_config, r)) for r, p, i in results], indent=2)
          if args.json else report.what_fits_table(results))
    if args.png:
        note(f"wrote {report.draw_what_fits_png(results, args.png)}")
    write_html(args, argv)
    if not args.write_config and any(recommended is not None for _, _, recommended in results):
        note(files_hint(argv, DEFAULT_CONFIG_DIR))
    if args.write_config:
        for request, plans, recommended in results:
            if recommended is not None:
                for path in write_configs(plans[recommended], _model_dir(args.write_config, request)):
                    note(f"wrote {path}")
    return 0


def _model_dir(write_config: str | None, request: Request) -> str:
    return str(Path(write_config or DEFAULT_CONFIG_DIR) / request.model.name)


# The web page (--serve, --html): form fields are the flags without dashes; the answer is what --json
# prints plus each plan's files, computed by the same functions as the terminal's.

PAGE_FLAGS = {
    "model": "--model", "nodes": "--nodes", "method": "--method", "strategy": "--strategy", "offload": "--offload",
    "precision": "--precision", "optimizer": "--optimizer", "lora_r": "--lora-r", "lora_targets": "--lora-targets",
    "micro_batch_size": "--micro-batch-size", "gradient_accumulation_steps": "--gradient-accumulation-steps",
    "seq_len": "--seq-len", "tokens": "--tokens", "host_memory": "--host-memory",
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
    directories = [_model_dir(args.write_config, r) if many else args.write_config or DEFAULT_CONFIG_DIR for r, *_ in results]
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
