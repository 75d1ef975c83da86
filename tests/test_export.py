"""`finetune export` from single-process checkpoints: full weights (sharded, dtypes) and LoRA
(adapter as is, and merged). Exports from FSDP2 and ZeRO checkpoints are in test_resume_strategies.py."""

from __future__ import annotations

import json

import pytest
import torch
from test_checkpointing import make_run  # noqa: F401  (fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.checkpointing import CheckpointError
from finetune.cli import main as cli
from finetune.export import export, plan_shards

TOKENS = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8], [9, 7, 9, 3, 2, 38, 4, 6]])


def logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def test_full_export_is_sharded_and_reproduces_the_trained_logits(make_run, tmp_path):
    run = make_run(save_every=2)
    run.train_steps(2)
    out = tmp_path / "exported"
    assert cli(["export", str(tmp_path / "out"), "--out", str(out), "--max-shard-size", "20KB"]) == 0

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and set(index["weight_map"].values()) == set(shards)
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embedding, stored once
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(logits(exported), logits(run.model))  # fp32 in, fp32 out: bitwise
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("w5") == 5

    bf16 = tmp_path / "bf16"
    export(tmp_path / "out" / "checkpoints" / "step-000002", bf16, dtype="bf16")
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(bf16)
    assert next(model.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(logits(model).float(), logits(run.model), atol=0.05, rtol=0.05)


def test_lora_export_as_adapter_and_merged(make_run, tmp_path):
    from peft import PeftModel

    run = make_run(method="lora", save_every=2)
    run.train_steps(2)
    trained = logits(run.model)

    adapter = export(tmp_path / "out", tmp_path / "adapter")
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json"]
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["base_model_name_or_path"]) == (4, str(tmp_path / "out" / "base_model"))
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "base_model")
    reloaded = PeftModel.from_pretrained(base, adapter)
    assert torch.equal(logits(reloaded), trained)

    merged_dir = export(tmp_path / "out", tmp_path / "merged", merge_lora=True)
    assert not any("lora" in n for n in json.dumps(json.loads((merged_dir / "config.json").read_text())))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged), trained, atol=1e-5, rtol=1e-5)  # W + BA vs Wx + B(Ax): rounding only


def test_export_refusals(make_run, tmp_path):
    run = make_run(save_every=1)
    run.train_steps(1)
    with pytest.raises(CheckpointError, match="full fine-tuning; there is no adapter"):
        export(tmp_path / "out", tmp_path / "x", merge_lora=True)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("keep me")
    with pytest.raises(CheckpointError, match="not empty"):
        export(tmp_path / "out", tmp_path / "busy")
    with pytest.raises(CheckpointError, match="No complete checkpoint in"):
        export(tmp_path / "busy", tmp_path / "y")


def test_plan_shards_groups_in_order_under_the_limit():
    sizes = {"a": 40, "b": 40, "c": 30, "d": 100, "e": 10}
    assert plan_shards(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e"]]
