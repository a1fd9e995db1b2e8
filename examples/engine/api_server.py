"""The API process: FastAPI on uvicorn, streaming the engine's tokens as server-sent events.

``POST /generate`` with ``{"prompt": "...", "max_tokens": 16}`` streams one
event per token (``data: {"index": 0, "token": 17}``), then ``event: done``;
a request that fails ends with ``event: error`` and what happened. Bad input
is a 422.

The engine (``engine.py``) is a process of its own, started with the app and
joined to it by a socket pair; the tokens come through a ring of slots in
shared memory. For each step the engine sends the slot and an exported
fence; one task of this process imports the fence, awaits it, reads the
slot, hands each token to its request's stream, and gives the slot back.
No thread is started for any of it, and nothing polls: the await parks on
the relay's socket, which the engine's loop answers as the copy completes.
A client that disconnects has its request cancelled in the engine.

``GET /health`` answers 503 once a step's fence has been awaited longer than
``--health-bound`` seconds (a stuck device), or once the engine has exited;
``GET /metrics`` gives those figures and the step counts for Prometheus.

    python api_server.py [--port 8000] [--wait fence|synchronize] [--device auto]
        [--rows 64] [--slots 8] [--health-bound S] [--step-ms MS]

``--wait synchronize`` is the old way, beside it: the engine synchronizes
each step, then sends it with no fence. ``--port 0`` picks a free port; once
it serves, it prints ``serving on http://HOST:PORT (WAIT, DEVICE)``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import numpy as np
import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bigram import prompt_token
from wire import Unframer, frame

import asyncfence

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable

    from anyio.streams.memory import MemoryObjectSendStream

__all__ = ["EngineClient", "main", "make_app"]

ENGINE = Path(__file__).resolve().with_name("engine.py")
#: The longest a request may ask for.
MAX_TOKENS = 1024


class GenerateBody(BaseModel):
    """``POST /generate``'s body."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str = Field(min_length=1, max_length=4096)
    max_tokens: int = Field(default=16, ge=1, le=MAX_TOKENS)


class EngineGone(RuntimeError):
    """The engine process exited, or stopped on a device error."""


