"""Tensor- and context-parallel rows of the GPU kit: memory and tokens/s of multi-GPU layouts,
measured with the real trainer and set beside the planner's prediction for exactly that run.

    python bench/gpu_kit/layouts.py --out DIR [--deadline EPOCH_SECONDS]    # on 2+ GPUs (bench/gpu_kit/run.sh, KIT_STEPS=layouts)
    python bench/gpu_kit/layouts.py --dry-run [--gpu H100-80GB] [--gpus 8]   # the rows and their predictions, no GPU

Each row is `accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes N -m finetune
… [--tp T | --cp C]` on memory.py's random-init checkpoint of the shape and its text rows of exactly
--max-seq-len tokens. Every TP or CP row follows the same shape on the same GPUs with FSDP2 alone,
so each layout is measured beside what it replaces (where that fits). Rank 0's metrics.jsonl gives
torch.cuda.max_memory_allocated / reserved and tokens/s (median after the first update). Rows that
need more GPUs than the machine has, or that the planner says do not fit, are listed, not run; a
time guard stops adding rows past the deadline. Writes layouts.md and layouts.csv.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import memory  # noqa: E402
from forked import run_logged  # noqa: E402

FSDP_CONFIG = REPO / "accelerate_configs" / "fsdp.yaml"
# LoRA under TP adapts the column-parallel linears only (finetune/config/parallelism.py)
COLUMN_TARGETS = "q_proj,k_proj,v_proj,gate_proj,up_proj"


@dataclass(frozen=True)
class LayoutRow:
    model: str
    method: str
    seq_len: int
    gradient_checkpointing: bool
    gpus: int
    tp: int = 1
    cp: int = 1

    @property
    def shape(self) -> memory.Row:
        return memory.Row(self.model, self.method, self.seq_len, self.gradient_checkpointing, 1)

    @property
    def label(self) -> str:
        layout = f"tp{self.tp}" if self.tp > 1 else f"cp{self.cp}" if self.cp > 1 else "fsdp"
        return f"{self.shape.label}-{self.gpus}gpu-{layout}"

    def train_flags(self, model_dir, data, output_dir) -> list[str]:
        flags = self.shape.train_flags(model_dir, data, output_dir)
        if self.tp > 1:
            flags += ["--tp", str(self.tp)] + (["--lora-targets", COLUMN_TARGETS] if self.method == "lora" else [])
        if self.cp > 1:
            flags += ["--cp", str(self.cp)]
        return flags

    def command(self, model_dir, data, output_dir, port: int) -> list[str]:
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG),
                "--num_processes", str(self.gpus), "--main_process_port", str(port), "-m", "finetune",
                *self.train_flags(model_dir, data, output_dir)]


def fsdp_then(layout: LayoutRow) -> list[LayoutRow]:
    """The layout's shape with FSDP2 alone on the same GPUs, then the layout."""
    return [LayoutRow(layout.model, layout.method, layout.seq_len, layout.gradient_checkpointing, layout.gpus), layout]


# In the order worth measuring on the first machine lent: 2 GPUs first (TP 2, CP 2 on a 1B), then a
# node's 4 and 8 GPUs on an 8B shape (TP inside the node; CP for long rows).
ROWS = [row for layout in (
    LayoutRow("llama-3.2-1b", "full", 2048, False, gpus=2, tp=2),
    LayoutRow("llama-3.2-1b", "lora", 16384, True, gpus=2, cp=2),
    LayoutRow("llama-3.2-1b", "lora", 2048, False, gpus=2, tp=2),
    LayoutRow("llama-3.1-8b", "full", 2048, True, gpus=4, tp=4),
    LayoutRow("llama-3.1-8b", "lora", 32768, True, gpus=4, cp=4),
    LayoutRow("llama-3.1-8b", "full", 4096, True, gpus=8, tp=8),
    LayoutRow("llama-3.1-8b", "lora", 65536, True, gpus=8, cp=8),
) for row in fsdp_then(layout)]


def predict(row: LayoutRow, gpu: str, data: Path | str, output_dir: Path | str) -> dict:
    """What `finetune --dry-run --json` plans for the row's command on `row.gpus` of `gpu`."""
    from finetune.config.flags import parse_config
    from finetune.config.resolve import Device, Launch, resolve_run
    from finetune.plan.report import plan_dict
    from finetune.train.dry_run import plan_run

    spec = memory.gpu_catalog.get(gpu)
    launch = Launch(world_size=row.gpus, fsdp=True, fsdp_cpu_ram_efficient_loading=True)
    run = resolve_run(parse_config(row.train_flags(row.model, data, output_dir)), launch,
                      Device(cuda=True, name=spec.name, bf16=spec.bf16))
    return plan_dict(plan_run(run, spec)[1], None, ".")


