"""Quiet by default: a run shows finetune's messages, not the libraries' logs and warnings;
`--verbose` shows those too, and errors always pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

from finetune.library_logs import PROGRESS_BARS_VARIABLE

# what the libraries printed on every plain run before (DeepSpeed's accelerator detection, peft
# calling a deprecated transformers method) and what our own output always has
NOISE = ("Setting accelerator to CPU", "FutureWarning", "Generating train split", "Saving the dataset",
         "Removed shared tensor")
OURS = ("distributed setup:", "eval loss")


def python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return result.stdout + result.stderr


def test_quiet_libraries_keeps_errors_and_drops_the_rest():
    output = python(
        "import logging, warnings\n"
        "from finetune.library_logs import quiet_libraries\n"
        "quiet_libraries()\n"
        # bitsandbytes logs from module loggers without handlers of its own
        "logging.getLogger('bitsandbytes.backends.cpu.ops').warning('bnb noise: pip install kernels')\n"
        "logging.getLogger('bitsandbytes.backends.cpu.ops').error('bnb error')\n"
        # DeepSpeed configures its logger when imported (after us): level WARNING, its own stdout handler
        "ds = logging.getLogger('DeepSpeed'); ds.setLevel(logging.WARNING)\n"
        "ds.addHandler(logging.StreamHandler(__import__('sys').stdout))\n"
        "ds.warning('ds noise: Setting accelerator to CPU'); ds.error('ds error')\n"
        "warnings.warn('deprecated noise', FutureWarning)\n"
        # Accelerate's module loggers, e.g. its "Removed shared tensor" warning when saving tied weights
        "logging.getLogger('accelerate.utils.other').warning('accelerate noise: Removed shared tensor')\n"
    )
    assert "noise" not in output
    assert "bnb error" in output and "ds error" in output


# what liger-kernel 0.8.5 logs, from `liger_kernel.backends.registry`'s module logger, for each optional
# backend (CuTe DSL, Ascend, ...) it cannot import, the first time an op is used
LIGER_LINE = ("logging.getLogger('liger_kernel.backends.registry').warning(\"Backend impl "
              "'liger_kernel.ops.backends._cutedsl.rms_norm' for op 'rms_norm' could not be imported: noise\")\n")
# the real thing where liger-kernel is installed (the gpu extra): its registry looks for every backend of an op
LIGER_DISCOVERY = ("import importlib.util\n"
                   "if importlib.util.find_spec('liger_kernel'):\n"
                   "    from liger_kernel.backends import registry; registry._discover('rms_norm')\n")
# PEFT's UserWarning about finetune's own exclude_modules, from the trainer's own LoRA build
LORA_BUILD = ("from helpers import tiny_model\n"
              "from peft import get_peft_model\n"
              "from finetune.config.options import TrainConfig\n"
              "from finetune.train.skeleton import lora_config\n"
              "base = tiny_model()\n"
              "get_peft_model(base, lora_config(base, TrainConfig(method='lora')))\n")


def test_peft_and_liger_warnings_of_every_lora_gpu_run_are_quiet_unless_verbose():
    """PEFT warns that finetune's `exclude_modules` matched nothing on every LoRA build of a text
    model, and liger-kernel logs a line for each optional backend it cannot import: neither reaches
    a default run's output; both are there without quiet_libraries (as with --verbose)."""
    setup = f"import logging, sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\n"
    loud = python(setup + LIGER_LINE + LIGER_DISCOVERY + LORA_BUILD)
    assert "exclude_modules" in loud and "could not be imported" in loud  # the noise is real
    quiet = python(setup + "from finetune.library_logs import quiet_libraries\nquiet_libraries()\n"
                   + LIGER_LINE + LIGER_DISCOVERY + LORA_BUILD)
    assert "exclude_modules" not in quiet and "could not be imported" not in quiet, quiet


@pytest.mark.slow  # two short training runs in subprocesses
def test_a_plain_run_shows_finetunes_messages_only(tmp_path):
    rows = "".join(json.dumps({"instruction": "Add.", "input": f"{i}+1", "output": str(i + 1)}) + "\n" for i in range(16))

    def run(*flags: str) -> str:
        """A full run, checkpoint (the tied embedding makes Accelerate warn) included, on rows that
        datasets parses and finetune tokenizes for the first time (each run its own copy and cache)."""
        folder = tmp_path / str(len(flags))
        folder.mkdir()
        (folder / "rows.jsonl").write_text(rows)
        result = subprocess.run(
            [sys.executable, "-m", "finetune", "--method", "lora", "--max-steps", "1", "--micro-batch-size", "4", "--save-every", "1",
             "--max-eval-examples", "4", "--num-samples", "0", "--dataset", str(folder / "rows.jsonl"),
             "--data-cache", str(folder / "cache"), "--output-dir", str(folder / "out"), *flags],
            capture_output=True, text=True, timeout=600, check=True,
            # without the switch quiet_libraries() leaves in this process's environment after an in-process run
            env={**{k: v for k, v in os.environ.items() if k != PROGRESS_BARS_VARIABLE}, "HF_DATASETS_CACHE": str(folder / "datasets")})
        return result.stdout + result.stderr

    quiet, verbose = run(), run("--verbose")
    assert all(line in quiet and line in verbose for line in OURS)
    assert [noise for noise in NOISE if noise in quiet] == []
    for noise in ("FutureWarning", "Generating train split", "Saving the dataset"):
        assert noise in verbose, noise  # the noise is real, and --verbose brings it back


@pytest.mark.slow  # a simulated training step on fake tensors: ~30 s of CPU
def test_plan_simulate_is_quiet_unless_verbose():
    """`finetune plan --simulate` builds the model through the trainer (transformers, peft): their
    deprecation warnings stay out of its output, as in a training run."""
    result = subprocess.run([sys.executable, "-m", "finetune", "plan", "--model", "tiny", "--gpus", "1xA100-40GB",
                             "--simulate"], capture_output=True, text=True, timeout=600, check=True)
    output = result.stdout + result.stderr
    assert "Warning" not in output and "bitsandbytes" not in output
    assert "simulat" in output.lower()  # the comparison itself is printed


@pytest.mark.slow  # two subprocesses that tokenize
def test_prepare_is_quiet_unless_verbose(tmp_path):
    """datasets is imported with the subcommand, before --verbose is read: its bars are switched off
    through its API, transformers' ("Writing model shards") too."""

    def prepare(*flags: str) -> subprocess.CompletedProcess:
        folder = tmp_path / str(len(flags))
        return subprocess.run(
            [sys.executable, "-m", "finetune", "prepare", "--dataset", str(REPO / "examples" / "smarthome"), "--eval-split",
             "test", "--data-cache", str(folder / "cache"), "--output-dir", str(folder / "out"), *flags],  # the tiny init goes there
            capture_output=True, text=True, timeout=600, check=True,
            env={**{k: v for k, v in os.environ.items() if k != PROGRESS_BARS_VARIABLE}, "HF_DATASETS_CACHE": str(folder / "datasets")})

    quiet, verbose = prepare(), prepare("--verbose")
    assert quiet.stderr == "" and "400 train / 50 eval examples (chat)" in quiet.stdout
    for noise in ("Generating train split", "tokenizing (chat)", "Writing model shards"):
        assert noise in verbose.stderr, noise  # the noise is real, and --verbose brings it back
