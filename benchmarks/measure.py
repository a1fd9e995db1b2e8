"""Small measuring helpers shared by the benchmark and the soak run."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import numpy as np
import psutil

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "hold_gil",
    "loop_lag",
    "os_thread_count",
    "percentile",
    "plural",
    "python_threads_cpu",
    "rss_bytes",
]


def percentile(samples: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile of ``samples`` (nearest rank); NaN if there are none.

    NumPy's ``inverted_cdf``: the smallest sample with at least ``fraction``
    of them at or below it. Infinite samples (trials that timed out) sort
    last, so a quantile that lands on one is infinite.
    """
    if not samples:
        return math.nan
    return float(np.percentile(samples, fraction * 100, method="inverted_cdf"))


def plural(count: int, word: str, plural_form: str | None = None) -> str:
    """``"1 task"``, ``"2 tasks"``, ``"1,000 tasks"``."""
    form = word if count == 1 else (plural_form or f"{word}s")
    return f"{count:,} {form}"


def python_threads_cpu() -> float:
    """CPU seconds used so far by the process's Python threads.

    Threads the device runtime started on its own (PoCL's workers, a driver's
    threads) are left out: on PoCL they *are* the device.
    """
    total = 0.0
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        with contextlib.suppress(OSError, OverflowError):
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total


def rss_bytes() -> int | None:
    """The process's resident set size now (psutil); None where it cannot tell."""
    try:
        return int(psutil.Process().memory_info().rss)
    except psutil.Error:
        return None


def os_thread_count() -> int | None:
    """Threads of the process as the OS counts them (Python's and the runtimes'), by psutil."""
    try:
        return int(psutil.Process().num_threads())
    except psutil.Error:
        return None


def hold_gil(seconds: float) -> None:
    """Keep this thread running Python for ``seconds``, as a busy event loop does."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


async def loop_lag(until: float, interval: float = 0.001) -> list[float]:
    """How long a task that yields waits to run again, once every ``interval`` seconds.

    Each probe is one checkpoint: the task goes to the back of the loop's run
    queue (as a ``call_soon`` would on asyncio), so the figure is what one
    turn of the loop costs its tasks. Any loop anyio runs on.
    """
    lags: list[float] = []
    while time.perf_counter() < until:
        sent = time.perf_counter()
        await anyio.lowlevel.checkpoint()
        lags.append(time.perf_counter() - sent)
        await anyio.sleep(interval)
    return lags
