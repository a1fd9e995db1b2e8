"""The engine process: continuous batching over the bigram model, one step after another.

Synchronous, as vLLM's EngineCore is: between steps it takes in what the API
process sent (new requests join free rows, cancelled ones leave), then queues
one step on the device for every row, the copy of the step's tokens into a
slot of the shared host ring, and returns at once. It exports the copy's
fence and tells the API process which requests, slot and tokens the step
made; the API process awaits the fence, reads the slot, and hands the slot
back. The step path never synchronizes:

* a slot is written again only once the API process has read it (its
  ``ack``): with every slot out, the engine waits for an ack;
* the device runs at most ``--in-flight`` steps behind: past that, the engine
  waits for the oldest step with ``fence.wait_sync(timeout=...)``, which
  sleeps on the completion signal, spends no CPU, and raises rather than
  hangs on a device that stopped.

An exported fence is answered by this process's event loop (its relay), so
the step loop runs as a coroutine whose loop turns between steps; it blocks
that loop only in ``wait_sync``, for the device, never for the API process
(whose acks wait on imports that the loop answers). A device error ends the
engine: it tells the API process (``fatal``) and exits with status 1, as an
engine must once a CUDA context is lost.

``--wait synchronize`` is the old way: after queueing each step the engine
synchronizes, then sends the step with no fence.

Run by ``api_server.py``, never by hand:

    python engine.py --fd FD --ring PATH [--rows 64] [--slots 8]
        [--wait fence|synchronize] [--device auto|opencl|torch|cuda|cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import mmap
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import numpy as np
from bigram import Runner, open_runner
from wire import Unframer, frame

import asyncfence

__all__ = ["Engine", "Link", "SocketLink", "main", "open_ring", "run"]

#: How long the engine waits for the oldest step in flight before it calls
#: the device stuck and stops.
STEP_TIMEOUT_S = 30.0


class Link(Protocol):
    """How the engine talks to the API side: a socket pair here, Ray calls in ``ray_app.py``."""

    #: Set once the API side is gone.
    closed: bool

    def send(self, message: tuple[Any, ...]) -> None:
        """Queue ``message`` for the API side."""

    async def flush(self) -> None:
        """Hand over what is queued; lets the loop turn if the API side is behind."""

    def take(self) -> list[tuple[Any, ...]]:
        """The messages that have arrived; never blocks."""

    async def wait(self) -> None:
        """Return once a message may have arrived (or the API side is gone)."""


class SocketLink:
    """The engine's end of its socket pair with the API process: framed pickles."""

    def __init__(self, connection: socket.socket) -> None:
        connection.setblocking(False)
        self.connection = connection
        self.closed = False
        self._unframer = Unframer()
        self._outbox = bytearray()

    def send(self, message: tuple[Any, ...]) -> None:
        self._outbox += frame(message)

    async def flush(self) -> None:
        while self._outbox:
            try:
                sent = self.connection.send(self._outbox)
            except BlockingIOError:
                await anyio.wait_writable(self.connection)
                continue
            del self._outbox[:sent]

    def take(self) -> list[tuple[Any, ...]]:
        messages: list[tuple[Any, ...]] = []
        while not self.closed:
            try:
                data = self.connection.recv(65536)
            except BlockingIOError:
                break
            if not data:
                self.closed = True  # the API process is gone
            messages += self._unframer.feed(data)
        return messages

    async def wait(self) -> None:
        await anyio.wait_readable(self.connection)


@dataclass
class _Request:
    request_id: int
    row: int
    remaining: int
    produced: int = 0


