"""Fit the planner's speed model to measured GPU runs and print planned beside measured per row.

    python bench/speed_fit.py                      # the committed CALIBRATION against every measured row
    python bench/speed_fit.py --fit                # refit the coefficients (prints a CALIBRATION to paste)
    python bench/speed_fit.py --leave-one-out      # each finetune row planned by a fit without it
    python bench/speed_fit.py --csv bench/gpu/measured/h100-2026-11-25.csv --markdown

Rows come from bench/gpu/measured/*.csv (one GPU class per file, with device, date and versions).
finetune's own rows are fitted (log error, least squares); the Liger coefficient is fitted to the
ratio of TRL SFTTrainer with and without `use_liger_kernel` in the same command, since finetune has
no Liger run yet. Other programs' rows (TRL, a bare PEFT loop) are printed for comparison only.
The reserved-memory slack is fitted as the largest reserved/allocated − 1 over the rows measured with
`expandable_segments:True` (the allocator finetune sets); default-allocator rows are shown beside it.
"""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import astuple, fields, replace
from pathlib import Path

from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.speed import CALIBRATION, Calibration, estimate_speed
from finetune.plan.workload import Workload

MEASURED = Path(__file__).parent / "gpu/measured"
# The committed model must plan every measured finetune row within this relative error (issue 15).
TOLERANCE = 0.25