def run_rows(rows: list[LayoutRow], gpu: str, capacity_gib: float, gpus_here: int, work: Path, deadline: float | None,
             dry_run: bool) -> list[dict]:
    from finetune.train.accelerator import free_port

    results = []
    for row in rows:
        data, output_dir = work / f"data-{row.seq_len}.jsonl", work / "runs" / row.label
        model_dir = work / "random-init" / row.model
        result = {**asdict(row), "precision": row.shape.precision}
        if row.gpus > gpus_here:
            result["status"] = f"not run: needs {row.gpus} GPUs, {gpus_here} here"
        elif deadline is not None and time.time() + memory.row_estimate(row.shape, {}) > deadline:
            result["status"] = "not run: time"
        else:
            result |= memory.planned(predict(row, gpu, data, output_dir))
            if result["predicted_device_gib"] > capacity_gib:
                result["status"] = f"skipped: predicted {result['predicted_device_gib']:.1f} > {capacity_gib:.1f} GiB"
            elif dry_run:
                result |= {"status": "dry run", "command": " ".join(row.command(model_dir, data, output_dir, 0)[1:])}
            else:
                result |= measure(row, work, data, output_dir, deadline, free_port())
        print(f"{row.label:<48} {result['status']}"
              + (f"  predicted {result['predicted_allocated_gib']:.2f} GiB, {result['predicted_tokens_per_second']:,.0f} tok/s"
                 if "predicted_allocated_gib" in result else "")
              + (f"  measured {result['allocated_gib']:.2f} GiB, {result['tokens_per_second']:,.0f} tok/s"
                 if result["status"] == "ok" else ""), flush=True)
        results.append(result)
    return results


def measure(row: LayoutRow, work: Path, data: Path, output_dir: Path, deadline: float | None, port: int) -> dict:
    """Write the data and the shape's checkpoint if needed, launch the row, read rank 0's metrics."""
    import shutil

    memory.write_text_data(data, row.seq_len)
    timeout = (deadline - time.time()) if deadline else 3600.0
    try:
        checkpoint = memory.random_checkpoint(row.model, work / "random-init", timeout)
    except OSError as e:
        return {"status": f"no checkpoint: {type(e).__name__}", "error": str(e)[:300]}
    shutil.rmtree(output_dir, ignore_errors=True)
    output_dir.mkdir(parents=True)
    result = run_logged(row.command(checkpoint, data, output_dir, port), output_dir / "run.log", deadline - time.time()
                        if deadline else 3600.0)
    return result | memory.metrics_summary(output_dir) if result["status"] == "ok" else result


CSV_FIELDS = ("model", "method", "precision", "seq_len", "gradient_checkpointing", "gpus", "tp", "cp", "status",
              "allocated_gib", "predicted_allocated_gib", "reserved_gib", "predicted_reserved_gib", "tokens_per_second",
              "predicted_tokens_per_second", "seconds")


def write_results(results: list[dict], out: Path, header: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "layouts.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)
    lines = [header, "", "| model | method | seq | ckpt | GPUs | tp | cp | allocated GiB (measured / planner) | "
             "tokens/s (measured / planner) | status |", "|" + "---|" * 10]
    for r in results:
        def pair(measured_key: str, predicted_key: str, form: str, r: dict = r) -> str:
            got = format(r[measured_key], form) if r["status"] == "ok" else "–"
            return f"{got} / {format(r[predicted_key], form)}" if predicted_key in r else got

        lines.append(f"| {r['model']} | {r['method']} | {r['seq_len']} | {'yes' if r['gradient_checkpointing'] else 'no'} | "
                     f"{r['gpus']} | {r['tp']} | {r['cp']} | {pair('allocated_gib', 'predicted_allocated_gib', '.2f')} | "
                     f"{pair('tokens_per_second', 'predicted_tokens_per_second', ',.0f')} | {r['status']} |")
    (out / "layouts.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "output" / "gpu-kit", help="where layouts.md and layouts.csv go")
    parser.add_argument("--work", type=Path, help="scratch: random-init checkpoints, data, runs (default: memory.py's)")
    parser.add_argument("--deadline", type=float, help="epoch seconds after which no row may still run")
    parser.add_argument("--dry-run", action="store_true", help="list the rows with predictions, run nothing (no GPU needed)")
    parser.add_argument("--gpu", help="catalog GPU to predict for (default: GPU 0; H100-80GB with --dry-run)")
    parser.add_argument("--gpus", type=int, help="GPUs the rows may use (default: all this machine has; 8 with --dry-run)")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.gpu, args.gpus = args.gpu or "H100-80GB", args.gpus or 8
    gpu, capacity, device = memory.device_description(args.gpu)
    if args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count()
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{len(ROWS)} layout rows on {args.gpus}× {device}", flush=True)
    results = run_rows(ROWS, gpu, capacity, args.gpus, args.work or memory.DEFAULT_WORK, args.deadline, args.dry_run)
    command = "python bench/gpu_kit/layouts.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(results, args.out, f"TP and CP layouts, measured vs planned: {args.gpus}× {device}; {started}; `{command}`; "
                  f"{memory.STEPS} updates per row, micro batch 1, rank 0's peaks; planner: `finetune --dry-run --json` "
                  "of each row's command on that many GPUs.")
    print(f"wrote {args.out / 'layouts.md'} and {args.out / 'layouts.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
