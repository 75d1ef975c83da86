"""One training run, wired top to bottom: config → accelerator → model and data → loop → save.

`python -m finetune [flags]` and `accelerate launch [--config_file X.yaml] -m finetune [flags]` land
in `main`. The strategy comes from the launch (see strategies.py); this file is the same for all.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from finetune import loop, modeling
from finetune.checkpointing import Checkpointer
from finetune.config import TrainConfig, parse_config, planned_epochs, save_yaml, scaled_lr
from finetune.data import Collator, prepare_data
from finetune.metrics import MetricsRecorder, plot_loss_curve
from finetune.optim import build_optimizer, build_scheduler
from finetune.strategies import build_accelerator


def main(argv: list[str] | None = None) -> int:
    train(parse_config(argv))
    return 0


def train(config: TrainConfig) -> dict:
    """Train as `config` says; returns the summary also written to `<output_dir>/summary.json`."""
    source, spec = modeling.resolve_source(config)
    if spec is not None and spec.hf_id is None:
        # before the Accelerator exists: under ZeRO-3 its zero.Init would make building the model a
        # collective, which a rank waiting at a barrier never joins. Every rank writes the same
        # seeded weights and the first atomic rename wins.
        modeling.materialize_random_init(spec, Path(source), seed=config.seed)
    accelerator, batch = build_accelerator(config)
    output_dir = Path(config.output_dir)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
    say = accelerator.print

    # tokenizer and data (the main process of each node writes caches first, the others reuse them)
    with accelerator.local_main_process_first():
        tokenizer = modeling.load_tokenizer(source, config.trust_remote_code)
        data = prepare_data(config, tokenizer)
    set_seed(config.seed)  # identical initial weights on every rank (FSDP keeps each rank's own)
    compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    model = modeling.load_model(config, source, compute_dtype)
    if config.packing:
        modeling.check_packing_support(model)

    collator = Collator(tokenizer)
    train_loader = DataLoader(data.train, batch_size=batch.micro_batch_size, shuffle=True, collate_fn=collator)
    eval_loader = DataLoader(data.eval, batch_size=batch.micro_batch_size, collate_fn=collator)
    windows_per_epoch = math.ceil(len(data.train) / (batch.micro_batch_size * batch.world_size)) // batch.gradient_accumulation_steps
    max_steps = config.max_steps or max(1, int(planned_epochs(config) * windows_per_epoch))
    lr = scaled_lr(config, batch.global_batch_size)
    optimizer = build_optimizer(config, model, lr)
    scheduler = build_scheduler(config, optimizer, max_steps)

    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    progress = loop.Progress()
    accelerator.register_for_checkpointing(progress, scheduler)

    trainable, total = modeling.parameter_counts(accelerator.unwrap_model(model))
    resolved = {"world_size": batch.world_size, "gradient_accumulation_steps": batch.gradient_accumulation_steps,
                "global_batch_size": batch.global_batch_size, "max_steps": max_steps, "peak_lr": lr,
                "mixed_precision": accelerator.mixed_precision, "format": data.format,
                "train_examples": len(data.train), "eval_examples": len(data.eval),
                "trainable_parameters": trainable, "total_parameters": total}
    # resume before anything reads `progress`
    checkpointer = Checkpointer(accelerator, config, manifest_extra=resolved, tokenizer=tokenizer)
    if checkpointer.resume() is not None:
        say(f"resumed from {checkpointer.resumed_from} at step {progress.step}")
    if accelerator.is_main_process:
        save_yaml(config, output_dir / "run.yaml", extra=resolved)
    say(f"model {config.model} ({config.method}): {trainable:,} trainable of {total:,} parameters")
    say(f"data: {len(data.train):,} train / {len(data.eval):,} eval examples ({data.format}); "
        f"batch: micro {batch.micro_batch_size} × accumulation {batch.gradient_accumulation_steps} × world "
        f"{batch.world_size} = global {batch.global_batch_size}; {max_steps} optimizer steps at peak lr {lr:.2e}")
    if config.report_to != "none":
        accelerator.init_trackers("finetune", config={k: v for k, v in config.to_dict().items() if v is not None})

    def evaluate() -> dict:
        return loop.evaluate(accelerator, model, eval_loader, tokenizer, data.eval_prompts,
                             keep_train_mode=config.method == "qlora")

    before = evaluate()
    metrics = MetricsRecorder(accelerator, output_dir, max_steps, config.log_every, start_step=progress.step)
    metrics.record_eval(progress.step, before)
    loop.train(accelerator, model, optimizer, scheduler, train_loader, progress=progress, max_steps=max_steps,
               max_grad_norm=config.max_grad_norm, metrics=metrics, checkpointer=checkpointer, evaluate=evaluate,
               eval_every=config.eval_every)
    checkpointer.close()
    if checkpointer.preempted:  # saved in the loop; stop here, exit 0
        metrics.close()
        say(checkpointer.preemption_message())
        return {"steps": progress.step, "tokens_seen": progress.tokens_seen, "preempted": True}
    if config.save_every and checkpointer.last_saved_step != progress.step:
        checkpointer.save(progress)
    after = evaluate()
    metrics.record_eval(progress.step, after)
    metrics.close()

    if config.save_final:
        save_final(accelerator, model, tokenizer, output_dir)
    summary = {
        "steps": progress.step, "tokens_seen": progress.tokens_seen,
        "eval_loss_before": before["eval_loss"], "eval_loss_after": after["eval_loss"],
        "exact_match_before": before.get("exact_match"), "exact_match_after": after.get("exact_match"),
        "samples": after.get("samples", [])[: config.num_samples],
    }
    if accelerator.is_main_process:
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_loss_curve(output_dir / "metrics.jsonl", output_dir / "loss_curve.png")
        say(format_summary(summary))
    accelerator.end_training()
    return summary


def save_final(accelerator, model, tokenizer, output_dir: Path) -> None:
    """The trained model as a Hugging Face folder: full weights, or the PEFT adapter for LoRA/QLoRA.

    `get_state_dict` gathers sharded (FSDP/ZeRO-3) parameters on every rank; passing it explicitly is
    what keeps adapters from being saved empty under sharding.
    """
    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        unwrapped.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(output_dir)
    accelerator.wait_for_everyone()


def format_summary(summary: dict) -> str:
    lines = ["", f"{'':24}{'before':>10}{'after':>10}",
             f"{'eval loss':24}{summary['eval_loss_before']:>10.4f}{summary['eval_loss_after']:>10.4f}"]
    if summary["exact_match_before"] is not None:
        lines.append(f"{'exact match (greedy)':24}{summary['exact_match_before']:>10.1%}{summary['exact_match_after']:>10.1%}")
    for sample in summary["samples"]:
        lines += ["", sample["prompt"] + sample["generated"], f"  (expected: {sample['expected']!r})"]
    return "\n".join(lines)
