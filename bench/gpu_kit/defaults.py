"""The defaults no GPU has run yet, each beside its alternative, on 2-layer cuts of full-width catalog shapes.

    python bench/gpu_kit/defaults.py --out DIR [--deadline EPOCH_SECONDS]     # on the GPU (bench/gpu_kit/run.sh, first)
    python bench/gpu_kit/defaults.py --dry-run [--gpu H200]                   # the cases and their planned figures

Mistral-7B and Llama-3.1-8B cut to 2 decoder layers (the real width, heads, MLP and vocabulary, so
the LM head and the loss are full size and each step takes well under a second), random init in
bf16, written once into --work. Every case builds its model through the trainer's own pieces
(resolve_run, loading.load_model, train.speedups.apply_speedups, optim.build_optimizer), so what it
measures is what a run with those flags does:

- the loss, for LoRA and QLoRA (bf16-true, r16 on every linear layer, seq 4096 × micro batch 2): the
  model's own, the chunked loss (the default) and Liger's fused loss (the default where liger-kernel
  is installed). The first step's loss and LoRA gradients against the model's own (lora_B starts
  seeded, not at zero, so every adapter has a gradient), the peak allocated memory of a step against
  the plan of exactly that run, ms per update (median after the first). Liger's cases come last:
  it patches transformers' modules for the rest of the process.
- AdamW for full fine-tuning (bf16-mixed, seq 512 × 1): fused (the run's, on a GPU) against foreach
  (torch's default on CUDA): the memory the optimizer step adds beside the plan's step scratch, ms per update.
- the allocator: whether expandable segments are in effect in this process, which sets
  PYTORCH_CUDA_ALLOC_CONF as finetune's entry does (before torch loads), and in one that imports
  torch first and sets it after, as the kit's forked rows do.

A case that cannot run here (Liger without CUDA or liger-kernel) is listed as "skipped: why"; one
that would start too close to --deadline as "not run: time". Writes DIR/defaults.md (device, date,
versions, command) and DIR/defaults.csv after every case; exits 0 unless a case failed.
On CPU (tests/gpu_kit/test_gpu_kit.py) the same code runs with --shapes tiny at a tiny size, without peaks.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KIT = Path(__file__).resolve().parent
sys.path[:0] = [str(REPO), str(KIT)]

from finetune.cli import use_expandable_segments  # noqa: E402

use_expandable_segments()  # as finetune's entry does, before torch loads: the allocator case checks it took

import torch  # noqa: E402

from finetune.config.options import TrainConfig  # noqa: E402
from finetune.config.resolve import Launch, resolve_run  # noqa: E402
from finetune.library_logs import quiet_libraries, quiet_transformers_bars  # noqa: E402
from finetune.models import catalog  # noqa: E402
from finetune.plan import gpus  # noqa: E402
from finetune.plan.memory import GIB, estimate, model_states, place_states  # noqa: E402
from finetune.plan.workload import from_run  # noqa: E402
from finetune.train import loading  # noqa: E402
from finetune.train.dry_run import device_of  # noqa: E402
from finetune.train.optim import build_optimizer  # noqa: E402
from finetune.train.run import this_device  # noqa: E402
from finetune.train.speedups import apply_speedups, with_model  # noqa: E402

SHAPES = ("mistral-7b", "llama-3.1-8b")
LAYERS = 2
LOSS_ORDER = ("transformers", "finetune-chunked", "liger")  # the model's own first: the others are compared with it
MIN_CASE_SECONDS = 20  # loading a 2-layer cut (3 GB at Llama's 128k vocabulary), quantizing it, a few updates
CSV_FIELDS = ("shape", "method", "variant", "status", "loss", "loss_vs_own", "grads_vs_own", "peak_gib", "planned_gib",
              "step_gib", "planned_step_gib", "ms_per_update", "notes")


@dataclass(frozen=True)
class Case:
    shape: str
    method: str  # lora | qlora | full
    variant: str  # the loss (config.switches.LOSSES) for lora/qlora; fused | foreach for full

    @property
    def label(self) -> str:
        return f"{self.shape} {self.method} {self.variant}"

    def config(self, model_dir: Path, args: argparse.Namespace) -> TrainConfig:
        """The trainer's flags of the case (what `python -m finetune` would run)."""
        if self.method == "full":
            return TrainConfig(model=str(model_dir), method="full", precision=args.full_precision, max_seq_len=512,
                               micro_batch_size=1, liger=False, chunked_loss=False, output_dir=str(args.work / "out"))
        return TrainConfig(model=str(model_dir), method=self.method, precision=args.precision, max_seq_len=args.seq_len,
                           micro_batch_size=args.micro_batch_size, lora_targets="all-linear", lora_r=16,
                           liger=self.variant == "liger", chunked_loss={"transformers": False, "finetune-chunked": True}.get(self.variant),
                           output_dir=str(args.work / "out"))


