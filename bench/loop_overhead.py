"""Step time of finetune's loop vs a bare hand-written Accelerate loop vs transformers' Trainer.

Same tiny model (catalog `tiny`, seeded), same builtin data and collator, same batch, AdamW, one
process on CPU; finetune's variant is the run `train.setup` builds. Each variant runs `--steps`
optimizer updates after `--warmup` untimed ones; the table reports the median step time over
`--repeats` runs and the ratio to the bare loop.

    python bench/loop_overhead.py [--steps 40] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import GradientAccumulationPlugin
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from finetune.config.options import TrainConfig
from finetune.data import BUILTIN_DIR, Collator, prepare_data
from finetune.models.catalog import get
from finetune.train import loop
from finetune.train.run import resolve, setup

MICRO_BATCH = 16


def fresh_accelerator() -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1, sync_with_dataloader=False))


def fresh_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**get("tiny").to_hf_config_dict()),
                                            attn_implementation="sdpa")


class WarmupClock:
    """Stands in for MetricsRecorder: notes the time when the last warmup update finished."""

    def __init__(self, warmup: int):
        self.warmup = warmup

    def record_step(self, *, step: int, **_) -> None:
        if step == self.warmup:
            self.started = time.perf_counter()


def time_finetune_loop(data, collator, steps: int, warmup: int) -> float:
    """finetune's own run as `train.setup` builds it (same model, data, collator, batch), stepped by its loop."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    with tempfile.TemporaryDirectory() as tmp:
        config = TrainConfig(output_dir=tmp, micro_batch_size=MICRO_BATCH, max_steps=warmup + steps, lr=1e-3,
                             warmup_steps=0, lr_schedule="constant", max_eval_examples=0)
        clock = WarmupClock(warmup)
        with setup(*resolve(config)) as s:
            loop.train(s.accelerator, s.model, s.optimizer, s.scheduler, s.train_loader, progress=s.progress,
                       max_steps=s.max_steps, max_grad_norm=1.0, metrics=clock)
    return (time.perf_counter() - clock.started) / steps


def time_bare_loop(data, collator, steps: int, warmup: int) -> float:
    accelerator = fresh_accelerator()
    model = fresh_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=MICRO_BATCH, shuffle=True, collate_fn=collator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    batches = iter(loader)
    for step in range(warmup + steps):
        if step == warmup:
            started = time.perf_counter()
        with accelerator.accumulate(model):
            loss = model(**next(batches)).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss.item()  # the bare loop also reads its loss once per step
    return (time.perf_counter() - started) / steps


def time_trainer(data, collator, steps: int, warmup: int) -> float:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                self.started = time.perf_counter()

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=MICRO_BATCH, max_steps=warmup + steps,
                                 learning_rate=1e-3, max_grad_norm=1.0, logging_steps=10**9, save_strategy="no",
                                 report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                                 lr_scheduler_type="constant")
        trainer = Trainer(model=fresh_model(), args=args, train_dataset=data, data_collator=collator, callbacks=[clock])
        trainer.train()
    return (time.perf_counter() - clock.started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(BUILTIN_DIR)
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_data(TrainConfig(output_dir=tmp), tokenizer).train
    collator = Collator(tokenizer)
    variants = {"bare Accelerate loop": time_bare_loop, "finetune loop": time_finetune_loop,
                "transformers Trainer": time_trainer}
    results = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved so drift in machine load hits every variant alike
        for name, measure in variants.items():
            results[name].append(measure(data, collator, args.steps, args.warmup))
    bare = statistics.median(results["bare Accelerate loop"])
    print(f"tiny model, micro batch {MICRO_BATCH}, {args.steps} steps × {args.repeats} repeats, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'variant':24}{'median s/step':>15}{'min':>10}{'max':>10}{'vs bare':>10}")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"{name:24}{median:>15.4f}{min(times):>10.4f}{max(times):>10.4f}{median / bare:>9.3f}×")


if __name__ == "__main__":
    main()
