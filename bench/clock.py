"""What the CPU benches share: one call timed on both clocks, and a median with its range."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call: on a shared machine the CPU time is the steadier."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def spread(values: list[float]) -> str:
    """"median (min–max)"."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"