def cases(shapes: tuple[str, ...]) -> list[Case]:
    """The model's own loss and the chunked loss of every shape and method, then full fine-tuning's
    two AdamWs, then Liger's cases (it patches transformers' modules for the rest of the process)."""
    losses = [Case(shape, method, loss) for shape in shapes for method in ("lora", "qlora") for loss in LOSS_ORDER[:2]]
    adamw = [Case(shape, "full", kind) for shape in shapes for kind in ("fused", "foreach")]
    liger = [Case(shape, method, "liger") for shape in shapes for method in ("lora", "qlora")]
    return losses + adamw + liger


def model_dir(shape: str, args: argparse.Namespace, weights: bool) -> Path:
    """The 2-layer cut's folder in --work (`cut`)."""
    return cut(shape, LAYERS, args.work, weights)


def cut(shape: str, layers: int, work: Path, weights: bool) -> Path:
    """A `layers`-deep cut of the catalog shape, in `work`: config.json (a dry run plans from it),
    and with `weights` a seeded random init in bf16, built on the GPU when there is one."""
    spec = replace(catalog.get(shape), num_layers=layers)
    folder = work / f"{shape}-{layers}-layers"
    if weights:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        loading.materialize_random_init(spec, folder, seed=0, dtype=torch.bfloat16, device=device)
    elif not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(spec.to_hf_config_dict()))
    return folder


def planned(case: Case, run, gpu) -> dict:
    """The plan of the case's run on `gpu` with the case's loss or AdamW (as on a GPU with liger-kernel):
    peak allocated, and for AdamW the step's scratch."""
    w = from_run(run, gpu)
    w = replace(w, fused_optimizer=case.variant == "fused") if case.method == "full" else replace(w, loss=case.variant)
    fields = {"planned_gib": round(estimate(w).allocated / GIB, 3)}
    if case.method == "full":
        fields["planned_step_gib"] = round(place_states(w, model_states(w)).step_scratch / GIB, 3)
    return fields


def run_case(case: Case, args: argparse.Namespace, gpu, own: dict) -> dict:
    """Build the case's model as the trainer does, train a few updates, measure; `own`: the model's
    own loss and gradients of each (shape, method), filled by its own case."""
    device = this_device()
    run = resolve_run(case.config(model_dir(case.shape, args, weights=True), args), Launch(), device)
    result = planned(case, run, gpu)
    switches = run.switches
    if case.method != "full" and switches.loss != case.variant:  # e.g. Liger without CUDA or liger-kernel
        return result | {"status": "skipped: " + "; ".join(switches.notes)}
    target = torch.device("cuda", 0) if device.cuda else torch.device("cpu")
    release()
    baseline = torch.cuda.memory_allocated() if device.cuda else 0
    torch.manual_seed(0)
    model = loading.load_model(run, target)
    said = []
    apply_speedups(model, with_model(run, model), said.append)
    seed_adapters(model)
    fused = case.variant == "fused" if case.method == "full" else switches.fused_adamw
    optimizer = build_optimizer(run.config, model, run.peak_lr, fused=fused)
    if case.variant == "foreach":
        for group in optimizer.param_groups:
            group["foreach"] = True  # torch's default on CUDA, said outright
    ids, autocast = random_batch(run, target)
    measured = updates(model, optimizer, ids, args.steps, baseline, autocast, keep_grads=case.method != "full")
    result |= {"status": "ok", "notes": " | ".join(said[:-1]), **measured.pop("fields")}
    if case.method != "full":
        result |= compared(case, measured, own)
    del model, optimizer
    release()
    return result


