"""finetune's defaults against their alternatives and against TRL SFTTrainer (± Liger) and a bare PEFT loop,
one shape, one GPU, one command.

    python bench/gpu_kit/throughput.py --dry-run [--gpu H200]           # the rows, their commands and finetune's plan, no GPU
    python bench/gpu_kit/throughput.py --out DIR [--work DIR] [--deadline EPOCH_SECONDS] [--model mistral-7b]
        [--method lora] [--seq-len 4096] [--micro-batch-size 2] [--steps 6]

The shape of issue 15's goal by default: a random-init Mistral-7B (memory.py's checkpoint, written
once into --work), LoRA r16 alpha 32 on all linear layers, bf16 base, gradient checkpointing, text
rows of exactly --seq-len tokens. Each row runs in its own process (so one row's allocator state and
compiled graphs do not help the next), for --steps updates: finetune's rows are `python -m finetune`,
TRL's and the bare PEFT loop's are bench/gpu_kit/baselines.py, on the same checkpoint and the same token
ids, every one with the allocator finetune sets for itself (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
unless the environment sets it). Tokens/s is the median update after the first (compile time, if any,
is in the first and reported apart), with torch.cuda.max_memory_allocated/reserved of the row's
process beside finetune's plan for exactly that row on the GPU found (--gpu: another catalog GPU).
Rows come in the order worth measuring when the deadline cuts the command short: finetune's defaults
and each one's A/B first (the chunked loss, the planned partial checkpointing, Liger), then TRL + Liger
(the anchor), the rest, the compiled rows last. A row that cannot run here (no CUDA, trl or a working
liger-kernel missing) is listed as "skipped: why"; one that would start too close to --deadline, or
that the deadline stops, as "not run: time". Writes DIR/throughput.csv after every row and each row's
log as DIR/throughput-ROW.log, prints a table; exits 0 unless a finetune row failed (a row not run
is not a failure) or none could run at all. trl and liger-kernel are pure Python: carry their wheels
in bench/gpu_kit/wheels (bench/gpu_kit/wheels.sh).

Not yet run on a GPU: no GPU was lent to the sessions that wrote it (bench/RESULTS.md); the CPU tests
(tests/gpu_kit/test_gpu_kit.py) cover the dry run, the commands, the order, the deadline and the baselines' configs.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KIT = Path(__file__).resolve().parent
sys.path[:0] = [str(REPO), str(KIT)]

import memory  # noqa: E402  (the kit's random-init checkpoints, text rows and metrics reading)
from forked import run_logged  # noqa: E402

from finetune.cli import use_expandable_segments  # noqa: E402
from finetune.config.flags import parse_config  # noqa: E402
from finetune.config.names import STRATEGIES  # noqa: E402
from finetune.config.resolve import Launch, resolve_run  # noqa: E402
from finetune.config.switches import fp8_problem, liger_problem  # noqa: E402
from finetune.models import catalog  # noqa: E402
from finetune.plan import gpus  # noqa: E402
from finetune.plan.choose import fewest_checkpointed  # noqa: E402
from finetune.plan.files import checkpointing_flags  # noqa: E402
from finetune.plan.memory import GIB, estimate  # noqa: E402
from finetune.plan.speed import estimate_speed  # noqa: E402
from finetune.plan.workload import Workload, from_run  # noqa: E402
from finetune.train.dry_run import device_of  # noqa: E402

MIN_ROW_SECONDS = 60  # a 7B row: interpreter and imports, 14 GB of weights from the page cache, the updates
CSV_FIELDS = ("row", "program", "liger", "compile", "fp8", "status", "tokens_per_second", "planned_tokens_per_second",
              "allocated_gib", "planned_allocated_gib", "reserved_gib", "planned_device_gib", "allocator",
              "compile_seconds", "first_update_seconds", "seconds", "losses", "error")


@dataclass(frozen=True)
class Row:
    name: str
    program: str  # "finetune", "trl" or "peft-loop"
    liger: bool = False
    compile: bool = False
    fp8: bool = False  # --fp8: LoRA's frozen base in float8 matmuls (LoRA only, compute capability ≥ 8.9)
    chunked_loss: bool = True  # finetune's default for LoRA/QLoRA; off: the model's own loss, as on 2026-11-25
    planned_layers: bool = False  # checkpoint only the layers `finetune plan` picks for --gpu (else all of them)


# In the order worth measuring when --deadline cuts the run short: finetune with its defaults (the
# chunked loss, fused AdamW, every layer checkpointed; Liger pinned off), then each default's A/B
# (the model's own loss as on 2026-11-25; the partial checkpointing the plan recommends, with its
# memory beside the plan; Liger), then the anchor finetune must beat (TRL + Liger) and finetune's
# fastest plan; the float8 base (--fp8, against --liger); the compiled rows last (their first update
# compiles for a minute or more): the fused LoRA path, then with float8 matmuls (against --liger --compile).
ROWS = (
    Row("finetune", "finetune"),
    Row("finetune --no-chunked-loss", "finetune", chunked_loss=False),
    Row("finetune, ckpt as planned", "finetune", planned_layers=True),
    Row("finetune --liger", "finetune", liger=True),
    Row("TRL SFTTrainer use_liger_kernel", "trl", liger=True),
    Row("finetune --liger, ckpt as planned", "finetune", liger=True, planned_layers=True),
    Row("TRL SFTTrainer", "trl"),
    Row("bare PEFT loop, fused AdamW", "peft-loop"),
    Row("finetune --liger --fp8", "finetune", liger=True, fp8=True),
    Row("finetune --compile", "finetune", compile=True),
    Row("finetune --liger --compile", "finetune", liger=True, compile=True),
    Row("finetune --liger --fp8 --compile", "finetune", liger=True, compile=True, fp8=True),
)


def refused(row: Row, args: argparse.Namespace) -> str | None:
    """Why finetune refuses the row's flags for --method (--fp8 is LoRA's), or None."""
    return fp8_problem(args.method, "bf16-true", STRATEGIES["single"], True) if row.fp8 else None


def planned(row: Row, args: argparse.Namespace) -> dict:
    """finetune's plan for the row on --gpu: tokens/s, allocated and device memory (the planner
    plans finetune, not the others)."""
    if row.program != "finetune":
        return {"planned_tokens_per_second": None}
    w = workload(row, args)
    memory = estimate(w)
    return {"planned_tokens_per_second": estimate_speed(w).tokens_per_second,
            "planned_allocated_gib": round(memory.allocated / GIB, 2), "planned_device_gib": round(memory.device(1) / GIB, 2)}


def workload(row: Row, args: argparse.Namespace) -> Workload:
    """The planner's view of a finetune row on --gpu: its flags (the catalog shape in place of the
    checkpoint) resolved as on that GPU and translated by from_run; Liger's loss for a --liger row (it
    runs only where Liger can); with `planned_layers`, checkpointing as few layers as `finetune plan` would."""
    config = parse_config(train_flags(row, args, args.model, inputs(args)[1]))
    w = from_run(resolve_run(config, Launch(), device_of(args.gpu_spec)), args.gpu_spec)
    w = replace(w, loss="liger") if row.liger else w
    return fewest_checkpointed(w) if row.planned_layers else w


def inputs(args: argparse.Namespace) -> tuple[Path, Path]:
    """(random-init checkpoint, text rows) in --work, named as memory.py names them so both reuse them."""
    return args.work / "random-init" / args.model, args.work / f"data-{args.seq_len}.jsonl"


def run_dir(row: Row, args: argparse.Namespace) -> Path:
    """The row's scratch folder (its run.log, finetune's metrics.jsonl or baselines.py's result.json)."""
    return args.work / "runs" / ("throughput-" + re.sub(r"[^a-z0-9]+", "-", row.name.lower()).strip("-"))


