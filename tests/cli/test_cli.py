"""Every command a newcomer types first: `--help` and `-h` of finetune and of each subcommand, directly
and under `accelerate launch`, print usage and exit 0."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO

from finetune.cli import SUBCOMMANDS


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("subcommand", ["", *SUBCOMMANDS])
def test_help_prints_usage_and_exits_0(subcommand, flag):
    result = run([sys.executable, "-m", "finetune", *([subcommand] if subcommand else []), flag])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: "), result.stdout[:500]
    assert "Traceback" not in result.stderr


def test_help_under_accelerate_launch():
    result = run(["accelerate", "launch", "-q", "--num_processes", "1", "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "finetune", "--help"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: finetune"), result.stdout[:500]
