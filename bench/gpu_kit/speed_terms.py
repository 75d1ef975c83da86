"""Where a micro-batch's time goes, term by term, beside the speed model's terms.

    python bench/gpu_kit/speed_terms.py --out DIR [--deadline EPOCH_SECONDS]   # on the GPU (bench/gpu_kit/run.sh)
    python bench/gpu_kit/speed_terms.py --dry-run [--gpu H200]                 # the cases and their planned terms

The speed model (finetune/plan/speed.py) plans a micro-batch from the host's issue time per decoder
layer and the GPU's time by term: matmul FLOPs, attention, memory-bound bytes, a cost per kernel.
It is fitted to whole runs, so a miss does not say which term it comes from: Qwen2.5 runs ran
1.7–2.2× slower than planned where a Llama-3.2-3B run ran 1.1×. This script measures the
terms one by one. Each case trains, with the trainer's own pieces (as defaults.py), a 2-layer and a
4-layer cut of a full-width shape: half their difference is one decoder layer; what the 2-layer cut
spends beyond two layers is the rest (embedding, LM head and loss over the vocabulary). For each it
records, per micro-batch:

- host ms: the wall clock until backward() returns, the GPU left running (the host's issue time
  where the host is the slower clock);
- wall ms: forward and backward with the GPU drained; the optimizer step's wall clock apart;
- from torch.profiler's trace of a few more micro-batches, the GPU's busy time by kernel class
  (matmul, attention, 4-bit dequantization, the rest: memory-bound kernels) and the kernel count,

each beside what the planner plans for exactly that cut as it runs (`from_run` with the model's own loss
and its sliding window kept, `kernel_classes`, `issue_seconds`).
The held-out shapes come first, then two anchors the fit already rests on (Llama-3.2-1B LoRA at
seq 512, Mistral-7B LoRA at 4096 × 2 with checkpointing). Writes DIR/speed_terms.md (device, date,
versions, command) and DIR/speed_terms.csv after every case; exits 0 unless a case failed. On CPU
(tests/gpu_kit/test_gpu_kit.py) the same code runs on the tiny shape, without GPU columns.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from finetune.cli import use_expandable_segments  # noqa: E402

use_expandable_segments()  # as finetune's entry does, before torch loads

import torch  # noqa: E402
from defaults import cut, provenance, quiet_start, random_batch, release, synchronize  # noqa: E402

from finetune.config.options import TrainConfig  # noqa: E402
from finetune.config.resolve import Launch, resolve_run  # noqa: E402
from finetune.plan.speed import (  # noqa: E402
    CALIBRATION,
    issue_seconds,
    kernel_classes,
    micro_batch_seconds,
    optimizer_seconds,
)
from finetune.plan.traffic import kernel_launches  # noqa: E402
from finetune.plan.workload import from_run  # noqa: E402
from finetune.train import loading  # noqa: E402
from finetune.train.dry_run import device_of  # noqa: E402
from finetune.train.optim import build_optimizer  # noqa: E402
from finetune.train.run import this_device  # noqa: E402

# shape:method:seq:micro batch[:ckpt] — the shapes the speed model planned worst, then two measured anchors
CASES = ("qwen2.5-1.5b:lora:2048:1", "qwen2.5-1.5b:full:2048:1", "llama-3.2-3b:lora:1024:1", "qwen2.5-7b:qlora:2048:2",
         "llama-3.2-1b:lora:512:1", "mistral-7b:lora:4096:2:ckpt")
CUTS = (2, 4)  # decoder layers of the two cuts: half their difference is one layer
MIN_CASE_SECONDS = 40  # two cuts written, loaded, warmed up, timed and profiled
KERNEL_CLASSES = ("matmul", "attention", "dequant", "other")
MEASURES = ("host_ms", "wall_ms", "step_ms", "busy_ms", *(f"{k}_ms" for k in KERNEL_CLASSES), "kernels")
PARTS = ("per layer", "rest")
CSV_FIELDS = ("case", "part", "status", *(f"{side}_{m}" for m in MEASURES for side in ("measured", "planned")), "notes")


@dataclass(frozen=True)
class Case:
    shape: str
    method: str
    seq_len: int
    micro_batch_size: int
    checkpointing: bool = False

    @classmethod
    def parse(cls, text: str) -> Case:
        shape, method, seq, micro, *ckpt = text.split(":")
        return cls(shape, method, int(seq), int(micro), ckpt == ["ckpt"])

    @property
    def label(self) -> str:
        return f"{self.shape} {self.method} s{self.seq_len} b{self.micro_batch_size}" + (" ckpt" if self.checkpointing else "")

    def config(self, model_dir: Path, work: Path) -> TrainConfig:
        """The trainer's flags (what `python -m finetune` would run): plain kernels, the rows' precisions."""
        return TrainConfig(model=str(model_dir), method=self.method, max_seq_len=self.seq_len,
                           micro_batch_size=self.micro_batch_size, gradient_checkpointing=self.checkpointing,
                           precision="bf16-mixed" if self.method == "full" else "bf16-true", lora_targets="all-linear",
                           lora_r=16, liger=False, output_dir=str(work / "out"))


def planned(run, gpu) -> dict[str, float]:
    """The plan of one cut's micro-batch as it runs here, in the measured columns (ms; kernels of the
    decoder layers): without train.speedups, so with the model's own loss and any sliding window kept."""
    w = replace(from_run(run, gpu), loss="transformers", inert_window_kept=True)
    classes = kernel_classes(w, CALIBRATION)
    issue, busy = issue_seconds(w, CALIBRATION), sum(classes.values())
    ms = {"host_ms": issue, "wall_ms": micro_batch_seconds(issue, busy, CALIBRATION), "step_ms": optimizer_seconds(w),
          "busy_ms": busy, **{f"{name}_ms": seconds for name, seconds in classes.items()}}
    return {key: 1000 * value for key, value in ms.items()} | {"kernels": kernel_launches(w)}


