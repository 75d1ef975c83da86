"""The chunked loss (train/chunked_loss.py) is the model's own loss, computed without the logits and
only where there are targets: same loss and gradients for every architecture it covers, in every
precision, with ignored tokens and token-weighted normalisation; untouched forwards without labels;
and a word where it cannot run (where it runs is tests/config/test_switches.py's)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import REPO, speed_up, tiny_model

from finetune.config import switches
from finetune.config.names import CHUNKED_LOSS_ARCHITECTURES
from finetune.config.options import TrainConfig
from finetune.train import chunked_loss
from finetune.train.skeleton import prepare_for_training

VOCAB = 300


@pytest.fixture(autouse=True)
def chunks_of_seven_tokens(monkeypatch):
    """Several chunks per batch, the last one short."""
    monkeypatch.setattr(switches, "CHUNK_LOGITS", 7 * VOCAB)


def batch(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 20), generator=generator)
    labels = ids.clone()
    labels[0, :6] = -100  # a prompt
    labels[2, 14:] = -100  # padding
    return {"input_ids": ids, "labels": labels}


def loss_and_gradients(model, inputs: dict, autocast: bool, **extra) -> tuple[torch.Tensor, dict]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**inputs, **extra).loss
    loss.backward()
    gradients = {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), gradients


@pytest.mark.parametrize("shape", ["tiny", "mistral-7b", "qwen2.5-7b", "qwen3-8b", "mixtral-8x7b", "qwen3-30b-a3b",
                                   "olmoe-1b-7b", "gpt-oss-20b", "deepseek-v2-lite"])
@pytest.mark.parametrize("precision", ["fp32", "bf16 weights", "bf16 autocast"])
def test_loss_and_gradients_equal_the_models_own(shape, precision):
    own = tiny_model(shape, vocab_size=VOCAB)
    if precision == "bf16 weights":
        own = own.to(torch.bfloat16)
    chunked = copy.deepcopy(own)
    assert chunked_loss.head_problem(chunked) is None
    chunked_loss.install(chunked)
    tolerance = {"fp32": 1e-5, "bf16 weights": 2e-2, "bf16 autocast": 2e-2}[precision]
    for extra in ({}, {"num_items_in_batch": torch.tensor(50)}):  # the mean over kept tokens, or the loop's global count
        expected_loss, expected = loss_and_gradients(own, batch(), precision == "bf16 autocast", **extra)
        loss, gradients = loss_and_gradients(chunked, batch(), precision == "bf16 autocast", **extra)
        assert loss == pytest.approx(expected_loss.item(), rel=tolerance / 10)
        assert gradients.keys() == expected.keys() and len(gradients) == len(list(own.parameters()))
        for name, gradient in gradients.items():
            if name.endswith("k_proj.bias"):  # softmax cancels a key bias: its true gradient is 0, this is rounding
                continue
            scale = expected[name].abs().max().clamp(min=1e-6)
            assert (gradient - expected[name]).abs().max() / scale < tolerance, name


def test_a_mixture_of_experts_keeps_its_load_balancing_loss():
    """With output_router_logits the model's own loss adds router_aux_loss_coef × the balancing loss."""
    own = tiny_model("mixtral-8x7b", vocab_size=VOCAB)
    own.config.output_router_logits, own.router_aux_loss_coef = True, 0.5
    chunked = copy.deepcopy(own)
    chunked_loss.install(chunked)
    expected_loss, expected = loss_and_gradients(own, batch(), False)
    loss, gradients = loss_and_gradients(chunked, batch(), False)
    assert loss == pytest.approx(expected_loss.item(), rel=1e-6)
    assert chunked(**batch()).aux_loss > 0
    router = "model.layers.0.mlp.gate.weight"  # only the balancing loss is not linear in the router's gradient
    assert torch.allclose(gradients[router], expected[router], rtol=1e-4, atol=1e-7)


