"""Tokens/s and memory of finetune's plans beside TRL SFTTrainer (± Liger), a bare PEFT loop and a
published run, on one GPU, each beside the planner's prediction for exactly that run.

    python bench/gpu_kit/throughput.py --dry-run [--gpu H200] [--rows first]      # rows, commands, plans; no GPU
    python bench/gpu_kit/throughput.py --out DIR [--logs DIR] [--work DIR] [--deadline EPOCH_SECONDS]
        [--rows all] [--steps 6]

The rows are bench/gpu_kit/rows.py's table (one line each; `--rows` picks ids, globs or the groups
first / rest / all): finetune with the flags `finetune plan` prints for the row's shape on the GPU
found, finetune with flags of its own, TRL's SFTTrainer and a bare PEFT loop (bench/gpu_kit/baselines.py),
on random-init checkpoints of catalog shapes (whole, or cut to a few decoder layers at full width;
memory.py's, written once into --work in bf16) and text rows of exactly the shape's sequence
length. Each row is its own process, forked from a server that has imported the trainer already
(forked.py; --no-fork: a fresh interpreter), so no row inherits another's allocator state or
compiled graphs and none pays the imports; every one runs with the allocator finetune sets for
itself (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the environment sets it). Tokens/s
is the median update after the first (compile time, if any, is in the first and reported apart),
with torch.cuda.max_memory_allocated/reserved of the row's process beside the plan: tokens/s with
its likely range, allocated and device memory. A finetune row whose run is the same as an earlier
row's (the plan chose what another row pins) is not run twice.

A row that cannot run here (no CUDA, trl or a working liger-kernel missing) is "skipped: why"; one
that would start too close to --deadline, or that the deadline stops, "not run: time"; a row past
--row-timeout prints its Python stack into its log and fails. Writes DIR/throughput.csv and
DIR/throughput.md after every row and each row's log into --logs; exits 0 unless a finetune row
failed (a row not run is not a failure) or none could run at all.
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KIT = Path(__file__).resolve().parent
sys.path[:0] = [str(REPO), str(KIT)]

import memory  # noqa: E402  (the kit's random-init checkpoints, text rows and metrics reading)
import rows as table  # noqa: E402
from forked import RowRunner  # noqa: E402
from rows import Row, Shape  # noqa: E402

from finetune.cli import use_expandable_segments  # noqa: E402
from finetune.config.flags import parse_config  # noqa: E402
from finetune.config.resolve import Launch, resolve_run  # noqa: E402
from finetune.config.switches import liger_problem  # noqa: E402
from finetune.errors import FinetuneError  # noqa: E402
from finetune.plan import gpus  # noqa: E402
from finetune.plan.memory import GIB, estimate  # noqa: E402
from finetune.plan.speed import estimate_speed  # noqa: E402
from finetune.plan.workload import Workload, from_run  # noqa: E402
from finetune.train.dry_run import device_of  # noqa: E402

MIN_ROW_SECONDS = 45  # a 7B row forked: 14 GB of weights from the page cache, CUDA's start, the updates
MIN_CUT_SECONDS = 20  # a row on a cut of a few layers: a few GB to load
# the knobs each finetune row sets beyond its plan: plain text rows, nothing evaluated, sampled or saved
RUN_FLAGS = ("--format", "text", "--optimizer", "adamw", "--lr-schedule", "constant", "--warmup-steps", "0", "--log-every", "1",
             "--max-eval-examples", "0", "--num-samples", "0", "--no-save-final", "--seed", "0")
CSV_FIELDS = ("row", "shape", "program", "flags", "status", "tokens_per_second", "planned_tokens_per_second", "planned_low",
              "planned_high", "published_tokens_per_second", "allocated_gib", "planned_allocated_gib", "reserved_gib",
              "planned_device_gib", "planned_fits", "loss", "recomputed_layers", "compile", "allocator", "compile_seconds",
              "first_update_seconds", "seconds", "losses", "error")
VERSIONS = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "liger-kernel")


def checkpoint(shape: Shape, args: argparse.Namespace) -> Path:
    return args.work / "random-init" / shape.name


def data(shape: Shape, args: argparse.Namespace) -> Path:
    """memory.py's text rows of the shape's sequence length (shared with it in --work), or of its examples' length."""
    return args.work / (f"data-{shape.seq_len}.jsonl" if shape.example_len is None else f"data-packed-{shape.example_len}.jsonl")