def row_command(row: Row, args: argparse.Namespace) -> list[str]:
    """The process the row runs: finetune as a user types it, or baselines.py for TRL and the PEFT loop."""
    checkpoint, data = inputs(args)
    if row.program != "finetune":
        return [sys.executable, str(KIT / "baselines.py"), row.program, "--checkpoint", str(checkpoint), "--data",
                str(data), "--method", args.method, "--seq-len", str(args.seq_len), "--micro-batch-size",
                str(args.micro_batch_size), "--steps", str(args.steps), *(["--liger"] if row.liger else []),
                "--result", str(run_dir(row, args) / "result.json")]
    # --gradient-checkpointing-layers N, if the plan has it (a row refused for --method is listed, never run)
    layers = [] if refused(row, args) else checkpointing_flags(workload(row, args))[1:]
    return [sys.executable, "-m", "finetune", *train_flags(row, args, str(checkpoint), data), *layers]


def train_flags(row: Row, args: argparse.Namespace, model: str, data: Path) -> list[str]:
    """finetune's flags for the row, every layer checkpointed (`model`: the checkpoint, or for the
    plan its catalog shape)."""
    return ["--model", model, "--dataset", str(data), "--format", "text",
            "--method", args.method, "--max-seq-len", str(args.seq_len), "--micro-batch-size", str(args.micro_batch_size),
            "--max-steps", str(args.steps), "--precision", "bf16-true", "--gradient-checkpointing",
            "--gradient-accumulation-steps", "1", "--lora-r", "16", "--lora-targets", "all-linear", "--optimizer", "adamw",
            "--log-every", "1", "--max-eval-examples", "0", "--num-samples", "0", "--no-save-final",
            "--liger" if row.liger else "--no-liger", "--compile" if row.compile else "--no-compile",
            *(["--fp8"] if row.fp8 else []), *([] if row.chunked_loss else ["--no-chunked-loss"]), "--output-dir", str(run_dir(row, args))]


