"""The preference objectives in the loop (train/objectives.py, train/log_probs.py): sequence log-probabilities
through the LM head in chunks equal the full logits' (values and gradients, frozen or trained head), each
loss is its formula, and every pair of an optimizer step weighs the same whatever the split into
micro-batches (the decision written in train/loop.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import reset_accelerate, tiny_model
from torch.utils.data import DataLoader

from finetune.checkpoint.progress import Progress
from finetune.config.objectives import OBJECTIVES
from finetune.config.options import TrainConfig
from finetune.data.collate import PreferenceCollator
from finetune.train import log_probs, loop
from finetune.train.accelerator import build_accelerator
from finetune.train.objectives import Preference, Settings, score
from finetune.train.reference import Reference
from finetune.train.run import resolve


def test_chunked_log_probs_equal_the_full_logits_values_and_gradients(monkeypatch):
    monkeypatch.setattr(log_probs, "chunk_tokens", lambda vocab: 3)  # several chunks, one pair split across them
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 7, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, generator=generator)
    labels = torch.randint(0, 11, (4, 7), generator=generator)
    labels[:, :3], labels[1, 5:] = -100, -100
    upstream = torch.randn(4, dtype=torch.float64, generator=generator)
    for trainable in (False, True):
        grads = []
        for compute in (log_probs.chunked_log_probs, lambda h, w, y: log_probs.full_log_probs(h @ w.T, y)):
            head = weight.clone().requires_grad_(trainable)
            sums, tokens = compute(hidden, head, labels)
            (sums.double() * upstream).sum().backward()
            grads.append((sums.detach().double(), tokens, hidden.grad.clone(), head.grad))
            hidden.grad = None
        (chunked, chunked_tokens, chunked_hidden, chunked_head), (full, full_tokens, full_hidden, full_head) = grads
        assert chunked_tokens.tolist() == full_tokens.tolist() == [4, 2, 4, 4]
        assert torch.allclose(chunked, full, atol=1e-5) and torch.allclose(chunked_hidden, full_hidden, atol=1e-5)
        assert (chunked_head is None) == (not trainable)
        if trainable:
            assert torch.allclose(chunked_head, full_head, atol=1e-5)


def scores_of(name: str, **settings):
    """The per-example scores of two pairs: chosen log-probs (−2, −3), rejected (−4, −1); 2 and 4 tokens
    each; reference (−3, −3) and (−3, −3)."""
    policy, tokens = torch.tensor([-2.0, -3.0, -4.0, -1.0]), torch.tensor([2.0, 4.0, 2.0, 4.0])
    reference = torch.tensor([-3.0, -3.0, -3.0, -3.0])
    return score(OBJECTIVES[name], Settings(**{"beta": 0.5} | settings), policy, tokens, reference)


def test_each_preference_loss_is_its_formula():
    h = torch.tensor([(-2 + 3) - (-4 + 3), (-3 + 3) - (-1 + 3)])  # chosen − rejected log-ratio: 2, −2
    sigmoid = scores_of("dpo")
    assert torch.allclose(sigmoid.loss, -F.logsigmoid(0.5 * h)) and torch.allclose(sigmoid.chosen - sigmoid.rejected, 0.5 * h)
    assert torch.allclose(scores_of("dpo", dpo_loss="hinge").loss, torch.relu(1 - 0.5 * h))
    h_mean = torch.tensor([(-2 + 3) / 2 - (-4 + 3) / 2, (-3 + 3) / 4 - (-1 + 3) / 4])  # IPO: on mean log-probs
    assert torch.allclose(scores_of("dpo", dpo_loss="ipo").loss, (h_mean - 1 / (2 * 0.5)) ** 2)
    means = torch.tensor([[-1.0, -2.0], [-0.75, -0.25]])  # (chosen, rejected) mean log-prob per pair
    simpo = scores_of("simpo", simpo_gamma=0.3)
    assert torch.allclose(simpo.loss, -F.logsigmoid(0.5 * (means[:, 0] - means[:, 1]) - 0.3))
    odds = means - torch.log1p(-means.exp())
    orpo = scores_of("orpo")
    assert torch.allclose(orpo.loss, -means[:, 0] - 0.5 * F.logsigmoid(odds[:, 0] - odds[:, 1]))
    certain = score(OBJECTIVES["orpo"], Settings(beta=0.5), torch.tensor([0.0, -1.0]), torch.ones(2), None)
    assert torch.isfinite(certain.loss).all()  # a chosen answer of probability 1: its odds capped, not infinite


def test_kto_compares_each_rows_reward_with_the_kl_estimate():
    policy, reference = torch.tensor([-2.0, -5.0]), torch.tensor([-3.0, -3.0])
    desirable, kl = torch.tensor([True, False]), torch.tensor(0.4)
    scores = score(OBJECTIVES["kto"], Settings(beta=0.5), policy, torch.ones(2), reference, desirable, kl)
    assert torch.allclose(scores.loss, torch.tensor([1 - torch.sigmoid(torch.tensor(0.5 * (1 - 0.4))),
                                                     1 - torch.sigmoid(torch.tensor(0.5 * (0.4 + 2)))]))


def pair_rows(n: int = 8, seed: int = 0) -> list[dict]:
    """Pairs of very different lengths, prompts masked, each with its row index."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        prompt = torch.randint(1, 64, (2 + i % 3,), generator=generator).tolist()
        chosen, rejected = (torch.randint(1, 64, (1 + (i * k) % 7,), generator=generator).tolist() for k in (3, 5))
        rows.append({"chosen_input_ids": prompt + chosen, "chosen_labels": [-100] * len(prompt) + chosen,
                     "rejected_input_ids": prompt + rejected, "rejected_labels": [-100] * len(prompt) + rejected, "row": i})
    return rows