def kernel_class(name: str) -> str:
    """Which term a CUDA kernel belongs to, by its name (cuBLAS/CUTLASS, FlashAttention/cuDNN SDPA, bitsandbytes)."""
    if re.search(r"flash|fmha|sdpa|attention", name, re.I):
        return "attention"
    if re.search(r"dequantize", name, re.I):
        return "dequant"
    if re.search(r"gemm|nvjet|xmma|wgmma|s16816|cutlass.*tensorop|matmul", name, re.I):
        return "matmul"
    return "other"


def kernel_times(trace: dict, micro_batches: int) -> dict[str, float]:
    """GPU busy ms per micro-batch by kernel class, and the kernel count, from a Chrome trace."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]
    found = {f"{k}_ms": 0.0 for k in KERNEL_CLASSES}
    for event in kernels:
        found[f"{kernel_class(event.get('name', ''))}_ms"] += event.get("dur", 0) / 1000 / micro_batches
    return found | {"busy_ms": sum(found.values()), "kernels": len(kernels) / micro_batches}


def measure(case: Case, layers: int, args: argparse.Namespace, gpu) -> tuple[dict, dict]:
    """(measured, planned) figures of one micro-batch of the case's `layers`-deep cut."""
    device = this_device()
    run = resolve_run(case.config(cut(case.shape, layers, args.work, weights=True), args.work), Launch(), device)
    target = torch.device("cuda", 0) if device.cuda else torch.device("cpu")
    release()
    torch.manual_seed(0)
    model = loading.load_model(run, target)
    optimizer = build_optimizer(run.config, model, run.peak_lr, fused=device.cuda)
    ids, autocast = random_batch(run, target)
    cuda = target.type == "cuda"

    for _ in range(args.warmup):
        micro_batch(model, optimizer, ids, autocast, cuda)
    timed = [micro_batch(model, optimizer, ids, autocast, cuda) for _ in range(args.steps)]
    measured = {key: 1000 * statistics.median(t[i] for t in timed) for i, key in enumerate(("host_ms", "wall_ms", "step_ms"))}
    if cuda:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profiler:
            for _ in range(args.profiled):
                micro_batch(model, optimizer, ids, autocast, cuda)
        with tempfile.TemporaryDirectory() as scratch:
            profiler.export_chrome_trace(str(Path(scratch) / "trace.json"))
            measured |= kernel_times(json.loads((Path(scratch) / "trace.json").read_text()), args.profiled)
    return measured, planned(run, gpu)


def micro_batch(model, optimizer, ids, autocast, cuda: bool) -> tuple[float, float, float]:
    """Seconds of one micro-batch: until backward() returns (the host's issue), until the GPU has
    drained it, and the optimizer step after it."""
    synchronize(cuda)
    started = time.perf_counter()
    with autocast:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    issued = time.perf_counter()
    synchronize(cuda)
    drained = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronize(cuda)
    return issued - started, drained - started, time.perf_counter() - drained


def parts(deep: dict, shallow: dict, layers: tuple[int, int] = CUTS) -> dict[str, dict]:
    """One decoder layer (half the cuts' difference) and the rest (the shallow cut beyond its layers)."""
    per_layer = {k: (deep[k] - shallow[k]) / (layers[1] - layers[0]) for k in deep if k in shallow}
    return {"per layer": per_layer, "rest": {k: shallow[k] - layers[0] * per_layer[k] for k in per_layer}}


