"""Fit the planner's speed model to measured GPU runs, print planned beside measured per row, and
how far the model carries: errors on rows, shape families and chips it was not fitted on.

    python bench/speed_fit.py                      # the committed CALIBRATION: every row, in and out of sample
    python bench/speed_fit.py --fit                # refit (prints CALIBRATION, MEASURED and SPREAD to paste)
    python bench/speed_fit.py --no-cross-validation  # in sample only (a few seconds instead of minutes)

What it fits (bench/speed_data.py reads each from the planner's package data, finetune/plan/calibration/):
- finetune's runs (measured/*.csv: one H100 80GB, one H200), on both clocks; the other programs' runs
  there are shown, and the ratio of TRL SFTTrainer with and without `use_liger_kernel` is fitted;
- LLaMA-Factory's Llama-2-7B QLoRA runs on one A100 40GB, and the published 8-GPU runs of a mixture
  of experts (prime-rl, Qwen3-30B-A3B) and of context parallelism (torchtitan, Llama-3.1-8B): another
  program on another host, so planned on the GPU clock only (our host's issue time says nothing about
  theirs); the 8-GPU rows weigh less (PUBLISHED_SPREAD: posed as finetune would run them, without their
  compile, FlashAttention 3 or Float8);
- the GPU kit's profile of 2- and 4-layer cuts on the H200 (speed_terms_h200.csv): per decoder layer
  the GPU's busy time by kernel class (matmul, attention, dequantization, the other kernels) beside the
  same classes of the plan (speed.kernel_classes). These are the only measurements that split the GPU's
  time between its terms (whole runs cannot tell a slow matmul from a slow elementwise kernel), so they
  are fitted. The profile's host time per layer and its "rest" (embedding, head and loss) are checks:
  the host per layer is another host's than the runs' (the H100's), and the rest mixes head, loss and
  embedding. The GPU kit's defaults on 2-layer cuts (speed_defaults_h200.csv: each loss, fused and
  foreach AdamW; ms per update) are checks too.

The fit: least squares on log errors over the coefficients in log space, with a weak prior per
coefficient (PRIOR: a plausible value and how far the data may move it) so that a coefficient no
remaining row constrains, in cross-validation, falls back to that value instead of to what the
left-out rows taught it. Out of sample, each row is planned by a fit without it (leave-one-out),
without its whole shape family on its chip (leave-one-family-out; the profile's cases of that family
leave with it), and without its chip (leave-one-chip-out: the chip's efficiencies then come from the
other chip, as for a GPU never measured). The RMS of each kind of error over the single-GPU rows is
the spread plan/speed_range.py gives plans that rest on the same footing.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed_data import (  # noqa: E402
    DEFAULTS,
    HOST,
    KERNEL_CLASSES,
    MEASURED,
    PUBLISHED,
    PUBLISHED_MOE_CP,
    TERMS,
    chip_of,
    default_cases,
    family_of,
    fitted,
    liger_pairs,
    log_error,
    moe_cp_rows,
    multi_gpu,
    per_layer,
    planned,
    published_rows,
    read_rows,
    rms,
    term_rows,
    workload_of,
)

from finetune.plan import gpus  # noqa: E402
from finetune.plan.speed import CALIBRATION, Calibration  # noqa: E402

# The committed model must plan every fitted single-GPU row within this relative error.
TOLERANCE = 0.25
# Host-clock coefficients (speed_data.HOST), then one matmul efficiency per GPU, one flash-attention speed
# per chip, then the GPU-clock coefficients and the clocks' overlap: the order of the fit's parameter vector.
GPU = ("masked_attention_speed", "memory_efficiency", "kernel_gpu_s", "expert_tokens_half", "overlap_exponent")
# (prior value, factor the data may move it by at one standard deviation): eager transformers issues
# a layer in a few ms, a PEFT linear or a bitsandbytes dequantization in a few tenths; matmuls reach
# about half of peak, elementwise kernels most of the datasheet bandwidth, flash attention about
# 60 % of the matmul rate (FlashAttention-2's reports), SDPA's kernel for an explicit mask half that;
# a kernel costs a few µs beyond its FLOPs and bytes (launch and tail); a grouped expert matmul loses
# half its rate at about a thousand tokens per expert; the host's and the GPU's clocks overlap well but
# not perfectly (p ≈ 4: equal clocks take 1.19× either).
PRIOR = {"layer_issue_s": (3e-3, 4.0), "adapter_issue_s": (0.3e-3, 4.0), "dequant_issue_s": (0.3e-3, 4.0),
         "matmul_efficiency": (0.5, 2.0), "attention_speed": (0.6, 2.0), "masked_attention_speed": (0.3, 2.0),
         "memory_efficiency": (0.8, 2.0), "kernel_gpu_s": (5e-6, 4.0), "expert_tokens_half": (1000.0, 4.0),
         "overlap_exponent": (4.0, 3.0)}
# Physical limits: no fraction of a peak above what the hardware can reach, no micro-batch longer
# than both clocks end to end (p = 1).
CEILING = {"matmul_efficiency": 0.95, "memory_efficiency": 1.0, "attention_speed": 1.0, "masked_attention_speed": 1.0}
FLOOR = {"overlap_exponent": 1.0}
# The log error a measured row is expected to carry (run-to-run noise and what the model leaves
# out): the data's weight against the prior. A published 8-GPU row carries more (posed as finetune
# would run it: another program's kernels, compile, FlashAttention 3 or Float8 left out), a profiled
# kernel class too (the difference of two cuts, and kernels sorted into classes by name).
ROW_SPREAD = 0.1
PUBLISHED_SPREAD = 0.2
TERM_SPREAD = 0.15


def all_rows(paths: list[Path], published: Path | None = PUBLISHED, moe_cp: Path | None = PUBLISHED_MOE_CP) -> list[dict]:
    """Every row with a measured tokens/s: the GPU kit's files, LLaMA-Factory's, the 8-GPU published ones."""
    rows = read_rows(paths) + (published_rows(published) if published else []) + (moe_cp_rows(moe_cp) if moe_cp else [])
    return [row for row in rows if row["tokens_per_second"]]


def term_errors(case: dict, calibration: Calibration) -> list[float]:
    """Log errors of the plan's kernel classes per layer against the profile's (a class the case does not run is skipped)."""
    plan, measured = per_layer(case, calibration), case["per layer"]
    return [math.log(plan[k] / measured[f"{k}_ms"]) for k in KERNEL_CLASSES if measured[f"{k}_ms"] > 0.01]


def residuals(calibration: Calibration, rows: list[dict], cases: list[dict]) -> list[float]:
    """Log errors of the fitted rows, of the Liger speed-ups against the measured pairs and of the
    profiled kernel classes, each over the spread it is expected to carry."""
    own = [log_error(r, calibration) / (PUBLISHED_SPREAD if multi_gpu(r) else ROW_SPREAD) for r in rows if fitted(r)]
    ratios = [(log_error(on, calibration) - log_error(off, calibration)) / ROW_SPREAD for off, on in liger_pairs(rows)]
    terms = [e / TERM_SPREAD for case in cases for e in term_errors(case, calibration)]
    return own + ratios + terms


def gpu_names(rows: list[dict], cases: list[dict]) -> list[str]:
    return sorted({gpus.get(r["device"]).name for r in rows + cases if fitted(r)})


def chip_names(rows: list[dict], cases: list[dict]) -> list[str]:
    return sorted({chip_of(r) for r in rows + cases if fitted(r)})


def parameter_names(cards: list[str], chips: list[str]) -> list[str]:
    return [*HOST, *["matmul_efficiency"] * len(cards), *["attention_speed"] * len(chips), *GPU]


def to_calibration(x: list[float], cards: list[str], chips: list[str]) -> Calibration:
    values = [math.exp(v) for v in x]
    host, rest = values[:len(HOST)], values[len(HOST):]
    efficiencies, speeds, gpu = rest[:len(cards)], rest[len(cards):len(cards) + len(chips)], rest[len(cards) + len(chips):]
    return Calibration(**dict(zip(HOST, host)), matmul_efficiency=dict(zip(cards, efficiencies)),
                       attention_speed=dict(zip(chips, speeds)), **dict(zip(GPU, gpu)))


def prior_terms(names: list[str]) -> list[tuple[float, float]]:
    """(log prior value, log of its spread) per parameter, in the vector's order."""
    return [(math.log(PRIOR[n][0]), math.log(PRIOR[n][1])) for n in names]


