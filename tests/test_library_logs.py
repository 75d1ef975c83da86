"""Quiet by default: a run shows finetune's messages, not the libraries' logs and warnings;
`--verbose` shows those too, and errors always pass."""

from __future__ import annotations

import subprocess
import sys

import pytest

# what the libraries printed on every plain run before (DeepSpeed's accelerator detection, peft
# calling a deprecated transformers method) and what our own output always has
NOISE = ("Setting accelerator to CPU", "FutureWarning")
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
    )
    assert "noise" not in output
    assert "bnb error" in output and "ds error" in output


@pytest.mark.slow  # two short training runs in subprocesses
def test_a_plain_run_shows_finetunes_messages_only(tmp_path):
    def run(*flags: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "finetune", "--method", "lora", "--max-steps", "1", "--micro-batch-size", "4",
             "--max-eval-examples", "4", "--num-samples", "0", "--output-dir", str(tmp_path / str(len(flags))), *flags],
            capture_output=True, text=True, timeout=600, check=True)
        return result.stdout + result.stderr

    quiet, verbose = run(), run("--verbose")
    assert all(line in quiet and line in verbose for line in OURS)
    assert [noise for noise in NOISE if noise in quiet] == []
    assert "FutureWarning" in verbose  # the noise is real, and --verbose brings it back
