"""Training tokens/s on a real model: finetune vs transformers' Trainer vs TRL's SFTTrainer.

What users would otherwise run for the same job, side by side in one bench run: LoRA (r 16,
alpha 32, all linear layers) on SmolLM2-135M-Instruct (`--model smollm2-135m`), the same rows
(examples/smarthome/train.jsonl, loss on the assistant answer only), micro batch 8, sequences of at
most 128 tokens, fp32, AdamW, gradient clipping at 1.0, no gradient checkpointing, one process, CPU.

- finetune: `python -m finetune ...` as a user types it (its run path, subprocess); its own
  metrics.jsonl (`--log-every 1`) gives each update's tokens and seconds.
- Trainer: the rows finetune tokenized (same ids, same masks), `DataCollatorForSeq2Seq` padding
  right; plain (its random order), and on finetune's batches (its sampler, `data/sampler.py`, with
  the same seed: identical rows in every batch, so the two are timed on identical work). Not the
  Trainer's `group_by_length`: its megabatches make every update one length class, which trains
  other, less padded batches and costs what the model learns (bench/quality.py).
- SFTTrainer: the raw chats as prompt/completion conversations (its own chat-template tokenization,
  loss on the completion), `padding_free=True` (each batch flattened into one row, no padding);
  its defaults bf16 and gradient checkpointing are turned off to match.

Every tool trains in a process of its own, started fresh for each measurement (finetune as the
user's `python -m finetune`, the Trainers through this script's `--tool`). A process's heap history
changes what an update costs: in a fresh process each logits-sized buffer (8 × ~75 × 49,152 fp32,
~115 MB) is a new mmap whose pages fault in zero-filled, ~110k minor faults per update, about 5 % of
its CPU time (glibc tunables that keep freed memory took both tools' faults to 0 and their CPU time
down ~5 %); a process that already holds large free heap chunks, as this script's does after data
preparation and earlier tools, reuses resident memory instead (55k–85k faults per update), so a tool
run in it would be timed on cheaper updates than one in a fresh process (bench/RESULTS.md).

Throughput = tokens the model reads (padding excluded) / seconds spent in optimizer updates after
`--warmup` untimed ones. Every tool's update is timed the same way: from the batch in hand to the
update done (finetune's loop clock; `on_step_begin` → `on_step_end` for the Trainers), on two clocks:
wall time, and the process's CPU time over the same span (finetune: `seconds` and `cpu_seconds` of
its metrics.jsonl lines), which a shared machine's load disturbs far less. Each tool runs once per round; the table gives
the median over rounds, the spread (min–max), and finetune's ratio to each tool on both clocks.
Ratios of wall-clock medians from 2 rounds on a loaded machine are noise (bench/RESULTS.md).

    python bench/throughput_vs_trainer.py [--steps 8] [--warmup 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from finetune.config.options import TrainConfig
from finetune.config.run_folder import RunFolder, read_metrics
from finetune.data import prepare_data
from finetune.data.sampler import UpdateSortedSampler, row_lengths
from finetune.models.source import model_source
from finetune.train import loading

MODEL = "smollm2-135m"
DATASET = Path(__file__).resolve().parents[1] / "examples" / "smarthome"
MICRO_BATCH, MAX_SEQ_LEN, LR = 8, 128, 1e-3


def finetune_tokens_per_second(steps: int, warmup: int) -> tuple[tuple[float, float], str]:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "finetune", "--model", MODEL, "--method", "lora", "--dataset", str(DATASET),
                   "--eval-split", "test", "--max-eval-examples", "0", "--micro-batch-size", str(MICRO_BATCH),
                   "--max-seq-len", str(MAX_SEQ_LEN), "--precision", "fp32", "--lr", str(LR), "--max-steps",
                   str(warmup + steps), "--log-every", "1", "--no-save-final", "--output-dir", out]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        records = read_metrics(RunFolder(out).metrics)  # raises when the run wrote none
    steps_ = [r for r in records if "loss" in r]
    tokens = [b["tokens"] - a["tokens"] for a, b in zip([{"tokens": 0}] + steps_, steps_)]  # cumulative → per update
    timed = list(zip(tokens, steps_))[warmup:]
    seconds, cpu = sum(r["seconds"] for _, r in timed), sum(r["cpu_seconds"] for _, r in timed)
    read = sum(n for n, _ in timed)
    return (read / seconds, read / cpu), "python -m finetune (its metrics.jsonl)"


class CountingCollator:
    """A collator that notes how many real tokens each batch holds, in the order batches are made."""

    def __init__(self, collate):
        self.collate, self.tokens = collate, []

    def __call__(self, rows):
        batch = self.collate(rows)
        mask = batch.get("attention_mask")
        self.tokens.append(int(mask.sum()) if mask is not None else batch["input_ids"].numel())
        return batch


def lora_model(source: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))


def tokens_per_second(trainer, warmup: int) -> tuple[float, float]:
    """Train with `trainer` and return the tokens per wall second and per process CPU second of its
    updates after the first `warmup`."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.seconds, self.cpu_seconds = [], []

        def on_step_begin(self, args, state, control, **_):
            self.started, self.cpu_started = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **_):
            self.seconds.append(time.perf_counter() - self.started)
            self.cpu_seconds.append(time.process_time() - self.cpu_started)

    clock = Clock()
    trainer.add_callback(clock)
    trainer.data_collator = counter = CountingCollator(trainer.data_collator)  # read when train() builds its loader
    trainer.train()
    read = sum(counter.tokens[warmup:len(clock.seconds)])
    return read / sum(clock.seconds[warmup:]), read / sum(clock.cpu_seconds[warmup:])


