"""`finetune export CHECKPOINT_OR_OUTPUT_DIR --out DIR [--merge-lora] [--dtype bf16|fp16|fp32] [--format gguf]`.

The command line of export: safetensors.py writes a Hugging Face folder (or a PEFT adapter), gguf.py one
llama.cpp file, card.py the README.md model card, hub.py the upload (checked before anything is written).
"""

from __future__ import annotations

import argparse

from finetune.errors import FinetuneError
from finetune.export import hub
from finetune.export.gguf import GGUF_TYPES, export_gguf
from finetune.export.safetensors import DTYPES, export
from finetune.export.trained import find_trained
from finetune.library_logs import quiet_libraries, quiet_transformers_bars


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetune export",
        description="Export a training checkpoint to a Hugging Face folder (sharded safetensors + config + "
        "tokenizer), or a LoRA/QLoRA checkpoint to a PEFT adapter (merged into the base with --merge-lora), or to "
        "one GGUF file (--format gguf); with a README.md model card.",
    )
    parser.add_argument("checkpoint", help="A checkpoint folder (…/checkpoints/step-000200) or an output dir "
                        "(its final model, or its newest complete checkpoint if that is newer).")
    parser.add_argument("--out", required=True, help="Folder to write; must be new or empty.")
    parser.add_argument("--merge-lora", action="store_true", help="Merge LoRA/QLoRA adapters into the base weights.")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="Weights dtype (default: the model config's dtype).")
    parser.add_argument("--max-shard-size", help="Largest safetensors file, e.g. 5GB or 500MB (default 5GB; "
                        "a smaller model is one model.safetensors; larger ones are numbered shards + index).")
    parser.add_argument("--format", choices=("safetensors", "gguf"), default="safetensors",
                        help="safetensors: a Hugging Face folder; gguf: one llama.cpp file (Llama-family models with a "
                        "byte-level BPE tokenizer; LoRA is merged first).")
    parser.add_argument("--gguf-type", choices=GGUF_TYPES, help="Tensor type of --format gguf (default f16; "
                        "norms stay f32; q8_0 keeps f16 for rows not a multiple of 32).")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="Upload the export to this Hugging Face Hub repo "
                        "(created if missing; checked before anything is written).")
    parser.add_argument("--verbose", action="store_true", help="Also show the libraries' own logs and warnings.")
    return parser


# flags that only one --format reads: given with the other, they would do nothing
SAFETENSORS_ONLY = ("merge_lora", "dtype", "max_shard_size")
GGUF_ONLY = ("gguf_type",)


class ExportFlagError(FinetuneError):
    """A flag that cannot apply to this export: refused rather than silently ignored."""


def check_flags(args: argparse.Namespace) -> None:
    """Every given flag must apply to the chosen --format (see SAFETENSORS_ONLY, GGUF_ONLY)."""
    def given(names):
        return ", ".join(f"--{name.replace('_', '-')}" for name in names if getattr(args, name) not in (None, False))

    if args.format == "gguf" and given(SAFETENSORS_ONLY):
        raise ExportFlagError(f"{given(SAFETENSORS_ONLY)}: not used by --format gguf, which writes one file with LoRA "
                              "always merged and its tensor type from --gguf-type; drop the flag or use --format safetensors.")
    if args.format == "safetensors" and given(GGUF_ONLY):
        raise ExportFlagError(f"{given(GGUF_ONLY)}: only --format gguf uses it; add --format gguf or drop the flag.")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_flags(args)
    if not args.verbose:
        quiet_libraries()
        quiet_transformers_bars()
    if args.push_to_hub:
        hub.check_can_push(args.push_to_hub)
    if args.format == "gguf":
        out = export_gguf(args.checkpoint, args.out, args.gguf_type or "f16")
    else:
        out = export(args.checkpoint, args.out, merge_lora=args.merge_lora, dtype=args.dtype,
                     max_shard_size=args.max_shard_size)
    files = sorted(p.name for p in out.iterdir())
    print(f"exported {find_trained(args.checkpoint).path} → {out}: {', '.join(files)}")
    if args.push_to_hub:
        print(f"uploaded to {hub.push(out, args.push_to_hub)}")
    return 0
