"""The flags of `finetune plan` and the Request they ask for: one parser for the terminal (cli/plan.py)
and the web page (cli/plan_page.py), which turns its form fields into the same flags.

Torch-free, like the planner.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

from finetune.config.names import METHODS, OFFLOADS, OPTIMIZERS, PRECISIONS, STRATEGIES
from finetune.errors import FinetuneError
from finetune.models import catalog as model_catalog
from finetune.models.catalog import ModelSpec
from finetune.models.source import resolve_model
from finetune.plan import gpus as gpu_catalog
from finetune.plan.choose import PARTIAL_CHECKPOINTING_HEADROOM, Request
from finetune.plan.files import DEFAULT_CONFIG_DIR
from finetune.plan.parallel import CP_MIN_SEQ_LEN
from finetune.plan.query import parse_gpus, parse_query

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
                        "the trainer decides it (on for LoRA/QLoRA and under --tp, not with Liger, ZeRO-3 or LoRA on lm_head)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="plan with regional compilation of the decoder blocks (less per-layer overhead); default off")
    parser.add_argument("--fp8", action="store_true", default=None,
                        help="plan LoRA with its frozen base's matmuls in float8 (twice the bf16 rate on GPUs with FP8 "
                        "tensor cores; a float8 copy of each base weight); LoRA on one GPU or DDP only; default off")
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
    return [request_for(name) for name in model_catalog.REAL_MODELS]


def split_into_nodes(request_fields: dict) -> None:
    """More GPUs than one host holds, with no --nodes: plan them as nodes of the GPU's usual host
    (and say so), not as one impossible node with all their host RAM."""
    gpu, count = request_fields["gpu"], request_fields["gpus_per_node"]
    usual = gpu_catalog.usual_gpus_per_node(gpu.speed_of or gpu.name)
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


def note(text: str) -> None:
    """Messages beside the plan go to stderr, so `--json` output stays machine-readable."""
    print(text, file=sys.stderr)


def model_dir(write_config: str | None, request: Request) -> str:
    """Where --write-config puts `request`'s files when several models are planned: a folder per model."""
    return str(Path(write_config or DEFAULT_CONFIG_DIR) / request.model.name)
