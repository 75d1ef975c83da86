"""Every rank stops together: an error one rank meets in a rank-synchronised section ends them all.

Data preparation runs on each node's main process first while the other ranks wait at a barrier;
if the main process raised there (an empty dataset, a wrong-typed row, a Hub model that cannot be
reached offline), it never reached the barrier, the others waited until it died, and the launch
ended in gloo's "Connection closed by peer" and the launcher's tracebacks around the one useful
line. Here the ranks instead exchange each section's outcome (ok, or the error) with a collective
every rank reaches; the lowest rank that failed prints its error, and every rank raises
`ReportedElsewhere`, which the CLI turns into exit 2 without printing the message a second time.
The process group is destroyed before raising, so no rank exits with a collective in flight.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from finetune.errors import FinetuneError, ReportedElsewhere, tell_the_launcher


@contextmanager
def main_process_first(accelerator) -> Iterator[None]:
    """Like `accelerator.local_main_process_first()`: each node's main process runs the body, then
    the other ranks (reading what it wrote). A failure in either turn stops every rank."""
    if accelerator.is_local_main_process:
        with _outcome_shared(accelerator):
            yield
        _share(accelerator, None)  # the others' turn
    else:
        _share(accelerator, None)  # the main processes' turn
        with _outcome_shared(accelerator):
            yield


@contextmanager
def together(accelerator) -> Iterator[None]:
    """Run the body on every rank at once; a failure on any rank stops every rank."""
    with _outcome_shared(accelerator):
        yield


@contextmanager
def _outcome_shared(accelerator) -> Iterator[None]:
    try:
        yield
    except Exception as error:
        _share(accelerator, error)
        raise
    _share(accelerator, None)


def _share(accelerator, error: Exception | None) -> None:
    """Tell every rank this rank's outcome and hear theirs; if any rank failed, stop this one.

    The lowest failing rank prints its error (the message of a FinetuneError, the traceback of
    anything else) before a last barrier, so the launcher, which kills the other ranks as soon as
    one exits, cannot cut the message off; then every rank raises ReportedElsewhere (exit 2), or
    exits 1 after a bug's traceback.
    """
    if accelerator.num_processes == 1 or not dist.is_initialized():
        return
    outcomes: list[str | None] = [None] * accelerator.num_processes
    dist.all_gather_object(outcomes, None if error is None else _report(error))
    failed = [rank for rank, outcome in enumerate(outcomes) if outcome is not None]
    if not failed:
        return
    reporter = failed[0] == accelerator.process_index
    if reporter:
        print(outcomes[failed[0]], file=sys.stderr, flush=True)
    tell_the_launcher(outcomes[failed[0]])
    dist.barrier()
    dist.destroy_process_group()
    if reporter and not isinstance(error, FinetuneError):
        raise SystemExit(1)
    raise ReportedElsewhere(outcomes[failed[0]])


def _report(error: Exception) -> str:
    """What the user reads: the message of a FinetuneError, the traceback of anything else."""
    if isinstance(error, FinetuneError):
        return f"finetune train: error: {error}"
    return "".join(traceback.format_exception(error)).rstrip()
