"""What the preference objectives learn on the embedded pairs, and how long README's preference command takes.

    python bench/preference.py                 # every row (about 20 minutes on an idle 2-core CPU)
    python bench/preference.py --only dpo      # README's command, seeds 0–2
    python bench/preference.py --json out.json # also keep the numbers

Each row is `python -m finetune --objective ...` on the builtin pairs (the tiny Llama from random init,
4 epochs, 952 updates of 16 pairs) in a fresh process, its summary.json read back: the held-out
preference accuracy and reward margin before → after, the objective's eval loss, the wall time and
this process tree's CPU time (which a machine shared with other jobs disturbs far less than the wall
time), and the load average while it ran.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from finetune.config.run_folder import RunFolder

REPO = Path(__file__).resolve().parents[1]
# (objective, flags after README's command, seeds)
ROWS = (
    ("dpo", [], (0, 1, 2)),
    ("dpo", ["--dpo-loss", "ipo"], (0,)),
    ("dpo", ["--dpo-loss", "hinge"], (0,)),
    ("simpo", [], (0,)),
    ("orpo", [], (0,)),
    ("kto", [], (0,)),
)


def train(objective: str, flags: list[str], seed: int, folder: Path) -> dict:
    """README's preference command with `--objective objective`, `flags` and `--seed`: its summary, wall
    and CPU seconds (children's), and the 1-minute load average at its end."""
    output = folder / f"{objective}-{len(list(folder.iterdir()))}"
    command = [sys.executable, "-m", "finetune", "--objective", objective, *flags, "--seed", str(seed),
               "--num-samples", "0", "--no-save-final", "--output-dir", str(output)]
    cpu_before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime
    summary = json.loads(RunFolder(output).summary.read_text())  # raises when the run wrote none
    return summary | {"seconds": time.perf_counter() - started, "cpu_seconds": cpu, "load": os.getloadavg()[0]}


def format_row(objective: str, flags: list[str], seeds: tuple, results: list[dict]) -> str:
    def values(key: str, form: str) -> str:
        numbers = [r[key] for r in results]
        shown = " / ".join(format(n, form) for n in numbers)
        return shown if len(numbers) == 1 else f"{shown} (median {format(statistics.median(numbers), form)})"

    first = results[0]
    return (f"| {' '.join(['--objective', objective, *flags])} | {', '.join(map(str, seeds))} | "
            f"{first['preference_accuracy_before']:.1%} → {values('preference_accuracy_after', '.1%')} | "
            f"{first['reward_margin_before']:.3f} → {values('reward_margin_after', '.3f')} | "
            f"{first['eval_loss_before']:.3f} → {values('eval_loss_after', '.3f')} | "
            f"{statistics.median(r['seconds'] for r in results):.0f} s | {statistics.median(r['cpu_seconds'] for r in results):.0f} s | "
            f"{statistics.median(r['load'] for r in results):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted({row[0] for row in ROWS}), help="one objective's rows")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    print("| command (after `python -m finetune`) | seeds | preference accuracy | reward margin | eval loss | wall | CPU | "
          "load |\n|---|---|---|---|---|---|---|---|")
    table = []
    with tempfile.TemporaryDirectory() as folder:
        for objective, flags, seeds in ROWS:
            if args.only and objective != args.only:
                continue
            results = [train(objective, flags, seed, Path(folder)) for seed in seeds]
            table.append({"objective": objective, "flags": flags, "seeds": list(seeds), "results": results})
            print(format_row(objective, flags, seeds, results), flush=True)
    if args.json:
        args.json.write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()
