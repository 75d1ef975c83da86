"""A sliding window no training row reaches, switched off (train/sliding_window.py): the same logits,
loss and gradients as the masked model, no mask handed to SDPA, and the window kept wherever it could
matter (longer rows, generation, the saved config)."""

import copy
import json
from dataclasses import replace

import pytest
import torch
from helpers import speed_up, tiny_model

from finetune.config.options import TrainConfig
from finetune.models import catalog
from finetune.train.skeleton import prepare_for_training
from finetune.train.sliding_window import inert_window, switch_off_inert_window

WINDOW = 16


def windowed_mistral():
    """Mistral-7B's shape shrunk, with a 16-token window (rows of 16 tokens are as long as it), and no
    KV cache in forwards that do not ask for one, as the trainer prepares it."""
    model = tiny_model("mistral-7b", overrides={"sliding_window": WINDOW})
    model.config.use_cache = False
    return model


@pytest.fixture
def sdpa_masks(monkeypatch):
    """The attn_mask of every SDPA call (None: SDPA's causal path, which its flash kernel takes on a GPU)."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        seen.append(attn_mask)
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def forward_backward(model, ids, attention_mask=None):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=attention_mask, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), [p.grad.clone() for p in model.parameters()]


def assert_same(a, b, tolerance: float = 1e-6):
    """fp32 on CPU: the masked and the unmasked kernel agree within 1e-6 (they are equal here)."""
    (logits_a, loss_a, grads_a), (logits_b, loss_b, grads_b) = a, b
    torch.testing.assert_close(logits_b, logits_a, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(loss_b, loss_a, atol=tolerance, rtol=tolerance)
    for g, h in zip(grads_a, grads_b):
        torch.testing.assert_close(h, g, atol=tolerance, rtol=tolerance)


def test_an_inert_window_switched_off_trains_exactly_as_the_masked_model_with_no_mask(sdpa_masks):
    """Rows exactly as long as the window (transformers masks them) and padded rows, every layer
    recomputed: logits, loss and every gradient equal the masked model's; SDPA gets no mask for the
    unpadded rows, where the masked model handed it one in every layer."""
    masked = windowed_mistral()
    switched = copy.deepcopy(masked)
    for model in (masked, switched):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert "sliding window 16 off" in switch_off_inert_window(switched, max_seq_len=WINDOW)
    ids = torch.randint(0, 64, (2, WINDOW), generator=torch.Generator().manual_seed(0))

    plain = forward_backward(masked, ids)
    assert len(sdpa_masks) == 4 and all(mask is not None for mask in sdpa_masks)  # 2 layers, forward + recompute
    sdpa_masks.clear()
    assert_same(plain, forward_backward(switched, ids))
    assert len(sdpa_masks) == 4 and all(mask is None for mask in sdpa_masks)

    padding = torch.ones_like(ids)
    padding[1, 11:] = 0
    assert_same(forward_backward(masked, ids, padding), forward_backward(switched, ids, padding))
    assert switched.config.sliding_window == WINDOW == switched.model.layers[0].self_attn.config.sliding_window


def test_a_window_shorter_than_the_rows_is_kept(sdpa_masks):
    """--max-seq-len past the window: nothing switched off, no line. Rows longer than the window
    reaching a switched model anyway keep the window: its logits are the masked model's, not those of
    the same weights without a window (which differ: the window bites)."""
    model = windowed_mistral()
    assert inert_window(model, WINDOW + 1) is None and switch_off_inert_window(model, WINDOW + 1) is None
    assert inert_window(model, WINDOW) == WINDOW
    assert inert_window(tiny_model(), 10**6) is None  # Llama: no window
    spec = replace(catalog.get("mistral-7b"), sliding_window=WINDOW)  # the planner poses what the trainer does
    assert all(spec.masks_attention(n) == (inert_window(model, n) is None) for n in (WINDOW - 1, WINDOW, WINDOW + 1))

    switched, unwindowed = copy.deepcopy(model), copy.deepcopy(model)
    switch_off_inert_window(switched, WINDOW)
    unwindowed.config.sliding_window = None
    long_rows = torch.randint(0, 64, (1, 2 * WINDOW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        masked, kept, unmasked = (m(input_ids=long_rows).logits for m in (model, switched, unwindowed))
    torch.testing.assert_close(kept, masked, atol=1e-6, rtol=1e-6)
    assert (kept - unmasked).abs().max() > 1e-3
    assert all(mask is not None for mask in sdpa_masks[2:4])  # the switched model's two layers


def test_generation_and_the_saved_config_keep_the_window(tmp_path):
    """Generation carries a KV cache and runs past the window (12 prompt tokens + 12 new ones; a cache
    that keeps every token, so only the mask can apply the window): the switched model's scores are
    the windowed model's, where the same weights without a window score otherwise. The saved
    config.json keeps the window."""
    from transformers import DynamicCache

    model = windowed_mistral()
    switched, unwindowed = copy.deepcopy(model), copy.deepcopy(model)
    switch_off_inert_window(switched, WINDOW)
    unwindowed.config.sliding_window = None
    prompt = torch.randint(0, 63, (1, 12), generator=torch.Generator().manual_seed(2))
    windowed, kept, unmasked = (
        torch.stack(m.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), past_key_values=DynamicCache(),
                               max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=63,
                               return_dict_in_generate=True, output_logits=True).logits)
        for m in (model, switched, unwindowed))
    torch.testing.assert_close(kept, windowed, atol=1e-6, rtol=1e-6)
    assert (unmasked - windowed).abs().max() > 1e-3
    switched.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["sliding_window"] == WINDOW


def test_the_trainer_switches_it_off_through_lora_and_says_so_in_one_line():
    """apply_speedups on a LoRA model of the windowed shape at --max-seq-len 16: one line before the
    switches' summary; at 17, or for a model without a window, none."""
    config = TrainConfig(method="lora", max_seq_len=WINDOW)
    said = []
    speed_up(prepare_for_training(windowed_mistral(), config), config, say=said.append)
    assert said[0] == ("sliding window 16 off: rows of at most 16 tokens never reach past it, so attention is the "
                       "plain causal one (no mask handed to SDPA)")
    assert said[1].startswith("speed switches:") and len(said) == 2
    for model, max_seq_len in ((windowed_mistral(), WINDOW + 1), (tiny_model(), WINDOW)):
        said.clear()
        longer = TrainConfig(method="lora", max_seq_len=max_seq_len)
        speed_up(prepare_for_training(model, longer), longer, say=said.append)
        assert [line for line in said if "sliding window" in line] == []
