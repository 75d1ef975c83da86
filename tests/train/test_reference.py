"""The reference of DPO and KTO (train/reference.py), built by `train.setup` as a run builds it: LoRA's
adapters switched off, full fine-tuning's frozen copy, and the values precomputed before training all
give the base model's log-probabilities; precomputed ones are cached by the data and the model."""

from __future__ import annotations

import pytest
import torch
from helpers import reset_accelerate, tiny_model_dir, write_jsonl
from transformers import AutoModelForCausalLM

from finetune.config.options import TrainConfig
from finetune.train import log_probs, reference
from finetune.train.run import resolve, setup

PAIRS = [{"prompt": f"w{i} w{i + 1} w{i + 2}", "chosen": f"w{i + 3} w{i + 5}", "rejected": f"w{i + 7}"} for i in range(1, 21)]


def dpo_session(tmp_path, name: str, **flags):
    reset_accelerate()
    rows = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    config = TrainConfig(dataset=str(rows), objective="dpo", output_dir=str(tmp_path / name), micro_batch_size=4,
                         max_steps=2, eval_split="0.2", **{"model": str(tiny_model_dir(tmp_path / "base")), "method": "lora",
                                                           "lora_r": 4, "data_cache": str(tmp_path / "cache")} | flags)
    return setup(*resolve(config))


def base_log_probs(tmp_path, batch) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return log_probs.full_log_probs(logits, batch["labels"])[0]


def test_adapters_off_a_frozen_copy_and_precomputed_values_are_the_base_models_log_probs(tmp_path):
    with dpo_session(tmp_path, "precomputed", precompute_reference=True) as session:
        precomputed = session.collator.reference
        rows = [session.data.train[i] for i in range(4)]
        batch = session.collator(rows)
        assert session.objective.reference.kind == "precomputed"
        assert torch.equal(batch["reference_logps"], torch.cat([precomputed["chosen"][:4], precomputed["rejected"][:4]]))
    expected = base_log_probs(tmp_path, batch)
    assert torch.allclose(batch["reference_logps"], expected, atol=1e-5)
    for name, flags in (("adapters off", {}), ("frozen copy", {"method": "full", "precompute_reference": False})):
        with dpo_session(tmp_path, name.replace(" ", "-"), **flags) as session:
            assert session.objective.reference.kind == name and "reference_logps" not in session.collator(rows)
            got = session.objective.reference.log_probs(session.model, session.collator(rows))
            assert torch.allclose(got, expected, atol=1e-5), name


def test_precomputed_values_are_read_back_from_the_cache_by_the_next_run_of_the_same_data_and_model(tmp_path, monkeypatch):
    with dpo_session(tmp_path, "first", precompute_reference=True) as session:
        first = session.collator.reference
    cached = sorted((tmp_path / "cache" / "reference").glob("*.safetensors"))
    assert len(cached) == 2  # train and eval

    def no_second_pass(*_, **__):
        raise AssertionError("computed again instead of read from the cache")

    monkeypatch.setattr(reference, "compute", no_second_pass)
    with dpo_session(tmp_path, "second", precompute_reference=True) as session:
        assert all(torch.equal(session.collator.reference[k], first[k]) for k in first)
    other = tiny_model_dir(tmp_path / "other-base", rope_theta=1234.0)  # the same weights, another model
    with pytest.raises(AssertionError, match="computed again"):
        dpo_session(tmp_path, "other", precompute_reference=True, model=str(other))
