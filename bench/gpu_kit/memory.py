"""GPU memory and speed of single-GPU runs on catalog shapes, measured with the real trainer and
set beside the planner's prediction for exactly that run.

    python bench/gpu_kit/memory.py --out DIR [--deadline EPOCH_SECONDS]        # on the GPU (bench/gpu_kit/run.sh)
    python bench/gpu_kit/memory.py --dry-run [--gpu H200] [--limit N]           # the grid and its predictions, no GPU

Each row is `python -m finetune … --max-steps N` on a random-init checkpoint of the catalog shape
(written once per shape, in 16-bit like the published weights, and reused by every row) with text
rows of exactly --max-seq-len tokens; the run's metrics.jsonl gives torch.cuda.max_memory_allocated,
max_memory_reserved and tokens/s (median over the updates after the first). Rows come in priority
order, so the first minutes cover every model and method at short sequences; rows the planner says
do not fit are listed, not run; a time guard stops adding rows when the next would end after the
deadline. Rows the speed model is least sure of on this GPU (shape families never measured on its
chip) run before rows like those already measured (`least_sure_first`). Writes memory.md (a table
with device, date and versions) and memory.csv.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import os
import random
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from forked import RowRunner  # noqa: E402

from finetune.config.run_folder import RunFolder, read_metrics  # noqa: E402
from finetune.models.catalog import get as catalog_model  # noqa: E402
from finetune.plan import gpus as gpu_catalog  # noqa: E402
from finetune.plan.memory import CUDA_CONTEXT_GIB  # noqa: E402
from finetune.plan.params import count_params  # noqa: E402

MODELS = ("llama-3.2-1b", "llama-3.2-3b", "llama-7b", "llama-3.1-8b", "qwen2.5-1.5b", "qwen2.5-7b")
METHODS = ("full", "lora", "qlora")
PRECISION = {"full": "bf16-mixed", "lora": "bf16-true", "qlora": "bf16-true"}  # the planner's defaults on bf16 GPUs
# (seq len, checkpointing, micro batch) in the order rows are worth measuring: the base case of
# every model and method first, then longer sequences, bigger batches and checkpointing.
VARIANTS = ((512, False, 1), (2048, False, 1), (512, False, 4), (2048, True, 4),
            (2048, True, 1), (512, True, 1), (2048, False, 4), (512, True, 4))
STEPS = 4  # optimizer updates per row; the first is warm-up (allocator growth, kernel selection)
DATA_ROWS = 64
# Seconds a row costs (data, loading the weights from the page cache, moving them to the GPU, the
# steps; and, for a row as its own process, the interpreter and imports), fixed and per billion
# parameters: the time guard's first guess, replaced by each model's measured time once it has run.
# The fixed part was measured on subprocess rows (H100, 2026-11-25); forked rows should need less.
# Writing a shape's random-init checkpoint once costs about WRITE_SECONDS_PER_B more, and 2 bytes
# per parameter of disk.
ROW_SECONDS_FIXED, ROW_SECONDS_PER_B, WRITE_SECONDS_PER_B = 25.0, 8.0, 4.0
DEFAULT_WORK = Path(os.environ.get("TMPDIR", "/tmp")) / "finetune-gpu-memory"  # also throughput.py's: checkpoints are reused


@dataclass(frozen=True)
class Row:
    model: str
    method: str
    seq_len: int
    gradient_checkpointing: bool
    micro_batch_size: int

    @property
    def precision(self) -> str:
        return PRECISION[self.method]

    @property
    def label(self) -> str:
        ckpt = "ckpt" if self.gradient_checkpointing else "no-ckpt"
        return f"{self.model}-{self.method}-s{self.seq_len}-b{self.micro_batch_size}-{ckpt}"

    def train_flags(self, model_dir: Path | str, data: Path | str, output_dir: Path | str, steps: int = STEPS) -> list[str]:
        """The trainer's flags for this row (also what `finetune --dry-run` takes)."""
        return ["--model", str(model_dir), "--method", self.method, "--precision", self.precision,
                "--micro-batch-size", str(self.micro_batch_size), "--gradient-accumulation-steps", "1",
                "--max-seq-len", str(self.seq_len),
                "--gradient-checkpointing" if self.gradient_checkpointing else "--no-gradient-checkpointing",
                "--optimizer", "adamw", "--lora-r", "16", "--lora-targets", "all-linear",
                "--no-liger", "--no-compile",  # Liger pinned off (defaults.py and throughput.py measure it), eager
                "--dataset", str(data), "--format", "text", "--eval-split", "0.05", "--max-eval-examples", "1",
                "--max-steps", str(steps), "--warmup-steps", "0", "--lr-schedule", "constant", "--log-every", "1",
                "--no-save-final", "--num-samples", "0", "--seed", "0", "--output-dir", str(output_dir)]


