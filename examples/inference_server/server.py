"""An async inference service: batched embedding lookups on the device.

``POST /embed`` with ``{"tokens": [3, 14, 15]}`` answers with one embedding row
per token. Requests are gathered into batches; each batch runs on the device
(a gather kernel where the OpenCL device can build one, else one device copy
per row; ``--gather`` chooses), the handler awaits the batch's fence, and the
staging buffers, with the events of the batch's host transfers, go back
through the drop queue once the device is done with them. Nothing on the loop
waits for the device, so it keeps accepting requests meanwhile.

    python examples/inference_server/server.py --port 8000 [--wait to_thread]
        [--gather auto|kernel|copies] [--busy-loop US] [--device-ms MS]

``--wait to_thread`` serves the same work but waits the usual way,
``await asyncio.to_thread(event.wait)``, for comparison (see ``load.py`` and
``README.md`` beside this file). ``--port 0`` picks a free port. Once it
serves, the server prints one line: ``serving on http://HOST:PORT (WAIT,
gather=...)``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import anyio
import numpy as np
import uvicorn
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

import asyncfence
from asyncfence.testing import open_default_device

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from starlette.requests import Request

DIM = 16
VOCAB = 4096
MAX_BATCH = 64  # tokens
MAX_WAIT_S = 0.002
IN_FLIGHT = 4  # batches on the device at once, one staging slot each

GATHER = """
__kernel void gather(__global const float *table, __global const int *ids,
                     __global float *out, const int dim) {
    int row = get_global_id(0), col = get_global_id(1);
    out[row * dim + col] = table[ids[row] * dim + col];
}
"""


class EmbedBody(BaseModel):
    """``POST /embed``'s body: 1 to ``MAX_BATCH`` token ids in ``[0, VOCAB)``, ints (no bools)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    tokens: list[Annotated[int, Field(ge=0, lt=VOCAB)]] = Field(min_length=1, max_length=MAX_BATCH)


def embedding(token: int) -> list[float]:
    """What the service answers for ``token``: exact in float32."""
    return [token + column / DIM for column in range(DIM)]


@dataclass
class Slot:
    """The buffers of one batch in flight: reused only once the device is done.

    ``transfers`` holds pyopencl's events for the batch's copies between host
    and device. Such an event, garbage-collected, waits for its transfer with
    the GIL held (it keeps the host array alive): dropped at once, it would
    make the copy synchronous, and on a held queue never return. The pool
    keeps the slot, and so its events, until the batch's fence has completed.
    """

    ids_host: np.ndarray
    out_host: np.ndarray
    ids_device: Any = None
    out_device: Any = None
    transfers: tuple[Any, ...] = ()