def skip_reason(row: Row, cuda: bool, model_type: str = "mistral", fp8_gpu: bool = True) -> str | None:
    """Why the row cannot run on this machine, or None. finetune would run --liger without the
    kernels (with a note) rather than fail, so a liger-kernel that is missing, does not import or
    does not cover the model skips its rows too."""
    if not cuda:
        return "no CUDA device"
    if row.program == "trl" and importlib.util.find_spec("trl") is None:
        return "trl is not installed (carry bench/gpu_kit/wheels: bash bench/gpu_kit/wheels.sh)"
    if row.liger and liger_problem(cuda, model_type):
        return f"{liger_problem(cuda, model_type)} (carry bench/gpu_kit/wheels: bash bench/gpu_kit/wheels.sh)"
    if row.fp8 and not fp8_gpu:
        return fp8_problem("lora", "bf16-true", STRATEGIES["single"], False)
    return None


def dry_run(args: argparse.Namespace) -> None:
    print(f"{args.model} {args.method} r16 all-linear, bf16, checkpointing, seq {args.seq_len}, micro batch "
          f"{args.micro_batch_size}, {args.steps} updates per row, on {args.gpu_spec.name}:")
    for row in ROWS:
        plan = {} if refused(row, args) else planned(row, args)
        rate = plan.get("planned_tokens_per_second")
        text = (f"planned {rate:,.0f} tok/s, {plan['planned_allocated_gib']:.1f} GiB allocated" if rate
                else f"skipped: {refused(row, args)}" if refused(row, args) else "not planned (another program)")
        print(f"  {row.name:<34} {row.program:<10} liger={'on' if row.liger else 'off':<4}"
              f"compile={'on' if row.compile else 'off':<4} {text}")
        print(f"      $ {shlex.join(row_command(row, args))}")