class Engine:
    """The step loop's state: rows, the ring's free slots, the steps in flight."""

    def __init__(
        self,
        link: Link,
        ring: np.ndarray[Any, np.dtype[np.int32]],
        runner: Runner,
        *,
        wait: str,
        in_flight: int,
        step_s: float,
        fail_at: int | None,
        stall_at: int | None,
    ) -> None:
        self.link = link
        self.ring = ring
        self.runner = runner
        self.wait = wait
        self.max_in_flight = in_flight
        self.step_s = step_s
        self.fail_at, self.stall_at = fail_at, stall_at
        slots, rows = ring.shape
        self.free_rows = list(range(rows - 1, -1, -1))
        self.free_slots = collections.deque(range(slots))
        self.active: dict[int, _Request] = {}
        self.joining: collections.deque[tuple[int, int, int]] = collections.deque()
        self.in_flight: collections.deque[tuple[asyncfence.Fence, object]] = collections.deque()
        self.steps = 0

    def send(self, message: tuple[Any, ...]) -> None:
        self.link.send(message)

    def take_input(self) -> None:
        """Handle every message that has arrived; never blocks."""
        for message in self.link.take():
            self._handle(message)

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, token, max_tokens = message
            self.joining.append((request_id, token, max_tokens))
        elif kind == "cancel":
            request = self.active.pop(message[1], None)
            if request is not None:
                self.free_rows.append(request.row)
            self.joining = collections.deque(j for j in self.joining if j[0] != message[1])
            self.send(("active", len(self.active)))
        elif kind == "ack":
            self.free_slots.append(message[1])

    # -- the step --------------------------------------------------------------------

    def admit(self) -> None:
        """Let waiting requests join the batch, one per free row."""
        while self.joining and self.free_rows:
            request_id, token, max_tokens = self.joining.popleft()
            row = self.free_rows.pop()
            self.runner.set_token(row, token)
            self.active[request_id] = _Request(request_id, row, max_tokens)

    def step(self) -> None:
        """Queue one step and the copy of its tokens; send what it made. Never synchronizes."""
        self.steps += 1
        slot = self.free_slots.popleft()
        if self.step_s:
            time.sleep(self.step_s)  # the model's own time, were it larger
        fence, keep = self.runner.step(
            self.ring[slot], fail=self.steps == self.fail_at, stall=self.steps == self.stall_at
        )
        rows, finished = [], []
        for request in list(self.active.values()):
            rows.append((request.request_id, request.produced, request.row))
            request.produced += 1
            request.remaining -= 1
            if not request.remaining:
                finished.append(request.request_id)
                del self.active[request.request_id]
                self.free_rows.append(request.row)
        if self.wait == "synchronize":
            self.runner.synchronize()
            fence.wait_sync(timeout=STEP_TIMEOUT_S)  # done now; raises if the step failed
            token = None
        else:
            token = fence.export()
            self.in_flight.append((fence, keep))
        self.send(("step", self.steps, slot, token, rows, finished, len(self.active)))

    def bound_in_flight(self) -> None:
        """Let go of the steps the device finished; wait for the oldest past the bound.

        Raises:
            asyncfence.DeviceError: A step failed on the device.
            TimeoutError: The oldest step did not finish in ``STEP_TIMEOUT_S``.
        """
        while self.in_flight and self.in_flight[0][0].done():
            self.in_flight.popleft()
        while len(self.in_flight) >= self.max_in_flight:
            fence, _ = self.in_flight.popleft()
            fence.wait_sync(timeout=STEP_TIMEOUT_S)


async def run(engine: Engine, info: dict[str, Any]) -> int:
    """The step loop; the event loop turns between steps (the relay answers imports)."""
    link = engine.link
    engine.send(("ready", info))
    try:
        while not link.closed:
            await link.flush()
            engine.take_input()
            engine.admit()
            if not engine.active or not engine.free_slots:
                # Nothing to do, or every slot out: wait for the API side.
                # Never a blocking wait here: its acks follow imports this
                # loop's relay answers.
                await link.wait()
                continue
            engine.step()
            engine.bound_in_flight()
            await anyio.lowlevel.checkpoint()
    except (asyncfence.DeviceError, TimeoutError) as error:
        engine.send(("fatal", f"{type(error).__name__}: {error}"))
        await link.flush()
        # Stay until the API side hangs up: the steps already sent are
        # answered by this loop's relay, the good ones and the failed one.
        with anyio.move_on_after(STEP_TIMEOUT_S):
            while not link.closed:
                await link.wait()
                engine.take_input()
        return 1
    return 0


def open_ring(path: str, slots: int, rows: int) -> np.ndarray[Any, np.dtype[np.int32]]:
    """The shared ring the API side made: ``slots`` rows of ``rows`` tokens."""
    with open(path, "r+b") as file:
        shared = mmap.mmap(file.fileno(), 0)
    return np.frombuffer(shared, np.int32).reshape(slots, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--ring", required=True)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--wait", choices=("fence", "synchronize"), default="fence")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--fail-at-step", type=int)
    parser.add_argument("--stall-at-step", type=int)
    args = parser.parse_args()
    link = SocketLink(socket.socket(fileno=args.fd))
    runner = open_runner(args.device, args.rows)
    engine = Engine(
        link,
        open_ring(args.ring, args.slots, args.rows),
        runner,
        wait=args.wait,
        in_flight=args.in_flight,
        step_s=args.step_ms / 1000,
        fail_at=args.fail_at_step,
        stall_at=args.stall_at_step,
    )
    info = {
        "device": runner.description,
        "done_when_recorded": runner.done_when_recorded,
        "rows": args.rows,
        "slots": args.slots,
        "wait": args.wait,
        "pid": os.getpid(),
    }
    sys.exit(asyncio.run(run(engine, info)))


if __name__ == "__main__":
    main()
