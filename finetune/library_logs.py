"""Library logs and warnings: off by default, shown with `--verbose`.

A user reads finetune's own messages. The libraries underneath log things meant for their own
developers on every run: DeepSpeed's "Setting accelerator to CPU" (Accelerate imports DeepSpeed
whenever it is installed, to unwrap models), bitsandbytes' optional CPU kernels, liger-kernel's
optional backends it cannot import (CuTe DSL, Ascend), transformers' deprecations, PEFT's note on
finetune's own `exclude_modules`, Hugging Face Hub retries, datasets' progress bars, Accelerate's
save warnings. Errors still pass. No library is imported here.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# variable a library reads its log level from when it first logs → its logger; the variables also
# reach the processes a launcher starts, and the logger covers a library this process already imported
LEVEL_VARIABLES = {"TRANSFORMERS_VERBOSITY": "transformers", "DATASETS_VERBOSITY": "datasets",
                   "HF_HUB_VERBOSITY": "huggingface_hub"}
# loggers that configure nothing themselves: their module loggers inherit this level (bitsandbytes'
# optional kernels; Accelerate's "[RANK 0] Removed shared tensor ... while saving"; liger-kernel 0.8's
# "Backend impl '…' could not be imported" for each optional backend of each op, on the first call)
PARENT_LOGGERS = ("bitsandbytes", "accelerate", "liger_kernel")
# PEFT warns on every LoRA build whose `exclude_modules` matched nothing; finetune always passes one
# (vision towers, 4-bit experts' parametrizations), so for a text model it never matches
PEFT_UNUSED_EXCLUDE = r"You have passed exclude_modules=.* but no modules were excluded"
# datasets' progress bars of its own steps ("Generating train split", "Saving the dataset"); read
# when datasets is imported, and then it wins over datasets' own switch
PROGRESS_BARS_VARIABLE = "HF_DATASETS_DISABLE_PROGRESS_BARS"
# DeepSpeed sets its logger's level and a stdout handler when it is imported, after us; a filter
# survives that
DEEPSPEED_LOGGER = "DeepSpeed"


class _DeepSpeedToStderr(logging.Filter):
    """Writes DeepSpeed's records to stderr and keeps them from DeepSpeed's own handler, which writes
    to stdout, where `--json` output must be alone; when `quiet`, only errors."""

    def __init__(self) -> None:
        super().__init__()
        self.quiet = False
        self.formatter = logging.Formatter("[%(levelname)s] [DeepSpeed] %(message)s")

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.quiet or record.levelno >= logging.ERROR:
            print(self.formatter.format(record), file=sys.stderr)  # sys.stderr now, not at import
        return False


_DEEPSPEED = _DeepSpeedToStderr()


def library_logs_to_stderr() -> None:
    """Keep stdout for finetune's own output, whatever the launcher and --verbose: the one library
    that logs to stdout, DeepSpeed, is sent to stderr."""
    deepspeed = logging.getLogger(DEEPSPEED_LOGGER)
    if _DEEPSPEED not in deepspeed.filters:
        deepspeed.addFilter(_DEEPSPEED)


def quiet_transformers_bars() -> None:
    """transformers draws a bar for every model it loads or saves ("Loading weights", "Writing model
    shards"): hundreds of redraws in a log, and one per rank. Imports transformers: call it once the
    command is known to need it."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


def quiet_libraries() -> None:
    """Keep only errors from the libraries' loggers and drop deprecation warnings. A *_VERBOSITY
    variable the user set wins."""
    for variable, logger in LEVEL_VARIABLES.items():
        os.environ.setdefault(variable, "error")
        if os.environ[variable] == "error":
            logging.getLogger(logger).setLevel(logging.ERROR)
    for logger in PARENT_LOGGERS:
        logging.getLogger(logger).setLevel(logging.ERROR)
    os.environ.setdefault(PROGRESS_BARS_VARIABLE, "1")
    if os.environ[PROGRESS_BARS_VARIABLE] == "1" and "datasets" in sys.modules:  # imported before: too late for the variable
        sys.modules["datasets"].disable_progress_bars()
    library_logs_to_stderr()
    _DEEPSPEED.quiet = True
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", message=PEFT_UNUSED_EXCLUDE, category=UserWarning)
