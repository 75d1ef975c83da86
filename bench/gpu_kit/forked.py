"""Grid rows in processes forked from one that has already imported the trainer.

As its own `python -m finetune`, a grid row took 24–29 s on the H100 for 4 updates of under a second
each, most of it starting Python (imports, torch registering its custom ops, compiling bytecode,
matplotlib's font cache; bench/RESULTS.md, "Forked grid rows"). A forkserver
pays the imports once and hands each row a fresh child from there: the row still gets its own
process (its own CUDA context and peak-memory counters, the whole GPU back when it exits), but
starts with the libraries loaded. On the 2-core CPU machine a tiny row takes 11.5 s as its own
process and 5.3 s forked (`python bench/gpu_kit/row_start.py`, bench/RESULTS.md).

The server must never touch CUDA (a child forked after CUDA initialised cannot use it), so torch
checks devices through NVML, and peft is not preloaded: it imports bitsandbytes, which queries the
GPU when imported. Should a forked row still fail to initialise CUDA, the runner says so and runs
that row and the rest as subprocesses.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import re
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What every row imports and the server may import too (none of them initialises CUDA).
PRELOAD = ["finetune.cli", "finetune.train.run", "finetune.train.loading", "transformers.models.llama.modeling_llama",
           "matplotlib.pyplot"]
STACK_SECONDS = 10  # for a row past its time to print its stack before it is killed
CUDA_AFTER_FORK = re.compile(r"Cannot re-initialize CUDA in forked subprocess|CUDA error: initialization error")


class RowRunner:
    """Runs `python ARGS` (`-m module …`, `-c code …` or `script.py …`) with its output in `log`:
    {"status": ok | exit N | timeout | OOM, "seconds"[, "error"]}. A row past its time first prints
    its Python stack into `log` (faulthandler, on SIGABRT), then is killed: a hang says where it was."""

    def __init__(self, fork: bool = True):
        self.fork = fork
        self.context = None

    def run(self, python_args: list[str], log: Path, timeout_s: float) -> dict:
        if self.fork:
            result = self.run_forked(python_args, log, timeout_s)
            if not CUDA_AFTER_FORK.search(read_log(log)):
                return result
            print("forked rows cannot initialise CUDA here: running this row and the rest as subprocesses", flush=True)
            self.fork = False
        return run_logged([sys.executable, *python_args], log, timeout_s)

    def run_forked(self, python_args: list[str], log: Path, timeout_s: float) -> dict:
        if self.context is None:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # inherited by the server: is_available() without cuInit
            self.context = multiprocessing.get_context("forkserver")
            self.context.set_forkserver_preload(PRELOAD)
        started = time.monotonic()
        child = self.context.Process(target=python_in_child, args=(python_args, log))
        child.start()
        child.join(max(timeout_s, 1))
        if child.is_alive():
            os.kill(child.pid, signal.SIGABRT)
            child.join(STACK_SECONDS)
            if child.is_alive():
                child.kill()
                child.join()
            return outcome("timeout", read_log(log), time.monotonic() - started)
        status = "ok" if child.exitcode == 0 else f"exit {child.exitcode}"
        return outcome(status, read_log(log), time.monotonic() - started)


def python_in_child(python_args: list[str], log: Path) -> None:
    """`python -m module …`, `python -c code …` or `python script.py …` in the forked child, its
    stdout and stderr into `log`, every thread's stack dumped there on SIGABRT."""
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    faulthandler.enable(all_threads=True)
    os.chdir(REPO)
    if python_args[0] not in ("-m", "-c"):
        script, *rest = python_args
        sys.argv = [script, *rest]
        sys.path.insert(0, str(Path(script).parent))
        runpy.run_path(script, run_name="__main__")
        return
    option, target, *rest = python_args
    sys.argv = [target if option == "-m" else "-c", *rest]
    if option == "-m":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})


def run_logged(command: list[str], log: Path, timeout_s: float) -> dict:
    """Run `command` as a subprocess from the repository root, its output kept in `log`; past
    `timeout_s`, its Python stack printed (PYTHONFAULTHANDLER, on SIGABRT), then killed."""
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                               env=os.environ | {"PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"})
    try:
        output = process.communicate(timeout=max(timeout_s, 1))[0]
        status = "ok" if process.returncode == 0 else f"exit {process.returncode}"
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            output = process.communicate(timeout=STACK_SECONDS)[0]
        except subprocess.TimeoutExpired:
            process.kill()
            output = process.communicate()[0]
        status = "timeout"
    log.write_text(output)
    return outcome(status, output, time.monotonic() - started)


def read_log(log: Path) -> str:
    return log.read_text(errors="replace") if log.is_file() else ""


def outcome(status: str, log: str, seconds: float) -> dict:
    """A row's status and seconds and, on failure, its last error line (OOM named as such)."""
    if status == "ok":
        return {"status": status, "seconds": seconds}
    if "out of memory" in log.lower():
        status = "OOM"
    errors = [line for line in log.splitlines() if re.search(r"Error|error:", line)]
    return {"status": status, "seconds": seconds, "error": errors[-1][:300] if errors else ""}
