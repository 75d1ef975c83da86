"""`finetune scaling`: tokens/s of the same per-process micro batch on 1, 2, 4 … processes.

    finetune scaling [--config_file accelerate_configs/ddp.yaml] [--processes 1,2,4] [--json] [--png FILE] [training flags]

Each process count runs the real training command (`accelerate launch … -m finetune`) for a fixed
number of optimizer updates with the per-process micro batch and accumulation fixed (weak scaling:
the global batch grows with the processes). Reported per count: tokens/s over the updates after the
warm-up, speedup over one process, scaling efficiency = tokens/s with N ÷ (N × tokens/s with 1),
and the communication share: one update's gradient all-reduce, timed alone on N processes, over
the update time (an upper bound for DDP, which overlaps it with the backward). Beside it, the
efficiency the planner's communication model (plan/speed.py) predicts from the measured
one-process update time and the measured all-reduce: where the two disagree, something other than
communication costs time (on CPU: processes sharing cores and memory bandwidth).

On CPU each process is one thread (OMP_NUM_THREADS=1) and the processes talk over gloo: one core
stands for one device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from finetune.config.flags import parse_command, save_yaml
from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.config.run_folder import RunFolder
from finetune.errors import FinetuneError
from finetune.launch import rehearse
from finetune.plan.gpus import GPUSpec, identify
from finetune.plan.memory import model_states
from finetune.plan.speed import collectives, exposed_seconds, training_flops
from finetune.plan.workload import Workload, from_run
from finetune.train.accelerator import free_port

# Run-to-run spread of tokens/s ((max - min) / median over the repeats) above which a process
# count's numbers say more about the machine's other load than about scaling.
MAX_SPREAD = 0.10


@dataclass(frozen=True)
class Timing:
    """One launch of one process count."""

    tokens_per_second: float  # over the updates after the warm-up
    seconds_per_update: float
    wall_seconds: float  # the whole launch, start-up included
    cpu_seconds: float  # user + system CPU time of every process of the launch


@dataclass(frozen=True)
class Measurement:
    """One process count, repeated: medians, their spread, and what its gradient all-reduce costs."""

    processes: int
    tokens_per_second: float  # median over the repeats
    seconds_per_update: float  # median
    spread: float | None  # (max - min) / median of tokens/s; None from one repeat
    cpu_share: float  # median CPU time ÷ (wall time × processes): below 1, processes waited for a core or I/O
    all_reduce_seconds: float | None  # one update's gradients, timed alone; None for 1 process

    @classmethod
    def of(cls, processes: int, timings: list[Timing], all_reduce_seconds: float | None) -> Measurement:
        rates = sorted(t.tokens_per_second for t in timings)
        middle = statistics.median(rates)
        return cls(processes, middle, statistics.median(t.seconds_per_update for t in timings),
                   (rates[-1] - rates[0]) / middle if len(rates) > 1 else None,
                   statistics.median(t.cpu_seconds / (t.wall_seconds * processes) for t in timings), all_reduce_seconds)


@dataclass(frozen=True)
class ScalingRow:
    processes: int
    tokens_per_second: float
    speedup: float
    efficiency: float
    seconds_per_update: float
    spread: float | None
    cpu_share: float
    all_reduce_seconds: float | None
    communication_share: float | None
    model_efficiency: float | None  # the planner's communication model, from the measured times
    untrusted: tuple[str, ...] = ()  # why speedup and efficiency are not a result (see `doubts`)


def doubts(m: Measurement, baseline: Measurement, efficiency: float) -> tuple[str, ...]:
    """Why a row's speedup and efficiency cannot be trusted: an efficiency above 1 (N processes
    cannot do more than N times one: the baseline was slowed by something else), or tokens/s that
    varied more than MAX_SPREAD between repeats, here or in the 1-process baseline."""
    found = []
    if m.processes > 1 and efficiency > 1:
        found.append(f"efficiency {efficiency:.0%} > 100 %: impossible, the 1-process baseline ran slower than it can")
    found += _spread_doubts("", m)
    if m is not baseline:
        found += _spread_doubts("the 1-process baseline ", baseline)
    return tuple(found)


def _spread_doubts(whose: str, m: Measurement) -> list[str]:
    if m.spread is None:
        return [f"{whose or 'it '}ran once: no run-to-run spread to judge it by (--repeats 2 or more)"]
    if m.spread > MAX_SPREAD:
        return [f"{whose}tokens/s varied {m.spread:.0%} between repeats (> {MAX_SPREAD:.0%}): the machine was busy with "
                "other work"]
    return []


def rows_of(measured: list[Measurement], model_efficiencies: dict[int, float]) -> list[ScalingRow]:
    """Speedup and efficiency against the 1-process measurement, each row with its doubts."""
    one = next(m for m in measured if m.processes == 1)  # main() requires 1 among the counts
    rows = []
    for m in measured:
        speedup = m.tokens_per_second / one.tokens_per_second
        efficiency = speedup / m.processes
        rows.append(ScalingRow(
            processes=m.processes, tokens_per_second=m.tokens_per_second, speedup=speedup, efficiency=efficiency,
            seconds_per_update=m.seconds_per_update, spread=m.spread, cpu_share=m.cpu_share,
            all_reduce_seconds=m.all_reduce_seconds,
            communication_share=None if m.all_reduce_seconds is None else m.all_reduce_seconds / m.seconds_per_update,
            model_efficiency=model_efficiencies.get(m.processes, 1.0), untrusted=doubts(m, one, efficiency),
        ))
    return rows


def run_once(config: TrainConfig, accelerate_config: str | None, processes: int, updates: int, warmup: int,
             workdir: Path, cpu: bool, repeat: int = 0) -> Timing:
    """Train `warmup + updates` optimizer updates on `processes` processes; tokens/s and s/update
    over the updates after the warm-up, wall and CPU time of the whole launch."""
    run_dir = workdir / (f"processes-{processes}" + (f"-repeat-{repeat}" if repeat else ""))
    run_yaml = run_dir.with_suffix(".yaml")
    save_yaml(dataclasses.replace(
        config, output_dir=str(run_dir), max_steps=warmup + updates, log_every=1, save_every=0, save_final=False,
        eval_every=0, max_eval_examples=1, num_samples=0, resume=None, report_to="none"), run_yaml)
    command = rehearse.launch_command(accelerate_config, processes, free_port(), run_yaml)
    env = rehearse.rehearsal_env() if cpu else os.environ | {"HF_HUB_OFFLINE": "1"}
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    finished = subprocess.run(command, env=env, capture_output=True, text=True)
    wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    log = run_dir.with_suffix(".log")
    log.write_text(finished.stdout + finished.stderr)
    if finished.returncode != 0:
        tail = "\n".join((finished.stdout + finished.stderr).strip().splitlines()[-15:])
        raise FinetuneError(f"scaling: the {processes}-process run failed (exit {finished.returncode}; log: {log}):\n{tail}")
    steps = [r for r in RunFolder(run_dir).read_metrics() if "loss" in r]
    tokens = [b["tokens"] - a["tokens"] for a, b in zip([{"tokens": 0}] + steps, steps)]  # records hold running totals
    timed = [(n, n / r["tokens_per_second"]) for n, r in zip(tokens, steps) if r["step"] > warmup]
    seconds = sum(s for _, s in timed)
    cpu_seconds = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timing(sum(n for n, _ in timed) / seconds, seconds / len(timed), wall, cpu_seconds)


def model_efficiency(w: Workload, seconds_one_process: float, all_reduce_seconds: float) -> float:
    """Efficiency the planner's communication model predicts when fed measured numbers: the
    one-process update time (split into forward and backward as the model counts FLOPs) and the
    bus bandwidth of the measured gradient all-reduce (no extra latency: it is in the measurement)."""
    n, gradients = w.world_size, model_states(w).gradients
    gb_per_s = 2 * (n - 1) / n * gradients / all_reduce_seconds / 1e9
    forward, backward = training_flops(w)
    micro = seconds_one_process / w.gradient_accumulation_steps
    exposed = exposed_seconds(collectives(w), gb_per_s, 0.0, micro * forward / (forward + backward),
                              micro * backward / (forward + backward), w.gradient_accumulation_steps)
    return seconds_one_process / (seconds_one_process + exposed)


def scale(config: TrainConfig, accelerate_config: str | None, process_counts: list[int], updates: int, warmup: int,
          workdir: Path, repeats: int = 1) -> tuple[list[ScalingRow], str, str]:
    """Measure every process count `repeats` times (interleaved, so slow phases of a shared machine
    fall on every count); rows in the order given, what the processes ran on, and the strategy of
    the largest count (the planner's name for it)."""
    import torch

    from finetune.launch.bandwidth import spawn_all_reduce

    cpu = not torch.cuda.is_available()
    if cpu:
        device, gpu, this = "cpu (gloo, 1 thread per process)", GPUSpec("cpu", 0.0, 0.0, False, "gloo", 0.0, 0.0, 0.0), Device()
    else:
        props = torch.cuda.get_device_properties(0)
        device, memory = f"{props.name} (nccl)", props.total_memory / 2**30
        gpu = identify(props.name, memory) or GPUSpec(props.name, memory, 0.0, True, "?", 0.0, 0.0, 0.0)
        this = Device(cuda=True, name=props.name, bf16=torch.cuda.is_bf16_supported())
    timings: dict[int, list[Timing]] = {processes: [] for processes in process_counts}
    for repeat in range(repeats):
        for processes in process_counts:
            timings[processes].append(run_once(config, accelerate_config, processes, updates, warmup, workdir, cpu, repeat))
    measured, workloads = [], {}
    for processes in process_counts:
        # the planner's view of exactly this run, through the one run → workload translation
        w = workloads[processes] = from_run(resolve_run(config, Launch.from_accelerate_config(accelerate_config, processes), this), gpu)
        all_reduce = None
        if processes > 1:
            gradients = int(model_states(w).gradients)
            (timing,) = spawn_all_reduce(processes, [gradients], "gloo" if cpu else "nccl")
            all_reduce = timing.seconds
        measured.append(Measurement.of(processes, timings[processes], all_reduce))
    one = next(m for m in measured if m.processes == 1)
    modelled = {m.processes: model_efficiency(workloads[m.processes], one.seconds_per_update, m.all_reduce_seconds)
                for m in measured if m.all_reduce_seconds is not None}
    return rows_of(measured, modelled), device, workloads[max(process_counts)].strategy.name


def format_table(rows: list[ScalingRow], title: str) -> str:
    """The rows; a row with doubts shows no speedup or efficiency ("untrusted"), and its reasons follow."""
    header = ("processes", "tokens/s", "spread", "cpu share", "speedup", "efficiency", "s/update", "all-reduce",
              "comm share", "model eff.")
    table = [header] + [(
        str(r.processes), f"{r.tokens_per_second:,.0f}", "-" if r.spread is None else f"{r.spread:.0%}", f"{r.cpu_share:.0%}",
        "untrusted" if r.untrusted else f"{r.speedup:.2f}", "untrusted" if r.untrusted else f"{r.efficiency:.1%}",
        f"{r.seconds_per_update:.3f}", "-" if r.all_reduce_seconds is None else f"{r.all_reduce_seconds * 1e3:.1f} ms",
        "-" if r.communication_share is None else f"{r.communication_share:.1%}", f"{r.model_efficiency:.1%}",
    ) for r in rows]
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    lines = [title] + ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in table]
    lines.append("tokens/s and s/update: medians over the repeats; spread = (max - min) ÷ median tokens/s; cpu share = CPU "
                 "time ÷ (wall time × processes) of the whole launch; efficiency = tokens/s ÷ (processes × tokens/s of 1); "
                 "comm share = gradient all-reduce timed alone ÷ update time; model eff. = the planner's communication "
                 "model fed with the measured times")
    lines += [f"not trustworthy, {r.processes} process(es): {'; '.join(r.untrusted)}" for r in rows if r.untrusted]
    return "\n".join(lines)


