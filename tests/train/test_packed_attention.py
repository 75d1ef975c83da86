"""Attention over packed rows on CPU: `--attention varlen` (train/packed_attention.py) and the
flattened micro-batches that it and `--attention flash` read (data/collate.flattened).

torch's varlen_attn runs on CUDA only, so `per_example_sdpa` (SDPA on each example alone) stands in
for the kernel here: everything around it runs as on a GPU (registration, the mask transformers
builds, the flattening and offsets, the layouts, the fallbacks to SDPA), and
tests/gpu_kit/test_gpu.py checks the kernel itself. transformers' flash path runs here with SDPA
stand-ins for flash-attn's two functions. fp32 throughout: equal means within 1e-5.
"""

import copy

import datasets
import pytest
import torch
import torch.nn.functional as F
from helpers import speed_up, tiny_model, word_tokenizer

from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.data.collate import Collator
from finetune.data.packing import pack
from finetune.errors import ConfigError
from finetune.train import packed_attention
from finetune.train.loop import count_input_tokens, count_target_tokens
from finetune.train.skeleton import prepare_for_training
from finetune.train.speedups import flattens_packed_rows

LENGTHS = (7, 9, 5, 12, 3, 10)  # packed at 20 tokens: rows of 7 + 9, 5 + 12 + 3, 10


def per_example_sdpa(q, k, v, cu_seq_lens, longest, scale, window):
    """The kernel's contract, computed with SDPA on each example alone (causal, within `window`)."""
    assert cu_seq_lens.dtype == torch.int32 and longest == int(cu_seq_lens.diff().max())
    pieces = []
    for start, end in zip(cu_seq_lens[:-1].tolist(), cu_seq_lens[1:].tolist()):
        i = torch.arange(end - start)
        allowed = (i[None, :] <= i[:, None]) & ((i[None, :] >= i[:, None] - window[0]) if window[0] >= 0 else True)
        q_, k_, v_ = (t[start:end].transpose(0, 1) for t in (q, k, v))
        pieces.append(F.scaled_dot_product_attention(q_, k_, v_, attn_mask=allowed, scale=scale, enable_gqa=True).transpose(0, 1))
    return torch.cat(pieces)


def examples(lengths=LENGTHS) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, 62, (n,), generator=g).tolist() for n in lengths]
    return [{"input_ids": row, "labels": row} for row in ids]


def packed(rows: list[dict], max_seq_len: int = 20) -> list[dict]:
    return list(pack(datasets.Dataset.from_list(rows), max_seq_len))


def varlen_copy(model, calls: list | None = None):
    """`model` with the varlen attention function, `per_example_sdpa` as its kernel (`calls` counts them)."""
    def kernel(*args):
        if calls is not None:
            calls.append(args[0].shape)
        return per_example_sdpa(*args)

    copied = copy.deepcopy(model)
    copied.set_attn_implementation(packed_attention.register("test_varlen", kernel))
    return copied


def without_labels(batch: dict) -> dict:
    return {key: value for key, value in batch.items() if key != "labels"}


def each_alone(model, rows: list[dict]) -> torch.Tensor:
    """Logits of every example computed alone, concatenated: (1, tokens, vocab)."""
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([row["input_ids"]])).logits for row in rows], 1)


def lora_models(config: TrainConfig):
    """(plain, varlen) LoRA models with the same non-zero adapters, each through apply_speedups (the chunked
    loss on both); varlen's as a CUDA run would get it, then given the CPU stand-in kernel."""
    torch.manual_seed(0)
    plain = prepare_for_training(tiny_model(), config)
    for name, param in plain.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=0.1)
    varlen = copy.deepcopy(plain)
    speed_up(plain, TrainConfig(method="lora", liger=False), say=lambda _: None)
    speed_up(varlen, config, cuda=True, say=lambda _: None)
    return plain, varlen


def loss_and_adapter_grads(model, batch: dict, targets: torch.Tensor):
    model.zero_grad()
    loss = model(**batch, num_items_in_batch=targets).loss
    loss.backward()
    return loss.detach(), [p.grad for name, p in model.named_parameters() if p.requires_grad]