def bounds(names: list[str]) -> tuple[list[float], list[float]]:
    """Log bounds: FLOOR and CEILING where physics sets them, else 100× either side of the prior."""
    low = [math.log(FLOOR.get(n, PRIOR[n][0] / 100)) for n in names]
    return low, [math.log(CEILING.get(n, PRIOR[n][0] * 100)) for n in names]


def fit(rows: list[dict], cases: list[dict]) -> Calibration:
    """The coefficients that minimise the rows' and terms' weighted log errors plus the prior's."""
    from scipy.optimize import least_squares  # bench-only dependency

    cards, chips = gpu_names(rows, cases), chip_names(rows, cases)
    names = parameter_names(cards, chips)
    prior = prior_terms(names)

    def objective(x):
        data = residuals(to_calibration(x, cards, chips), rows, cases)
        return data + [(v - mean) / spread for v, (mean, spread) in zip(x, prior)]

    low, high = bounds(names)
    start = [min(mean, top - 0.01) for (mean, _), top in zip(prior, high)]
    result = least_squares(objective, start, bounds=(low, high))
    return to_calibration(result.x, cards, chips)


def held_out(rows: list[dict], cases: list[dict], group) -> dict[int, float]:
    """Each fitted row's log error under a fit without every row and profiled case of its group
    (`group(item)`; None: never left out)."""
    errors = {}
    for key in {group(r) for r in rows if fitted(r)} - {None}:
        calibration = fit([r for r in rows if group(r) != key], [c for c in cases if group(c) != key])
        for i, r in enumerate(rows):
            if fitted(r) and group(r) == key:
                errors[i] = log_error(r, calibration)
    return errors