def run_dir(row: Row, args: argparse.Namespace) -> Path:
    """The row's scratch folder (finetune's metrics.jsonl or baselines.py's result.json, the log)."""
    return args.work / "runs" / f"throughput-{row.id}"


def model_to_plan(shape: Shape, args: argparse.Namespace) -> str:
    """What --model the planner reads for the shape: its catalog name, or for a cut a folder with the
    cut's config.json (written here, without weights)."""
    if shape.layers is None:
        return shape.model
    folder = args.work / "shapes" / shape.name
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(shape.spec.to_hf_config_dict()))
    return str(folder)


def finetune_args(row: Row, args: argparse.Namespace, model: str, output_dir: Path) -> list[str]:
    """`python -m finetune`'s flags for the row, on `model` (the checkpoint, or what the planner reads)."""
    return ["--model", model, "--dataset", str(data(row.shape, args)), *table.finetune_flags(row, args.gpu_spec),
            *RUN_FLAGS, "--max-steps", str(args.steps), "--output-dir", str(output_dir)]


def workload(row: Row, args: argparse.Namespace) -> Workload:
    """The planner's view of a finetune row on --gpu: its flags resolved as on that GPU and translated
    by from_run; Liger's loss for a row that asks for Liger (it runs only where Liger can)."""
    config = parse_config(finetune_args(row, args, model_to_plan(row.shape, args), run_dir(row, args)))
    w = from_run(resolve_run(config, Launch(), device_of(args.gpu_spec)), args.gpu_spec)
    return replace(w, loss="liger") if row.liger else w


@functools.cache
def refusal(row: Row, gpu: gpus.GPUSpec, work: Path) -> str | None:
    """Why finetune or its planner refuses a finetune row on `gpu` (--fp8 below compute capability
    8.9, say), in one line, or None."""
    if row.program != "finetune":
        return None
    args = argparse.Namespace(gpu_spec=gpu, work=work, steps=2)
    try:
        workload(row, args)
    except FinetuneError as e:
        return " ".join(line.strip().removeprefix("- ") for line in str(e).splitlines() if line.strip())
    return None


def planned(row: Row, args: argparse.Namespace) -> dict:
    """The plan's columns for a finetune row (the planner plans finetune, not the others; nothing
    for a row it refuses) and the published run beside any row."""
    fields = {"published_tokens_per_second": row.published.tokens_per_second if row.published else None}
    if row.program != "finetune" or refusal(row, args.gpu_spec, args.work):
        return fields | {"planned_tokens_per_second": None}
    w = workload(row, args)
    memory_plan, speed = estimate(w), estimate_speed(w)
    fits = table.best_plan(row.shape, row.plan, args.gpu_spec)[1] if row.plan is not None else None
    return fields | {"planned_tokens_per_second": speed.tokens_per_second, "planned_low": round(speed.low),
                     "planned_high": round(speed.high), "planned_allocated_gib": round(memory_plan.allocated / GIB, 2),
                     "planned_device_gib": round(memory_plan.device(1) / GIB, 2), "planned_fits": fits, "loss": w.loss,
                     "recomputed_layers": w.recomputed_layers, "compile": w.compile}


def python_args(row: Row, args: argparse.Namespace) -> list[str]:
    """What the row's process runs after `python`: finetune as a user types it, or baselines.py."""
    shape, out = row.shape, run_dir(row, args)
    if row.program == "finetune":
        return ["-m", "finetune", *finetune_args(row, args, str(checkpoint(shape, args)), out)]
    return [str(KIT / "baselines.py"), row.program, "--checkpoint", str(checkpoint(shape, args)), "--data",
            str(data(shape, args)), "--method", shape.method, "--seq-len", str(shape.seq_len), "--micro-batch-size",
            str(shape.micro_batch_size), "--steps", str(args.steps), *row.flags, "--result", str(out / "result.json")]


