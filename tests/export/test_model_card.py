"""The README.md model card every export writes (from what the run recorded), and `--push-to-hub`
refusing up front, with nothing written, when the Hub cannot be reached."""

from __future__ import annotations

import json
from types import SimpleNamespace

from huggingface_hub import ModelCard

from finetune.cli import main as cli
from finetune.config.options import TrainConfig
from finetune.config.run_folder import ResolvedRecord, read_metrics
from finetune.export.card import RunRecord, model_card
from finetune.export.safetensors import export


def card_of(folder) -> ModelCard:
    return ModelCard.load(folder / "README.md")


def test_card_of_a_finished_lora_run(bpe_lora_run, tmp_path):
    run = bpe_lora_run / "run"
    card = card_of(export(run, tmp_path / "adapter"))
    data = card.data.to_dict()
    assert data == {"library_name": "peft", "pipeline_tag": "text-generation", "tags": ["finetune", "lora"]}  # local base
    summary = json.loads((run / "summary.json").read_text())
    evals = [r for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 4]
    text = card.text
    assert "LoRA of `base` with finetune 0.1.0, exported as PEFT adapter." in text  # a local folder: its name only
    assert "| method | LoRA: r=16, alpha=32, dropout=0.0, targets all-linear |" in text
    assert "| data | `chat.jsonl` (chat; 32 train / 8 eval examples) |" in text
    assert str(bpe_lora_run) not in card.content  # no local path of the trainer's machine in what --push-to-hub uploads
    assert "| optimizer steps | 4 of 4 |" in text
    assert f"| tokens trained on | {summary['tokens_seen']:,} |" in text
    assert "| learning rate | 0.01 peak, cosine schedule, 0 warmup steps, adamw |" in text
    assert f"| eval loss | {evals[0]['eval_loss']:.4g} | {evals[1]['eval_loss']:.4g} |" in text
    assert evals[0]["eval_loss"] != evals[1]["eval_loss"]

    merged = card_of(bpe_lora_run / "merged")
    assert merged.data.library_name == "transformers" and "exported as safetensors (fp32, adapters merged)" in merged.text


def test_card_of_a_checkpoint_stops_at_its_step(bpe_lora_run, tmp_path):
    card = card_of(export(bpe_lora_run / "run" / "checkpoints" / "step-000002", tmp_path / "step2"))
    assert "| optimizer steps | 2 of 4 |" in card.text
    assert "at step 0 and step 0" in card.text  # the eval after training (step 4) came later


def test_card_names_a_catalogued_base_its_license_and_a_hub_dataset():
    config = TrainConfig(model="llama-3.2-1b", method="qlora", dataset="tatsu-lab/alpaca").to_dict()
    record = RunRecord(config=config, resolved=ResolvedRecord(), step=10, tokens_seen=None, evals=[])
    card = ModelCard(model_card(record, "GGUF (q8_0)", title="mine"))
    assert card.data.to_dict() == {
        "base_model": "meta-llama/Llama-3.2-1B", "datasets": ["tatsu-lab/alpaca"], "library_name": "gguf",
        "license": "llama3.2", "pipeline_tag": "text-generation", "tags": ["finetune", "qlora", "gguf"]}
    assert "No evaluation was recorded" in card.text and "| optimizer steps | 10 |" in card.text
    hub = TrainConfig(model="HuggingFaceTB/SmolLM2-135M-Instruct").to_dict()
    data = ModelCard(model_card(RunRecord(hub, ResolvedRecord(), 1, 5, []), "safetensors (bf16)", "x")).data
    assert (data.base_model, data.license, data.library_name) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0", "transformers")
    packaged = ModelCard(model_card(RunRecord({"model": "smollm2-135m", "method": "lora"}, ResolvedRecord(), 1, 5, []), "GGUF (f16)", "x"))
    # base and license from its GGUF's source
    assert (packaged.data.base_model, packaged.data.license) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")
    assert "| base weights | dequantised from SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1) |" in packaged.text
    bare = RunRecord({"method": "full"}, ResolvedRecord(), 3, None, [])  # a bare manifest
    sparse = ModelCard(model_card(bare, "safetensors (fp32)", "x"))
    assert "| optimizer steps | 3 |" in sparse.text and "| seed | ? |" in sparse.text and sparse.data.base_model is None


