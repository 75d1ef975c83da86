"""The loop's contracts: token-weighted loss over the optimizer step, one LR step per update,
whole accumulation windows, and resumable progress."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import GradientAccumulationPlugin
from conftest import tiny_llama
from torch.utils.data import DataLoader

from finetune import loop
from finetune.data import Collator
from finetune.metrics import MetricsRecorder, read_metrics
from finetune.optim import lr_multiplier

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


def one_sgd_update(tmp_path, micro_batch_size: int, accumulation: int):
    """Run one optimizer update with SGD(lr=1), so the weight change is minus the gradient (float64
    keeps the subtraction exact enough to compare gradients of 1e-4 on weights of 1)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=accumulation, sync_with_dataloader=False))
    model = tiny_llama(seed=0).double()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    tmp_path.mkdir()
    loader = DataLoader(variable_length_examples(), batch_size=micro_batch_size, collate_fn=pad_collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    metrics = MetricsRecorder(accelerator, tmp_path, max_steps=1, log_every=1)
    loop.train(accelerator, model, optimizer, scheduler, loader, progress=loop.Progress(), max_steps=1,
               max_grad_norm=0.0, metrics=metrics)
    gradient = {name: before[name] - p.detach() for name, p in model.named_parameters()}
    return gradient, read_metrics(tmp_path / "metrics.jsonl")[-1]["loss"]


def full_batch_reference():
    """Gradient and loss of the token-weighted mean over all 8 examples in one forward."""
    model = tiny_llama(seed=0).double()
    batch = pad_collate(variable_length_examples())
    loss = model(**batch).loss  # HF's default: mean over all non-ignored target tokens
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}, loss.item()


def naive_mean_of_micro_batch_means(micro_batch_size: int):
    """What a loop that averages per-micro-batch mean losses would compute."""
    model = tiny_llama(seed=0).double()
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
    progress = loop.Progress(step=7, epoch=1, batches_in_epoch=12, tokens_seen=345)
    restored = loop.Progress()
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
    accelerator = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4, sync_with_dataloader=False))
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    loader = DataLoader(variable_length_examples(), batch_size=1, collate_fn=pad_collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loop.train(accelerator, model, optimizer, scheduler, loader, progress=loop.Progress(), max_steps=2,
               max_grad_norm=1.0, metrics=MetricsRecorder(accelerator, tmp_path, max_steps=2, log_every=1))
    assert scheduler.last_epoch == 2
    assert [r["lr"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 0.5]
