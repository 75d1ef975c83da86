"""Host cost of one decoder layer by model code, relative to Llama's: eager forward and backward of
tiny-width cuts on this CPU.

    python bench/layer_issue.py                 # every model type of the catalog, 5 rounds (~25 s)
    python bench/layer_issue.py --rounds 7      # more rounds (the median over rounds counts): bench/RESULTS.md's

The speed model's host clock (finetune/plan/speed.py) charges each decoder layer the time eager
transformers takes to issue its kernels, fitted on runs of Llama and Mistral model code only. Other
model code issues other work per layer: Qwen2's biases, Qwen3's and Gemma 3's extra norms, an MoE
router and its experts (transformers' grouped matmuls, on a CPU as on a GPU; the cut keeps at most
8). What a layer costs the host is Python and the dispatcher, the same on any machine, so it is
measured here, where the tensors are so small that executing the kernels costs next to nothing: each
catalog model type cut to width 64 (families.shrink: the same classes, biases, norms and head
ratio), built at 2 and 8 layers, every weight trained (LoRA's adapters are counted apart, per
adapted linear), one row of 16 tokens, the fastest of --steps forward and backward passes after a
warm-up (the fastest, not the median: on a shared machine a pass longer than the scheduler's slice
is preempted more often than a short one, which inflates long passes against short ones); a sixth of
the cuts' difference is one layer. The model types take turns, round by round, so a machine that
slows down mid-run slows them all; the median over rounds counts. Prints each model type's per-layer time and its
ratio to Llama's: `LAYER_ISSUE_RELATIVE` in finetune/plan/speed.py.

The chunked loss's loop (train/chunked_loss.py) takes its turn too: its forward and backward over
LOSS_TOKENS rows one token a chunk against the same rows in one chunk, a 1/(LOSS_TOKENS − 1) of the
difference per chunk: `LOSS_CHUNK_ISSUE_RELATIVE` (× a Llama layer) in finetune/plan/speed.py.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from finetune.library_logs import quiet_libraries
from finetune.models import catalog, families
from finetune.train import chunked_loss

CUTS = (2, 8)
WIDTH, TOKENS, VOCAB = 64, 16, 256
LOSS_TOKENS = 33


def model_types() -> dict[str, str]:
    """One catalog model per model type (the first listed), the CPU demos aside."""
    found = {}
    for name, spec in catalog.REAL_MODELS.items():
        found.setdefault(spec.model_type, name)
    return found


def cut(name: str, layers: int) -> torch.nn.Module:
    config = families.shrink(catalog.get(name).to_hf_config_dict(), layers=layers, hidden=WIDTH,
                             overrides={"vocab_size": VOCAB})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))


def seconds_per_pass(model: torch.nn.Module, steps: int, warmup: int = 3) -> float:
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(warmup + steps):
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - started)
    return min(times[warmup:])


def loss_seconds(chunk: int, steps: int, warmup: int = 3) -> float:
    """Median seconds of the chunked loss's forward and backward over LOSS_TOKENS rows, `chunk` tokens a
    chunk whatever the vocabulary, against a frozen head (LoRA's, QLoRA's)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, LOSS_TOKENS + 1, WIDTH, generator=generator, requires_grad=True)
    head = torch.randn(VOCAB, WIDTH, generator=generator)
    labels = torch.randint(0, VOCAB, (1, LOSS_TOKENS + 1), generator=generator)
    times = []
    with mock.patch.object(chunked_loss, "chunk_tokens", lambda vocab_size: chunk):
        for _ in range(warmup + steps):
            started = time.perf_counter()
            chunked_loss.chunked_cross_entropy(hidden, head, labels).backward()
            times.append(time.perf_counter() - started)
    return min(times[warmup:])


def per_layer_ms(cuts: dict[str, tuple[torch.nn.Module, torch.nn.Module]], steps: int, rounds: int) -> dict[str, float]:
    """Per model type, the median over rounds of the cuts' difference per layer, ms, and under "chunked
    loss" the loop's time per chunk; they take turns."""
    estimates = {t: [] for t in [*cuts, "chunked loss"]}
    for _ in range(rounds):
        for t, (shallow, deep) in cuts.items():
            difference = seconds_per_pass(deep, steps) - seconds_per_pass(shallow, steps)
            estimates[t].append(1000 * difference / (CUTS[1] - CUTS[0]))
        difference = loss_seconds(1, steps) - loss_seconds(LOSS_TOKENS, steps)
        estimates["chunked loss"].append(1000 * difference / (LOSS_TOKENS - 1))
    return {t: statistics.median(values) for t, values in estimates.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="passes per measurement (the fastest counts)")
    parser.add_argument("--rounds", type=int, default=5, help="measurements per model type, taking turns")
    args = parser.parse_args(argv)
    quiet_libraries()
    torch.set_num_threads(1)
    types = model_types()
    cuts = {t: (cut(name, CUTS[0]), cut(name, CUTS[1])) for t, name in types.items()}
    seconds_per_pass(cuts["llama"][1], args.steps)  # the first passes of the process pay one-off costs
    ms = per_layer_ms(cuts, args.steps, args.rounds)
    print("| model type | catalog model | ms per layer (forward + backward) | × llama |")
    print("|---|---|---|---|")
    for t, name in types.items():
        print(f"| {t} | {name} | {ms[t]:.3f} | {ms[t] / ms['llama']:.2f} |")
    print(f"| chunked loss, per chunk | - | {ms['chunked loss']:.3f} | {ms['chunked loss'] / ms['llama']:.3f} |")
    print(f"\nLAYER_ISSUE_RELATIVE = {({t: round(ms[t] / ms['llama'], 2) for t in types})!r}")
    print(f"LOSS_CHUNK_ISSUE_RELATIVE = {ms['chunked loss'] / ms['llama']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