def common_arguments(out: str, steps: int) -> dict:
    """TrainingArguments (and SFTConfig) settings shared by both Trainers: the run finetune makes."""
    return {"output_dir": out, "per_device_train_batch_size": MICRO_BATCH, "max_steps": steps, "learning_rate": LR,
            "max_grad_norm": 1.0, "optim": "adamw_torch", "logging_steps": 10**9, "save_strategy": "no",
            "report_to": [], "use_cpu": True, "disable_tqdm": True, "dataloader_num_workers": 0, "bf16": False,
            "fp16": False, "gradient_checkpointing": False, "seed": 0}


def trainer_tokens_per_second(source: str, tokenizer, rows, steps: int, warmup: int, same_batches: bool) -> tuple[tuple[float, float], str]:
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    class SameOrderTrainer(Trainer):
        """finetune's sampler with finetune's seed, so both train on the same batches (see the docstring)."""

        def _get_train_sampler(self, train_dataset=None):
            return UpdateSortedSampler(row_lengths(rows), MICRO_BATCH, TrainConfig().seed)

    tokenizer.padding_side = "right"
    trainer_class = SameOrderTrainer if same_batches else Trainer
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(**common_arguments(out, warmup + steps))
        trainer = trainer_class(model=lora_model(source), args=args, train_dataset=rows,
                                data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))
        rate = tokens_per_second(trainer, warmup)
    order = "finetune's batches" if same_batches else "random order"
    return rate, f"finetune's tokenized rows, DataCollatorForSeq2Seq, {order}"


def sft_tokens_per_second(source: str, tokenizer, steps: int, warmup: int) -> tuple[tuple[float, float], str]:
    import datasets
    from trl import SFTConfig, SFTTrainer

    chats = datasets.load_dataset("json", data_files=str(DATASET / "train.jsonl"), split="train")
    rows = chats.map(lambda row: {"prompt": row["messages"][:-1], "completion": row["messages"][-1:]},
                     remove_columns=["messages"])
    with tempfile.TemporaryDirectory() as out:
        # padding_free without packing refuses max_length (it would not enforce it): every row is shorter anyway
        args = SFTConfig(**common_arguments(out, warmup + steps), max_length=None, padding_free=True,
                         completion_only_loss=True)
        trainer = SFTTrainer(model=lora_model(source), args=args, train_dataset=rows, processing_class=tokenizer)
        rate = tokens_per_second(trainer, warmup)
    return rate, "prompt/completion chats tokenized by TRL, padding_free, completion-only loss"


TOOLS = ("finetune", "transformers Trainer", "Trainer, finetune's batches", "TRL SFTTrainer")


def measure(tool: str, steps: int, warmup: int) -> tuple[tuple[float, float], str]:
    """`tool`'s tokens per wall and per CPU second, measured in a fresh process (see the docstring)."""
    if tool == "finetune":
        return finetune_tokens_per_second(steps, warmup)  # its own process already
    with tempfile.TemporaryDirectory() as out:
        result = Path(out) / "result.json"
        subprocess.run([sys.executable, __file__, "--tool", tool, "--result", str(result), "--steps", str(steps),
                        "--warmup", str(warmup)], check=True, stdout=subprocess.DEVNULL)
        rate, setting = json.loads(result.read_text())
    return tuple(rate), setting