REFERENCE = {"chosen": torch.linspace(-30, -10, 8, dtype=torch.float64), "rejected": torch.linspace(-12, -28, 8, dtype=torch.float64)}


def dpo_update(tmp_path, micro_batch_size: int, accumulation: int) -> dict:
    """One DPO update through loop.train with SGD(lr=1) in float64: the weight change is minus the gradient."""
    reset_accelerate()
    model = tiny_model(seed=0).double()
    log_probs.install(model, "finetune-chunked")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    run, _ = resolve(TrainConfig(output_dir=str(tmp_path), micro_batch_size=micro_batch_size,
                                 gradient_accumulation_steps=accumulation, objective="dpo"))
    accelerator = build_accelerator(run)
    collator = PreferenceCollator(SimpleNamespace(pad_token_id=0))
    collator.reference = REFERENCE
    loader = DataLoader(pair_rows(), batch_size=micro_batch_size, collate_fn=collator)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0), loader)
    objective = Preference(OBJECTIVES["dpo"], Settings(beta=0.5), Reference("precomputed", accelerator))
    loop.train(accelerator, model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), loader,
               progress=Progress(), max_steps=1, max_grad_norm=0.0, metrics=SimpleNamespace(record_step=lambda **_: None),
               objective=objective)
    return {name: before[name] - p.detach() for name, p in model.named_parameters()}


def test_every_pair_of_an_update_weighs_the_same_whatever_the_split(tmp_path):
    """The full batch's gradient of the mean DPO loss over its 8 pairs, against one update split 8 × 1,
    4 × 2 and 1 × 8: equal to 1e-9 (a mean per micro-batch would weigh the pairs of small micro-batches more)."""
    model = tiny_model(seed=0).double()
    log_probs.install(model, "finetune-chunked")
    collator = PreferenceCollator(SimpleNamespace(pad_token_id=0))
    collator.reference = REFERENCE
    batch = collator(pair_rows())
    policy, tokens = log_probs.sequence_log_probs(model, batch)
    score(OBJECTIVES["dpo"], Settings(beta=0.5), policy, tokens, batch["reference_logps"]).loss.mean().backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    for micro, accumulation in [(8, 1), (4, 2), (1, 8)]:
        grad = dpo_update(tmp_path / f"{micro}x{accumulation}", micro, accumulation)
        error = max(((grad[k] - expected[k]).norm() / expected[k].norm().clamp(min=1e-12)).item() for k in expected)
        assert error < 1e-9, (micro, accumulation, error)


@pytest.mark.parametrize("form", ["finetune-chunked", "transformers"])
def test_a_model_answers_log_probs_of_its_labels_in_either_form_and_is_itself_otherwise(form):
    model = tiny_model(seed=0)
    batch = PreferenceCollator(SimpleNamespace(pad_token_id=0))(pair_rows(4))
    plain = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    log_probs.install(model, form)
    sums, tokens = log_probs.sequence_log_probs(model, batch)
    expected, _ = log_probs.full_log_probs(plain, batch["labels"])
    assert torch.allclose(sums, expected, atol=1e-5) and math.isfinite(sums.sum().item())
    assert torch.equal(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, plain)
