"""The rows of bench/gpu_kit/throughput.py that are not finetune, one per process (throughput.py
launches them so that no row inherits another's allocator state):

    python bench/gpu_kit/baselines.py trl [--liger] --checkpoint DIR --data ROWS.jsonl --seq-len N
        --micro-batch-size B --steps S [--method lora|qlora] [--no-gradient-checkpointing] --result RESULT.json
    python bench/gpu_kit/baselines.py peft-loop ...same flags, without --liger

trl: TRL's SFTTrainer as its docs set it up (SFTConfig, peft_config=LoraConfig), with
use_liger_kernel per row. peft-loop: transformers + PEFT and a plain loop with
torch.optim.AdamW(fused=True), what a hand-written script does. Both read finetune's own encoding
of the same text rows (the ids its row trains on, exactly --seq-len each) and load the same
random-init checkpoint in bf16 (NF4 under qlora): LoRA r16, alpha 32, no dropout, all linear
layers; non-reentrant gradient checkpointing (unless --no-gradient-checkpointing); clipping at 1.0 as finetune and Trainer do. Each
update is timed from its start to torch.cuda.synchronize() after the optimizer step; tokens/s is
the median over the updates after the first, as for finetune's rows. Writes tokens_per_second,
first_update_seconds, allocated_gib, reserved_gib (torch.cuda.max_memory_allocated/reserved) and
losses to --result.

Real GPU runs are not tested here (the CI machine has no GPU): tests/gpu_kit/test_gpu_kit.py builds the
SFTConfig and the PEFT loop on CPU and runs that loop on a tiny model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from finetune.data.formats import encode  # noqa: E402
from finetune.train.loading import load_tokenizer  # noqa: E402
from finetune.train.skeleton import nf4_config  # noqa: E402

LEARNING_RATE = 2e-4  # finetune's LoRA default; the rate changes the losses, not the speed
MAX_GRAD_NORM = 1.0  # finetune's and Trainer's default clipping: its norm is part of every update


def lora_config():
    """finetune's LoRA defaults: r16, alpha 32, no dropout, every linear layer but the LM head."""
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def token_rows(tokenizer, data: Path, seq_len: int) -> list[dict[str, list[int]]]:
    """finetune's encoding of the `text` rows (BOS + text + EOS, cut to seq_len): the same ids its
    own row trains on. Raises ValueError if a row is shorter, which would make tokens/s unequal."""
    texts = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    rows = encode(texts, "text", tokenizer, train_on_prompt=False, max_seq_len=seq_len)
    short = [len(row["input_ids"]) for row in rows if len(row["input_ids"]) != seq_len]
    if short:
        raise ValueError(f"{len(short)} of {len(rows)} rows in {data} are not {seq_len} tokens (one has {short[0]}): "
                         "write longer text rows")
    return rows


def base_model(checkpoint: Path, method: str):
    """The checkpoint on GPU 0 as both baselines load it: bf16 weights (NF4 with bf16 compute under
    qlora, finetune's quantization), SDPA attention, no KV cache."""
    from transformers import AutoModelForCausalLM

    quantized = {"quantization_config": nf4_config(torch.bfloat16)} if method == "qlora" else {}
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                 device_map={"": 0}, **quantized)
    model.config.use_cache = False
    return model


def sft_config(output_dir: Path, micro_batch_size: int, steps: int, seq_len: int, liger: bool, checkpointing: bool = True):
    """SFTConfig of the TRL rows: one micro batch per update, bf16, non-reentrant checkpointing (or none),
    fused AdamW, rows kept whole (no packing, no padding-free flattening), nothing evaluated or
    saved; a loss logged every update (after on_step_end, outside the timed window)."""
    from trl import SFTConfig

    return SFTConfig(output_dir=str(output_dir), per_device_train_batch_size=micro_batch_size,
                     gradient_accumulation_steps=1, max_steps=steps, learning_rate=LEARNING_RATE,
                     lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=MAX_GRAD_NORM, optim="adamw_torch_fused",
                     bf16=True, gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False},
                     max_length=seq_len, packing=False, padding_free=False, use_liger_kernel=liger,
                     eval_strategy="no", save_strategy="no", logging_steps=1, report_to="none", disable_tqdm=True,
                     dataloader_num_workers=0, seed=0)


