"""A producing process for the cross-process tests: exports a fence held by a gate.

Run as ``python -m tests.relay_producer LOOP BACKEND``. It prints one line, the
hex of the pickled :class:`~asyncfence.FenceToken`, then obeys one command a
line on stdin, read by its event loop (no thread): ``release`` or ``fail`` the
gate; ``fault`` (a sticky fault, on the emulated CUDA driver);
``release-and-block`` (release it, then block the loop until the next line:
no relay answers meanwhile); ``export`` another token of the same fence
(printed likewise); ``threads`` (the names of its Python threads, printed
likewise); ``die`` (``os._exit`` at once, as a crash would); or ``quit`` (end
the loop).
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

import asyncfence
from asyncfence.testing import StreamGate, open_default_device

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


async def _produce(backend: str) -> None:
    device = open_default_device(backend)
    queue = device.new_stream()
    gate = StreamGate(queue)
    fence = asyncfence.record(queue)

    def say(value: Any) -> None:
        sys.stdout.write(pickle.dumps(value).hex() + "\n")
        sys.stdout.flush()

    say(fence.export())
    async for command in _commands():
        if command == "release":
            gate.release()
        elif command == "release-and-block":
            gate.release()
            # The loop stops here, answering nothing, until the next line.
            os.read(sys.stdin.fileno(), 4096)
        elif command == "fail":
            gate.fail()
        elif command == "fault":
            _fault_emulated_cuda(queue)
        elif command == "export":
            say(fence.export())
        elif command == "threads":
            say(sorted(thread.name for thread in threading.enumerate()))
        elif command == "die":
            os._exit(3)
        elif command == "quit":
            break
    gate.release()


def _fault_emulated_cuda(stream: Any) -> None:
    """Turn the stream's context sticky with an illegal address, as a crashed kernel would."""
    from cuda.bindings import driver as drv

    from tests.cuda_emulator import Emulator

    library = Path(os.environ["LD_LIBRARY_PATH"].split(os.pathsep)[0]) / "libcuda.so.1"
    _, context = drv.cuStreamGetCtx(stream)
    Emulator(library).inject_fault(int(context), 700)  # CUDA_ERROR_ILLEGAL_ADDRESS


async def _commands() -> AsyncIterator[str]:
    """Lines from stdin, read on the loop; ends at ``quit`` or the end of stdin."""
    pending = b""
    while True:
        await anyio.wait_readable(sys.stdin.fileno())
        chunk = os.read(sys.stdin.fileno(), 4096)
        if not chunk:
            return
        # One read may hold several commands, or part of one.
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line.decode().strip()


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