def grid(models=MODELS, methods=METHODS) -> list[Row]:
    return [Row(model, method, seq, ckpt, micro) for seq, ckpt, micro in VARIANTS for model in models for method in methods]


def least_sure_first(rows: list[Row], gpu: str) -> list[Row]:
    """The rows whose planned speed the fit is least sure of on `gpu` first (the widest likely range:
    shape families never measured on its chip before measured ones, plan/speed_range.py); rows
    equally sure keep their order."""
    from finetune.plan.speed import CALIBRATION
    from finetune.plan.speed_range import speed_range
    from finetune.plan.workload import Workload

    spec = gpu_catalog.get(gpu)

    def width(row: Row) -> float:
        w = Workload(model=catalog_model(row.model), gpu=spec, gpus_per_node=1, method=row.method, strategy="single",
                     offload="none", precision=row.precision, optimizer="adamw", micro_batch_size=row.micro_batch_size,
                     seq_len=row.seq_len, gradient_checkpointing=row.gradient_checkpointing)
        likely = speed_range(w, CALIBRATION.chips)
        return likely.high / likely.low

    return sorted(rows, key=width, reverse=True)


def predict(row: Row, gpu: str, data: Path | str, output_dir: Path | str) -> dict:
    """What `finetune --dry-run --json` prints as plans[0] for the row's training flags (without
    building the model): the planner's prediction for exactly the run those flags resolve to on
    `gpu`. The catalog name stands in for the random-init checkpoint of the same shape."""
    from finetune.config.flags import parse_config
    from finetune.config.resolve import Device, Launch, resolve_run
    from finetune.plan.report import plan_dict
    from finetune.train.dry_run import plan_run

    spec = gpu_catalog.get(gpu)
    run = resolve_run(parse_config(row.train_flags(row.model, data, output_dir)), Launch(),
                      Device(cuda=True, name=spec.name, bf16=spec.bf16))
    return plan_dict(plan_run(run, spec)[1], None, ".")


def write_text_data(path: Path, seq_len: int, rows: int = DATA_ROWS) -> Path:
    """`text` rows longer than the sequence, so every training row is exactly --max-seq-len tokens
    (the builtin tokenizer has one token per character)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        draw = random.Random(0)
        letters = "abcdefghijklmnopqrstuvwxyz     "
        path.write_text("".join(json.dumps({"text": "".join(draw.choice(letters) for _ in range(seq_len + 16))}) + "\n"
                                for _ in range(rows)))
    return path


def checkpoint_name(model: str, layers: int | None = None) -> str:
    """A random-init checkpoint's folder: the catalog name, or `<name>-<N>-layers` for a cut to N decoder layers."""
    return model if layers is None else f"{model}-{layers}-layers"


