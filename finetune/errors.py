"""The one exception type the CLI turns into a clean message instead of a traceback."""


class FinetuneError(Exception):
    """A problem the user can fix (bad flag, missing file, model that does not fit); the message
    says what is wrong and how to fix it."""


class ReportedElsewhere(FinetuneError):
    """Another rank of this launch failed and reports the error; this rank stops with exit 2 and
    prints nothing, so the user reads the message once (see train/ranks.py)."""
