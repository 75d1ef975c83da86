"""Every error the user can fix, in one place: the CLI turns a FinetuneError into one clean line
instead of a traceback, and the subclasses say which stage found the problem."""

import hashlib
import json
import os
import sys
import time
from pathlib import Path


class FinetuneError(Exception):
    """A problem the user can fix (bad flag, missing file, model that does not fit); the message
    says what is wrong and how to fix it."""


class ConfigError(FinetuneError):
    """A configuration problem the user can fix; the message says how."""


class UnknownModelError(FinetuneError):
    """--model names nothing in the catalog, on disk or in the Hugging Face cache."""


class UnknownGPUError(FinetuneError):
    """--gpus / --gpu names no GPU of the catalog (or an ambiguous one)."""


class CheckpointError(FinetuneError):
    """A checkpoint that cannot be resumed or exported; the message says why and what to do."""


class GgufExportError(CheckpointError):
    """The model or tokenizer has no GGUF form this version writes."""


class PreflightError(FinetuneError):
    """The distributed job cannot train as launched; the message lists every problem found."""


class FitError(FinetuneError):
    """The run will not fit the memory it is launched on; the message says what would."""


class HubError(FinetuneError):
    """The Hub cannot be reached, or refused the upload."""


class ReportedElsewhere(FinetuneError):
    """Another rank of this launch failed and reports the error; this rank stops with exit 2 and
    prints nothing, so the user reads the message once (see train/ranks.py). `args[0]` is that
    rank's one-line message."""


def tell_the_launcher(message: str) -> None:
    """Under torch's launcher (`accelerate launch`, `torchrun`), write the error to this worker's
    error file: the launcher's failure summary, which it prints whatever the ranks do, then names it
    as the root cause instead of "To enable traceback see ...". Elsewhere a no-op."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)


def report(message: str) -> None:
    """Print a rank's error once per launcher and tell the launcher. Before the process group forms,
    every rank meets the same mistake at once (a flag, a file): the first rank of this launcher to
    claim the message prints it, so eight ranks print one line, while a message only one rank meets
    is still printed."""
    tell_the_launcher(message)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # <launcher's folder for this attempt>/<local rank>/error.json: the folder all its ranks share
        digest = hashlib.sha256(message.encode()).hexdigest()[:16]
        try:
            (Path(error_file).parent.parent / f"finetune-error-{digest}").touch(exist_ok=False)
        except FileExistsError:
            return  # another rank of this launch printed it
        except OSError:
            pass  # the folder is gone or read-only: print it anyway
    print(message, file=sys.stderr, flush=True)