def random_checkpoint(model: str, cache: Path, timeout_s: float, runner: RowRunner | None = None,
                      layers: int | None = None) -> Path:
    """A random-init checkpoint of the catalog shape in bf16 (with `layers`: cut to its first `layers`
    decoder layers at full width), built on the GPU (where there is one) in a child process (this
    process stays without a CUDA context, so rows see the whole GPU), forked where `runner` forks."""
    directory = cache / checkpoint_name(model, layers)
    if not (directory / "config.json").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        spec = catalog_model(model)
        needed = 2 * count_params(replace(spec, num_layers=layers or spec.num_layers)).total * 1.05
        if shutil.disk_usage(cache).free < needed:
            raise OSError(f"{needed / 2**30:.0f} GiB of disk needed for the random-init {directory.name} in {cache}")
        code = ("import sys, torch; from dataclasses import replace; from pathlib import Path; "
                "from finetune.train.loading import materialize_random_init; from finetune.models.catalog import get; "
                "spec = get(sys.argv[1]); spec = replace(spec, num_layers=int(sys.argv[3])) if sys.argv[3] else spec; "
                "materialize_random_init(spec, Path(sys.argv[2]), seed=0, dtype=torch.bfloat16, "
                "device='cuda' if torch.cuda.is_available() else 'cpu')")
        written = (runner or RowRunner(fork=False)).run(["-c", code, model, str(directory), str(layers or "")],
                                                        cache / f"{directory.name}.log", timeout_s)
        if written["status"] != "ok":
            raise OSError(f"writing the random-init {directory.name} ended with {written['status']}: {written.get('error', '')}")
    return directory


def measure(row: Row, model_dir: Path, data: Path, output_dir: Path, timeout_s: float, runner: RowRunner) -> dict:
    """Run the trainer for the row; peaks and tokens/s from its metrics.jsonl, or why it failed."""
    shutil.rmtree(output_dir, ignore_errors=True)
    output_dir.mkdir(parents=True)
    result = runner.run(["-m", "finetune", *row.train_flags(model_dir, data, output_dir)], output_dir / "run.log", timeout_s)
    if result["status"] != "ok":
        return result
    return result | metrics_summary(output_dir)


def metrics_summary(output_dir: Path) -> dict:
    """A finished finetune run's peaks, tokens/s (median over the updates after the first: the first
    grows the allocator and picks kernels), compile seconds and losses, from its metrics.jsonl."""
    records = read_metrics(RunFolder(output_dir).metrics)  # raises when the run wrote none
    steps = [r for r in records if "loss" in r]
    return {"allocated_gib": steps[-1]["peak_gpu_allocated_gib"], "reserved_gib": steps[-1]["peak_gpu_reserved_gib"],
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in steps[1:]),
            "compile_seconds": steps[-1].get("compile_seconds", 0.0), "losses": [round(r["loss"], 4) for r in steps]}


def row_estimate(row: Row, seen: dict[str, float]) -> float:
    """Seconds the row should take: the model's last measured row, else the first guess with the
    checkpoint's writing."""
    if row.model in seen:
        return seen[row.model]
    billions = count_params(catalog_model(row.model)).total / 1e9
    return ROW_SECONDS_FIXED + (ROW_SECONDS_PER_B + WRITE_SECONDS_PER_B) * billions


def run_grid(rows: list[Row], gpu: str, capacity_gib: float, work: Path, deadline: float | None, dry_run: bool,
             runner: RowRunner) -> list[dict]:
    """Predict and measure the rows in order, skipping those the planner says do not fit. A row
    whose estimated time would end after the deadline is listed without a prediction (predicting
    costs seconds too); later, cheaper rows may still run."""
    results, seconds_per_model = [], {}
    for row in rows:
        data, model_dir, output_dir = work / f"data-{row.seq_len}.jsonl", work / "random-init" / row.model, work / "runs" / row.label
        result = {**asdict(row), "precision": row.precision}
        started = time.monotonic()
        if deadline is not None and time.time() + row_estimate(row, seconds_per_model) > deadline:
            result["status"] = "not run: time"
        else:
            result |= planned(predict(row, gpu, data, output_dir))
            if result["predicted_device_gib"] > capacity_gib:
                result["status"] = f"skipped: predicted {result['predicted_device_gib']:.1f} > {capacity_gib:.1f} GiB"
            elif dry_run:
                result |= {"status": "dry run", "command": " ".join(["python -m finetune", *row.train_flags(model_dir, data, output_dir)])}
            else:
                result |= measured(row, work, data, output_dir, deadline, runner)
                seconds_per_model[row.model] = time.monotonic() - started
        print(summary_line(result), flush=True)
        results.append(result)
    return results