class EngineClient:
    """This process's side of the engine: its process, the ring, and each request's stream.

    Thread-safety: the event loop's thread only.
    """

    def __init__(
        self,
        *,
        wait: str = "fence",
        device: str = "auto",
        rows: int = 64,
        slots: int = 8,
        step_ms: float = 0.0,
        engine_args: Iterable[str] = (),
    ) -> None:
        self.wait, self.device, self.rows, self.slots = wait, device, rows, slots
        self._step_ms = step_ms
        self._engine_args = list(engine_args)
        self.info: dict[str, Any] = {}
        self.process: subprocess.Popen[bytes] | None = None
        self.failure: str | None = None  # why the engine is gone
        self.steps = 0
        self.tokens = 0
        self.engine_active = 0
        self.slots_held = 0
        self._streams: dict[int, MemoryObjectSendStream[tuple[Any, ...]]] = {}
        self._ids = itertools.count(1)
        self._unframer = Unframer()
        self._pending: list[tuple[Any, ...]] = []
        # The steps received, their fences imported, in order (one per slot at most),
        # and the counts of active requests sent between them.
        self._steps_send, self._steps_receive = anyio.create_memory_object_stream[
            tuple[Any, asyncfence.ImportedFence | asyncfence.FenceError | None]
        ](max_buffer_size=math.inf)
        self._outbox_send, self._outbox_receive = anyio.create_memory_object_stream[
            tuple[Any, ...]
        ](max_buffer_size=1 << 16)

    @property
    def open_requests(self) -> int:
        return len(self._streams)

    @property
    def alive(self) -> bool:
        return self.failure is None and self._engine_running()

    def engine_args(self, ring_path: str) -> list[str]:
        """The engine's command line options (``engine.py``'s), for the ring at ``ring_path``."""
        return [
            f"--ring={ring_path}",
            f"--rows={self.rows}",
            f"--slots={self.slots}",
            f"--wait={self.wait}",
            f"--device={self.device}",
            f"--step-ms={self._step_ms}",
            *self._engine_args,
        ]

    # -- the transport: a process and a socket pair here; Ray calls in ray_app.py ---

    def _engine_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @contextlib.asynccontextmanager
    async def _engine_started(self, ring_path: str) -> AsyncIterator[None]:
        """Start the engine process on the ring; stop it when the block ends."""
        ours, theirs = socket.socketpair()
        try:
            # Forks and execs, quickly, once at startup. (asyncio's own
            # subprocess support would watch the child with a thread.)
            self.process = subprocess.Popen(  # noqa: ASYNC220
                [
                    sys.executable,
                    str(ENGINE),
                    f"--fd={theirs.fileno()}",
                    *self.engine_args(ring_path),
                ],
                pass_fds=[theirs.fileno()],
            )
            theirs.close()
            self._connection = await anyio.abc.UNIXSocketStream.from_socket(ours)
            yield
        finally:
            theirs.close()
            ours.close()
            await self._stop_engine()

    async def _receive_batch(self) -> list[tuple[Any, ...]] | None:
        """The engine's next messages; ``None`` at the end of its stream."""
        try:
            data = await self._connection.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return None
        return self._unframer.feed(data)

    async def _send_batch(self, messages: list[tuple[Any, ...]]) -> None:
        """Send ``messages`` to the engine (the caller handles a broken link)."""
        await self._connection.send(b"".join(map(frame, messages)))

    async def _hang_up(self) -> None:
        """Tell the engine this side is done with it (it waits for that to exit)."""
        await self._connection.aclose()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[EngineClient]:
        """Start the engine, serve its steps while the block runs, then stop it."""
        ring_fd, ring_path = tempfile.mkstemp(prefix="asyncfence-engine-", dir=_shm_dir())
        try:
            os.ftruncate(ring_fd, self.slots * self.rows * 4)
            self._ring_map = mmap.mmap(ring_fd, 0)
            self.ring = np.frombuffer(self._ring_map, np.int32).reshape(self.slots, self.rows)
            async with self._engine_started(ring_path), anyio.create_task_group() as tg:
                with anyio.fail_after(120):  # the engine imports its runtime, builds the kernel
                    ready = await self._receive()
                if ready is None or ready[0] != "ready":
                    raise EngineGone(f"the engine did not start (it sent {ready!r})")
                self.info = ready[1]
                tg.start_soon(self._receive_steps)
                tg.start_soon(self._deliver_steps)
                tg.start_soon(self._send_outbox)
                try:
                    yield self
                finally:
                    tg.cancel_scope.cancel()
        finally:
            os.close(ring_fd)
            os.unlink(ring_path)

    async def _stop_engine(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        with anyio.move_on_after(5), anyio.CancelScope(shield=True):
            # At shutdown only; a child watcher would start a thread.
            while self.process.poll() is None:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        if self.process.poll() is None:
            self.process.kill()

    def submit(self, prompt: str, max_tokens: int) -> tuple[int, Any]:
        """Queue a request; return its id and the stream its tokens arrive on.

        Raises:
            EngineGone: The engine is gone.
        """
        if not self.alive:
            raise EngineGone(self.failure or "the engine is not running")
        request_id = next(self._ids)
        send, receive = anyio.create_memory_object_stream[tuple[Any, ...]](max_tokens + 2)
        self._streams[request_id] = send
        self._tell(("add", request_id, prompt_token(prompt), max_tokens))
        return request_id, receive

    def forget(self, request_id: int) -> None:
        """Drop a request that ended here (a client gone): the engine lets its row go."""
        send = self._streams.pop(request_id, None)
        if send is not None:
            send.close()
            self._tell(("cancel", request_id))

    def _tell(self, message: tuple[Any, ...]) -> None:
        """Queue a message for the engine; dropped once the engine is gone."""
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._outbox_send.send_nowait(message)

    async def _send_outbox(self) -> None:
        with self._outbox_receive:
            async for message in self._outbox_receive:
                batch = [message]
                with contextlib.suppress(anyio.WouldBlock):
                    while True:
                        batch.append(self._outbox_receive.receive_nowait())
                try:
                    await self._send_batch(batch)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return  # the engine is gone: _deliver_steps tells every stream

    async def _receive(self) -> tuple[Any, ...] | None:
        """The engine's next message; ``None`` once it is gone."""
        while not self._pending:
            batch = await self._receive_batch()
            if batch is None:
                return None
            self._pending = batch
        return self._pending.pop(0)

    async def _receive_steps(self) -> None:
        """Take each message as it comes; import a step's fence at once, without waiting.

        Importing connects to the engine's relay and asks for the answer, so
        the round trips of the steps behind the one awaited overlap it.
        Everything goes on, in order, to :meth:`_deliver_steps`.
        """
        with self._steps_send:
            while True:
                message = await self._receive()
                if message is None or message[0] == "fatal":
                    self._steps_send.send_nowait((message, None))
                    return
                if message[0] == "active":  # in order with the steps, which carry it too
                    self._steps_send.send_nowait((message, None))
                    continue
                self.slots_held += 1
                token = message[3]
                fence: asyncfence.ImportedFence | asyncfence.FenceError | None = None
                if token is not None:
                    try:
                        fence = asyncfence.import_fence(token)
                    except asyncfence.FenceError as error:  # its exporter is gone
                        fence = error
                self._steps_send.send_nowait((message, fence))

    async def _deliver_steps(self) -> None:
        """Each step in turn: await its fence, read its slot, hand out its tokens."""
        async for message, fence in self._steps_receive:
            if message is None or message[0] == "fatal":
                stopped = f"the engine stopped: {message[1]}" if message else None
                self._fail_all(self.failure or stopped or "the engine process exited")
                await self._hang_up()  # the engine waits for this to exit
                return
            if message[0] == "active":
                self.engine_active = message[1]
                continue
            _, number, slot, _, rows, finished, active = message
            try:
                if isinstance(fence, asyncfence.FenceError):
                    raise fence
                if fence is not None:
                    await fence  # parks on the relay's socket: no thread, no polling
            except asyncfence.FenceError as error:  # DeviceError, FenceLostError
                if isinstance(error, asyncfence.FenceLostError):
                    failed = f"the engine process is gone (at step {number}): {error}"
                    self.failure = self.failure or failed  # /health says so at once
                elif isinstance(error, asyncfence.TokenRefusedError):
                    failed = f"step {number}'s fence cannot be awaited here: {error}"
                else:
                    failed = f"step {number} failed: {type(error).__name__}: {error}"
                for request_id, _, _ in rows:
                    self._end(request_id, ("error", failed))
                    self._tell(("cancel", request_id))
            else:
                tokens = self.ring[slot]
                for request_id, index, row in rows:
                    send = self._streams.get(request_id)
                    if send is not None:
                        send.send_nowait(("token", index, int(tokens[row])))
                        self.tokens += 1
                for request_id in finished:
                    self._end(request_id, ("done",))
            finally:
                self.slots_held -= 1
            self.steps = number
            self.engine_active = active
            self._tell(("ack", slot))

    def _end(self, request_id: int, last: tuple[Any, ...]) -> None:
        send = self._streams.pop(request_id, None)
        if send is not None:
            send.send_nowait(last)
            send.close()

    def _fail_all(self, why: str) -> None:
        self.failure = why
        for request_id in list(self._streams):
            self._end(request_id, ("error", why))


def _shm_dir() -> str | None:
    """``/dev/shm`` where there is one: the ring is memory, never written to disk."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def _event(kind: str | None, data: dict[str, Any]) -> str:
    head = f"event: {kind}\n" if kind else ""
    return f"{head}data: {json.dumps(data)}\n\n"


def make_app(
    *,
    wait: str = "fence",
    device: str = "auto",
    rows: int = 64,
    slots: int = 8,
    health_bound_s: float = 5.0,
    step_ms: float = 0.0,
    engine_args: Iterable[str] = (),
    engine: EngineClient | None = None,
) -> FastAPI:
    """The API app; its lifespan starts the engine process and stops it.

    ``engine``, where given, is the client to use instead of a new
    :class:`EngineClient` made from the other settings (``ray_app.py``'s).
    """
    client = engine or EngineClient(
        wait=wait, device=device, rows=rows, slots=slots, step_ms=step_ms, engine_args=engine_args
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with client.running():
            yield

    app = FastAPI(title="asyncfence engine example", lifespan=lifespan)
    app.state.engine = client

    @app.post("/generate")
    async def generate(body: GenerateBody) -> StreamingResponse:
        try:
            request_id, receive = client.submit(body.prompt, body.max_tokens)
        except EngineGone as error:
            raise HTTPException(503, str(error)) from None

        async def events() -> AsyncIterator[str]:
            try:
                async with receive:
                    async for kind, *rest in receive:
                        if kind == "token":
                            yield _event(None, {"index": rest[0], "token": rest[1]})
                        elif kind == "done":
                            yield _event("done", {})
                        else:
                            yield _event("error", {"error": rest[0]})
            finally:
                client.forget(request_id)  # a client gone mid-stream: its row is let go

        return StreamingResponse(events(), media_type="text/event-stream")

    def health_report() -> tuple[int, dict[str, Any]]:
        stats = asyncfence.current_statistics(stuck_after=health_bound_s)
        stuck = stats.stuck_fences or 0
        healthy = client.alive and not stuck
        return (200 if healthy else 503), {
            "status": "ok" if healthy else "unhealthy",
            "engine": "running" if client.alive else (client.failure or "gone"),
            "stuck_fences": stuck,
            "oldest_pending_s": stats.oldest_pending_age,
            "health_bound_s": health_bound_s,
            "wait": client.wait,
            "device": client.info.get("device"),
            "fences_done_when_recorded": client.info.get("done_when_recorded"),
            "steps": client.steps,
            "tokens": client.tokens,
            "open_requests": client.open_requests,
            "engine_active_requests": client.engine_active,
            "slots_held": client.slots_held,
            "threads": threading.active_count(),
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = health_report()
        return JSONResponse(body, status_code=status)

    registry = CollectorRegistry()

    class _Collector:
        def collect(self) -> Iterable[Any]:
            _, body = health_report()
            yield GaugeMetricFamily(
                "engine_stuck_fences",
                f"step fences awaited longer than {health_bound_s} s",
                value=body["stuck_fences"],
            )
            yield GaugeMetricFamily(
                "engine_oldest_fence_seconds",
                "how long the oldest awaited step fence has been pending",
                value=body["oldest_pending_s"] or 0.0,
            )
            yield GaugeMetricFamily("engine_up", "1 while the engine runs", value=client.alive)
            yield CounterMetricFamily("engine_steps", "steps received", value=client.steps)
            yield CounterMetricFamily("engine_tokens", "tokens streamed", value=client.tokens)
            yield GaugeMetricFamily(
                "engine_open_requests", "requests streaming", value=client.open_requests
            )

    registry.register(_Collector())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


class Server(uvicorn.Server):
    """uvicorn's server, saying where it serves once it does."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started or not sockets:
            return
        host, port = sockets[0].getsockname()[:2]
        app = self.config.app
        assert isinstance(app, FastAPI)
        engine: EngineClient = app.state.engine
        print(f"serving on http://{host}:{port} ({engine.wait}, {engine.info['device']})")
        if engine.info.get("done_when_recorded"):
            print("note: on CPU PyTorch every fence is done when recorded: nothing is awaited")
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 for a free one")
    parser.add_argument("--wait", choices=("fence", "synchronize"), default="fence")
    parser.add_argument("--device", choices=("auto", "opencl", "torch", "cuda", "cpu"))
    parser.add_argument("--rows", type=int, default=64, help="the engine's batch rows")
    parser.add_argument("--slots", type=int, default=8, help="the host ring's slots")
    parser.add_argument("--health-bound", type=float, default=5.0, metavar="S")
    parser.add_argument(
        "--step-ms", type=float, default=0.0, help="time each step takes besides the model's"
    )
    args = parser.parse_args()
    app = make_app(
        wait=args.wait,
        device=args.device or "auto",
        rows=args.rows,
        slots=args.slots,
        health_bound_s=args.health_bound,
        step_ms=args.step_ms,
    )
    listening = socket.create_server((args.host, args.port))
    Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listening])


if __name__ == "__main__":
    main()