def measure_here(tool: str, steps: int, warmup: int) -> tuple[tuple[float, float], str]:
    """A Trainer's measurement in this process, which `measure` started for it."""
    source = loading.materialize(model_source(MODEL))
    tokenizer = loading.load_tokenizer(source, trust_remote_code=False)
    if tool == "TRL SFTTrainer":
        return sft_tokens_per_second(source, tokenizer, steps, warmup)
    with tempfile.TemporaryDirectory() as cache:
        rows = tokenized_rows(tokenizer, cache)
        if tool == "transformers Trainer":
            return trainer_tokens_per_second(source, tokenizer, rows, steps, warmup, same_batches=False)
        return trainer_tokens_per_second(source, tokenizer, rows, steps, warmup, same_batches=True)


def tokenized_rows(tokenizer, cache: str):
    """The train rows as finetune tokenizes them (its cache in `cache`)."""
    data = prepare_data(TrainConfig(model=MODEL, dataset=str(DATASET), eval_split="test", max_seq_len=MAX_SEQ_LEN,
                                    data_cache=cache), tokenizer)
    return data.train.with_format(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer updates per tool")
    parser.add_argument("--warmup", type=int, default=2, help="untimed updates first")
    parser.add_argument("--rounds", type=int, default=5, help="passes over the tools, every other one in reverse "
                        "order so that drift in machine load hits each tool alike; the table shows the median")
    parser.add_argument("--tool", choices=TOOLS[1:], help=argparse.SUPPRESS)  # one Trainer's measurement, for `measure`
    parser.add_argument("--result", help=argparse.SUPPRESS)  # where --tool writes it
    args = parser.parse_args()
    if args.tool:
        Path(args.result).write_text(json.dumps(measure_here(args.tool, args.steps, args.warmup)))
        return

    tokenizer = loading.load_tokenizer(loading.materialize(model_source(MODEL)), trust_remote_code=False)
    with tempfile.TemporaryDirectory() as cache:
        mean_len = statistics.mean(len(ids) for ids in tokenized_rows(tokenizer, cache)["input_ids"])
    tools = list(TOOLS)
    if not importlib.util.find_spec("trl"):
        print("trl is not installed (pip install trl): TRL SFTTrainer left out")
        tools.remove("TRL SFTTrainer")
    rates, settings, loads = {name: [] for name in tools}, {}, []
    for round_ in range(args.rounds):
        for name in tools[:: -1 if round_ % 2 else 1]:
            rate, settings[name] = measure(name, args.steps, args.warmup)
            rates[name].append(rate)
            loads.append(os.getloadavg()[0])
    import transformers

    print(f"LoRA r16 all-linear, {MODEL}, fp32, micro batch {MICRO_BATCH}, max {MAX_SEQ_LEN} tokens (mean row "
          f"{mean_len:.0f}), {args.steps} timed updates after {args.warmup}, {args.rounds} rounds, each tool in a fresh "
          f"process; torch {torch.__version__} threads {torch.get_num_threads()}, transformers "
          f"{transformers.__version__}; load average {min(loads):.1f}-{max(loads):.1f}")
    print("\n".join(summary_lines(rates, settings)))


def summary_lines(rates: dict[str, list[tuple[float, float]]], settings: dict[str, str]) -> list[str]:
    """Per tool: median tokens/s over rounds with min–max, on the wall and the CPU clock, and
    finetune's ratio of medians on each."""
    def median(name, clock):
        return statistics.median(r[clock] for r in rates[name])

    lines = [f"{'tool':26}{'wall tok/s (min-max)':>24}{'CPU tok/s (min-max)':>24}{'finetune × wall':>17}"
             f"{'× CPU':>8}  settings"]
    for name, measured in rates.items():
        cells = []
        for clock in (0, 1):
            values = [r[clock] for r in measured]
            cells.append(f"{median(name, clock):.1f} ({min(values):.1f}-{max(values):.1f})")
        lines.append(f"{name:26}{cells[0]:>24}{cells[1]:>24}{median('finetune', 0) / median(name, 0):>16.2f}×"
                     f"{median('finetune', 1) / median(name, 1):>7.2f}×  {settings[name]}")
    return lines


if __name__ == "__main__":
    main()