def test_lora_adapters_get_the_gradients_of_the_models_own_loss():
    config = TrainConfig(method="lora", lora_r=4)
    own = prepare_for_training(tiny_model(vocab_size=VOCAB), config)
    chunked = copy.deepcopy(own)
    chunked_loss.install(chunked.get_base_model())
    expected_loss, expected = loss_and_gradients(own, batch(1), autocast=False)
    loss, gradients = loss_and_gradients(chunked, batch(1), autocast=False)
    assert loss == pytest.approx(expected_loss.item(), rel=1e-6)
    assert gradients.keys() == expected.keys() and all("lora_" in name for name in gradients)
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, expected[name], rtol=1e-4, atol=1e-7)


def test_a_micro_batch_without_targets_adds_nothing_and_still_backpropagates():
    """Under accumulation a micro-batch can hold only prompt tokens: its loss is 0 of the window's
    count, and backward runs (zero gradients) as with the model's own loss."""
    model = tiny_model(vocab_size=VOCAB)
    chunked_loss.install(model)
    inputs = batch()
    inputs["labels"] = torch.full_like(inputs["labels"], -100)
    loss = model(**inputs, num_items_in_batch=torch.tensor(50)).loss
    loss.backward()
    assert loss.item() == 0.0 and all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_without_labels_the_forward_is_the_models_own():
    """Evaluation reads logits and generation calls the forward without labels: both unchanged."""
    own = tiny_model(vocab_size=VOCAB).eval()
    chunked = copy.deepcopy(own)
    chunked_loss.install(chunked)
    ids = batch()["input_ids"]
    torch.testing.assert_close(chunked(input_ids=ids).logits, own(input_ids=ids).logits, rtol=0, atol=0)
    greedy = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(chunked.generate(input_ids=ids[:1], **greedy), own.generate(input_ids=ids[:1], **greedy))
    assert chunked(**batch()).logits is None  # with labels: the loss only


def test_an_uncovered_head_keeps_the_models_own_loss_and_says_so_when_asked():
    from transformers import AutoConfig, AutoModelForCausalLM

    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB))
    said = []
    speed_up(gpt2, TrainConfig(chunked_loss=True), say=said.append)
    assert said[0] == (f"--chunked-loss: model type 'gpt2' is not one of {', '.join(CHUNKED_LOSS_ARCHITECTURES)}; "
                       "using the model's own loss")
    assert said[-1].startswith("speed switches: liger off, chunked loss off")
    said.clear()
    zero3 = TrainConfig(chunked_loss=True, deepspeed=str(REPO / "ds_configs" / "zero3.json"))
    speed_up(tiny_model(vocab_size=VOCAB), zero3, say=said.append)
    assert said[0] == ("--chunked-loss: ZeRO-3 gathers the LM head's weight only inside the head's own forward; "
                       "using the model's own loss")


def test_a_quantized_head_is_not_read_as_a_weight_matrix():
    import bitsandbytes as bnb

    model = tiny_model(vocab_size=VOCAB)
    head = model.get_output_embeddings()
    quantized = bnb.nn.Linear4bit(head.in_features, head.out_features, bias=False, quant_type="nf4")
    quantized.load_state_dict(head.state_dict())
    model.set_output_embeddings(quantized.to("cpu"))  # packs the weight
    assert chunked_loss.head_problem(model) == "its LM head is quantized"
    said = []
    speed_up(model, TrainConfig(chunked_loss=True), say=said.append)
    assert said[0] == "--chunked-loss: its LM head is quantized; using the model's own loss"


def test_where_liger_cannot_run_the_chunked_loss_stands_in_for_its_fused_loss():
    """--liger plans no logits; on CPU Liger does not run, and the chunked loss keeps that true."""
    said = []
    model = speed_up(tiny_model(vocab_size=VOCAB), TrainConfig(liger=True), say=said.append)
    assert said == ["running without Liger (Liger's Triton kernels need a CUDA GPU)",
                    "speed switches: liger off, chunked loss on, compile off, attention sdpa"]
    assert model(**batch()).logits is None
