"""The loop's contracts: token-weighted loss over the optimizer step, one LR step and one optimizer
step per update (also across epoch ends), whole accumulation windows, resumable progress, and an LR
schedule that a resume with another --max-steps continues smoothly.

Every Accelerator here comes from `accelerator.build_accelerator`, which a run starts through."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from helpers import reset_accelerate, tiny_model
from torch.utils.data import DataLoader

from finetune.checkpoint.progress import Progress
from finetune.config.options import TrainConfig
from finetune.config.run_folder import read_metrics
from finetune.data import Collator
from finetune.train import loop
from finetune.train.accelerator import build_accelerator
from finetune.train.metrics import MetricsRecorder
from finetune.train.optim import LRSchedule, build_scheduler, continue_schedule, lr_multiplier
from finetune.train.run import resolve

PAD = 0


def variable_length_examples(n: int = 8, seed: int = 0) -> list[dict]:
    """Examples of very different lengths with prompt tokens masked, so per-batch token counts differ."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n):
        length = 4 + (i * 7) % 23
        ids = torch.randint(1, 64, (length,), generator=generator).tolist()
        labels = [-100] * (length // 3) + ids[length // 3:]
        examples.append({"input_ids": ids, "labels": labels})
    return examples


# the project's own collator; the loop only needs the pad id from a tokenizer
pad_collate = Collator(SimpleNamespace(pad_token_id=PAD))


def prepared(output_dir, micro_batch_size: int, accumulation: int, model, make_optimizer, examples: list[dict]):
    """Accelerator (built as a run builds it), model, optimizer and loader, prepared."""
    reset_accelerate()
    output_dir.mkdir(parents=True, exist_ok=True)
    run, _ = resolve(TrainConfig(output_dir=str(output_dir), micro_batch_size=micro_batch_size,
                                 gradient_accumulation_steps=accumulation))
    accelerator = build_accelerator(run)
    optimizer = make_optimizer(model.parameters())
    loader = DataLoader(examples, batch_size=micro_batch_size, collate_fn=pad_collate)
    return accelerator, *accelerator.prepare(model, optimizer, loader)


def one_sgd_update(tmp_path, micro_batch_size: int, accumulation: int):
    """Run one optimizer update with SGD(lr=1), so the weight change is minus the gradient (float64
    keeps the subtraction exact enough to compare gradients of 1e-4 on weights of 1)."""
    model = tiny_model(seed=0).double()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    accelerator, model, optimizer, loader = prepared(tmp_path, micro_batch_size, accumulation, model,
                                                     lambda params: torch.optim.SGD(params, lr=1.0), variable_length_examples())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    metrics = MetricsRecorder(accelerator, tmp_path, max_steps=1, log_every=1)
    loop.train(accelerator, model, optimizer, scheduler, loader, progress=Progress(), max_steps=1,
               max_grad_norm=0.0, metrics=metrics)
    gradient = {name: before[name] - p.detach() for name, p in model.named_parameters()}
    return gradient, read_metrics(tmp_path / "metrics.jsonl")[-1]["loss"]


def full_batch_reference():
    """Gradient and loss of the token-weighted mean over all 8 examples in one forward."""
    model = tiny_model(seed=0).double()
    batch = pad_collate(variable_length_examples())
    loss = model(**batch).loss  # HF's default: mean over all non-ignored target tokens
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}, loss.item()


def naive_mean_of_micro_batch_means(micro_batch_size: int):
    """What a loop that averages per-micro-batch mean losses would compute."""
    model = tiny_model(seed=0).double()
    examples = variable_length_examples()
    chunks = [examples[i:i + micro_batch_size] for i in range(0, len(examples), micro_batch_size)]
    for chunk in chunks:
        (model(**pad_collate(chunk)).loss / len(chunks)).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def max_relative_error(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-12)).item() for k in b)


def test_accumulation_splits_give_the_full_batch_gradient_and_loss(tmp_path):
    reference_grad, reference_loss = full_batch_reference()
    for micro, accumulation in [(8, 1), (4, 2), (1, 8)]:
        grad, loss = one_sgd_update(tmp_path / f"{micro}x{accumulation}", micro, accumulation)
        assert max_relative_error(grad, reference_grad) < 1e-9, (micro, accumulation)
        assert abs(loss - reference_loss) < 1e-7 * reference_loss, (micro, accumulation, loss, reference_loss)


def test_naive_per_micro_batch_mean_would_fail_the_same_check():
    reference_grad, _ = full_batch_reference()
    assert max_relative_error(naive_mean_of_micro_batch_means(1), reference_grad) > 0.05


def test_accumulation_windows_drop_the_partial_tail():
    assert [len(w) for w in loop.accumulation_windows(range(10), 4)] == [4, 4]
    assert list(loop.accumulation_windows(range(4), 2)) == [[0, 1], [2, 3]]


