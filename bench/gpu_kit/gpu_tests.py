"""The kit's pytest step in two summary files: gpu-tests.csv and gpu-tests.md, one line per test
(outcome, seconds, the reason or the failure's first line), from pytest's JUnit XML, or where pytest
did not get to write it (killed at the step's cap) from its -v log.

    python bench/gpu_kit/gpu_tests.py --xml LOGS/gpu-tests.xml --log LOGS/gpu-tests.log --out DIR
"""

from __future__ import annotations

import argparse
import csv
import re
import xml.etree.ElementTree as ElementTree
from pathlib import Path

FIELDS = ("test", "outcome", "seconds", "detail")
VERBOSE_LINE = re.compile(r"::(\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def from_xml(path: Path) -> list[dict]:
    """One row per <testcase>: passed, failed, error or skipped, with its message's first line."""
    rows = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome, text = {"failure": "failed"}.get(tag, tag), (found.get("message") or found.text or "").strip()
                detail = text.splitlines()[0][:300] if text else ""
                break
        rows.append({"test": case.get("name"), "outcome": outcome, "seconds": round(float(case.get("time") or 0), 1),
                     "detail": detail})
    return rows


def from_log(path: Path) -> list[dict]:
    """What pytest -v printed before it was stopped; the test it was running, as not finished."""
    text = path.read_text(errors="replace") if path.is_file() else ""
    rows = [{"test": name, "outcome": outcome.lower(), "seconds": "", "detail": "from the log (no JUnit XML)"}
            for name, outcome in VERBOSE_LINE.findall(text)]
    started = re.findall(r"::(\S+) ?$", text, re.MULTILINE)
    if started and started[-1] not in {r["test"] for r in rows}:
        rows.append({"test": started[-1], "outcome": "not finished", "seconds": "",
                     "detail": "still running when the step's cap stopped pytest"})
    return rows


def write(rows: list[dict], out: Path, source: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "gpu-tests.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    counts = {}
    for row in rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    total = sum(float(r["seconds"] or 0) for r in rows)
    lines = [f"`pytest -m gpu tests/gpu_kit/test_gpu.py`: {', '.join(f'{n} {k}' for k, n in counts.items()) or 'no test ran'}; "
             f"{total:.0f} s in tests ({source}).", "", "| test | outcome | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {r['test']} | {r['outcome']} | {r['seconds']} | {str(r['detail']).replace('|', '/')} |" for r in rows]
    (out / "gpu-tests.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--xml", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.xml.is_file():
        write(from_xml(args.xml), args.out, "pytest's JUnit XML")
    else:
        write(from_log(args.log), args.out, "pytest's -v log: it wrote no JUnit XML")
    print((args.out / "gpu-tests.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
