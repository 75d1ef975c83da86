"""Mixture-of-experts models trained on CPU: QLoRA's experts packed to NF4 as they load (the logits
those of the 16-bit model with its weights rounded to NF4), LoRA on 4-bit experts that stays one
LoRA per forward, the router's load-balancing loss taken as the config says and logged apart, and
tiny random configs of each new family training with full fine-tuning, LoRA and QLoRA."""

from __future__ import annotations

import pytest
import torch
from helpers import build_word_run, tiny_model_dir, train_steps, word_tokenizer
from test_families import FAMILY_CONFIGS, family_config

from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.train import loading


def nf4_rounded(weight: torch.Tensor) -> torch.Tensor:
    """`weight` quantized to NF4 and back, as QLoRA's 4-bit storage holds it."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    packed, state = quantize_4bit(weight, compress_statistics=True, quant_type="nf4", quant_storage=weight.dtype)
    return dequantize_4bit(packed, state)


def test_qlora_packs_the_experts_as_they_load_with_the_logits_of_nf4_rounded_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    source = str(tiny_model_dir(tmp_path / "m", "qwen3-30b-a3b"))
    run = resolve_run(TrainConfig(model=source, method="qlora", lora_targets="all-linear+experts"), Launch(), Device())
    quantized = loading.load_model(run, torch.device("cpu"))
    experts = quantized.get_base_model().model.layers[0].mlp.experts.get_base_layer()
    packed = experts.parametrizations.gate_up_proj.original
    assert not packed.requires_grad and packed.numel() * packed.element_size() * 2 == experts.gate_up_proj.numel()  # 4 bits
    full = AutoModelForCausalLM.from_pretrained(source)  # fp32, as the run loads
    rounded = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        for name, param in rounded.model.layers.named_parameters():
            if param.dim() >= 2 and "mlp.gate." not in name:  # every linear and expert; the router stays 16-bit
                param.copy_(nf4_rounded(param))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # train mode (an eval-mode forward repacks 4-bit weights: train/skeleton.py), no dropout
        got, nf4, exact = (m(input_ids=ids).logits for m in (quantized, rounded.train(), full.train()))
    assert torch.allclose(got, nf4, atol=1e-5)  # the 4-bit model computes with NF4(W), experts included:
    assert 0 < (got - exact).abs().max() < 0.25 * exact.abs().max()  # the 16-bit model within NF4's rounding


def test_lora_on_4bit_experts_adds_one_update_per_forward_and_trains(tmp_path):
    """PEFT 0.21 leaves its LoRA proxy on a parameter bitsandbytes already parametrizes, stacking one
    more ΔW per forward (experts_4bit.fit_lora_to_4bit_experts): repeated forwards must agree."""
    source = str(tiny_model_dir(tmp_path / "m", "mixtral-8x7b"))
    run = resolve_run(TrainConfig(model=source, method="qlora", lora_targets="experts", lora_r=4), Launch(), Device())
    model = loading.load_model(run, torch.device("cpu"))
    adapters = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in adapters:
            p.normal_(std=0.05)  # a LoRA that changes the experts (B starts at zero)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first, second = (model(input_ids=ids, labels=ids).loss.item() for _ in range(2))
    assert first == second  # W + ΔW each time, not W + 2ΔW
    experts = model.get_base_model().model.layers[0].mlp.experts.get_base_layer()
    assert [type(p).__name__ for p in experts.parametrizations.gate_up_proj] == ["Bnb4bitParametrization"]
    optimizer = torch.optim.AdamW(adapters, lr=1e-2)
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(("shape", "method", "targets"), [
    ("qwen3-30b-a3b", "full", "all-linear"),
    ("qwen3-30b-a3b", "lora", "all-linear+experts"),
    ("qwen3-30b-a3b", "qlora", "all-linear+experts"),
    ("mixtral-8x7b", "qlora", "all-linear,router"),
    ("gpt-oss-20b", "lora", "all-linear+experts"),
    ("olmoe-1b-7b", "qlora", "experts"),
    ("deepseek-v2-lite", "lora", "all-linear+experts"),
    ("gemma-3-12b", "qlora", "all-linear"),
    ("qwen2_moe", "qlora", "all-linear+experts"),  # families without a catalog entry: test_families.py's FAMILY_CONFIGS
    ("deepseek_v3", "qlora", "all-linear+experts"),
])
def test_tiny_configs_of_each_family_train(shape, method, targets, tmp_path):
    model = {}
    if shape in FAMILY_CONFIGS:
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(**family_config(shape))).save_pretrained(tmp_path / "m")
        word_tokenizer().save_pretrained(tmp_path / "m")
        model = {"model": str(tmp_path / "m")}
    session = build_word_run(tmp_path / "run", method=method, shape="tiny" if model else shape, lora_targets=targets,
                             lr=1e-2, **model)
    batch = next(iter(session.train_loader))
    with torch.no_grad():
        before_loss = session.model(**batch).loss.item()
    before = {n: p.detach().clone() for n, p in session.model.named_parameters() if p.requires_grad}
    train_steps(session, 3, save=False)
    changed = {n for n, p in session.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])}
    assert changed == set(before)  # every trainable parameter moved: adapters on experts included
    with torch.no_grad():
        assert session.model(**batch).loss.item() < before_loss


def test_the_load_balancing_loss_is_averaged_over_micro_batches_and_logged_apart(tmp_path):
    """With output_router_logits the router's loss joins the token loss as the model adds it, as a
    mean over the accumulation window (not summed like token losses), and metrics get it apart."""
    from finetune.train import loop
    from finetune.train.run import router_aux_loss_coef

    source = str(tiny_model_dir(tmp_path / "m", "mixtral-8x7b", output_router_logits=True, router_aux_loss_coef=0.5))
    session = build_word_run(tmp_path / "run", model=source, micro_batch_size=4, global_batch_size=8)
    model, coef = session.model, router_aux_loss_coef(session.model)
    assert coef == 0.5 and session.accelerator.gradient_accumulation_steps == 2
    session.train_loader.set_epoch(0)
    window = [batch for _, batch in zip(range(2), session.train_loader)]  # the loop's first window
    targets = sum((b["labels"][:, 1:] != -100).sum() for b in window)
    outputs = [model(**batch, num_items_in_batch=targets) for batch in window]
    tokens = sum(out.loss - coef * out.aux_loss for out in outputs)
    aux = sum(out.aux_loss for out in outputs) / len(outputs)
    (tokens + coef * aux).backward()  # what one update should follow
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    class Record:
        def record_step(self, **record):
            self.record = record

    gradients, recorded, step = {}, Record(), session.optimizer.step
    def capture(*args, **kwargs):  # the update's gradients, as the optimizer sees them
        gradients.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    session.optimizer.step = capture
    loop.train(session.accelerator, model, session.optimizer, session.scheduler, session.train_loader,
               progress=session.progress, max_steps=1, max_grad_norm=0, metrics=recorded, router_aux_loss_coef=coef)
    assert gradients.keys() == expected.keys()
    for name, gradient in gradients.items():
        assert torch.allclose(gradient, expected[name], rtol=1e-4, atol=1e-7), name
    assert recorded.record["aux_loss"] == pytest.approx(aux.item(), rel=1e-5)
    assert recorded.record["loss"] == pytest.approx(tokens.item(), rel=1e-5)  # the token loss alone
