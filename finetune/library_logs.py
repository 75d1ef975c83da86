"""Library logs and warnings: off by default, shown with `--verbose`.

A user reads finetune's own messages. The libraries underneath log things meant for their own
developers on every run: DeepSpeed's "Setting accelerator to CPU" (Accelerate imports DeepSpeed
whenever it is installed, to unwrap models), bitsandbytes' optional CPU kernels, transformers'
deprecations, Hugging Face Hub retries. Errors still pass. No library is imported here.
"""

from __future__ import annotations

import logging
import os
import warnings

# variable a library reads its log level from when it first logs → its logger; the variables also
# reach the processes a launcher starts, and the logger covers a library this process already imported
LEVEL_VARIABLES = {"TRANSFORMERS_VERBOSITY": "transformers", "DATASETS_VERBOSITY": "datasets",
                   "HF_HUB_VERBOSITY": "huggingface_hub"}
# bitsandbytes configures nothing itself: its module loggers inherit this level
BITSANDBYTES_LOGGER = "bitsandbytes"
# DeepSpeed sets its logger's level when it is imported, after us; a filter survives that
DEEPSPEED_LOGGER = "DeepSpeed"


def quiet_libraries() -> None:
    """Keep only errors from the libraries' loggers and drop deprecation warnings. A *_VERBOSITY
    variable the user set wins."""
    for variable, logger in LEVEL_VARIABLES.items():
        os.environ.setdefault(variable, "error")
        if os.environ[variable] == "error":
            logging.getLogger(logger).setLevel(logging.ERROR)
    logging.getLogger(BITSANDBYTES_LOGGER).setLevel(logging.ERROR)
    deepspeed = logging.getLogger(DEEPSPEED_LOGGER)
    if _errors_only not in deepspeed.filters:
        deepspeed.addFilter(_errors_only)
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR
