"""finetune vs TRL SFTTrainer (± Liger) vs a bare PEFT loop, one shape, one GPU, one command.

    python bench/gpu/throughput.py --dry-run                       # the rows and their planned tokens/s, no GPU
    python bench/gpu/throughput.py --out DIR [--model mistral-7b] [--method lora] [--seq-len 4096] [--micro-batch-size 2]

The shape of issue 15's goal by default: a random-init Mistral-7B, LoRA r16 on all linear layers,
bf16 base, gradient checkpointing, rows of exactly --seq-len tokens. Each row runs in its own process
(so one row's allocator state and compiled graphs do not help the next), for --steps updates; its
tokens/s is the median update after the first (compile time, if any, is in the first and reported
apart as first-update seconds), with torch.cuda.max_memory_allocated/reserved. Writes
DIR/throughput.csv and prints a table. trl and liger-kernel are pure Python: carry their wheels in
bench/gpu/wheels.

Not yet run on a GPU: no GPU was lent to the session that wrote it (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from finetune.models import catalog  # noqa: E402
from finetune.plan import gpus  # noqa: E402
from finetune.plan.speed import estimate_speed  # noqa: E402
from finetune.plan.workload import Workload  # noqa: E402


@dataclass(frozen=True)
class Row:
    name: str
    program: str  # "finetune", "trl" or "peft-loop"
    liger: bool = False
    compile: bool = False


ROWS = (
    Row("finetune", "finetune"),
    Row("finetune --liger", "finetune", liger=True),
    Row("finetune --compile", "finetune", compile=True),
    Row("finetune --liger --compile", "finetune", liger=True, compile=True),
    Row("TRL SFTTrainer", "trl"),
    Row("TRL SFTTrainer use_liger_kernel", "trl", liger=True),
    Row("bare PEFT loop, fused AdamW", "peft-loop"),
)


def planned(row: Row, args: argparse.Namespace) -> float | None:
    """finetune's planned tokens/s for the row (the planner plans finetune, not the others)."""
    if row.program != "finetune":
        return None
    w = Workload(model=catalog.get(args.model), gpu=gpus.get(args.gpu), gpus_per_node=1, method=args.method,
                 strategy="single", offload="none", precision="bf16-true", optimizer="adamw",
                 micro_batch_size=args.micro_batch_size, seq_len=args.seq_len, gradient_checkpointing=True,
                 loss="liger" if row.liger else "transformers", compile=row.compile, fused_optimizer=True)
    return estimate_speed(w).tokens_per_second


def finetune_command(row: Row, args: argparse.Namespace, checkpoint: Path, data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "finetune", "--model", str(checkpoint), "--method", args.method, "--precision",
            "bf16-true", "--gradient-checkpointing", "--dataset", str(data), "--format", "text", "--max-seq-len",
            str(args.seq_len), "--micro-batch-size", str(args.micro_batch_size), "--max-steps", str(args.steps),
            "--log-every", "1", "--max-eval-examples", "0", "--num-samples", "0", "--no-save-final",
            "--liger" if row.liger else "--no-liger", "--compile" if row.compile else "--no-compile",
            "--output-dir", str(out)]


def dry_run(args: argparse.Namespace) -> None:
    print(f"{args.model} {args.method} r16 all-linear, bf16, checkpointing, seq {args.seq_len}, micro batch "
          f"{args.micro_batch_size}, {args.steps} updates per row, on {args.gpu}:")
    for row in ROWS:
        rate = planned(row, args)
        plan = f"planned {rate:,.0f} tok/s" if rate else "not planned (another program)"
        print(f"  {row.name:<34} {row.program:<10} liger={'on' if row.liger else 'off':<4}"
              f"compile={'on' if row.compile else 'off':<4} {plan}")


def text_rows(tokens: int, path: Path) -> Path:
    """Rows of at least `tokens` tokens of plain words, truncated to exactly --seq-len by each program."""
    words = " ".join(f"w{i % 997}" for i in range(tokens))
    path.write_text("".join(json.dumps({"text": words}) + "\n" for _ in range(64)))
    return path


def finetune_row(row: Row, args, checkpoint: Path, data: Path, out: Path) -> dict:
    subprocess.run(finetune_command(row, args, checkpoint, data, out), check=True, timeout=args.row_timeout)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    return {"tokens_per_second": statistics.median(r["tokens_per_second"] for r in steps[1:]),
            "allocated_gib": steps[-1].get("peak_gpu_allocated_gib"), "reserved_gib": steps[-1].get("peak_gpu_reserved_gib")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the rows and finetune's planned tokens/s")
    parser.add_argument("--out", type=Path, help="where throughput.csv goes (a GPU run)")
    parser.add_argument("--model", default="mistral-7b")
    parser.add_argument("--method", default="lora", choices=("lora", "qlora"))
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--gpu", default="H100-80GB", help="GPU class the plan column is for")
    parser.add_argument("--row-timeout", type=float, default=300)
    args = parser.parse_args(argv)
    if args.dry_run:
        dry_run(args)
        return 0
    if args.out is None:
        parser.error("--out DIR is needed for a GPU run (or --dry-run)")
    return run_rows(args)


def run_rows(args: argparse.Namespace) -> int:
    """Every row on this GPU. TRL and the bare PEFT loop rows are not written yet: they are listed
    as such in throughput.csv rather than measured by a stand-in."""
    sys.path.insert(0, str(Path(__file__).parent))
    from memory import random_checkpoint  # the kit's random-init checkpoint of a catalog shape

    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint = random_checkpoint(args.model, args.out / "random-init", timeout_s=900)
    data = text_rows(args.seq_len, args.out / "rows.jsonl")
    results = []
    for row in ROWS:
        started = time.perf_counter()
        measured = {"status": "not written yet"}
        if row.program == "finetune":
            measured = finetune_row(row, args, checkpoint, data, args.out / row.name.replace(" ", "_")) | {"status": "ok"}
        results.append({"row": row.name, "planned_tokens_per_second": planned(row, args), **measured,
                        "seconds": round(time.perf_counter() - started, 1)})
        print(results[-1], flush=True)
    with open(args.out / "throughput.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, sorted({k for r in results for k in r}))
        writer.writeheader()
        writer.writerows(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
