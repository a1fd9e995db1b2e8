"""A producing process for the cross-process tests: exports a fence held by a gate.

Run as ``python -m tests.relay_producer LOOP BACKEND``. It prints one line, the
hex of the pickled :class:`~asyncfence.FenceToken`, then obeys one command a
line on stdin, read by its event loop (no thread): ``release`` or ``fail`` the
gate; ``fault`` (a sticky fault, on the emulated CUDA driver);
``release-and-block`` (release it, then block the loop until the next line:
no relay answers meanwhile); ``fail-await-block`` or ``fault-await-block``
(fail the work, await the fence as the producer's own code would, and once
that raised, block the loop until the next line); ``export`` another token
of the same fence (printed likewise); ``waiters`` (how many waits its loop
has, printed likewise: the relay's included); ``threads`` (the names of its
Python threads, printed likewise); ``die`` (``os._exit`` at once, as a crash
would); or ``quit`` (end the loop).

With ``ASYNCFENCE_TEST_SPARE_FDS=N`` in its environment it may open only N
more descriptors than it holds once its fence is exported.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from pathlib import Path
from typing import Any

import anyio

import asyncfence
from asyncfence.testing import StreamGate, open_default_device


async def _produce(backend: str) -> None:
    device = open_default_device(backend)
    queue = device.new_stream()
    gate = StreamGate(queue)
    fence = asyncfence.record(queue)

    def say(value: Any) -> None:
        sys.stdout.write(pickle.dumps(value).hex() + "\n")
        sys.stdout.flush()

    say(fence.export())
    _limit_descriptors()
    commands = _Commands()
    while (command := await commands.next()) != "quit":
        if command == "release":
            gate.release()
        elif command == "release-and-block":
            gate.release()
            commands.next_blocking()  # the loop stops here, answering nothing
        elif command == "fail":
            gate.fail()
        elif command == "fault":
            _fault_emulated_cuda(queue)
        elif command in ("fail-await-block", "fault-await-block"):
            if command == "fail-await-block":
                gate.fail()
            else:
                _fault_emulated_cuda(queue)
            try:
                await fence
            except asyncfence.DeviceError:
                commands.next_blocking()  # the loop stops here, as soon as this task runs
        elif command == "export":
            say(fence.export())
        elif command == "waiters":
            say(asyncfence.current_statistics().waiters)
        elif command == "threads":
            say(sorted(thread.name for thread in threading.enumerate()))
        elif command == "die":
            os._exit(3)
    gate.release()


def _limit_descriptors() -> None:
    spare = os.environ.get("ASYNCFENCE_TEST_SPARE_FDS")
    if spare is not None:
        import resource

        # The limit is on descriptor numbers: past the highest held (any
        # gap below it is spare too, so "about N").
        highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1 + int(spare), hard))


def _fault_emulated_cuda(stream: Any) -> None:
    """Turn the stream's context sticky with an illegal address, as a crashed kernel would."""
    from cuda.bindings import driver as drv

    from tests.cuda_emulator import Emulator

    library = Path(os.environ["LD_LIBRARY_PATH"].split(os.pathsep)[0]) / "libcuda.so.1"
    _, context = drv.cuStreamGetCtx(stream)
    Emulator(library).inject_fault(int(context), 700)  # CUDA_ERROR_ILLEGAL_ADDRESS


class _Commands:
    """Lines from stdin: read on the loop, or (to block it, on purpose) not."""

    def __init__(self) -> None:
        self._fd = sys.stdin.fileno()
        self._pending = b""  # one read may hold several commands, or part of one

    async def next(self) -> str:
        """The next line; ``quit`` at the end of stdin."""
        while b"\n" not in self._pending:
            await anyio.wait_readable(self._fd)
            if not self._read():
                return "quit"
        return self._line()

    def next_blocking(self) -> str:
        """The next line, read without giving the loop back."""
        while b"\n" not in self._pending:
            if not self._read():
                return "quit"
        return self._line()

    def _read(self) -> bool:
        chunk = os.read(self._fd, 4096)
        self._pending += chunk
        return bool(chunk)

    def _line(self) -> str:
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode().strip()


def main() -> None:
    loop, backend = sys.argv[1:3]
    if loop == "trio":
        anyio.run(_produce, backend, backend="trio")
    elif loop == "uvloop":
        anyio.run(_produce, backend, backend_options={"use_uvloop": True})
    else:
        anyio.run(_produce, backend)


if __name__ == "__main__":
    main()
