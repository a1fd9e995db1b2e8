"""Cross-process wake latency: await, in this process, device work that another queued.

A producer process (``cross_process_producer.py``) holds its queue behind a
gate, records a fence behind it and releases the gate 0.5 to 3 ms later,
stamping the release. This process, the consumer, resumes by one of:

* ``asyncfence import``: it imports the fence's token
  (:func:`asyncfence.import_fence`) and awaits it; the producer's loop parks
  its own wait and answers.
* ``message after sync``: the usual workaround with a thread, in the
  producer: a thread per wait blocks in the runtime's own sync on its own
  event (``clWaitForEvents``, ``cuEventSynchronize``) and then writes a byte
  to a pipe this loop watches.
* ``polled, 10 ms``: the usual workaround without one, in the consumer: it
  looks for that byte every 10 ms (``await sleep(0.01)`` around a query).

The latency is from the producer's stamp to the consumer's resumption, on
the system's monotonic clock (``time.perf_counter``, which both read).
Contenders take turns in a random order within each round.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

import asyncfence

from .base import IMPORT, MESSAGE_AFTER_SYNC, POLLED_10MS, bounded, latency

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .targets import Context

__all__ = ["CROSS_PROCESS_CONTENDERS", "cross_process"]

CROSS_PROCESS_CONTENDERS = (IMPORT, MESSAGE_AFTER_SYNC, POLLED_10MS)
_POLL_S = 0.01
_DELAYS_S = (0.0005, 0.003)
_ROOT = Path(__file__).resolve().parents[2]


class _Producer:
    """The producing process, its commands, and the pipe its threads write to."""

    def __init__(self, backend: str) -> None:
        self.notified, notify = os.pipe()
        os.set_blocking(self.notified, False)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench.cross_process_producer", backend, str(notify)],
            cwd=_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(notify,),
            # This checkout first, then whatever the parent's path had (the GPU
            # check's carried wheels, say).
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])
                ),
            },
        )
        os.close(notify)

    def start(self, method: str, delay_s: float) -> Any:
        """Start a trial; what the producer printed first (a token, or ``None``).

        Blocks for the moment the producer takes to record: before anything is timed.
        """
        assert self.process.stdin is not None
        self.process.stdin.write(f"{method} {delay_s}\n".encode())
        self.process.stdin.flush()
        return self.read()

    def command(self, line: str) -> Any:
        """Send a command of one word; what the producer printed back."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"{line}\n".encode())
        self.process.stdin.flush()
        return self.read()

    def read(self) -> Any:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the producer exited ({self.process.wait()})")
        return pickle.loads(bytes.fromhex(line.decode()))

    def take_message(self) -> bool:
        """Whether a producer thread's byte was waiting (it is consumed)."""
        try:
            return bool(os.read(self.notified, 64))
        except BlockingIOError:
            return False

    def close(self) -> None:
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self.process.wait(10)
        os.close(self.notified)


async def _polled(producer: _Producer) -> None:
    while not producer.take_message():  # noqa: ASYNC110 (the workaround measured)
        await anyio.sleep(_POLL_S)


async def _message(producer: _Producer) -> None:
    while not producer.take_message():
        await anyio.wait_readable(producer.notified)


async def cross_process(ctx: Context) -> None:
    """Each way to resume across processes, the producer's gate released 0.5 to 3 ms in."""
    samples = ctx.results.latency.setdefault("wake_cross_process", {})
    limit_s = ctx.config.trial_timeout_s
    rng = random.Random(7)
    producer = _Producer(ctx.target.device.backend)
    try:
        for trial in range(ctx.config.cross_process_trials + 1):  # the first is untimed
            for name in rng.sample(CROSS_PROCESS_CONTENDERS, len(CROSS_PROCESS_CONTENDERS)):
                producer.take_message()  # a timed-out trial's late byte
                token = producer.start(
                    "import" if name == IMPORT else "thread", rng.uniform(*_DELAYS_S)
                )
                wait: Callable[[], Awaitable[None]]
                if name == IMPORT:
                    wait = asyncfence.import_fence(token).wait
                elif name == MESSAGE_AFTER_SYNC:
                    wait = lambda: _message(producer)  # noqa: E731
                else:
                    wait = lambda: _polled(producer)  # noqa: E731
                resumed = await bounded(wait(), limit_s)
                stamp = producer.read()
                if trial:
                    samples.setdefault(name, []).append(latency(resumed, [stamp]))
    finally:
        producer.close()
