"""`finetune export` from single-process checkpoints: full weights (sharded, dtypes) and LoRA
(adapter as is, and merged). Exports from FSDP2 and ZeRO checkpoints are in test_resume_strategies.py."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import train_steps, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.cli import main as cli
from finetune.errors import CheckpointError
from finetune.export.safetensors import export, parse_size
from finetune.export.trained import find_trained

TOKENS = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8], [9, 7, 9, 3, 2, 38, 4, 6]])


def logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def test_full_export_is_sharded_and_reproduces_the_trained_logits(make_run, tmp_path):
    run = make_run(save_every=2)
    train_steps(run, 2)
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
    train_steps(run, 2)
    trained = logits(run.model)

    adapter = export(tmp_path / "out", tmp_path / "adapter")
    assert sorted(p.name for p in adapter.iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors", "generation_config.json", "tokenizer.json",
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


def test_a_dpo_trained_adapter_exports_like_any_other(make_run, tmp_path):
    """The adapter of a DPO run (whose reference was its own base, adapters off) reloads and merges to
    the trained policy's logits; the forward it was given for log-probabilities does not travel."""
    from peft import PeftModel

    pairs = [{"prompt": f"w{i} w{i + 1}", "chosen": f"w{i + 2} w{i + 9}", "rejected": f"w{i + 30}"} for i in range(1, 25)]
    run = make_run(method="lora", objective="dpo", save_every=2, dataset=str(write_jsonl(tmp_path / "pairs.jsonl", pairs)))
    losses = train_steps(run, 2)
    assert losses[0] == pytest.approx(0.693147, abs=1e-5) and losses[1] != losses[0]
    trained = logits(run.model)
    adapter = export(tmp_path / "out", tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "base_model"), adapter)
    assert torch.equal(logits(reloaded), trained)
    merged = AutoModelForCausalLM.from_pretrained(export(tmp_path / "out", tmp_path / "merged", merge_lora=True))
    torch.testing.assert_close(logits(merged), trained, atol=1e-5, rtol=1e-5)


def test_export_refusals(make_run, tmp_path):
    run = make_run(save_every=1)
    train_steps(run, 1)
    with pytest.raises(CheckpointError, match="is full fine-tuning; there is no adapter"):
        export(tmp_path / "out", tmp_path / "x", merge_lora=True)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("keep me")
    with pytest.raises(CheckpointError, match="not empty"):
        export(tmp_path / "out", tmp_path / "busy")
    with pytest.raises(CheckpointError, match="Nothing to export in .*busy: no complete checkpoint"):
        export(tmp_path / "busy", tmp_path / "y")


def test_output_dir_export_takes_the_newer_of_final_model_and_checkpoint(make_run, tmp_path):
    from finetune.config.run_folder import ResolvedRecord, RunFolder
    from finetune.train.run import save_final

    run = make_run(save_every=2)
    train_steps(run, 2)
    output_dir = tmp_path / "out"
    save_final(run.accelerator, run.model, run.tokenizer, output_dir)  # as run.py ends a run
    RunFolder(output_dir).write_run_yaml(run.config, ResolvedRecord(precision="fp32"))
    RunFolder(output_dir).write_summary({"steps": 2})
    assert find_trained(output_dir).path == output_dir  # as new as checkpoints/step-000002: the final model

    exported = export(output_dir, tmp_path / "final")
    assert sorted(p.name for p in exported.iterdir()) == [
        "README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(exported)), logits(run.model))

    train_steps(run, 2)  # as a resumed run preempted at step 4: its checkpoint is newer than the final model
    assert find_trained(output_dir).path.name == "step-000004"
    exported = export(output_dir, tmp_path / "newer")
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(exported)), logits(run.model))


@pytest.mark.slow  # a training run in a subprocess
def test_export_after_a_run_with_the_default_save_every_0(tmp_path):
    """The run saved no checkpoint, only its final adapter: export takes that, as is or merged."""
    import subprocess
    import sys

    from peft import PeftModel
    from safetensors.torch import load_file

    output_dir = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "finetune", "--method", "lora", "--max-steps", "2", "--micro-batch-size", "4",
                    "--max-eval-examples", "4", "--num-samples", "0", "--output-dir", str(output_dir)],
                   check=True, capture_output=True, timeout=300)
    assert not (output_dir / "checkpoints").exists()

    assert cli(["export", str(output_dir), "--out", str(tmp_path / "adapter")]) == 0
    saved, exported = load_file(output_dir / "adapter_model.safetensors"), load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == exported.keys() and all(torch.equal(saved[k], exported[k]) for k in saved)

    assert cli(["export", str(output_dir), "--out", str(tmp_path / "merged"), "--merge-lora"]) == 0
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(output_dir / "base_model"), output_dir)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(merged), logits(trained), atol=1e-5, rtol=1e-5)


def test_max_shard_size_reads_like_save_pretrained():
    assert (parse_size("5GB"), parse_size("500MB"), parse_size("2GiB"), parse_size("1234")) == (5 * 10**9, 5 * 10**8, 2 * 2**30, 1234)
    with pytest.raises(CheckpointError, match="--max-shard-size '5 gigs'"):
        parse_size("5 gigs")


def export_cli(*args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "finetune", "export", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("flags, named", [
    (("--gguf-type", "q8_0"), "--gguf-type: only --format gguf uses it"),  # not a safetensors export that ignores it
    (("--format", "gguf", "--dtype", "bf16"), "--dtype: not used by --format gguf"),
    (("--format", "gguf", "--merge-lora", "--max-shard-size", "1GB"), "--merge-lora, --max-shard-size: not used by --format gguf"),
])
def test_export_flags_that_cannot_apply_are_one_line_errors(tmp_path, flags, named):
    done = export_cli(str(tmp_path / "run"), "--out", str(tmp_path / "e"), *flags)
    assert done.returncode == 2 and done.stderr.startswith(f"finetune export: error: {named}")
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "e").exists()


def test_lora_adapter_export_refuses_dtype_and_merge_is_quiet(make_run, tmp_path):
    run = make_run(method="lora", save_every=2)
    train_steps(run, 2)
    done = export_cli(str(tmp_path / "out"), "--out", str(tmp_path / "a"), "--dtype", "bf16")
    assert done.returncode == 2 and "--dtype: not used for a lora adapter export" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "a").exists()

    done = export_cli(str(tmp_path / "out"), "--out", str(tmp_path / "m"), "--merge-lora", "--dtype", "bf16")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Loading weights" not in done.stderr and done.stderr.count("\r") == 0  # no progress bar without --verbose
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "bfloat16"
