"""What a grid row costs before it trains: the same tiny run as its own `python -m finetune` and
forked from the kit's preloaded server (bench/gpu_kit/forked.py), on whatever machine this runs on.

    python bench/gpu_kit/row_start.py [--rows 4]

Each row is 3 updates of the catalog's `tiny` model on the builtin data, so nearly all of its
seconds are start-up. The first forked row includes starting the server.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

from forked import RowRunner  # noqa: E402


def row_seconds(runner: RowRunner, work: Path, name: str) -> float:
    out = work / name
    out.mkdir()
    flags = ["--model", "tiny", "--max-steps", "3", "--no-save-final", "--num-samples", "0", "--output-dir", str(out)]
    started = time.monotonic()
    result = runner.run(["-m", "finetune", *flags], out / "run.log", timeout_s=300)
    if result["status"] != "ok":
        raise SystemExit(f"row {name}: {result['status']} {result.get('error', '')} (see {out / 'run.log'})")
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        own = [row_seconds(RowRunner(fork=False), work, f"own-{i}") for i in range(args.rows)]
        runner = RowRunner()
        forked = [row_seconds(runner, work, f"forked-{i}") for i in range(args.rows)]
    print("| row | seconds per row, median (min–max) |\n|---|---|")
    print(f"| own process (`python -m finetune`) | {statistics.median(own):.1f} ({min(own):.1f}–{max(own):.1f}) |")
    print(f"| forked, first (starts the server) | {forked[0]:.1f} |")
    rest = forked[1:]
    print(f"| forked, the rest | {statistics.median(rest):.1f} ({min(rest):.1f}–{max(rest):.1f}) |")


if __name__ == "__main__":
    main()