def skip_reason(row: Row, cuda: bool) -> str | None:
    """Why the row cannot run on this machine, or None. finetune would run --liger without the
    kernels (with a note) rather than fail, so a liger-kernel that is missing, does not import or
    does not cover the model skips the rows that ask for it."""
    if not cuda:
        return "no CUDA device"
    if row.program == "trl" and importlib.util.find_spec("trl") is None:
        return "trl is not installed (carry the kit's wheels: bash bench/gpu_kit/wheels.sh)"
    problem = liger_problem(cuda, row.shape.spec.model_type) if row.liger else None
    return f"{problem} (carry the kit's wheels: bash bench/gpu_kit/wheels.sh)" if problem else None


def describe(row: Row, args: argparse.Namespace) -> str:
    """The row in words: its shape, program and flags (a plan row: what `finetune plan` chose)."""
    if row.program != "finetune":
        return f"{row.shape.label}, {row.program} {' '.join(row.flags)}".rstrip()
    if row.plan is None:
        return f"{row.shape.label}, finetune {' '.join(row.flags)}"
    asked = " ".join(["finetune plan", *row.plan])
    if refusal(row, args.gpu_spec, args.work):
        return f"{row.shape.label}, {asked}"
    return f"{row.shape.label}, {asked} → {' '.join(table.plan_choices(row, args.gpu_spec)) or 'no flags beyond the shape'}"


def dry_run(args: argparse.Namespace) -> None:
    print(f"{len(args.rows)} row{'s' * (len(args.rows) != 1)} on {args.gpu_spec.name}, {args.steps} updates each "
          "(LoRA r16 alpha 32, bf16):")
    for row in args.rows:
        plan = planned(row, args)
        rate = plan["planned_tokens_per_second"]
        refused = refusal(row, args.gpu_spec, args.work)
        text = (f"planned {rate:,.0f} tok/s ({plan['planned_low']:,}–{plan['planned_high']:,}), "
                f"{plan['planned_allocated_gib']:.1f} GiB allocated" if rate else f"skipped: {refused}" if refused
                else "not planned (another program)")
        published = f"; published {row.published.tokens_per_second:,.0f} ({row.published.source})" if row.published else ""
        command = "(refused: not run)" if refused else f"python {shlex.join(python_args(row, args))}"
        print(f"  {row.id:<28} {describe(row, args)}\n      {text}{published}\n      $ {command}")