def test_progress_round_trips_through_state_dict():
    progress = Progress(step=7, epoch=1, batches_in_epoch=12, tokens_seen=345)
    restored = Progress()
    restored.load_state_dict(progress.state_dict())
    assert restored == progress


def test_lr_schedule_warmup_then_cosine_to_floor():
    kwargs = dict(warmup_steps=4, max_steps=20, schedule="cosine", min_lr_ratio=0.1)
    factors = [lr_multiplier(step, **kwargs) for step in range(21)]
    assert factors[:4] == [0.2, 0.4, 0.6, 0.8]
    assert factors[4] == 1.0
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert abs(factors[20] - 0.1) < 1e-12
    assert lr_multiplier(10, **{**kwargs, "schedule": "constant"}) == 1.0
    assert abs(lr_multiplier(12, **{**kwargs, "schedule": "linear"}) - (0.1 + 0.9 * 0.5)) < 1e-12


def test_scheduler_steps_once_per_update_with_accumulation(tmp_path):
    """With 4 micro-batches per update, 2 updates must advance the LR schedule by exactly 2."""
    accelerator, model, optimizer, loader = prepared(tmp_path, 1, 4, tiny_model(), lambda params: torch.optim.SGD(params, lr=1.0),
                                                     variable_length_examples())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    loop.train(accelerator, model, optimizer, scheduler, loader, progress=Progress(), max_steps=2,
               max_grad_norm=1.0, metrics=MetricsRecorder(accelerator, tmp_path, max_steps=2, log_every=1))
    assert scheduler.last_epoch == 2
    assert [r["lr"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 0.5]


def adamw_steps(optimizer) -> set[int]:
    """AdamW's own count of the steps it took, over all its parameters."""
    return {int(state["step"]) for state in optimizer.optimizer.state.values()}


def test_one_optimizer_step_per_update_across_epoch_ends(tmp_path):
    """8 examples at micro 2 × accumulation 2: 2 updates per epoch, so 5 updates pass two epoch ends.
    The loop collects each window before its first forward, so in an epoch's last window the
    dataloader has already ended; that must not make every micro-batch of the window step."""
    accelerator, model, optimizer, loader = prepared(tmp_path, 2, 2, tiny_model(), lambda params: torch.optim.AdamW(params),
                                                     variable_length_examples())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    progress = Progress()
    loop.train(accelerator, model, optimizer, scheduler, loader, progress=progress, max_steps=5, max_grad_norm=1.0,
               metrics=MetricsRecorder(accelerator, tmp_path, max_steps=5, log_every=1))
    assert (progress.step, progress.epoch) == (5, 2)
    assert adamw_steps(optimizer) == {5}


def test_lr_schedule_continued_to_a_new_end_keeps_the_resume_lr_and_ends_at_the_floor():
    original = LRSchedule(warmup_steps=4, max_steps=20, schedule="cosine", min_lr_ratio=0.1)
    before = [original(step) for step in range(21)]
    for new_end in (40, 14):  # extended, shortened
        schedule = LRSchedule(warmup_steps=4, max_steps=20, schedule="cosine", min_lr_ratio=0.1)
        schedule.continue_to(new_end, step=10)
        after = [schedule(step) for step in range(new_end + 1)]
        assert after[10] == before[10]  # the LR of the first resumed update is the original schedule's
        assert all(a > b for a, b in zip(after[10:], after[11:])) and abs(after[new_end] - 0.1) < 1e-12
    schedule.continue_to(30, step=12)  # a second resume goes on from wherever the first left it
    assert schedule(12) == after[12] and abs(schedule(30) - 0.1) < 1e-12
    during_warmup = LRSchedule(warmup_steps=4, max_steps=20, schedule="linear", min_lr_ratio=0.1)
    during_warmup.continue_to(40, step=2)  # still warming up: simply the schedule of a 40-step run
    assert [during_warmup(step) for step in range(41)] == [lr_multiplier(step, warmup_steps=4, max_steps=40, schedule="linear",
                                                                          min_lr_ratio=0.1) for step in range(41)]


def test_lr_schedule_travels_in_the_scheduler_state():
    """A resumed LambdaLR gets the schedule it was saved with, whatever this run built."""
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    config = TrainConfig(warmup_steps=2)
    saved = build_scheduler(config, optimizer, max_steps=10)
    saved.lr_lambdas[0].continue_to(30, step=6)
    resumed = build_scheduler(config, optimizer, max_steps=50)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.lr_lambdas[0] == saved.lr_lambdas[0]
    assert continue_schedule(resumed, 30, step=8) is None
    assert "--max-steps 30 → 50" in continue_schedule(resumed, 50, step=8)
