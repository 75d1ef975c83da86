"""What a run reports: progress bar, metrics.jsonl, Accelerate trackers, loss curve, summary.

Only the main process writes or prints; every other rank gets the same calls and does nothing,
so callers never check ranks.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from finetune.config.run_folder import RunFolder, read_metrics
from finetune.train.speedups import compile_seconds


def peak_memory_gib() -> dict[str, float]:
    """Peak memory of this process: CUDA allocated and reserved (what the caching allocator holds,
    the part of nvidia-smi's figure a run controls) where a GPU is used, host RSS always."""
    peaks = {"peak_host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
    if torch.cuda.is_available():
        peaks["peak_gpu_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        peaks["peak_gpu_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return peaks


class MetricsRecorder:
    """One record per optimizer update: progress bar every update, metrics.jsonl and trackers every
    `log_every` updates (and the last)."""

    def __init__(self, accelerator, output_dir: str | Path, max_steps: int, log_every: int, start_step: int = 0):
        self.accelerator = accelerator
        self.log_every = log_every
        self.max_steps = max_steps
        self.path = RunFolder(output_dir).metrics
        self.active = accelerator.is_main_process
        self.tokens = 0
        self.compiled = compile_seconds()  # compilation so far; each update's share is reported apart
        self.compile_seconds = 0.0
        self.bar = tqdm(total=max_steps, initial=start_step, desc="train", disable=not self.active,
                        dynamic_ncols=True, file=sys.stdout)
        if start_step and self.active:
            keep_records_before_resume(self.path, start_step)

    def record_step(self, *, step: int, loss: float, lr: float, grad_norm: float | None, tokens: int, seconds: float,
                    cpu_seconds: float, aux_loss: float | None = None) -> None:
        """One update: `seconds` and `cpu_seconds` (this process's CPU time, which a shared machine's
        load disturbs far less) from its micro-batches in hand to the update done; `aux_loss`, a
        mixture of experts' load-balancing loss (mean over micro-batches), apart from `loss`."""
        self.tokens += tokens
        compiled, self.compiled = self.compiled, compile_seconds()
        compiling = min(self.compiled - compiled, seconds)  # the first update of a compiled run, or a recompile
        self.compile_seconds += compiling
        training = seconds - compiling
        tokens_per_second = tokens / training if training else 0.0
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:,.0f}", refresh=False)
        if step >= self.max_steps:
            self.bar.close()  # training is over: its clock stops before the final evaluation's bars
        if step % self.log_every and step != self.max_steps:
            return
        record = {"step": step, "loss": loss, **({} if aux_loss is None else {"aux_loss": aux_loss}),
                  "lr": lr, "grad_norm": grad_norm, "tokens": self.tokens,
                  "tokens_per_second": tokens_per_second, "compile_seconds": self.compile_seconds,
                  "seconds": seconds, "cpu_seconds": cpu_seconds, **peak_memory_gib()}
        self._write(record)

    def record_eval(self, step: int, result: dict) -> None:
        record = {"step": step, **{k: v for k, v in result.items() if k != "samples"}}
        self._write(record)
        if self.active:
            tqdm.write(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()),
                       file=sys.stdout)

    def _write(self, record: dict) -> None:
        if not self.active:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.accelerator.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])

    def close(self) -> None:
        self.bar.close()


def keep_records_before_resume(path: Path, step: int) -> None:
    """Drop what the interrupted run logged after the checkpoint it resumes from (those steps run
    again), and its evaluation at that step (the resumed run evaluates there again), so a resumed
    run's metrics.jsonl reads like an uninterrupted one's."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r["step"] < step or (r["step"] == step and "eval_loss" not in r)]
    path.write_text("".join(json.dumps(record) + "\n" for record in kept))


def plot_loss_curve(metrics_path: str | Path, png_path: str | Path) -> None:
    """Training loss (and eval loss where recorded) against optimizer steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o--", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (token-weighted)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
