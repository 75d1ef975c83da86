"""How sure a speed estimate is: the range the fit's cross-validated errors support, and what the
estimate rests on.

An estimate rests on runs measured on the same chip and the same shape family (method, model size,
sequence length), on runs of the same chip but other shapes, or on other chips only. Each of the
three has its own spread, the root mean square of the log errors bench/speed_fit.py finds when it
plans rows it was not fitted on: leave one row out, leave its shape family out, leave its chip out.
Terms no GPU run has measured yet (communication, offload, compiled blocks) widen the range by an
ASSUMED spread each. "Likely" is the central 80 % of a log-normal error with that spread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune.plan.params import count_params
from finetune.plan.workload import Workload

# Shape families: the method, the model's size and the sequence length, in bands.
SIZE_BANDS = ((2e9, "<2B"), (20e9, "2–20B"), (math.inf, "≥20B"))
SEQ_BANDS = ((1536, "seq ≤1k"), (6144, "seq 2k–4k"), (math.inf, "seq ≥8k"))

# Written by `python bench/speed_fit.py --fit` with CALIBRATION: the shape families measured on each
# chip, and the RMS log error of estimates that rest on the same chip and family ("measured",
# leave-one-out), on the same chip but another family ("shape", leave-one-family-out) and on other
# chips only ("chip", leave-one-chip-out).
MEASURED = {
    "A100": ("qlora 2–20B seq ≤1k", "qlora 2–20B seq 2k–4k", "qlora 2–20B seq ≥8k"),
    "H100": ("full 2–20B seq ≤1k", "full <2B seq 2k–4k", "full <2B seq ≤1k", "lora 2–20B seq 2k–4k",
             "lora <2B seq ≤1k", "qlora 2–20B seq 2k–4k", "qlora <2B seq ≤1k"),
}
SPREAD = {"measured": 0.132, "shape": 0.17, "chip": 0.3}
# The model code (transformers' model_type) of the whole runs fitted, written with MEASURED: another
# architecture runs other kernels (biases, extra norms, other head layouts) and per-update work the
# fit has not seen (the H200 profile of Qwen2 decoder layers does not cover a whole run).
MEASURED_ARCHITECTURES = ("llama", "mistral")
# Terms no run of finetune has measured: their spread is ASSUMED (not fitted), added in quadrature.
# Model code never run: the first Qwen2.5 runs on an H100 ran 1.7–2.2× slower than a fit on Llama-family
# runs planned (log 0.5–0.8) where a Llama-3.2-3B run ran 1.1×. Communication and mixtures of experts
# are fitted to other programs' 8-GPU runs only (bench/RESULTS.md, *Speed model*: left out one at a
# time they come out within +8 … +28 %), which these spreads cover.
UNMEASURED_SPREAD = {"communication": 0.25, "offload": 0.4, "compiled blocks": 0.3,
                     "mixture-of-experts routing": 0.3, "model code": 0.4, "fp8 matmuls": 0.3}
# ± this many spreads hold the central 80 % of a normal distribution of log errors.
LIKELY_Z = 1.2816


@dataclass(frozen=True)
class SpeedRange:
    """The likely range as factors of the estimate, and what the estimate rests on."""

    low: float
    high: float
    basis: str
    measured: bool  # measured on this chip and shape family, nothing unmeasured on top


def band(value: float, bands: tuple[tuple[float, str], ...]) -> str:
    return next(name for limit, name in bands if value < limit)


def shape_family(w: Workload) -> str:
    """'lora 2–20B seq 2k–4k': the method, the model's size and the sequence length band."""
    return f"{w.method} {band(count_params(w.model).total, SIZE_BANDS)} {band(w.seq_len, SEQ_BANDS)}"


def unmeasured_terms(w: Workload) -> dict[str, str]:
    """What no GPU run behind the fit has measured: {UNMEASURED_SPREAD's key: how the basis names it}."""
    terms = {}
    if w.world_size > 1:
        terms["communication"] = "communication"
    if w.offload != "none":
        terms["offload"] = "offload"
    if w.compile:
        terms["compiled blocks"] = "compiled blocks"
    if w.fp8:
        terms["fp8 matmuls"] = "fp8 matmuls"
    if w.model.moe:
        terms["mixture-of-experts routing"] = "mixture-of-experts routing"
    if w.model.model_type not in MEASURED_ARCHITECTURES:
        terms["model code"] = f"{w.model.model_type} model code"
    return terms


def speed_range(w: Workload, chips: tuple[str, ...]) -> SpeedRange:
    """The likely range of `w`'s tokens/s and its basis, given the chips the calibration measured."""
    chip, family = w.gpu.chip, shape_family(w)
    if chip in chips and family in MEASURED.get(chip, ()):
        tier, basis = "measured", f"measured on {chip} ({family})"
    elif chip in chips:
        tier, basis = "shape", f"extrapolated on {chip} from other shapes (no {family} run)"
    else:
        tier, basis = "chip", f"extrapolated: no runs on {chip or w.gpu.name}; from {', '.join(chips)} runs"
    extra = unmeasured_terms(w)
    spread = math.sqrt(SPREAD[tier] ** 2 + sum(UNMEASURED_SPREAD[t] ** 2 for t in extra))
    if extra:
        basis += f"; {', '.join(extra.values())} modelled, not measured"
    width = math.exp(LIKELY_Z * spread)
    return SpeedRange(1 / width, width, basis, tier == "measured" and not extra)