def run_case(case: Case, args: argparse.Namespace, gpu) -> list[dict]:
    if args.dry_run:
        plans = [planned(resolve_run(case.config(cut(case.shape, n, args.work, weights=False), args.work), Launch(),
                                     device_of(gpu)), gpu) for n in CUTS]
        return [{"part": part, "status": "dry run", **{f"planned_{k}": v for k, v in values.items()}}
                for part, values in parts(plans[1], plans[0]).items()]
    (m2, p2), (m4, p4) = (measure(case, n, args, gpu) for n in CUTS)
    measured, plan = parts(m4, m2), parts(p4, p2)
    return [{"part": part, "status": "ok", **{f"measured_{k}": v for k, v in measured[part].items()},
             **{f"planned_{k}": v for k, v in plan[part].items()}} for part in PARTS]


def cell(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def write_results(results: list[dict], out: Path, header: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "speed_terms.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: cell(v) for k, v in r.items()} for r in results)
    columns = ("case", "part", "status", *MEASURES)
    lines = [header, "", "Each cell: measured / planned (ms per micro-batch; kernels: count).", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in results:
        pairs = [f"{cell(r.get(f'measured_{m}', ''))} / {cell(r.get(f'planned_{m}', ''))}" for m in MEASURES]
        lines.append("| " + " | ".join([r["case"], r.get("part", ""), r["status"], *pairs]) + " |")
    (out / "speed_terms.md").write_text("\n".join(lines) + "\n")


def run_all(args: argparse.Namespace, gpu, header: str) -> list[dict]:
    results = []
    for case in args.cases:
        if not args.dry_run and args.deadline and args.deadline - time.time() < MIN_CASE_SECONDS:
            rows = [{"status": "not run: time"}]
        else:
            try:
                rows = run_case(case, args, gpu)
            except Exception as e:  # one case's failure (an OOM, a missing wheel) is its row, not the end of the run
                text = str(e).strip()
                rows = [{"status": f"failed: {type(e).__name__}", "notes": text.splitlines()[0][:300] if text else ""}]
                release()
        for row in rows:
            results.append({"case": case.label, **row})
            print(" | ".join(cell(v) for v in results[-1].values()), flush=True)
        write_results(results, args.out, header)
    return results


def chosen_cases(text: str) -> list[str]:
    """--cases as case specs: a glob (`*`, `?`, `[`) stands for the default cases it matches, in their
    order; each case once. Raises ValueError for a glob that matches none."""
    chosen = []
    for word in filter(None, (w.strip() for w in text.split(","))):
        found = [case for case in CASES if fnmatch.fnmatchcase(case, word)] if any(c in word for c in "*?[") else [word]
        if not found:
            raise ValueError(f"{word!r} matches no default case")
        chosen += [case for case in found if case not in chosen]
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("output") / "gpu-kit", help="where speed_terms.md and .csv go")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "finetune-gpu-terms",
                        help="scratch: the cuts' random-init checkpoints")
    parser.add_argument("--deadline", type=float, help=f"epoch seconds: no case starts less than {MIN_CASE_SECONDS} s before")
    parser.add_argument("--dry-run", action="store_true", help="list the cases with their planned terms, run nothing")
    parser.add_argument("--gpu", help="catalog GPU the plan column is for (default: GPU 0; on CPU, H200)")
    parser.add_argument("--cases", default=",".join(CASES), help="shape:method:seq:micro batch[:ckpt], or globs over the "
                        f"default cases (e.g. 'qwen2.5-*', '*:lora:*'), comma-separated, run in that order: {', '.join(CASES)}")
    parser.add_argument("--warmup", type=int, default=2, help="micro-batches before timing")
    parser.add_argument("--steps", type=int, default=5, help="timed micro-batches (the median counts)")
    parser.add_argument("--profiled", type=int, default=2, help="micro-batches under torch.profiler (CUDA only)")
    args = parser.parse_args(argv)
    try:
        args.cases = tuple(Case.parse(text) for text in chosen_cases(args.cases))
    except ValueError as e:
        parser.error(f"--cases: each is shape:method:seq:micro batch[:ckpt] or a glob over the default cases, got {args.cases!r}"
                     + (f" ({e})" if "matches" in str(e) else ""))
    if min(args.steps, args.profiled) < 1:
        parser.error("--steps and --profiled must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu = quiet_start(args)
    header = (f"Where a micro-batch's time goes, {CUTS[0]}- and {CUTS[1]}-layer cuts of full-width shapes: "
              f"{provenance('speed_terms.py', argv)}. Planned: the planner's terms for each cut on {gpu.name}.")
    results = run_all(args, gpu, header)
    print(f"wrote {args.out / 'speed_terms.md'} and {args.out / 'speed_terms.csv'}")
    return 1 if any(r["status"].startswith("failed") for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