def read_rows(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            rows += [row | {"file": path.name} for row in csv.DictReader(f)]
    return rows


def speed_rows(rows: list[dict]) -> list[dict]:
    return [row for row in rows if row["tokens_per_second"]]


def workload_of(row: dict) -> Workload:
    """The planner's Workload for one measured single-GPU row."""
    return Workload(
        model=catalog.get(row["model"]), gpu=gpus.get(row["device"]), gpus_per_node=1, method=row["method"],
        strategy="single", offload="none", precision=row["precision"], optimizer="adamw",
        micro_batch_size=int(row["micro_batch_size"]), seq_len=int(row["seq_len"]),
        gradient_checkpointing=row["gradient_checkpointing"] == "true", lora_r=int(row["lora_r"]),
        lora_targets=row["lora_targets"], loss="liger" if row["liger"] == "on" else "transformers",
        compile=row["compile"] == "on",
    )


def planned(row: dict, calibration: Calibration = CALIBRATION) -> float:
    return estimate_speed(workload_of(row), calibration).tokens_per_second


def liger_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(without, with) Liger rows of the same program and shape."""
    def key(row):
        return row["framework"], row["model"], row["method"], row["seq_len"], row["micro_batch_size"]
    off = {key(r): r for r in rows if r["liger"] == "off"}
    return [(off[key(r)], r) for r in rows if r["liger"] == "on" and key(r) in off]


def residuals(calibration: Calibration, rows: list[dict]) -> list[float]:
    """Log errors of finetune's rows, and of the Liger speed-up against the measured pairs."""
    own = [math.log(planned(r, calibration) / float(r["tokens_per_second"])) for r in rows if r["framework"] == "finetune"]
    ratios = [math.log((planned(on, calibration) / planned(off, calibration))
                       / (float(on["tokens_per_second"]) / float(off["tokens_per_second"])))
              for off, on in liger_pairs(rows)]
    return own + ratios


def fit(rows: list[dict]) -> Calibration:
    """Least squares on log errors, coefficients searched in log space (all positive)."""
    from scipy.optimize import least_squares  # bench-only dependency

    names = [f.name for f in fields(Calibration)]
    start = [math.log(max(v, 1e-6)) for v in astuple(CALIBRATION)]

    def calibration(x) -> Calibration:
        return Calibration(**{n: math.exp(v) for n, v in zip(names, x)})

    result = least_squares(lambda x: residuals(calibration(x), rows), start)
    return calibration(result.x)


def leave_one_out(rows: list[dict]) -> list[str]:
    """Out-of-sample errors: 8 rows and 6 coefficients make in-sample errors optimistic."""
    lines = []
    for i, row in enumerate(rows):
        if row["framework"] != "finetune":
            continue
        calibration = fit(rows[:i] + rows[i + 1:])
        error = planned(row, calibration) / float(row["tokens_per_second"]) - 1
        lines.append(f"{row['model']:<13} {row['method']:<5} s{row['seq_len']:<5} b{row['micro_batch_size']} "
                     f"left out: planned {planned(row, calibration):>9,.0f} vs measured {float(row['tokens_per_second']):>9,.0f} "
                     f"({error:+.0%})")
    return lines


def reserved_slack(rows: list[dict]) -> tuple[float, list[dict]]:
    """Largest reserved/allocated − 1 among rows with expandable segments, and the rows it rests on."""
    measured = [r for r in rows if r["allocated_gib"] and r["reserved_gib"]]
    expandable = [r for r in measured if r["allocator"] == "expandable_segments"]
    slack = max((float(r["reserved_gib"]) / float(r["allocated_gib"]) - 1 for r in expandable), default=float("nan"))
    return slack, measured


def table(rows: list[dict], calibration: Calibration) -> list[str]:
    lines = ["| file | program | model | method | seq | mbs | ckpt | liger | measured tok/s | planned tok/s | error | bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in speed_rows(rows):
        speed = estimate_speed(workload_of(r), calibration)
        error = speed.tokens_per_second / float(r["tokens_per_second"]) - 1
        fitted = "" if r["framework"] == "finetune" else " (not fitted)"
        lines.append(f"| {r['file']} | {r['framework']}{fitted} | {r['model']} | {r['method']} | {r['seq_len']} | "
                     f"{r['micro_batch_size']} | {r['gradient_checkpointing']} | {r['liger']} | "
                     f"{float(r['tokens_per_second']):,.0f} | {speed.tokens_per_second:,.0f} | {error:+.0%} | "
                     f"{'host (launch)' if speed.launch_bound else 'GPU'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, nargs="*", default=sorted(MEASURED.glob("*.csv")))
    parser.add_argument("--fit", action="store_true", help="refit the coefficients instead of using CALIBRATION")
    parser.add_argument("--leave-one-out", action="store_true", help="plan each finetune row with a fit that left it out")
    args = parser.parse_args(argv)
    rows = read_rows(args.csv)
    if args.leave_one_out:
        print("\n".join(leave_one_out(speed_rows(rows))))
        return 0
    calibration = fit(speed_rows(rows)) if args.fit else CALIBRATION
    if args.fit:
        print("CALIBRATION = " + repr(replace(calibration)).replace("Calibration(", "Calibration(\n    ") + "\n")
    print("\n".join(table(rows, calibration)))
    own = [r for r in speed_rows(rows) if r["framework"] == "finetune"]
    worst = max(abs(planned(r, calibration) / float(r["tokens_per_second"]) - 1) for r in own)
    print(f"\nworst error over finetune's {len(own)} rows: {worst:.0%} (target ≤ {TOLERANCE:.0%})")
    for off, on in liger_pairs(rows):
        print(f"Liger speed-up, {on['framework']} {on['model']} {on['method']}: measured "
              f"{float(on['tokens_per_second']) / float(off['tokens_per_second']):.3f}×, "
              f"planned {planned(on, calibration) / planned(off, calibration):.3f}×")
    slack, measured = reserved_slack(rows)
    print(f"\nreserved ÷ allocated − 1 with expandable_segments (fitted slack): {slack:.3f}")
    for r in measured:
        ratio = float(r["reserved_gib"]) / float(r["allocated_gib"])
        print(f"  {r['allocator']:<20} {r['model']:<13} {r['method']:<5} s{r['seq_len']:<5} b{r['micro_batch_size']}: "
              f"{r['allocated_gib']} GiB allocated, {r['reserved_gib']} reserved ({ratio:.3f}×)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
