"""`finetune export --format gguf`: a LoRA run of a tiny Llama with a byte-level BPE tokenizer, exported
as one GGUF file per type and read back by transformers (`gguf_file=`): same tokenizer and chat
template, logits of the exported (merged) model within each type's rounding."""

from __future__ import annotations

import pytest
import torch
from helpers import train_steps
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.cli import main as cli
from finetune.errors import GgufExportError
from finetune.export.gguf import export_gguf

MESSAGES = [{"role": "user", "content": "What is 7 plus 7?"}]
# largest |gguf logit - exported logit| as a fraction of the largest |logit|: f16 keeps 11 significant
# bits, bf16 8, q8_0 8 per value with one f16 scale per 32 values (measured: 1.5e-4, 1.4e-3, 4e-3;
# without llama.cpp's q/k permutation the f16 error on the base model is 0.12)
TOLERANCE = {"f16": 3e-3, "bf16": 1e-2, "q8_0": 3e-2}  # of the largest logit; f16 rounds each weight by up to 2^-11


def chat_ids(tokenizer, messages=MESSAGES) -> torch.Tensor:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits.float()


@pytest.mark.parametrize("gguf_type", ["f16", "bf16", "q8_0"])
def test_gguf_round_trip_through_transformers(bpe_lora_run, gguf_type, tmp_path):
    out = tmp_path / "gguf"
    assert cli(["export", str(bpe_lora_run / "run"), "--out", str(out), "--format", "gguf", "--gguf-type", gguf_type]) == 0
    name = f"model-{gguf_type}.gguf"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", name]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the staging folder is gone

    exported = AutoModelForCausalLM.from_pretrained(bpe_lora_run / "merged")
    exported_tokenizer = AutoTokenizer.from_pretrained(bpe_lora_run / "merged")
    model = AutoModelForCausalLM.from_pretrained(out, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(out, gguf_file=name)
    assert tokenizer.chat_template == exported_tokenizer.chat_template
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    ids = chat_ids(exported_tokenizer)
    assert torch.equal(chat_ids(tokenizer), ids)
    assert model.config.tie_word_embeddings and model.config.vocab_size == 320

    expected = logits(exported, ids)
    error = (logits(model, ids) - expected).abs().max().item() / expected.abs().max().item()
    assert error < TOLERANCE[gguf_type]
    base = logits(AutoModelForCausalLM.from_pretrained(bpe_lora_run / "base"), ids)
    assert (base - expected).abs().max().item() / expected.abs().max().item() > 10 * TOLERANCE[gguf_type]  # merged


def test_gguf_file_holds_llama_cpp_metadata_tokenizer_and_types(bpe_lora_run, tmp_path):
    import gguf

    export_gguf(bpe_lora_run / "run", tmp_path / "q8", "q8_0")
    reader = gguf.GGUFReader(tmp_path / "q8" / "model-q8_0.gguf")
    field = {name: f.contents() for name, f in reader.fields.items()}
    assert (field["general.architecture"], field["general.name"], field["llama.block_count"]) == ("llama", "q8", 2)
    assert (field["llama.attention.head_count"], field["llama.attention.head_count_kv"], field["llama.rope.dimension_count"]) == (4, 2, 8)
    assert (field["tokenizer.ggml.model"], field["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    tokens, types = field["tokenizer.ggml.tokens"], field["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 320
    assert tokens[297:300] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert [types.count(t) for t in (gguf.TokenType.NORMAL, gguf.TokenType.CONTROL, gguf.TokenType.UNUSED)] == [297, 3, 20]
    assert tokens[300] == "[PAD300]" and len(field["tokenizer.ggml.merges"]) > 0
    assert (field["tokenizer.ggml.eos_token_id"], field["tokenizer.ggml.padding_token_id"]) == (299, 297)
    assert field["tokenizer.chat_template"].startswith("{% for message in messages %}")
    assert (field["tokenizer.ggml.add_bos_token"], field["tokenizer.ggml.add_eos_token"]) == (False, False)  # as the tokenizer

    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert "output.weight" not in kinds  # tied to token_embd.weight, as llama.cpp expects
    assert len(kinds) == 1 + 2 * 9 + 1  # embedding, 9 per block, final norm
    assert {kinds["output_norm.weight"], kinds["blk.0.attn_norm.weight"]} == {"F32"}
    assert {kinds["token_embd.weight"], kinds["blk.1.attn_q.weight"], kinds["blk.1.ffn_down.weight"]} == {"Q8_0"}


def test_a_tokenizer_without_a_gguf_form_is_refused_before_anything_is_written(make_run, tmp_path):
    run = make_run(save_every=1)  # the word-level test tokenizer
    train_steps(run, 1)
    with pytest.raises(GgufExportError, match=r"tokenizer model 'WordLevel'.*supported: byte-level BPE"):
        export_gguf(tmp_path / "out", tmp_path / "exports" / "gguf")
    assert not (tmp_path / "exports").exists()  # refused before the staging export


@pytest.mark.slow  # the real SmolLM2-135M-Instruct: converted once per session, ~20 s to load the f16 file
def test_smollm2_as_gguf_answers_as_the_model_it_was_written_from(tmp_path, smollm2_dir):
    """The real model (byte-level BPE with the `smollm` pre-tokenizer, ChatML, 9 heads over 3 KV
    heads, tied embeddings) written as f16 and read back: same tokens, near-equal logits, same answer."""
    from finetune.export.gguf import write_gguf

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    write_gguf(smollm2_dir, tmp_path / "model-f16.gguf", "f16", name="smollm2")

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model-f16.gguf", dtype=torch.float32)
    reloaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file="model-f16.gguf")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    ids = chat_ids(tokenizer, question)
    assert torch.equal(chat_ids(reloaded_tokenizer, question), ids)
    expected = logits(model, ids)
    assert (logits(reloaded, ids) - expected).abs().max().item() < 0.005 * expected.abs().max().item()  # 0.04 of 37.6
    with torch.no_grad():
        answer = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:]
        assert torch.equal(reloaded.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:], answer)
    assert tokenizer.decode(answer) == "The capital of France is Paris.<|im_end|>"
