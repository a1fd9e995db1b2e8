"""Load: many fences, many waiters, random completion, cancellation and timeouts.

Short by default (CI); ``ASYNCFENCE_STRESS=full`` runs the full sizes: 100,000
fences across 64 queues, a million fences for memory.
"""

from __future__ import annotations

import os
import random
import threading
import tracemalloc
from contextlib import ExitStack
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import pytest

import asyncfence
from asyncfence.testing import hold

if TYPE_CHECKING:
    from asyncfence.testing import OpenCLDevice

pytestmark = pytest.mark.stress

FULL = os.environ.get("ASYNCFENCE_STRESS") == "full"
FENCES = 100_000 if FULL else 10_000
QUEUES = 64
WAITERS = 1_000
MEMORY_FENCES = 1_000_000 if FULL else 30_000


async def test_many_fences_waiters_cancellations_and_timeouts(device: OpenCLDevice) -> None:
    rng = random.Random(2026)
    queues = [device.new_stream() for _ in range(QUEUES)]
    outcomes: dict[str, int] = {"resumed": 0, "timed out": 0, "cancelled": 0}
    threads_before = threading.active_count()
    with ExitStack() as stack:
        gates = [stack.enter_context(hold(queue)) for queue in queues]
        fences = [asyncfence.record(queues[i % QUEUES]) for i in range(FENCES)]

        async def waiter(fence: asyncfence.Fence, plan: str, strategy: str) -> None:
            if plan == "cancel":
                with anyio.move_on_after(rng.uniform(0, 0.02)) as scope:
                    await fence.wait(strategy=strategy)  # type: ignore[arg-type]
                if scope.cancelled_caught:
                    outcomes["cancelled"] += 1
                    return
            elif plan == "timeout":
                try:
                    await fence.wait(timeout=rng.uniform(0, 0.02), strategy=strategy)  # type: ignore[arg-type]
                except TimeoutError:
                    outcomes["timed out"] += 1
                    return
            else:
                await fence.wait(strategy=strategy)  # type: ignore[arg-type]
            assert fence.done()  # never woken early
            outcomes["resumed"] += 1

        with anyio.fail_after(120):  # no waiter may hang: each ends one of three ways
            async with anyio.create_task_group() as tg:
                for _ in range(WAITERS):
                    tg.start_soon(
                        waiter,
                        rng.choice(fences),
                        rng.choice(["plain", "plain", "cancel", "timeout"]),
                        rng.choice(["auto", "poll", "park"]),
                    )
                await anyio.sleep(0.01)
                for gate in rng.sample(gates, len(gates)):  # random completion order
                    gate.release()
                    await anyio.lowlevel.checkpoint()
    assert sum(outcomes.values()) == WAITERS
    assert outcomes["resumed"] > 0
    for fence in fences[-QUEUES:]:  # the newest on every queue: so all are done
        fence.wait_sync(timeout=60)
    assert all(fence.done() for fence in fences)
    stats = asyncfence.current_statistics()
    assert (stats.pending_fences, stats.waiters, stats.parked) == (0, 0, 0)
    # asyncfence starts no thread (trio's guest mode may have one of its own).
    assert threading.active_count() <= threads_before + 1


async def test_memory_stays_flat_over_many_fences(device: OpenCLDevice) -> None:
    queues = [device.new_stream() for _ in range(8)]
    batch = 1_000
    tracemalloc.start()
    try:
        samples = []
        for index in range(MEMORY_FENCES // batch):
            fences = [asyncfence.record(queues[i % 8]) for i in range(batch)]
            for fence in fences[-8:]:
                await fence
            del fences
            if index in (5, MEMORY_FENCES // batch - 1):  # after warm-up, and at the end
                samples.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    warm, end = samples
    assert end - warm < 512 * 1024, f"grew {end - warm} bytes over {MEMORY_FENCES} fences"


@pytest.mark.timeout(600 if FULL else 120)  # the long form soaks for 3 minutes
def test_the_soak_command_reports_flat() -> None:
    import subprocess
    import sys

    minutes = "3" if FULL else "0.05"
    result = subprocess.run(
        [sys.executable, "-m", "asyncfence", "soak", "--minutes", minutes],
        capture_output=True,
        text=True,
        env={**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.rstrip().endswith(": flat")
    assert "fences awaited" in result.stdout