def measure(row: Row, args: argparse.Namespace, timeout_s: float) -> dict:
    """Run the row's process; its measured fields, or why it failed."""
    out = run_dir(row, args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").unlink(missing_ok=True)
    result = run_logged(row_command(row, args), out / "run.log", timeout_s)
    shutil.copy(out / "run.log", args.out / f"{out.name}.log")  # --work is scratch; the logs go back with the table
    if result["status"] == "timeout" and timeout_s < args.row_timeout:  # stopped by the deadline, not by its own time
        return result | {"status": f"not run: time (the deadline stopped it after {result['seconds']:.0f} s)"}
    if result["status"] != "ok":
        return result
    if row.program == "finetune":
        return result | memory.metrics_summary(out)
    return result | json.loads((out / "result.json").read_text())


def run_rows(args: argparse.Namespace) -> int:
    """Every row on this GPU, throughput.csv rewritten after each; 1 when a finetune row failed or
    none could run, else 0 (rows the deadline left out are not failures)."""
    import torch

    use_expandable_segments()  # every row's process inherits it: TRL's and the PEFT loop's as finetune's own
    allocator = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    cuda = torch.cuda.is_available()
    fp8_gpu = cuda and torch.cuda.get_device_capability() >= (8, 9)
    reasons = {row: refused(row, args) or skip_reason(row, cuda, catalog.get(args.model).model_type, fp8_gpu)
               for row in ROWS}
    checkpoint, data = inputs(args)
    if any(reason is None for reason in reasons.values()):
        memory.write_text_data(data, args.seq_len)
        memory.random_checkpoint(args.model, checkpoint.parent, timeout_s=seconds_left(args, 900))
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for row in ROWS:
        result = {"row": row.name, "program": row.program, "liger": row.liger, "compile": row.compile, "fp8": row.fp8,
                  "allocator": allocator, **({"planned_tokens_per_second": None} if refused(row, args) else planned(row, args))}
        if reasons[row]:
            result["status"] = f"skipped: {reasons[row]}"
        elif args.deadline and args.deadline - time.time() < MIN_ROW_SECONDS:
            result["status"] = "not run: time"
        else:
            result |= measure(row, args, seconds_left(args, args.row_timeout))
        results.append(result)
        print(table_line(result), flush=True)
        write_csv(results, args.out / "throughput.csv")
    print("\n".join(table(results, args)))
    ours = [r for r in results if r["program"] == "finetune"]
    failed = [r for r in ours if r["status"] != "ok" and not r["status"].startswith(("skipped", "not run"))]
    return 1 if failed or all(r["status"].startswith("skipped") for r in ours) else 0


def seconds_left(args: argparse.Namespace, cap: float) -> float:
    """`cap` seconds, or fewer when --deadline comes first."""
    return min(cap, args.deadline - time.time()) if args.deadline else cap


def write_csv(results: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)


def table_line(r: dict) -> str:
    """One row of the table: measured tokens/s and CUDA peaks beside the plan, or its status."""
    plan = f"{r['planned_tokens_per_second']:>9,.0f}" if r["planned_tokens_per_second"] else f"{'–':>9}"
    if r["status"] != "ok":
        return f"{r['row']:<34} {'–':>9} {plan}  {r['status']}" + (f": {r['error']}" if r.get("error") else "")
    compiling = f", {r['compile_seconds']:.0f} s compiling" if r.get("compile_seconds") else ""
    allocated = f"{r['allocated_gib']:.2f}" + (f" (planned {r['planned_allocated_gib']:.2f})" if r.get("planned_allocated_gib") else "")
    return (f"{r['row']:<34} {r['tokens_per_second']:>9,.0f} {plan}  {allocated} GiB allocated, "
            f"{r['reserved_gib']:.2f} reserved, {r['seconds']:.0f} s{compiling}")


def table(results: list[dict], args: argparse.Namespace) -> list[str]:
    return ["", f"{args.model} {args.method}, seq {args.seq_len}, micro batch {args.micro_batch_size}, {args.steps} updates "
            "(tokens/s: median after the first):", f"{'row':<34} {'tok/s':>9} {'planned':>9}  peaks",
            *map(table_line, results), f"wrote {args.out / 'throughput.csv'}"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the rows, their commands and finetune's planned tokens/s")
    parser.add_argument("--out", type=Path, help="where throughput.csv goes (a GPU run)")
    parser.add_argument("--work", type=Path, default=memory.DEFAULT_WORK,
                        help="scratch shared with memory.py: random-init checkpoints, text rows, each row's run")
    parser.add_argument("--deadline", type=float, help="epoch seconds: no row starts less than a minute before, none runs past")
    parser.add_argument("--model", default="mistral-7b")
    parser.add_argument("--method", default="lora", choices=("lora", "qlora"))
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--gpu", help="catalog GPU the plan columns are for (default: GPU 0; on a dry run without one, H200)")
    parser.add_argument("--row-timeout", type=float, default=300)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2: tokens/s is the median after the first update")
    if args.out is None and not args.dry_run:
        parser.error("--out DIR is needed for a GPU run (or --dry-run)")
    args.gpu_spec = gpu_found(args.gpu)
    return args


def gpu_found(name: str | None):
    """--gpu, else the catalog entry of GPU 0, else (no GPU: a dry run, or a run that will skip every
    row) the H200 lent now. Asks nvidia-smi, so that this process holds no CUDA context while the rows run."""
    if name:
        return gpus.get(name)
    query = ["nvidia-smi", "--id=0", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    answer = subprocess.run(query, capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    if answer is None or answer.returncode != 0 or "," not in answer.stdout:
        return gpus.get("H200")
    device, mib = answer.stdout.strip().rsplit(",", 1)
    found = gpus.identify(device.strip(), float(mib) / 1024)
    if found is None:
        raise SystemExit(f"{device.strip()} is not in the GPU catalog (finetune/plan/gpus.py): pass --gpu")
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args)
        return 0
    return run_rows(args)


if __name__ == "__main__":
    raise SystemExit(main())
