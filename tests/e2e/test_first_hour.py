"""A newcomer's first hour: Ctrl-C and resume, and a resumed run's metrics log."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, make_venv_seeing_these_packages

from finetune.config.run_folder import read_metrics
from finetune.train.metrics import keep_records_before_resume

# the default tiny model and builtin data, small enough for a step well under a second on an idle core
QUICK = ["--micro-batch-size", "2", "--max-seq-len", "64", "--max-eval-examples", "0", "--num-samples", "0",
         "--no-save-final", "--log-every", "1", "--save-every", "3", "--output-dir", "out"]


def test_resume_drops_records_the_interrupted_run_logged_after_its_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logged = [{"step": 0, "eval_loss": 3.0}, {"step": 1, "loss": 2.9}, {"step": 2, "loss": 2.8},
              {"step": 2, "eval_loss": 2.7}, {"step": 3, "loss": 2.6}]
    path.write_text("".join(json.dumps(r) + "\n" for r in logged))
    keep_records_before_resume(path, 2)
    assert read_metrics(path) == logged[:3]


def newest_logged_step(output_dir: Path) -> int:
    path = output_dir / "metrics.jsonl"
    records = read_metrics(path) if path.is_file() else []
    return max((r["step"] for r in records if "loss" in r), default=0)


@pytest.mark.slow
def test_ctrl_c_says_one_line_with_the_resume_hint_and_resume_logs_each_step_once(tmp_path):
    command = [sys.executable, "-m", "finetune", *QUICK]
    log = tmp_path / "run.log"  # a file, not a pipe: a progress bar nobody reads cannot fill it and stall the run
    with log.open("w") as sink:
        # Ctrl-C as a terminal sends it: a test run in the background (`cmd &` in a script) inherits SIGINT
        # ignored, and Python then never raises KeyboardInterrupt; the child gets the default back
        process = subprocess.Popen([*command, "--max-steps", "1000"], cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 400
        while newest_logged_step(tmp_path / "out") < 4 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        seen = newest_logged_step(tmp_path / "out")
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)
    output = log.read_text()
    assert process.returncode == 130, f"step {seen} seen before Ctrl-C\n" + output[-3000:]
    assert "Traceback" not in output and output.count("interrupted (Ctrl-C)") == 1, output[-3000:]
    saved = re.search(r"Continue from (\S+) by running the same command with --resume auto", output)
    assert saved, output[-3000:]

    interrupted_at = newest_logged_step(tmp_path / "out")
    resumed_from = int(Path(saved.group(1)).name.split("-")[1])
    assert resumed_from < interrupted_at  # steps after the checkpoint were logged and will run again
    finish = interrupted_at + 1
    subprocess.run([*command, "--max-steps", str(finish), "--resume", "auto"], cwd=tmp_path, check=True,
                   capture_output=True, timeout=600)
    steps = [r["step"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, finish + 1))


def test_plan_names_the_command_that_writes_the_files_its_launch_command_reads(tmp_path):
    plan = [sys.executable, "-m", "finetune", "plan", "--model", "llama-7b", "--gpus", "2xA100-40GB"]
    first = subprocess.run(plan, cwd=tmp_path, capture_output=True, text=True, check=True)
    config_file = re.search(r"launch: accelerate launch --config_file (\S+)", first.stdout).group(1)
    assert not (tmp_path / config_file).exists()
    write = re.search(r"write its files first with: finetune plan (.+)", first.stderr).group(1)
    subprocess.run([sys.executable, "-m", "finetune", "plan", *shlex.split(write)], cwd=tmp_path, check=True,
                   capture_output=True)
    assert (tmp_path / config_file).is_file()


def test_plan_splits_more_gpus_than_a_host_holds_into_nodes_and_says_so():
    plan = [sys.executable, "-m", "finetune", "plan", "--model", "llama-7b", "--gpus", "1000xA100-40GB", "--json"]
    done = subprocess.run(plan, capture_output=True, text=True, check=True)
    hardware = json.loads(done.stdout)["hardware"]
    assert "as 125 nodes × 8 GPUs" in done.stderr
    assert (hardware["nodes"], hardware["gpus_per_node"]) == (125, 8)
    assert hardware["host_memory_gib_per_node"] == 1152  # AWS p4d.24xlarge, not 1000 GPUs' worth


def answers_of_export(folder: Path, prompts: list, max_new_tokens: int) -> list[str]:
    """Greedy answers of an exported model, reloaded and asked as docs/checkpoints.md's *Reload an export* shows:
    text prompts through `tokenizer(prompt)`, chats (lists of messages) through the chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    answers = []
    for prompt in prompts:
        inputs = (tokenizer(prompt, return_tensors="pt") if isinstance(prompt, str) else
                  tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True))
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        answers.append(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    return answers


def train_and_export(folder: Path, *flags: str) -> list[dict]:
    """The run's printed samples (summary.json) after training with `flags`, exported to `folder/hf`."""
    finetune = [sys.executable, "-m", "finetune"]
    subprocess.run([*finetune, *flags, "--output-dir", "run"], cwd=folder, check=True, capture_output=True, timeout=2400)
    subprocess.run([*finetune, "export", "run", "--out", "hf"], cwd=folder, check=True, capture_output=True, timeout=600)
    return json.loads((folder / "run" / "summary.json").read_text())["samples"]


def run_max_new_tokens(samples: list[dict], folder: Path) -> int:
    """What the run's evaluation allowed: the longest expected answer's tokens + 2 (loop.evaluate)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return max(len(tokenizer(s["expected"], add_special_tokens=False)["input_ids"]) for s in samples) + 2


@pytest.mark.slow
def test_the_default_runs_export_answers_as_the_run_did(tmp_path):
    samples = train_and_export(tmp_path, "--max-steps", "6", "--micro-batch-size", "4", "--max-eval-examples", "4",
                               "--num-samples", "4")
    assert len(samples) == 4
    answers = answers_of_export(tmp_path / "hf", [s["prompt"] for s in samples], run_max_new_tokens(samples, tmp_path / "hf"))
    assert answers == [s["generated"] for s in samples]


@pytest.mark.slow
def test_smollm2_export_answers_as_the_run_did(tmp_path):
    data = REPO / "examples" / "smarthome"
    samples = train_and_export(tmp_path, "--model", "smollm2-135m", "--method", "full", "--lr", "1e-5",
                               "--dataset", str(data), "--eval-split", "test", "--max-eval-examples", "2",
                               "--eval-generate", "2", "--num-samples", "2", "--micro-batch-size", "2",
                               "--max-seq-len", "128", "--max-steps", "1")
    rows = [json.loads(line) for line in (data / "test.jsonl").read_text().splitlines()[:2]]
    assert [s["expected"] for s in samples] == [row["messages"][-1]["content"] for row in rows]
    chats = [row["messages"][:-1] for row in rows]
    answers = answers_of_export(tmp_path / "hf", chats, run_max_new_tokens(samples, tmp_path / "hf"))
    assert answers == [s["generated"] for s in samples]


def readme_quick_start_section() -> str:
    """README's quick start, between the markers that also put it on the docs site's home page (docs/index.md)."""
    readme = (REPO / "README.md").read_text()
    return readme.split("<!-- --8<-- [start:quickstart] -->")[1].split("<!-- --8<-- [end:quickstart] -->")[0]


def readme_quick_start() -> list[str]:
    """The command lines of README's quick start block: step 1 first, then step 2's."""
    block = readme_quick_start_section().split("```bash\n")[1].split("```")[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_exactly_readmes_test_commands():
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    commands = [line for line in lines if line and not line.startswith("#")]
    assert commands[:2] == ["set -euo pipefail", 'cd "$(dirname "$0")/.."']
    assert commands[2:] == readme_quick_start()[1:]


@pytest.mark.slow
def test_readmes_first_command_runs_in_a_fresh_clone(tmp_path):
    """README's step 1 as written, in a clone of this commit and a new venv (reusing the packages
    installed here), shortened to two updates so it costs seconds, not the demo's minutes."""
    clone, venv = tmp_path / "clone", tmp_path / "venv"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    make_venv_seeing_these_packages(venv, pip=True)
    assert (venv / "bin" / "pip").is_file()  # else `pip` on PATH would install into this interpreter
    short = " --max-steps 2 --micro-batch-size 2 --max-eval-examples 2 --num-samples 1"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", readme_quick_start()[0] + short], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = json.loads((clone / "runs" / "demo" / "summary.json").read_text())
    assert summary["steps"] == 2 and "Traceback" not in done.stdout + done.stderr
    imported = subprocess.run([venv / "bin" / "python", "-c", "import finetune; print(finetune.__file__)"], env=env,
                              cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert imported == str(clone / "finetune" / "__init__.py")  # the clone's code ran, not this checkout's


@pytest.mark.slow
def test_readmes_accelerate_launch_is_quiet(tmp_path):
    """README's single-process `accelerate launch` line starts without Accelerate's defaults warning
    (`--max-seq-len` beyond the model's maximum makes it stop at once, with our one line)."""
    line = next(line for line in readme_quick_start_section().splitlines() if line.startswith("accelerate launch -q --config_file"))
    words = shlex.split(line.replace("accelerate_configs/", f"{REPO}/accelerate_configs/"))
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *words[2:], "--max-seq-len", "1000000"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert "--max-seq-len 1000000 is beyond tiny's maximum" in output
    assert "were not passed to `accelerate launch`" not in output and "Traceback" not in output