def random_batch(run, target: torch.device) -> tuple[torch.Tensor, torch.autocast]:
    """A seeded micro-batch of random ids of the run's shape on `target` (labels: the ids), and the
    autocast Accelerate wraps the forward in for the run's precision (-true included)."""
    shape = (run.batch.micro_batch_size, run.config.max_seq_len)
    ids = torch.randint(0, run.spec.vocab_size, shape, generator=torch.Generator().manual_seed(0)).to(target)
    return ids, torch.autocast(target.type, dtype=getattr(torch, run.precision.compute), enabled=run.precision.autocast)


def seed_adapters(model: torch.nn.Module) -> None:
    """lora_B from a seeded normal instead of PEFT's zeros, so lora_A's gradients are not all zero."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


def updates(model, optimizer, ids, steps: int, baseline: int, autocast, keep_grads: bool) -> dict:
    """`steps` updates on `ids` (labels: the ids), each forward under `autocast`; the first step's loss
    and trainable gradients, the peak allocated memory above `baseline`, what the optimizer step adds
    (after the first, which creates the states), ms per update."""
    cuda = ids.is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds, peak, step_peak, first = [], 0, 0, {}
    for step in range(steps):
        synchronize(cuda)
        started = time.perf_counter()
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            first = {"loss": loss.item(), "grads": {name: p.grad.detach().float().cpu().clone()
                                                    for name, p in model.named_parameters() if p.grad is not None}
                     if keep_grads else {}}
        if cuda:
            peak, before = max(peak, torch.cuda.max_memory_allocated()), torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        optimizer.step()
        if cuda:
            if step:  # the first step also creates the optimizer's states
                step_peak = max(step_peak, torch.cuda.max_memory_allocated() - before)
            peak = max(peak, torch.cuda.max_memory_allocated())
        optimizer.zero_grad(set_to_none=True)
        synchronize(cuda)
        seconds.append(time.perf_counter() - started)
    fields = {"loss": round(first["loss"], 5), "ms_per_update": round(1000 * statistics.median(seconds[1:]), 1),
              **({"peak_gib": round((peak - baseline) / GIB, 3), "step_gib": round(step_peak / GIB, 3)} if cuda else {})}
    return {"fields": fields, "loss": first["loss"], "grads": first["grads"]}


def compared(case: Case, measured: dict, own: dict) -> dict:
    """The model's own loss case stores its loss and gradients; the others say how far they are from them."""
    key = (case.shape, case.method)
    if case.variant == "transformers":
        own[key] = measured
        return {}
    if key not in own:
        return {}
    reference = own[key]
    errors = [float((g - reference["grads"][name]).norm() / reference["grads"][name].norm().clamp_min(1e-30))
              for name, g in measured["grads"].items()]
    return {"loss_vs_own": f"{measured['loss'] / reference['loss'] - 1:+.2e}",
            "grads_vs_own": f"{max(errors):.2e}" if errors else "no gradients"}


