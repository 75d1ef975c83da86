"""A run as `train.setup` builds it (`Session`), and the one place that closes what it opened (`Opened`).

Whatever ends a run — its last step, an error in setup or training, Ctrl-C — the same teardown runs:
the preemption signal handlers go back, the model is let go of, then the trackers finish and the
process group is destroyed. torchtune's recipes have `cleanup()`; here it is `Session.close`, run
by `with setup(run, device) as session:`.
"""

from __future__ import annotations

import gc
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from finetune.checkpoint.checkpointer import Checkpointer
from finetune.checkpoint.progress import Progress
from finetune.config.options import TrainConfig
from finetune.config.resolve import ResolvedRun
from finetune.config.run_folder import ResolvedRecord
from finetune.data import Collator, PreparedData
from finetune.train.metrics import MetricsRecorder
from finetune.train.objectives import Preference, Supervised


class Opened:
    """What a run opens, and the one place that closes it whatever ends the run (its last step, an
    error, Ctrl-C): the preemption signal handlers the Checkpointer took, then the Accelerator's
    trackers and process group."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator: Accelerator | None = accelerator
        self.checkpointer: Checkpointer | None = None  # once it has taken the preemption signals

    def close(self, error: BaseException | None = None) -> None:
        """Close it all, once; `error`: what ended the run, if anything did."""
        if self.checkpointer is not None:
            self.checkpointer.close()  # the preemption signals go back to their handlers
            self.checkpointer = None
        accelerator, self.accelerator = self.accelerator, None
        if accelerator is None:
            return
        # The model goes before the process group. DDP's C++ reducer holds the group too; when it lets go
        # of it last, gloo joins its worker threads while holding the GIL, which a worker may need to free
        # a finished collective's tensors: a hang at exit (tests/checkpoint/test_resume_strategies.py counts the DDP
        # modules alive when the group goes). The session has let go of the model (Session.close); an
        # error's traceback still holds the frames that built or trained it, so their locals go too.
        if error is not None:
            let_go_of_frames(error)
        accelerator.free_memory()  # drops its references to the prepared model after its own collection, so:
        gc.collect()
        accelerator.end_training()  # the trackers finish, the process group is destroyed


def let_go_of_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames `error` (and the errors it was raised during) passed
    through; the frames still running keep theirs."""
    while error is not None:
        traceback.clear_frames(error.__traceback__)
        error = error.__context__


# what a session holds that holds the model or its parameters: let go of when it closes
TRAINED_WITH = ("model", "optimizer", "scheduler", "train_loader", "evaluate", "checkpointer", "objective")


@dataclass
class Session:
    """One run, built and ready to train: what `setup` made and `fit` runs. Tests and benches enter
    here too, so they exercise the production optimiser, schedule, collator, loader and loop.

    A context manager: `with setup(run, device) as session:` closes what setup opened however the
    block ends (`close`); a closed session no longer holds TRAINED_WITH."""

    run: ResolvedRun  # its max_steps resolved
    accelerator: Accelerator
    model: torch.nn.Module  # prepared
    tokenizer: PreTrainedTokenizerBase
    data: PreparedData
    collator: Collator
    train_loader: DataLoader  # prepared
    optimizer: torch.optim.Optimizer  # prepared
    scheduler: torch.optim.lr_scheduler.LambdaLR  # not prepared: stepped once per update (see optim.py)
    progress: Progress  # where a resume left it
    checkpointer: Checkpointer
    evaluate: Callable[[], dict] | None  # None when eval is off
    resolved: ResolvedRecord  # what the flags resolved to, in run.yaml and every checkpoint manifest
    opened: Opened  # what setup opened
    objective: Supervised | Preference | None = None  # what the loss is (train/objectives.py); None: supervised

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind, error, trace) -> None:
        self.close(error)

    def close(self, error: BaseException | None = None) -> None:
        """Let go of the model and what holds it, then close what setup opened (`Opened.close`)."""
        for name in TRAINED_WITH:
            self.__dict__.pop(name, None)
        self.opened.close(error)

    @property
    def config(self) -> TrainConfig:
        return self.run.config

    @property
    def max_steps(self) -> int:
        return self.run.max_steps

    def recorder(self) -> MetricsRecorder:
        """The run's metrics.jsonl writer and progress bar, from the step it is at."""
        return MetricsRecorder(self.accelerator, self.config.output_dir, self.max_steps, self.config.log_every,
                               start_step=self.progress.step)