def planned(plan: dict) -> dict:
    """The planner's numbers for a row, named as the measurements are."""
    memory = plan["memory_per_gpu_gib"]
    return {"predicted_allocated_gib": memory["allocated"], "predicted_reserved_gib": round(memory["device"] - CUDA_CONTEXT_GIB, 3),
            "predicted_device_gib": memory["device"], "predicted_tokens_per_second": plan["tokens_per_second"]}


def measured(row: Row, work: Path, data: Path, output_dir: Path, deadline: float | None, runner: RowRunner) -> dict:
    """Write the row's data and checkpoint if needed, run it, and compare with the prediction."""
    write_text_data(data, row.seq_len)
    try:
        checkpoint = random_checkpoint(row.model, work / "random-init", (deadline - time.time()) if deadline else 3600.0, runner)
    except OSError as e:
        return {"status": f"no checkpoint: {type(e).__name__}", "error": str(e)[:300]}
    return measure(row, checkpoint, data, output_dir, (deadline - time.time()) if deadline else 3600.0, runner)


def summary_line(r: dict) -> str:
    checkpointing = "y" if r["gradient_checkpointing"] else "n"
    row = f"{r['model']:<13} {r['method']:<5} seq {r['seq_len']:<4} mbs {r['micro_batch_size']} ckpt {checkpointing}"
    if "predicted_allocated_gib" not in r:
        return f"{row}  [{r['status']}]"
    predicted = f"predicted {r['predicted_allocated_gib']:6.2f} GiB alloc, {r['predicted_tokens_per_second']:>9,.0f} tok/s"
    if r["status"] != "ok":
        return f"{row}  {predicted}  [{r['status']}]" + (f" {r['error']}" if r.get("error") else "")
    return (f"{row}  {predicted}  measured {r['allocated_gib']:6.2f} GiB alloc ({error(r, 'allocated'):+.1%}), "
            f"{r['reserved_gib']:6.2f} reserved, {r['tokens_per_second']:>9,.0f} tok/s, {r['seconds']:.0f} s")


def error(r: dict, quantity: str) -> float:
    """Planner over measurement, minus one: + means the planner predicts more than was measured."""
    return r[f"predicted_{quantity}_gib"] / r[f"{quantity}_gib"] - 1


CSV_FIELDS = ("model", "method", "precision", "seq_len", "micro_batch_size", "gradient_checkpointing", "status",
              "allocated_gib", "predicted_allocated_gib", "allocated_error", "reserved_gib", "predicted_reserved_gib",
              "reserved_error", "tokens_per_second", "predicted_tokens_per_second", "seconds")


def write_results(results: list[dict], out: Path, header: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "memory.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({**r, **({"allocated_error": round(error(r, "allocated"), 4), "reserved_error": round(error(r, "reserved"), 4)}
                                  if r["status"] == "ok" else {})} for r in results)
    lines = [header, "", "| model | method | precision | seq | mbs | ckpt | allocated GiB (measured / planner) | error | "
             "reserved GiB (measured / planner) | tokens/s (measured / planner) | status |", "|" + "---|" * 11]
    for r in results:
        ok = r["status"] == "ok"

        def pair(measured_key: str, predicted_key: str, form: str, r: dict = r, ok: bool = ok) -> str:
            got = format(r[measured_key], form) if ok else "–"
            return f"{got} / {format(r[predicted_key], form)}" if predicted_key in r else got

        lines.append(f"| {r['model']} | {r['method']} | {r['precision']} | {r['seq_len']} | {r['micro_batch_size']} | "
                     f"{'yes' if r['gradient_checkpointing'] else 'no'} | {pair('allocated_gib', 'predicted_allocated_gib', '.2f')} | "
                     f"{format(error(r, 'allocated'), '+.1%') if ok else ''} | {pair('reserved_gib', 'predicted_reserved_gib', '.2f')} | "
                     f"{pair('tokens_per_second', 'predicted_tokens_per_second', ',.0f')} | {r['status']} |")
    (out / "memory.md").write_text("\n".join(lines) + "\n")