def synchronize(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def release() -> None:
    """Free what the last case left, so the next case's peak counts only its own tensors."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def allocator_state() -> str:
    """Whether the CUDA caching allocator of this process maps expandable segments (after one allocation)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    probe = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    flags = {segment.get("is_expandable") for segment in torch.cuda.memory_snapshot()}
    del probe
    if flags <= {None}:
        return "unknown: the memory snapshot does not say"
    return "expandable segments" if True in flags else "not expandable"


# A process that imports torch before it sets the allocator (the kit's forked rows: the server
# imported torch; finetune's entry sets PYTORCH_CUDA_ALLOC_CONF in the child)
SET_AFTER_TORCH = ("import sys, torch; sys.path[:0] = sys.argv[1:]; from finetune.cli import use_expandable_segments; "
                   "use_expandable_segments(); import defaults; print(defaults.allocator_state())")


def allocator_cases() -> list[dict]:
    """The allocator setting in this process and in one that imports torch first."""
    here = {"shape": "-", "method": "allocator", "variant": "set before torch loads (finetune's entry)",
            "status": "ok", "notes": f"{allocator_state()} (PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')})"}
    if not torch.cuda.is_available():
        return [here]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    done = subprocess.run([sys.executable, "-c", SET_AFTER_TORCH, str(REPO), str(KIT)], capture_output=True, text=True,
                          env=env, timeout=300)
    after = {"shape": "-", "method": "allocator", "variant": "set after torch is imported (forked rows)",
             "status": "ok" if done.returncode == 0 else f"exit {done.returncode}",
             "notes": (done.stdout.strip().splitlines() or [""])[-1] if done.returncode == 0 else done.stderr.strip()[-300:]}
    return [here, after]


def write_results(results: list[dict], out: Path, header: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "defaults.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)
    lines = [header, "", "| " + " | ".join(CSV_FIELDS) + " |", "|" + "---|" * len(CSV_FIELDS)]
    lines += ["| " + " | ".join(str(r.get(field, "")) for field in CSV_FIELDS) + " |" for r in results]
    (out / "defaults.md").write_text("\n".join(lines) + "\n")


def run_all(args: argparse.Namespace, gpu, header: str) -> list[dict]:
    """Every case in order, the allocator's first; the results rewritten after each."""
    results, own = [], {}
    if not args.dry_run:
        results += allocator_cases()
    for case in cases(args.shapes):
        result = {**asdict(case)}
        if args.dry_run:
            config = case.config(model_dir(case.shape, args, weights=False), args)
            result |= planned(case, resolve_run(config, Launch(), device_of(gpu)), gpu) | {"status": "dry run"}
        elif args.deadline and args.deadline - time.time() < MIN_CASE_SECONDS:
            result["status"] = "not run: time"
        else:
            try:
                result |= run_case(case, args, gpu, own)
            except Exception as e:  # one case's failure (an OOM, a kernel error) is its row, not the end of the run
                result |= {"status": f"failed: {type(e).__name__}", "notes": str(e).strip().splitlines()[0][:300] if str(e).strip() else ""}
                release()
        print(" | ".join(str(result.get(field, "")) for field in CSV_FIELDS if result.get(field, "") != ""), flush=True)
        results.append(result)
        write_results(results, args.out, header)
    return results


def quiet_start(args: argparse.Namespace):
    """Libraries' logs and bars off (the results are the output); the catalog GPU the plans are for."""
    quiet_libraries()
    quiet_transformers_bars()
    return gpu_of(args)


def gpu_of(args: argparse.Namespace):
    """The catalog GPU the plan column is for: --gpu, else GPU 0, else (a dry run on CPU) the H200 lent now."""
    if args.gpu:
        return gpus.get(args.gpu)
    if torch.cuda.is_available():
        found = gpus.identify(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory / GIB)
        if found is None:
            raise SystemExit(f"{torch.cuda.get_device_name(0)} is not in the GPU catalog (finetune/plan/gpus.py): pass --gpu")
        return found
    return gpus.get("H200")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "output" / "gpu-kit", help="where defaults.md and defaults.csv go")
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "finetune-gpu-defaults",
                        help="scratch: the 2-layer random-init checkpoints")
    parser.add_argument("--deadline", type=float, help="epoch seconds: no case starts less than 20 s before")
    parser.add_argument("--dry-run", action="store_true", help="list the cases with their planned figures, run nothing")
    parser.add_argument("--gpu", help="catalog GPU the plan column is for (default: GPU 0; on CPU, H200)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="catalog shapes to cut to 2 layers")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--precision", default="bf16-true", help="of the LoRA and QLoRA cases")
    parser.add_argument("--full-precision", default="bf16-mixed", help="of the AdamW cases")
    parser.add_argument("--steps", type=int, default=5, help="updates per case (ms per update: the median after the first)")
    args = parser.parse_args(argv)
    args.shapes = tuple(args.shapes.split(","))
    if args.steps < 2:
        parser.error("--steps must be at least 2: ms per update is the median after the first")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu = quiet_start(args)
    header = (f"finetune's defaults beside their alternatives, 2-layer cuts of full-width shapes: "
              f"{provenance('defaults.py', argv)}. Planned: what the planner plans for each case's run on {gpu.name}.")
    results = run_all(args, gpu, header)
    print(f"wrote {args.out / 'defaults.md'} and {args.out / 'defaults.csv'}")
    return 1 if any(r["status"].startswith(("failed", "exit")) for r in results) else 0


def provenance(script: str, argv: list[str] | None) -> str:
    """Where, when, with which versions and by which command a kit script ran: its results' header."""
    versions = ", ".join(f"{name} {metadata.version(name)}" for name in ("torch", "transformers", "peft", "bitsandbytes")
                         if _installed(name))
    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = f"python bench/gpu_kit/{script} " + " ".join(argv if argv is not None else sys.argv[1:])
    return f"{where}; {started}; {versions}; `{command}`"


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
