"""One exit for a run: whatever ends it, what `train.setup` opened is closed (train/session.py) — the
preemption signal handlers go back, the process group is destroyed."""

from __future__ import annotations

import signal

import pytest
import torch.distributed as dist
from helpers import build_word_run

from finetune.checkpoint.checkpointer import PREEMPTION_SIGNALS
from finetune.train import loop
from finetune.train import run as run_module
from finetune.train.accelerator import free_port
from finetune.train.run import fit


@pytest.fixture
def process_group():
    """A 1-process gloo group formed before the run, as Ray Train forms one for its workers: the group
    the run's teardown must destroy. Destroyed here if the run left it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def handlers() -> dict:
    return {sig: signal.getsignal(sig) for sig in PREEMPTION_SIGNALS}


@pytest.mark.parametrize("step", ["announce", "build_evaluation"])
def test_an_error_late_in_setup_closes_what_setup_opened(step, process_group, tmp_path, monkeypatch):
    before, seen = handlers(), {}

    def fail(*args, **kwargs):
        seen.update(handlers())  # what was installed when it failed: the Checkpointer's
        raise RuntimeError(f"{step} failed")

    monkeypatch.setattr(run_module, step, fail)
    with pytest.raises(RuntimeError, match=f"{step} failed"):
        build_word_run(tmp_path / "out")
    assert all(getattr(seen[sig], "__self__", None).__class__.__name__ == "Checkpointer" for sig in PREEMPTION_SIGNALS)
    assert handlers() == before
    assert not dist.is_initialized()


def test_ctrl_c_in_training_closes_what_setup_opened(process_group, tmp_path, monkeypatch):
    before = handlers()

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train", interrupt)
    with pytest.raises(KeyboardInterrupt), build_word_run(tmp_path / "out") as session:
        assert handlers() != before and dist.is_initialized()
        fit(session)
    assert handlers() == before
    assert not dist.is_initialized()
    assert not hasattr(session, "model")  # the closed session let go of the model before the group went
