"""End to end on one process: `python -m finetune` trains, reports, and saves something loadable
whose weights are the trained ones (full model, LoRA adapter, QLoRA adapter)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from finetune.config.flags import parse_config
from finetune.config.run_folder import read_metrics
from finetune.data import Collator, prepare_data
from finetune.train import loop

SHORT_RUN = ["--max-steps", "6", "--micro-batch-size", "8", "--max-eval-examples", "32", "--warmup-steps", "2",
             "--log-every", "2", "--num-samples", "2"]


def run_finetune(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "finetune", *args], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def eval_loss_of_saved(output_dir, method: str) -> float:
    """Reload what the run saved, the way a user would, and measure eval loss on the run's eval split."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = parse_config(["--config", str(output_dir / "run.yaml")])
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    if method == "full":
        model = AutoModelForCausalLM.from_pretrained(output_dir, dtype=torch.float32)
    else:
        from peft import AutoPeftModelForCausalLM

        kwargs = {}
        if method == "qlora":
            from finetune.train.skeleton import nf4_config

            kwargs["quantization_config"] = nf4_config(torch.float32)
        model = AutoPeftModelForCausalLM.from_pretrained(output_dir, dtype=torch.float32, **kwargs)
    data = prepare_data(config, tokenizer)
    loader = DataLoader(data.eval, batch_size=8, collate_fn=Collator(tokenizer))
    if method != "qlora":
        model.eval()
    return loop.evaluation_loss(Accelerator(cpu=True), model, loader)


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_short_run_saves_the_trained_weights(tmp_path, method):
    out = tmp_path / method
    run_finetune("--method", method, "--output-dir", str(out), *SHORT_RUN)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6
    assert summary["eval_loss_after"] < summary["eval_loss_before"]

    records = read_metrics(out / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [2, 4, 6]
    assert all(r["tokens_per_second"] > 0 and r["grad_norm"] > 0 and r["lr"] > 0 for r in steps)
    # each update's own clocks, the span tokens/s is over: no compilation without --compile
    assert all(0 < r["cpu_seconds"] and r["compile_seconds"] == 0 for r in steps)
    assert summary["compile_seconds"] == 0
    assert (out / "loss_curve.png").stat().st_size > 1000
    assert parse_config(["--config", str(out / "run.yaml")]).method == method

    if method == "full":
        assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    else:
        adapter = load_file(out / "adapter_model.safetensors")
        assert adapter and all(t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name)
        assert json.loads((out / "adapter_config.json").read_text())["r"] == 16
    # the reloaded model reproduces the trained model's eval loss, and differs from the initial one
    assert eval_loss_of_saved(out, method) == pytest.approx(summary["eval_loss_after"], rel=1e-4)