def test_card_names_a_local_dataset_by_file_name_and_a_gguf_file_by_name_and_type(tmp_path):
    """Issue 17 item 16: the dataset field and the data row carry no absolute path; weights that came
    from a GGUF file say which file and which quantisation, beside the Hub repo named as base."""
    from finetune.models.source import model_source

    gguf = model_source("smollm2-135m").gguf
    local_data = str(tmp_path / "private" / "chats.jsonl")
    config = TrainConfig(model=str(gguf), method="lora", dataset=local_data).to_dict()
    card = ModelCard(model_card(RunRecord(config, ResolvedRecord(), 1, 5, []), "safetensors (fp32, adapters merged)", "x"))
    assert "datasets" not in card.data.to_dict() and str(tmp_path) not in card.content and str(gguf.parent) not in card.content
    assert "| data | `chats.jsonl` (auto; ? train / ? eval examples) |" in card.text
    assert "| base model | `SmolLM2-135M-Instruct.Q4_1.gguf` |" in card.text
    assert "| base weights | dequantised from SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1) |" in card.text
    relative = TrainConfig(model="tiny", dataset="data/train.jsonl").to_dict()  # a relative path is not a Hub id
    assert ModelCard(model_card(RunRecord(relative, ResolvedRecord(), 1, 5, []), "safetensors (fp32)", "x")).data.datasets is None


def test_the_card_reads_a_run_and_writes_its_text_without_torch(bpe_lora_run):
    """In a fresh process: the card module, the run record of a final model and of a checkpoint, and the
    card's text load no torch (they read the run's folder through config/run_folder.py)."""
    import subprocess
    import sys

    code = f"""
import sys
from pathlib import Path
from types import SimpleNamespace
from finetune.export.card import model_card, read_run_record
assert "torch" not in sys.modules, "importing finetune.export.card loaded torch"
run = Path({str(bpe_lora_run / "run")!r})
for trained in (SimpleNamespace(path=run, is_checkpoint=False),
                SimpleNamespace(path=run / "checkpoints" / "step-000002", is_checkpoint=True)):
    text = model_card(read_run_record(trained), "PEFT adapter", title="adapter")
    assert "32 train / 8 eval examples" in text, text
assert "torch" not in sys.modules, "reading the run or writing the card loaded torch"
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_push_to_hub_offline_fails_before_anything_is_written(bpe_lora_run, tmp_path, capsys):
    out = tmp_path / "export"
    assert cli(["export", str(bpe_lora_run / "run"), "--out", str(out), "--push-to-hub", "me/model"]) == 2
    assert "--push-to-hub me/model: HF_HUB_OFFLINE is set" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_push_to_hub_without_network_fails_before_anything_is_written(bpe_lora_run, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")  # a token, so whoami goes to the (unreachable) Hub
    out = tmp_path / "export"
    assert cli(["export", str(bpe_lora_run / "run"), "--out", str(out), "--format", "gguf", "--push-to-hub", "me/model"]) == 2
    assert "--push-to-hub me/model: cannot reach http://127.0.0.1:9" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_push_to_hub_with_a_revoked_token_fails_before_anything_is_written(bpe_lora_run, tmp_path, capsys, monkeypatch):
    """A token that is set but no longer valid: the Hub's whoami answers 401 (monkeypatched: no network)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    asked = []

    def revoked(self, *args, **kwargs):
        asked.append(True)
        raise HfHubHTTPError("Invalid user token.", response=SimpleNamespace(status_code=401, headers={}, request=None))

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_revoked")
    monkeypatch.setattr(HfApi, "whoami", revoked)
    out = tmp_path / "export"
    assert cli(["export", str(bpe_lora_run / "run"), "--out", str(out), "--push-to-hub", "me/model"]) == 2
    err = capsys.readouterr().err
    assert asked and "--push-to-hub me/model: the Hub refused this machine's token (Invalid user token.)" in err
    assert "hf auth login --force" in err and list(tmp_path.iterdir()) == []