class OpenCLModel:
    """The lookup table on an OpenCL device, and the gather that reads it.

    Args:
        device: The OpenCL device (``open_default_device("opencl")``).
        gather: ``"kernel"``, ``"copies"``, or ``"auto"``: a kernel where the
            device can build one.
        device_s: Extra device work queued before each batch's gather, in
            seconds (calibrated once, here, before serving).
    """

    def __init__(self, device: Any, gather: str = "auto", device_s: float = 0.0) -> None:
        import pyopencl as cl

        self.cl = cl
        self.device = device
        self.context = device.context
        table = np.array([embedding(token) for token in range(VOCAB)], dtype=np.float32)
        flags = cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR
        self.table = cl.Buffer(self.context, flags, hostbuf=table)
        self.streams = [device.new_stream() for _ in range(IN_FLIGHT)]
        # Device-side copies of 1 MiB: blocks only here, while calibrating.
        self.busy_chunks = device.chunks_for(device_s) if device_s > 0 else 0
        self.kernel: Any = None
        if gather == "copies":
            return
        try:
            self.kernel = cl.Program(self.context, GATHER).build().gather
        except cl.Error as error:
            # PoCL 3.0's LLVM 14 cannot build for CPUs it does not know: copies instead.
            if gather == "kernel":
                message = f"--gather kernel: the device cannot build it: {error}"
                raise RuntimeError(message) from None

    def new_slot(self) -> Slot:
        """Allocate the host and device buffers of one batch."""
        cl = self.cl
        size = MAX_BATCH * DIM * 4
        return Slot(
            ids_host=np.zeros(MAX_BATCH, dtype=np.int32),
            out_host=np.zeros((MAX_BATCH, DIM), dtype=np.float32),
            ids_device=cl.Buffer(self.context, cl.mem_flags.READ_ONLY, size=MAX_BATCH * 4),
            out_device=cl.Buffer(self.context, cl.mem_flags.READ_WRITE, size=size),
        )

    def run(self, stream: Any, slot: Slot, count: int) -> None:
        """Queue the batch: upload ids, gather rows, download them. Never blocks.

        The events of the host transfers go into ``slot.transfers``: keep the
        slot until a fence recorded after this call has completed.
        """
        cl = self.cl
        transfers = []
        if self.busy_chunks:
            self.device.launch_chunks(stream, self.busy_chunks)
        if self.kernel is not None:
            transfers.append(
                cl.enqueue_copy(stream, slot.ids_device, slot.ids_host, is_blocking=False)
            )
            # Always the whole slot: PoCL compiles a kernel for each launch size
            # it meets (on its device thread, then caches it on disk); rows past
            # ``count`` gather valid ids (earlier batches' or zeros), never read.
            self.kernel(
                stream,
                (MAX_BATCH, DIM),
                None,
                self.table,
                slot.ids_device,
                slot.out_device,
                np.int32(DIM),
            )
        else:
            row = DIM * 4
            for index, token in enumerate(slot.ids_host[:count].tolist()):
                # Device to device: its event does not wait when dropped.
                cl.enqueue_copy(
                    stream,
                    slot.out_device,
                    self.table,
                    byte_count=row,
                    src_offset=token * row,
                    dst_offset=index * row,
                )
        transfers.append(cl.enqueue_copy(stream, slot.out_host, slot.out_device, is_blocking=False))
        slot.transfers = tuple(transfers)
        stream.flush()

    def warm_up(self) -> None:
        """Run one batch to the end; blocks. Before serving: PoCL compiles on first launch."""
        stream = self.streams[0]
        self.run(stream, self.new_slot(), 1)
        asyncfence.record(stream).wait_sync()

    def raw_wait(self, stream: Any) -> None:
        """The usual blocking wait, for the to_thread comparison."""
        self.cl.enqueue_marker(stream).wait()