def prepare(row: Row, args: argparse.Namespace, runner: RowRunner, later: set[str]) -> None:
    """The row's text rows and random-init checkpoint, written once in --work. Short of disk, the
    checkpoints no later row (`later`: their shapes' names) needs make room first. Raises OSError."""
    length = row.shape.example_len or row.shape.seq_len  # packed rows: as many tokens in shorter examples
    memory.write_text_data(data(row.shape, args), length, memory.DATA_ROWS * row.shape.seq_len // length)
    write = functools.partial(memory.random_checkpoint, row.shape.model, args.work / "random-init",
                              seconds_left(args, 900), runner, row.shape.layers)
    try:
        write()
    except OSError as e:
        unneeded = [c for c in (args.work / "random-init").glob("*/") if c.name not in later | {row.shape.name}]
        if "of disk needed" not in str(e) or not unneeded:
            raise
        print(f"{e}: deleting {', '.join(c.name for c in unneeded)}, which no later row needs", flush=True)
        for folder in unneeded:
            shutil.rmtree(folder)
        write()


def measure(row: Row, args: argparse.Namespace, runner: RowRunner, later: set[str]) -> dict:
    """Run the row's process; its measured fields, or why it failed."""
    try:
        prepare(row, args, runner, later)
    except OSError as e:
        return {"status": f"no checkpoint: {type(e).__name__}", "error": str(e)[:300]}
    out = run_dir(row, args)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    timeout_s = seconds_left(args, args.row_timeout)
    result = runner.run(python_args(row, args), out / "run.log", timeout_s)
    shutil.copy(out / "run.log", args.logs / f"throughput-{row.id}.log")  # --work is scratch; the logs go back
    if result["status"] == "timeout" and timeout_s < args.row_timeout:  # stopped by the deadline, not by its own time
        return result | {"status": f"not run: time (the deadline stopped it after {result['seconds']:.0f} s)"}
    if result["status"] != "ok":
        return result
    if row.program == "finetune":
        return result | memory.metrics_summary(out)
    return result | json.loads((out / "result.json").read_text())


def run_one(row: Row, args: argparse.Namespace, runner: RowRunner, done: dict[tuple, dict], later: set[str]) -> dict:
    """One row's result: skipped, not run, the same as an earlier row's run, or measured (`later`:
    the shapes the rows after it train)."""
    reason = refusal(row, args.gpu_spec, args.work) or skip_reason(row, args.cuda)
    if reason:
        return {"status": f"skipped: {reason}"}
    same = tuple(python_args(row, args)[:-2]) if row.program == "finetune" else None  # the command without its output dir
    if same in done:
        first = done[same]
        return {key: first.get(key) for key in ("tokens_per_second", "allocated_gib", "reserved_gib", "losses")} | {
            "status": f"same run as {first['row']}" if first["status"] == "ok" else f"{first['status']} (as {first['row']})"}
    if args.deadline and args.deadline - time.time() < (MIN_ROW_SECONDS if row.shape.layers is None else MIN_CUT_SECONDS):
        return {"status": "not run: time"}
    result = measure(row, args, runner, later)
    if same is not None:
        done[same] = result | {"row": row.id}
    return result


def run_rows(args: argparse.Namespace) -> int:
    """The selected rows on this GPU in order, throughput.csv and .md rewritten after each; 1 when a
    finetune row failed or none could run, else 0 (rows the deadline left out are not failures)."""
    use_expandable_segments()  # every row's process inherits it: TRL's and the PEFT loop's as finetune's own
    allocator = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    for folder in (args.out, args.logs):
        folder.mkdir(parents=True, exist_ok=True)
    runner, done, results = RowRunner(fork=not args.no_fork), {}, []
    for index, row in enumerate(args.rows):
        result = {"row": row.id, "shape": row.shape.label, "program": row.program, "flags": describe(row, args),
                  "allocator": allocator, **planned(row, args)}
        result |= run_one(row, args, runner, done, {later.shape.name for later in args.rows[index + 1:]})
        results.append(result)
        print(table_line(result), flush=True)
        write_results(results, args)
    print("\n".join(table_text(results)))
    ours = [r for r in results if r["program"] == "finetune"]
    failed = [r for r in ours if not r["status"].startswith(("ok", "skipped", "not run", "same run"))]
    return 1 if failed or all(r["status"].startswith("skipped") for r in ours) else 0


def seconds_left(args: argparse.Namespace, cap: float) -> float:
    """`cap` seconds, or fewer when --deadline comes first."""
    return min(cap, args.deadline - time.time()) if args.deadline else cap


def ratio(r: dict) -> str:
    measured, plan = r.get("tokens_per_second"), r.get("planned_tokens_per_second")
    return f"{measured / plan:.2f}" if measured and plan else "–"


def table_line(r: dict) -> str:
    """One row of the printed table: measured tokens/s and CUDA peaks beside the plan, or its status."""
    plan = f"{r['planned_tokens_per_second']:>9,.0f}" if r.get("planned_tokens_per_second") else f"{'–':>9}"
    if not r.get("tokens_per_second"):
        return f"{r['row']:<28} {'–':>9} {plan}  {r['status']}" + (f": {r['error']}" if r.get("error") else "")
    compiling = f", {r['compile_seconds']:.0f} s compiling" if r.get("compile_seconds") else ""
    allocated = f"{r['allocated_gib']:.2f}" + (f" (planned {r['planned_allocated_gib']:.2f})" if r.get("planned_allocated_gib") else "")
    took = f", {r['seconds']:.0f} s" if r.get("seconds") else ""
    return (f"{r['row']:<28} {r['tokens_per_second']:>9,.0f} {plan}  {allocated} GiB allocated, "
            f"{r['reserved_gib']:.2f} reserved{took}{compiling}" + ("" if r["status"] == "ok" else f"  [{r['status']}]"))


def table_text(results: list[dict]) -> list[str]:
    return ["", f"{'row':<28} {'tok/s':>9} {'planned':>9}  peaks (tokens/s: median update after the first)",
            *map(table_line, results)]


def markdown(results: list[dict], header: str) -> str:
    """throughput.md: each row measured beside its plan (ratio, likely range) and a published run."""
    lines = [header, "", "| row | run | tok/s | planned (likely) | measured / planned | published | allocated GiB "
             "(measured / planned) | reserved GiB | status |", "|" + "---|" * 9]
    for r in results:
        plan = (f"{r['planned_tokens_per_second']:,.0f} ({r['planned_low']:,}–{r['planned_high']:,})"
                + (", no plan fits" if r.get("planned_fits") is False else "") if r.get("planned_tokens_per_second") else "–")
        measured = f"{r['tokens_per_second']:,.0f}" if r.get("tokens_per_second") else "–"
        published = f"{r['published_tokens_per_second']:,.0f}" if r.get("published_tokens_per_second") else ""
        allocated = f"{r['allocated_gib']:.2f}" if r.get("allocated_gib") else "–"
        allocated += f" / {r['planned_allocated_gib']:.2f}" if r.get("planned_allocated_gib") else ""
        reserved = f"{r['reserved_gib']:.2f}" if r.get("reserved_gib") else "–"
        status = r["status"] + (f": {r['error']}" if r.get("error") else "")
        lines.append(f"| {r['row']} | {r['flags']} | {measured} | {plan} | {ratio(r)} | {published} | {allocated} | {reserved} | "
                     f"{status.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write_results(results: list[dict], args: argparse.Namespace) -> None:
    with (args.out / "throughput.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)
    (args.out / "throughput.md").write_text(markdown(results, args.header))


def provenance(args: argparse.Namespace, argv: list[str] | None) -> str:
    """The results' first line: the GPU, when, the packages' versions, the command."""
    versions = []
    for name in VERSIONS:
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} missing")
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "python bench/gpu_kit/throughput.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    return (f"Throughput on {args.gpu_found}; {started}; {', '.join(versions)}; `{command}`; {args.steps} updates per row, "
            "tokens/s the median after the first; planned: the planner's for exactly each finetune row's run.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the rows, their commands and finetune's plans")
    parser.add_argument("--out", type=Path, help="where throughput.csv and throughput.md go (a GPU run)")
    parser.add_argument("--logs", type=Path, help="where each row's log goes (default: --out)")
    parser.add_argument("--work", type=Path, default=memory.DEFAULT_WORK,
                        help="scratch shared with memory.py: random-init checkpoints, text rows, each row's run")
    parser.add_argument("--rows", default="all", help="ids, globs over ids or groups (first, rest, all), comma-separated, "
                        "run in that order: " + ", ".join(row.id for row in table.ROWS))
    parser.add_argument("--deadline", type=float, help=f"epoch seconds: no row starts less than {MIN_ROW_SECONDS} s "
                        f"({MIN_CUT_SECONDS} s on a cut) before, none runs past")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--gpu", help="catalog GPU the plans are for (default: GPU 0; on a dry run without one, H200)")
    parser.add_argument("--row-timeout", type=float, default=300)
    parser.add_argument("--no-fork", action="store_true", help="each row in a fresh interpreter instead of forked from a preloaded one")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2: tokens/s is the median after the first update")
    if args.out is None and not args.dry_run:
        parser.error("--out DIR is needed for a GPU run (or --dry-run)")
    try:
        args.rows = table.select(args.rows)
    except ValueError as e:
        parser.error(str(e))
    args.logs = args.logs or args.out
    args.gpu_spec, args.gpu_found = gpu_found(args.gpu)
    return args


def gpu_found(name: str | None) -> tuple[gpus.GPUSpec, str]:
    """(catalog entry, description) of --gpu, else of GPU 0, else (no GPU: a dry run, or a run that
    will skip every row) of the H200. Asks nvidia-smi, so that this process holds no CUDA context
    while the rows run."""
    if name:
        return gpus.get(name), f"{gpus.get(name).name} (catalog)"
    query = ["nvidia-smi", "--id=0", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    answer = subprocess.run(query, capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    if answer is None or answer.returncode != 0 or "," not in answer.stdout:
        return gpus.get("H200"), "no GPU (planned for the H200)"
    device, mib = answer.stdout.strip().rsplit(",", 1)
    found = gpus.identify(device.strip(), float(mib) / 1024)
    if found is None:
        raise SystemExit(f"{device.strip()} is not in the GPU catalog (finetune/plan/gpus.py): pass --gpu")
    return found, f"{device.strip()} ({float(mib) / 1024:.1f} GiB)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args)
        return 0
    import torch  # the parent only asks whether CUDA is there (no context); each row's process uses it

    args.cuda, args.header = torch.cuda.is_available(), provenance(args, argv)
    return run_rows(args)


if __name__ == "__main__":
    raise SystemExit(main())