def test_varlen_trains_packed_rows_as_sdpa_trains_each_example():
    """LoRA with the chunked loss and every layer recomputed: a micro-batch of three packed rows,
    flattened, through varlen gives the loss and adapter gradients of the six examples as unpadded
    rows under SDPA; the kernel runs once per layer and per recompute, with all 46 tokens."""
    config = TrainConfig(method="lora", attention="varlen", packing=True, liger=False, gradient_checkpointing=True)
    plain, varlen = lora_models(config)
    calls = []
    packed_attention.register(kernel=lambda *args: calls.append(args[0].shape) or per_example_sdpa(*args))
    assert flattens_packed_rows(varlen) and not flattens_packed_rows(plain)
    tokenizer, rows = word_tokenizer(), examples()
    unpacked, flat = Collator(tokenizer)(rows), Collator(tokenizer, flatten=True)(packed(rows))
    targets = count_target_tokens(unpacked)
    assert count_target_tokens(flat) == targets == count_target_tokens(Collator(tokenizer)(packed(rows)))
    assert count_input_tokens(flat) == sum(LENGTHS)  # no padding left

    loss, grads = loss_and_adapter_grads(plain, unpacked, targets)
    loss_varlen, grads_varlen = loss_and_adapter_grads(varlen, flat, targets)
    assert loss_varlen.item() == pytest.approx(loss.item(), rel=1e-6)
    assert len(grads) == len(grads_varlen) > 0
    assert all(torch.allclose(g, h, atol=1e-6) for g, h in zip(grads, grads_varlen))
    assert calls == [(sum(LENGTHS), 4, 8)] * 4  # 2 layers: forward, then recomputed in backward


def test_varlen_keeps_the_plain_path_for_padding_caches_and_rows_without_offsets():
    """Evaluation's padded rows and generation's cached steps go to SDPA with transformers' mask; packed
    rows handed over unflattened (no offsets) find their examples from the position ids."""
    plain, calls = tiny_model(), []
    varlen = varlen_copy(plain, calls)
    tokenizer, rows = word_tokenizer(), examples()
    padded = without_labels(Collator(tokenizer)(rows[:3]))
    with torch.no_grad():
        got, want = varlen(**padded).logits, plain(**padded).logits
    real = padded["attention_mask"].bool()
    assert torch.allclose(got[real], want[real], atol=1e-5) and not calls

    prompt = torch.tensor([rows[3]["input_ids"]])
    generated = varlen.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    expected = plain.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert generated.tolist() == expected.tolist() and len(calls) == 2  # the prompt's step, 2 layers

    two_rows = packed(rows)[:2]  # 7 + 9 and 5 + 12 + 3 tokens
    with torch.no_grad():
        logits = varlen(**without_labels(Collator(tokenizer)(two_rows)), use_cache=False).logits
    alone = each_alone(plain, rows[:5])
    assert torch.allclose(torch.cat([logits[0, :16], logits[1, :20]])[None], alone, atol=1e-5)


def test_varlen_slides_each_examples_window_as_transformers_masks_it():
    """A Mistral whose sliding window (3 keys) is shorter than its examples: varlen's window equals the
    mask transformers builds for SDPA, example by example."""
    plain = tiny_model("mistral-7b")
    plain.config.sliding_window = 3
    varlen = varlen_copy(plain)
    rows = examples()
    with torch.no_grad():
        flat = without_labels(Collator(word_tokenizer(), flatten=True)(packed(rows)))
        got = varlen(**flat, use_cache=False).logits
    assert torch.allclose(got, each_alone(plain, rows), atol=1e-5)
    plain.config.sliding_window = None
    assert not torch.allclose(got, each_alone(plain, rows), atol=1e-3)  # the window changes the answer