@dataclass
class Request_:
    tokens: list[int]
    answer: asyncio.Future[list[list[float]]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Batcher:
    """Gathers requests into batches and runs each on the device."""

    def __init__(self, model: OpenCLModel, wait: str) -> None:
        self.model = model
        self.wait = wait
        self.requests: asyncio.Queue[Request_] = asyncio.Queue()
        self.slots = asyncfence.StagingPool(model.new_slot, IN_FLIGHT)
        self.next_stream = 0
        self.batches = 0

    async def serve(self) -> None:
        """Take requests, batch them, and run each batch; until cancelled."""
        async with anyio.create_task_group() as tasks:
            while True:
                batch = [await self.requests.get()]
                tokens = len(batch[0].tokens)
                deadline = asyncio.get_running_loop().time() + MAX_WAIT_S
                while tokens < MAX_BATCH:
                    timeout = deadline - asyncio.get_running_loop().time()
                    try:
                        request = await asyncio.wait_for(self.requests.get(), max(timeout, 0))
                    except (asyncio.TimeoutError, TimeoutError):
                        break
                    if tokens + len(request.tokens) > MAX_BATCH:
                        self.requests.put_nowait(request)  # next batch
                        break
                    batch.append(request)
                    tokens += len(request.tokens)
                slot = await self.slots.acquire()  # backpressure: IN_FLIGHT batches at most
                tasks.start_soon(self.run, batch, slot)

    async def run(self, batch: list[Request_], slot: Slot) -> None:
        """Run one batch on the device and answer its requests."""
        tokens = [token for request in batch for token in request.tokens]
        slot.ids_host[: len(tokens)] = tokens
        stream = self.model.streams[self.next_stream % IN_FLIGHT]
        self.next_stream += 1
        fence: asyncfence.Fence | None = None
        try:
            self.model.run(stream, slot, len(tokens))
            fence = asyncfence.record(stream)
            if self.wait == "to_thread":
                await asyncio.to_thread(self.model.raw_wait, stream)
            else:
                await fence
            rows = slot.out_host[: len(tokens)].tolist()
        except Exception as error:  # a device error fails this batch's requests only
            for request in batch:
                request.answer.set_exception(error)
            return
        finally:
            # The slot, and with it its transfers' events, is reused only once
            # the device is done with this batch (and its rows are read).
            self.slots.release_after(
                fence if fence is not None else asyncfence.record(stream), slot
            )
        self.batches += 1
        start = 0
        for request in batch:
            request.answer.set_result(rows[start : start + len(request.tokens)])
            start += len(request.tokens)


async def keep_loop_busy(work_s: float) -> None:
    """Other work on the loop: ``work_s`` of Python at a time, then a yield; forever."""
    while True:
        end = time.perf_counter() + work_s
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(0)


def make_app(
    wait: str, gather: str = "auto", *, busy_loop_s: float = 0.0, device_s: float = 0.0
) -> Starlette:
    """The service: ``POST /embed`` and ``GET /health``.

    Args:
        wait: ``"asyncfence"`` (await the batch's fence) or ``"to_thread"``.
        gather: ``"auto"``, ``"kernel"`` or ``"copies"`` (see ``OpenCLModel``).
        busy_loop_s: Keep the loop busy with a background task running this
            much Python between yields; 0 for none.
        device_s: Extra device work per batch, in seconds.
    """
    state: dict[str, Any] = {}

    async def embed(request: Request) -> JSONResponse:
        expected = (
            f'a JSON object {{"tokens": [...]}}: a list of 1 to {MAX_BATCH} ints in [0, {VOCAB})'
        )
        try:  # malformed JSON, or not UTF-8, too: the client's error, a 422
            tokens = EmbedBody.model_validate_json(await request.body()).tokens
        except ValidationError as error:
            detail = error.errors(include_url=False, include_context=False, include_input=False)
            return JSONResponse({"error": f"tokens: expected {expected}", "detail": detail}, 422)
        pending = Request_(tokens)
        state["batcher"].requests.put_nowait(pending)
        return JSONResponse({"embeddings": await pending.answer})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({**app.state.settings, "batches": state["batcher"].batches})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        device = open_default_device("opencl")
        model = OpenCLModel(device, gather, device_s)
        model.warm_up()  # not serving yet: nothing else on the loop to block
        state["batcher"] = batcher = Batcher(model, wait)
        loop = asyncio.get_running_loop()
        app.state.settings = {
            "device": device.name,
            "wait": wait,
            "gather": "kernel" if model.kernel is not None else "copies",
            "loop": f"{type(loop).__module__}.{type(loop).__qualname__}",
            "busy_loop_us": busy_loop_s * 1e6,
            "device_ms": device_s * 1e3,
        }
        background = [asyncio.ensure_future(batcher.serve())]
        if busy_loop_s > 0:
            background.append(asyncio.ensure_future(keep_loop_busy(busy_loop_s)))
        yield
        for task in background:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await batcher.slots.aclose()

    routes = [Route("/embed", embed, methods=["POST"]), Route("/health", health)]
    app = Starlette(routes=routes, lifespan=lifespan)
    return app


class Server(uvicorn.Server):
    """uvicorn's server, saying where it serves once it does."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start serving, then print ``serving on http://HOST:PORT (WAIT, gather=...)``."""
        await super().startup(sockets)
        if not self.started or not sockets:
            return
        host, port = sockets[0].getsockname()[:2]
        app = self.config.app
        assert isinstance(app, Starlette)
        settings = app.state.settings
        extra = ""
        if settings["busy_loop_us"]:
            extra += f", busy loop {settings['busy_loop_us']:g} µs"
        if settings["device_ms"]:
            extra += f", device {settings['device_ms']:g} ms a batch"
        print(
            f"serving on http://{host}:{port} ({settings['wait']}, "
            f"gather={settings['gather']}{extra})",
            flush=True,
        )


def main() -> None:
    """Parse the command line and serve."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 for a free one")
    parser.add_argument("--wait", choices=("asyncfence", "to_thread"), default="asyncfence")
    parser.add_argument("--strategy", choices=("auto", "poll", "park"), default="auto")
    parser.add_argument(
        "--gather",
        choices=("auto", "kernel", "copies"),
        default="auto",
        help="the batch as one gather kernel, as one device copy per row, or "
        "a kernel where the device can build one (default)",
    )
    parser.add_argument(
        "--busy-loop",
        type=float,
        default=0.0,
        metavar="US",
        help="keep the loop busy: a background task runs US microseconds of Python, "
        "then yields (await asyncio.sleep(0)), forever; 0 (the default) for none",
    )
    parser.add_argument(
        "--device-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="extra device work queued with each batch, in milliseconds (default 0)",
    )
    args = parser.parse_args()
    asyncfence.configure(strategy=args.strategy)
    app = make_app(
        args.wait, args.gather, busy_loop_s=args.busy_loop * 1e-6, device_s=args.device_ms * 1e-3
    )
    listening = socket.create_server((args.host, args.port))
    Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listening])


if __name__ == "__main__":
    main()
