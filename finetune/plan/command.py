"""`finetune plan [QUERY] [flags]`: what fits, how fast, what it costs, and how to launch it.

Imports no torch, transformers or accelerate unless --simulate asks for a simulated step.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import fields
from pathlib import Path

from finetune.plan import gpus as gpu_catalog
from finetune.models import catalog as model_catalog
from finetune.errors import FinetuneError
from finetune.plan import report
from finetune.plan.choose import Request, plan
from finetune.plan.files import DEFAULT_CONFIG_DIR, write_configs
from finetune.models.source import resolve_model
from finetune.plan.query import parse_gpus, parse_query
from finetune.config.names import METHODS, OFFLOADS, OPTIMIZERS, PRECISIONS, STRATEGIES

# Sequence length when neither the query nor --seq-len gives one (capped by the model's context).
DEFAULT_SEQ_LEN = 2048


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
    parser.add_argument("--lora-targets", help="all-linear (default) or a comma list such as q_proj,v_proj")
    parser.add_argument("--micro-batch-size", type=int, help="default: the largest that fits")
    parser.add_argument("--gradient-accumulation-steps", type=int, help="micro-batches per update (default 1)")
    parser.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {DEFAULT_SEQ_LEN})")
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="default: only when needed to fit")
    parser.add_argument("--tokens", type=float, help="training tokens, for hours and cost (e.g. 1e9)")
    parser.add_argument("--host-memory", metavar="GiB|local",
                        help="host RAM per node a plan may use (default: what the GPU's usual cloud instance has; "
                        "local: this machine's)")
    parser.add_argument("--json", action="store_true", help="print the plans as JSON")
    parser.add_argument("--png", metavar="FILE", help="draw per-GPU memory per plan as a stacked bar chart")
    parser.add_argument("--write-config", metavar="DIR", help="write the recommended plan's accelerate YAML (and DeepSpeed JSON)")
    parser.add_argument("--simulate", action="store_true",
                        help="also run the recommended plan's launch command for two steps on fake tensors, through the "
                        "trainer's own model and optimizer construction, and compare memory (needs torch)")
    return parser


def build_request(args: argparse.Namespace) -> Request | list[Request]:
    """Query fields, overridden by flags. Without a model, one request per catalog model."""
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
        spec = resolve_model(name)
        seq_len = fields_from_query.get("seq_len")
        seq_len = min(DEFAULT_SEQ_LEN, spec.max_position_embeddings) if seq_len is None else seq_len
        return Request(model=spec, **{**fields_from_query, "seq_len": seq_len})

    if "model" in fields_from_query:
        return request_for(fields_from_query.pop("model"))
    return [request_for(name) for name in model_catalog.MODELS if name != "tiny"]


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
        meminfo = Path("/proc/meminfo")
        if not meminfo.is_file():
            raise FinetuneError("--host-memory local reads /proc/meminfo, which this system lacks; give a number of GiB.")
        total_kib = next(int(line.split()[1]) for line in meminfo.read_text().splitlines() if line.startswith("MemTotal:"))
        return total_kib / 2**20
    try:
        return float(text)
    except ValueError:
        raise FinetuneError(f"--host-memory {text!r}: give GiB per node (e.g. 512) or `local`.") from None


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
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
    except OSError as e:
        raise FinetuneError(f"Cannot write {e.filename or args.write_config or args.png}: {e.strerror or e}.") from e
    if recommended is not None and not args.write_config:
        note(files_hint(argv, config_dir))
    if args.simulate:
        chosen = plans[recommended] if recommended is not None else plans[0]
        note(simulation_text(chosen))
    return 0


def files_hint(argv: list[str], config_dir: str) -> str:
    """The launch command reads files this run of `plan` did not write; the command that writes them."""
    command = shlex.join(["finetune", "plan", *argv, "--write-config", config_dir])
    return f"The launch command reads {config_dir}/; write its files first with: {command}"


def note(text: str) -> None:
    """Messages beside the plan go to stderr, so `--json` output stays machine-readable."""
    print(text, file=sys.stderr)


def simulation_text(chosen) -> str:
    """Two fake-tensor steps of the plan's launch command, built as the trainer builds it."""
    import tempfile

    from finetune.train import simulate
    from finetune.train.dry_run import run_of_plan  # imports torch

    with tempfile.TemporaryDirectory(prefix="finetune-simulate-") as workdir:
        write_configs(chosen, workdir)
        run = run_of_plan(chosen, workdir, workdir)
        return simulate.compare_text(run, chosen.workload)


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