def cross_validation(rows: list[dict], cases: list[dict]) -> dict[str, dict[int, float]]:
    """Log errors out of sample, by what was left out: the row, its shape family on its chip, its chip.
    A TRL ± Liger pair leaves with its chip only (it is a ratio, not a row); a profiled case with its
    family or chip, never with one row."""
    indexed = [r | {"index": i} for i, r in enumerate(rows)]
    return {
        "measured": held_out(indexed, cases, lambda r: r.get("index") if fitted(r) else None),
        "shape": held_out(indexed, cases, lambda r: family_of(r) if fitted(r) else None),
        "chip": held_out(indexed, cases, chip_of),
    }


def spreads(rows: list[dict], cv: dict[str, dict[int, float]]) -> dict[str, float]:
    """RMS log error per kind of leaving out, over the single-GPU rows (the 8-GPU rows carry the
    communication and mixture-of-experts spreads on top, plan/speed_range.py)."""
    single = {i for i, r in enumerate(rows) if not multi_gpu(r)}
    return {tier: round(rms([e for i, e in errors.items() if i in single]), 3) for tier, errors in cv.items()}


def measured_families(rows: list[dict]) -> dict[str, tuple[str, ...]]:
    """Per chip, the shape families of its fitted single-GPU runs."""
    found = defaultdict(set)
    for r in rows:
        if fitted(r) and not multi_gpu(r):
            chip, family = family_of(r)
            found[chip].add(family)
    return {chip: tuple(sorted(families)) for chip, families in sorted(found.items())}


def measured_architectures(rows: list[dict]) -> tuple[str, ...]:
    """The model code (transformers' model_type) of the fitted single-GPU runs. The profiled cases
    (Qwen2 among them) measured decoder layers, not whole runs: a whole run's per-update costs of
    another model code stay unmeasured (plan/speed_range.py's "model code" spread)."""
    return tuple(sorted({workload_of(r).model.model_type for r in rows if fitted(r) and not multi_gpu(r)}))


def main(argv: list[str] | None = None) -> int:
    import speed_report as report  # the tables

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, nargs="*", default=sorted(MEASURED.glob("*.csv")))
    parser.add_argument("--fit", action="store_true", help="refit the coefficients instead of using CALIBRATION")
    parser.add_argument("--no-cross-validation", action="store_true", help="skip the refits of the out-of-sample columns")
    args = parser.parse_args(argv)
    rows, cases = all_rows(args.csv), term_rows(TERMS)
    calibration = fit(rows, cases) if args.fit else CALIBRATION
    cv = None if args.no_cross_validation else cross_validation(rows, cases)
    names = parameter_names(gpu_names(rows, cases), chip_names(rows, cases))
    print(f"{len(names)} coefficients fitted to {sum(fitted(r) for r in rows)} rows, {len(liger_pairs(rows))} Liger "
          f"ratios and {sum(len(term_errors(c, calibration)) for c in cases)} profiled kernel classes, each with a weak prior\n")
    if args.fit:
        print(report.calibration_source(calibration, measured_families(rows), spreads(rows, cv) if cv else {},
                                        measured_architectures(rows)) + "\n")
    sections = [("", report.runs_table(rows, calibration, cv)),
                ("8-GPU published runs (GPU clock only):", report.published_table(rows, calibration, cv)),
                ("Per decoder layer, the GPU kit's profile (measured / planned; kernel classes fitted, host a check):",
                 report.terms_table(cases, calibration)),
                ("The rest of each profiled 2-layer cut (checks):", report.rest_table(cases, calibration)),
                ("The GPU kit's defaults on 2-layer cuts, ms per update (checks):",
                 report.defaults_table(default_cases(DEFAULTS), calibration))]
    if cv:
        sections.append(("Out-of-sample error by chip and shape family (RMS of the log errors, as ± %):", report.summary(rows, cv)))
    for title, lines in sections:
        print("\n".join(([title] if title else []) + lines) + "\n")
    if cv:
        print(f"spreads (RMS log error) for plan/speed_range.py: {spreads(rows, cv)}")
    single = [r for r in rows if fitted(r) and not multi_gpu(r)]
    worst = max(abs(planned(r, calibration) / float(r["tokens_per_second"]) - 1) for r in single)
    print(f"worst in-sample error over the {len(single)} fitted single-GPU rows: {worst:.0%} (target ≤ {TOLERANCE:.0%})")
    print("\n".join(report.liger_lines(rows, calibration)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