def device_description(gpu: str | None) -> tuple[str, float, str]:
    """(catalog GPU name, capacity in GiB, a description) of GPU 0, or of `gpu` on a dry run."""
    if gpu is not None:
        spec = gpu_catalog.get(gpu)
        return spec.name, spec.memory_gib, f"{spec.name} (catalog, dry run)"
    import torch

    props = torch.cuda.get_device_properties(0)
    capacity = props.total_memory / 2**30
    spec = gpu_catalog.identify(props.name, capacity)
    if spec is None:
        raise SystemExit(f"{props.name} is not in the GPU catalog (finetune/plan/gpus.py): add it, or pass --gpu")
    versions = ", ".join(f"{name} {metadata.version(name)}" for name in ("torch", "transformers", "accelerate", "peft", "bitsandbytes"))
    return spec.name, capacity, f"{props.name} ({capacity:.1f} GiB, CUDA {torch.version.cuda}; {versions})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "output" / "gpu-kit",
                        help="where memory.md and memory.csv go (default: output/gpu-kit, which git ignores)")
    parser.add_argument("--work", type=Path, help="scratch: random-init checkpoints, data, runs (default: a temporary dir)")
    parser.add_argument("--deadline", type=float, help="epoch seconds after which no row may still run")
    parser.add_argument("--dry-run", action="store_true", help="list the grid with predictions, run nothing (no GPU needed)")
    parser.add_argument("--gpu", help="catalog GPU to predict for (default: GPU 0; a dry run without one: H200)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--rows", help="only rows whose label matches one of these globs, comma-separated (labels: "
                        "MODEL-METHOD-sSEQ-bMICRO-ckpt|no-ckpt, e.g. 'qwen2.5-7b-*' or '*-qlora-s2048-*')")
    parser.add_argument("--limit", type=int, help="only the first N rows of the grid")
    parser.add_argument("--no-fork", action="store_true",
                        help="each row as its own `python -m finetune` (as users run it) instead of forked from a preloaded server")
    args = parser.parse_args(argv)
    if args.dry_run and args.gpu is None:
        args.gpu = "H200"  # the GPU lent now; the H100's rows of 2026-11-25 stay in finetune/plan/calibration/measured/
    gpu, capacity, device = device_description(args.gpu)
    rows = [row for row in least_sure_first(grid(args.models.split(","), args.methods.split(",")), gpu)
            if args.rows is None or any(fnmatch.fnmatchcase(row.label, glob) for glob in args.rows.split(","))][: args.limit]
    if not rows:
        parser.error(f"--rows {args.rows!r} matches no row of the grid")
    work = args.work or DEFAULT_WORK
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{len(rows)} rows on {device}", flush=True)
    results = run_grid(rows, gpu, capacity, work, args.deadline, args.dry_run, RowRunner(fork=not args.no_fork))
    command = "python bench/gpu_kit/memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"GPU memory and speed, measured vs planned: {device}; {started}; `{command}`; {STEPS} updates per row "
              f"(tokens/s: median after the first), random-init weights, text rows of exactly seq tokens. "
              f"Planner: what `finetune --dry-run --json` plans for each row's training flags.")
    write_results(results, args.out, header)
    commands = [r["command"] for r in results if "command" in r]
    if commands:
        print(f"each row runs, e.g.: {commands[0]}")
    print(f"wrote {args.out / 'memory.md'} and {args.out / 'memory.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
