"""What the model learns at today's defaults, and with each speed switch flipped.

    python bench/quality.py                  # every row (about an hour on a 2-core CPU)
    python bench/quality.py --only embedded  # the embedded default's rows (~10 minutes)
    python bench/quality.py --padding-only   # what grouping saves, without training (a minute)
    python bench/quality.py --json out.json  # also keep the numbers

A switch that exists for speed stays on by default only where flipping it leaves the seeded eval
loss within the spread of three seeds and the exact match the same, on both runs README starts with:
the embedded default (`python -m finetune`, README step 1) and the SmolLM2-135M smart-home LoRA demo.
Every row is the real command in a fresh process (its summary.json is read back). The switches that
act on this CPU: length-grouped micro-batches (`--group-by-length`, which only reorders rows inside
an update, so it changes nothing where an update is one micro-batch: the embedded default is also run
split into micro 4 × accumulation 4) and the chunked loss (on for LoRA). Fused AdamW and flex
attention act only on CUDA; bench/gpu_kit/ measures them when a GPU is lent.

A second table shows what grouping buys: padded tokens as a share of all tokens, for the two
datasets at a few micro-batch × update splits, with uniformly random micro-batches, with the rows of
each update grouped by length (finetune), and with the Trainer's `group_by_length` (megabatches of
50 updates sorted by length, which made each update one length class and cut what the embedded
default learns from 73 % to 15 % exact match).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from finetune.config.run_folder import RunFolder

REPO = Path(__file__).resolve().parents[1]
DEMO = ["--model", "smollm2-135m", "--method", "lora", "--lr", "1e-3", "--dataset", str(REPO / "examples" / "smarthome"),
        "--eval-split", "test", "--eval-generate", "50", "--micro-batch-size", "8", "--max-seq-len", "128",
        "--warmup-steps", "3", "--max-steps", "30"]
SPLIT = ["--micro-batch-size", "4", "--global-batch-size", "16"]
# (run, what differs from README's command, extra flags, seeds)
ROWS = (
    ("embedded", "defaults", [], (0, 1, 2)),
    ("embedded", "--no-group-by-length", ["--no-group-by-length"], (0, 1, 2)),
    ("embedded", "micro 4 × accumulation 4", SPLIT, (0,)),
    ("embedded", "micro 4 × accumulation 4, --no-group-by-length", SPLIT + ["--no-group-by-length"], (0,)),
    ("smollm2", "defaults (LoRA)", [], (0, 1, 2)),
    ("smollm2", "--no-chunked-loss", ["--no-chunked-loss"], (0,)),
    ("smollm2", "--no-group-by-length", ["--no-group-by-length"], (0,)),
    ("smollm2", "--method full --lr 1e-4", ["--method", "full", "--lr", "1e-4"], (0,)),
    ("smollm2", "--method qlora", ["--method", "qlora"], (0,)),
)
# (dataset, finetune flags for its tokenizer and length cap, micro-batch × update splits)
PADDING = (("embedded", ["--model", "tiny"], ((4, 16), (2, 16), (4, 64))),
           ("smollm2", ["--model", "smollm2-135m", "--dataset", str(REPO / "examples" / "smarthome"), "--eval-split", "test",
                        "--max-seq-len", "128"],
            ((2, 8), (4, 16), (8, 64))))


def train(run: str, flags: list[str], seed: int, folder: Path) -> dict:
    """README's command for `run` with `flags` and `--seed`, in a fresh process: its summary and wall time."""
    output = folder / f"{run}-{len(list(folder.iterdir()))}"
    command = [sys.executable, "-m", "finetune", *(DEMO if run == "smollm2" else []), *flags,
               "--seed", str(seed), "--num-samples", "0", "--no-save-final", "--output-dir", str(output)]
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(RunFolder(output).summary.read_text())  # raises when the run wrote none
    return summary | {"seconds": time.perf_counter() - started}


def learning_table(only: str | None, folder: Path) -> list[dict]:
    rows = []
    for run, change, flags, seeds in ROWS:
        if only and run != only:
            continue
        results = [train(run, flags, seed, folder) for seed in seeds]
        row = {"run": run, "change": change, "seeds": list(seeds),
               "eval_loss_before": results[0]["eval_loss_before"],
               "eval_loss": [r["eval_loss_after"] for r in results],
               "exact_match_before": results[0]["exact_match_before"],
               "exact_match": [r["exact_match_after"] for r in results],
               "seconds": statistics.median(r["seconds"] for r in results)}
        rows.append(row)
        print(format_learning_row(row), flush=True)
    return rows


def format_learning_row(row: dict) -> str:
    def values(numbers: list[float], form: str) -> str:
        shown = " / ".join(format(n, form) for n in numbers)
        return shown if len(numbers) == 1 else f"{shown} (median {format(statistics.median(numbers), form)})"

    return (f"| {row['run']} | {row['change']} | {', '.join(map(str, row['seeds']))} | {row['eval_loss_before']:.3f} → "
            f"{values(row['eval_loss'], '.3f')} | {row['exact_match_before']:.0%} → {values(row['exact_match'], '.1%')} | "
            f"{row['seconds']:.0f} s |")


def padding_table(only: str | None) -> list[dict]:
    """Padded share of the tokens of one epoch's micro-batches, for three ways of ordering the rows."""
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    from finetune.config.flags import parse_command
    from finetune.data import prepare_data
    from finetune.data.sampler import UpdateSortedSampler, row_lengths
    from finetune.models.source import model_source
    from finetune.train import loading

    rows = []
    for name, flags, splits in PADDING:
        if only and name != only:
            continue
        config = parse_command(flags).config
        tokenizer = loading.load_tokenizer(loading.materialize(model_source(config.model, config.output_dir), config.seed),
                                           trust_remote_code=False)
        lengths = row_lengths(prepare_data(config, tokenizer).train)
        for micro, update in splits:
            uniform = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).tolist()
            orders = {"uniform": uniform, "finetune": list(UpdateSortedSampler(lengths, update, seed=0)),
                      "trainer": get_length_grouped_indices(lengths, update, generator=torch.Generator().manual_seed(0))}
            row = {"data": name, "micro": micro, "update": update} | {k: padded_share(o, lengths, micro) for k, o in orders.items()}
            rows.append(row)
            print(f"| {name} | {micro} × {update // micro} | {row['uniform']:.1%} | {row['finetune']:.1%} | {row['trainer']:.1%} |",
                  flush=True)
    return rows


def padded_share(order: list[int], lengths: list[int], micro: int) -> float:
    batches = [order[i:i + micro] for i in range(0, len(order), micro)]
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    return 1 - sum(lengths) / padded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("embedded", "smollm2"), help="one of the two runs")
    parser.add_argument("--padding-only", action="store_true", help="only the padding table (a minute)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    print("| data | micro × accumulation | padding, uniform | padding, finetune (grouped in the update) | "
          "padding, Trainer group_by_length |\n|---|---|---|---|---|")
    padding = padding_table(args.only)
    if args.padding_only:
        return
    print("\n| run | change from README's command | seeds | eval loss before → after | exact match before → after | "
          "time per run |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        learning = learning_table(args.only, Path(folder))
    if args.json:
        args.json.write_text(json.dumps({"padding": padding, "learning": learning}, indent=2) + "\n")


if __name__ == "__main__":
    main()