def sft_trainer(model, tokenizer, rows: list[dict], config):
    """SFTTrainer over already-tokenized rows: with an `input_ids` column TRL skips its own
    tokenization, and with `labels` it keeps them (every token counts, as in finetune's text rows)."""
    from datasets import Dataset
    from trl import SFTTrainer

    return SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                      peft_config=lora_config())


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queue, so a clock reading covers the work launched before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class UpdateClock(TrainerCallback):
    """Seconds of each optimizer update, on_step_begin → on_step_end, the GPU drained at both ends."""

    def __init__(self):
        self.seconds: list[float] = []
        self.started = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize(args.device)
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        synchronize(args.device)
        self.seconds.append(time.perf_counter() - self.started)


def peft_loop(model, lr: float = LEARNING_RATE, checkpointing: bool = True):
    """(LoRA model, optimizer) of the bare loop: non-reentrant checkpointing (or none), PEFT's LoRA,
    and one fused AdamW kernel over the adapters."""
    from peft import get_peft_model

    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, lora_config())
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, fused=True)


def train_loop(model, optimizer, rows: list[dict], micro_batch_size: int, steps: int) -> tuple[list[float], list[float]]:
    """forward → backward → clip → step → zero for `steps` updates of `micro_batch_size` rows (in
    order, wrapping around); returns each update's seconds and loss."""
    device, trainable = model.device, [p for p in model.parameters() if p.requires_grad]
    model.train()
    seconds, losses = [], []
    for step in range(steps):
        batch = [rows[(step * micro_batch_size + i) % len(rows)] for i in range(micro_batch_size)]
        synchronize(device)
        started = time.perf_counter()
        input_ids = torch.tensor([row["input_ids"] for row in batch], device=device)
        labels = torch.tensor([row["labels"] for row in batch], device=device)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        seconds.append(time.perf_counter() - started)
        losses.append(loss.item())
    return seconds, losses


def summary(seconds: list[float], tokens_per_update: int, losses: list[float]) -> dict:
    """The fields finetune's rows report: tokens/s the median update after the first (as finetune's
    metrics.jsonl gives it, per update), and this process's CUDA peaks."""
    return {"tokens_per_second": statistics.median(tokens_per_update / s for s in seconds[1:]),
            "first_update_seconds": round(seconds[0], 2), "allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "losses": [round(loss, 4) for loss in losses]}


def run_trl(args: argparse.Namespace) -> dict:
    """The TRL row: SFTTrainer on the rows, its updates timed by UpdateClock."""
    tokenizer = load_tokenizer(str(args.checkpoint), trust_remote_code=False)
    config = sft_config(args.result.parent / "trl", args.micro_batch_size, args.steps, args.seq_len, args.liger,
                        args.gradient_checkpointing)
    trainer = sft_trainer(base_model(args.checkpoint, args.method), tokenizer,
                          token_rows(tokenizer, args.data, args.seq_len), config)
    clock = UpdateClock()
    trainer.add_callback(clock)
    trainer.train()
    losses = [record["loss"] for record in trainer.state.log_history if "loss" in record]
    return summary(clock.seconds, args.micro_batch_size * args.seq_len, losses)


def run_peft_loop(args: argparse.Namespace) -> dict:
    """The bare row: the LoRA model, fused AdamW and the plain loop, nothing else."""
    rows = token_rows(load_tokenizer(str(args.checkpoint), trust_remote_code=False), args.data, args.seq_len)
    model, optimizer = peft_loop(base_model(args.checkpoint, args.method), checkpointing=args.gradient_checkpointing)
    seconds, losses = train_loop(model, optimizer, rows, args.micro_batch_size, args.steps)
    return summary(seconds, args.micro_batch_size * args.seq_len, losses)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("program", choices=("trl", "peft-loop"))
    parser.add_argument("--checkpoint", type=Path, required=True, help="the random-init checkpoint")
    parser.add_argument("--data", type=Path, required=True, help="text rows longer than --seq-len tokens")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--micro-batch-size", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True, help="optimizer updates, at least 2 (the first is warm-up)")
    parser.add_argument("--method", default="lora", choices=("lora", "qlora"))
    parser.add_argument("--liger", action="store_true", help="SFTConfig(use_liger_kernel=True) (trl only)")
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="non-reentrant checkpointing of every decoder layer (default: on)")
    parser.add_argument("--result", type=Path, required=True, help="where the measured fields go (JSON)")
    args = parser.parse_args(argv)
    if args.liger and args.program != "trl":
        parser.error("--liger is TRL's use_liger_kernel: trl only")
    if args.steps < 2:
        parser.error("--steps must be at least 2: tokens/s is the median after the first update")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    measured = run_trl(args) if args.program == "trl" else run_peft_loop(args)
    args.result.write_text(json.dumps(measured))
    print(json.dumps(measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