def flash_stand_ins(monkeypatch) -> str:
    """transformers' flash-attention path, registered as "fa_stand_in", with SDPA doing flash-attn's
    work (whole rows, causal; or each sequence of cu_seqlens): transformers decides which to call."""
    import transformers.modeling_flash_attention_utils as flash_utils
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    def whole_rows(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=True).transpose(1, 2)

    def each_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                      causal=False):
        assert causal and torch.equal(cu_seqlens_q, cu_seqlens_k)
        return per_example_sdpa(q, k, v, cu_seqlens_q.int(), int(max_seqlen_q), softmax_scale, (-1, 0))

    functions = (whole_rows, each_sequence, None, flash_utils._pad_input, flash_utils._unpad_input)
    processing = (flash_utils._lazy_define_process_function(each_sequence), dict)
    monkeypatch.setattr(flash_utils, "lazy_import_flash_attention", lambda *args, **kwargs: (functions, processing))
    AttentionInterface.register("fa_stand_in", flash_attention_forward)
    AttentionMaskInterface.register("fa_stand_in", flash_attention_mask)
    return "fa_stand_in"


def test_flash_attention_separates_packed_examples_only_in_the_flattened_micro_batch(monkeypatch):
    """The hole: transformers' flash path reads packed examples from position ids only for a one-row
    batch, so a micro-batch of two packed rows attends across examples. Flattened by the collator
    (--attention flash flattens: config.switches.FLATTENING_ATTENTIONS), the examples stay apart, with
    the offsets transformers itself derives from the position ids."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    plain = tiny_model()
    flash = copy.deepcopy(plain)
    flash.set_attn_implementation(flash_stand_ins(monkeypatch))
    tokenizer, rows = word_tokenizer(), examples()
    two_rows = packed(rows)[:2]
    alone = each_alone(plain, rows[:5])
    with torch.no_grad():
        as_rows = flash(**without_labels(Collator(tokenizer)(two_rows)), use_cache=False).logits
        flat = Collator(tokenizer, flatten=True)(two_rows)
        as_one_row = flash(**without_labels(flat), use_cache=False).logits
    assert not torch.allclose(torch.cat([as_rows[0, :16], as_rows[1, :20]])[None], alone, atol=1e-3)
    assert torch.allclose(as_one_row, alone, atol=1e-5)
    (cu_seq_lens, _), (longest, _) = prepare_fa_kwargs_from_position_ids(flat["position_ids"])
    assert flat["cu_seq_lens_q"].tolist() == cu_seq_lens.tolist() == [0, 7, 16, 21, 33, 36]
    assert flat["max_length_q"] == longest == 12


def test_varlen_is_refused_where_it_cannot_run(tmp_path, monkeypatch):
    """One line each, before anything loads where the flags tell (CPU, fp32, an older torch), and before
    training where only the loaded model does (attention sinks, soft-capped scores, attention dropout)."""
    config = TrainConfig(attention="varlen", packing=True, output_dir=str(tmp_path / "out"))
    gpu = Device(cuda=True, bf16=True)
    assert resolve_run(config, Launch(), gpu).switches.attention == "varlen"
    refusals = {"cpu": (Device(), "--attention varlen needs a CUDA GPU"),
                "fp32": (gpu, "--attention varlen runs FlashAttention, which takes 16-bit inputs")}
    for name, (device, start) in refusals.items():
        with pytest.raises(ConfigError, match=start):
            resolve_run(TrainConfig(**{**vars(config), "precision": name if name == "fp32" else "auto"}), Launch(), device)
    monkeypatch.setattr("finetune.config.switches._version", lambda distribution: "2.10.0")
    with pytest.raises(ConfigError, match=r"needs torch ≥ 2\.11 .* this is torch 2\.10\.0"):
        resolve_run(config, Launch(), gpu)
    monkeypatch.undo()  # this torch again: the refusals below come from the loaded model
    assert not (tmp_path / "out").exists()

    softcapped, dropout = tiny_model(), tiny_model()
    softcapped.config.attn_logit_softcapping = 50.0
    dropout.config.attention_dropout = 0.1
    assert "soft-caps its attention scores" in packed_attention.problem(softcapped)
    assert "no attention dropout" in packed_attention.problem(dropout)
    assert "attention sinks" in packed_attention.problem(tiny_model("gpt-oss-20b"))
    assert packed_attention.problem(tiny_model()) is None
    with pytest.raises(ConfigError, match="soft-caps"):
        speed_up(softcapped, TrainConfig(attention="varlen", packing=True, liger=False), cuda=True)