def draw_png(rows: list[ScalingRow], title: str, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    processes = [r.processes for r in rows]
    figure, throughput = plt.subplots(figsize=(6.5, 4.5))
    throughput.plot(processes, [r.tokens_per_second for r in rows], "o-", label="measured tokens/s")
    base = rows[[r.processes for r in rows].index(1)].tokens_per_second
    throughput.plot(processes, [base * p for p in processes], "--", color="grey", label="linear scaling")
    throughput.set_xlabel("processes")
    throughput.set_ylabel("tokens/s")
    throughput.set_xticks(processes)
    efficiency = throughput.twinx()
    efficiency.plot(processes, [100 * r.efficiency for r in rows], "s:", color="tab:red", label="efficiency (measured)")
    efficiency.plot(processes, [100 * r.model_efficiency for r in rows], "x:", color="tab:purple", label="efficiency (model)")
    efficiency.set_ylabel("efficiency %")
    efficiency.set_ylim(0, 110)
    handles = throughput.get_legend_handles_labels()[0] + efficiency.get_legend_handles_labels()[0]
    throughput.set_title(textwrap.fill(title, 70), fontsize=9)
    figure.tight_layout(rect=(0, 0.12, 1, 1))
    figure.legend(handles=handles, loc="lower center", ncol=2, fontsize=8)
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def default_process_counts() -> list[int]:
    """1, 2, 4, … up to the GPUs of this machine (CPU cores without a GPU)."""
    import torch

    devices = torch.cuda.device_count() if torch.cuda.is_available() else os.cpu_count() or 1
    return [2**k for k in range(devices.bit_length()) if 2**k <= devices]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="finetune scaling",
        description="Train the same per-process micro batch on 1, 2, 4 … processes for a fixed number of updates and "
        "report tokens/s, speedup, scaling efficiency and the communication share. Every other flag is a training "
        "flag (see `finetune --help`).",
    )
    parser.add_argument("--config_file", help="accelerate config to launch with (default: DDP, as `accelerate launch --multi_gpu`)")
    parser.add_argument("--processes", help="comma-separated process counts including 1 (default: 1, 2, 4 … up to the devices)")
    parser.add_argument("--updates", type=int, default=8, help="timed optimizer updates per process count")
    parser.add_argument("--warmup-updates", type=int, default=2, help="updates run first and not timed")
    parser.add_argument("--repeats", type=int, default=3, help="launches per process count (interleaved); the table "
                        f"shows medians and flags a spread above {MAX_SPREAD * 100:.0f} %% or an efficiency above 100 %% as untrusted")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--png", metavar="FILE", help="draw tokens/s and efficiency against processes")
    parser.add_argument("--workdir", help="where runs and logs go (default: a new temporary dir, kept)")
    args, train_args = parser.parse_known_args(argv)
    command = parse_command(train_args)
    config = command.config
    if config.global_batch_size is not None:
        raise FinetuneError("scaling keeps the per-process micro batch and accumulation fixed, so the global batch grows "
                            "with the processes: drop --global-batch-size (use --gradient-accumulation-steps)")
    if args.updates < 1 or args.warmup_updates < 0 or args.repeats < 1:
        raise FinetuneError("--updates and --repeats must be ≥ 1 and --warmup-updates ≥ 0")
    try:
        counts = [int(p) for p in args.processes.split(",")] if args.processes else default_process_counts()
    except ValueError:
        raise FinetuneError(f"--processes {args.processes!r}: give comma-separated integers, e.g. 1,2,4") from None
    if 1 not in counts or min(counts) < 1:
        raise FinetuneError(f"--processes {args.processes}: include 1 (the baseline) and only positive counts, e.g. 1,2,4")
    accelerate_config = rehearse.launch_config(args.config_file)
    if accelerate_config is not None and not Path(accelerate_config).is_file():
        raise FinetuneError(f"--config_file {accelerate_config}: no such file (see accelerate_configs/)")
    # what a DeepSpeed JSON adopts for options the user did not give is decided here, once: each
    # process count's run.yaml then holds it (a YAML counts every key it holds as given)
    from finetune.train.run import this_device

    config = resolve_run(config, Launch.from_accelerate_config(accelerate_config, 1), this_device(), command.given).config
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="finetune-scaling-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows, device, strategy = scale(config, accelerate_config, counts, args.updates, args.warmup_updates, workdir, args.repeats)
    title = (f"{config.model} ({config.method}), {strategy}, micro batch {config.micro_batch_size} "
             f"per process, {args.updates} timed updates, on {device}")
    if args.json:
        print(json.dumps({"model": config.model, "method": config.method, "strategy": strategy,
                          "accelerate_config": accelerate_config, "micro_batch_size": config.micro_batch_size,
                          "updates": args.updates, "repeats": args.repeats, "max_spread": MAX_SPREAD, "device": device,
                          "results": [dataclasses.asdict(r) for r in rows]}, indent=2))
    else:
        print(format_table(rows, title))
    if args.png:
        path = draw_png(rows, title, args.png)
        if not args.json:
            print(f"wrote {path}")
    return 0
