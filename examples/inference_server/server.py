"""An async inference service: batched embedding lookups on the device.

``POST /embed`` with ``{"tokens": [3, 14, 15]}`` answers with one embedding row
per token. Requests are gathered into batches; each batch runs on the device
(a gather kernel where the OpenCL device can build one, else one device copy
per row; ``--gather`` chooses), the handler awaits the batch's fence, and the
staging buffers go back through the drop queue once the device is done with
them. The loop never blocks on the device, so it keeps accepting requests
meanwhile.

    python examples/inference_server/server.py --port 8000 [--wait to_thread]
        [--gather auto|kernel|copies]

``--wait to_thread`` serves the same work but waits the usual way,
``await asyncio.to_thread(event.wait)``, for comparison (see ``load.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import uvicorn
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


def embedding(token: int) -> list[float]:
    """What the service answers for ``token``: exact in float32."""
    return [token + column / DIM for column in range(DIM)]


@dataclass
class Slot:
    """The buffers of one batch in flight: reused only once the device is done."""

    ids_host: np.ndarray
    out_host: np.ndarray
    ids_device: Any = None
    out_device: Any = None


class OpenCLModel:
    """The lookup table on an OpenCL device, and the gather that reads it."""

    def __init__(self, device: Any, gather: str = "auto") -> None:
        import pyopencl as cl

        self.cl = cl
        self.context = device.context
        table = np.array([embedding(token) for token in range(VOCAB)], dtype=np.float32)
        flags = cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR
        self.table = cl.Buffer(self.context, flags, hostbuf=table)
        self.streams = [device.new_stream() for _ in range(IN_FLIGHT)]
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
        cl = self.cl
        size = MAX_BATCH * DIM * 4
        return Slot(
            ids_host=np.zeros(MAX_BATCH, dtype=np.int32),
            out_host=np.zeros((MAX_BATCH, DIM), dtype=np.float32),
            ids_device=cl.Buffer(self.context, cl.mem_flags.READ_ONLY, size=MAX_BATCH * 4),
            out_device=cl.Buffer(self.context, cl.mem_flags.READ_WRITE, size=size),
        )

    def run(self, stream: Any, slot: Slot, count: int) -> None:
        """Queue the batch: upload ids, gather rows, download them. Never blocks."""
        cl = self.cl
        if self.kernel is not None:
            cl.enqueue_copy(stream, slot.ids_device, slot.ids_host, is_blocking=False)
            self.kernel(
                stream,
                (count, DIM),
                None,
                self.table,
                slot.ids_device,
                slot.out_device,
                np.int32(DIM),
            )
        else:
            row = DIM * 4
            for index, token in enumerate(slot.ids_host[:count].tolist()):
                cl.enqueue_copy(
                    stream,
                    slot.out_device,
                    self.table,
                    byte_count=row,
                    src_offset=token * row,
                    dst_offset=index * row,
                )
        cl.enqueue_copy(stream, slot.out_host, slot.out_device, is_blocking=False)
        stream.flush()

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
        tokens = [token for request in batch for token in request.tokens]
        slot.ids_host[: len(tokens)] = tokens
        stream = self.model.streams[self.next_stream % IN_FLIGHT]
        self.next_stream += 1
        self.model.run(stream, slot, len(tokens))
        fence = asyncfence.record(stream)
        try:
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
            self.slots.release_after(fence, slot)  # reused once the device is done
        self.batches += 1
        start = 0
        for request in batch:
            request.answer.set_result(rows[start : start + len(request.tokens)])
            start += len(request.tokens)


def make_app(wait: str, gather: str = "auto") -> Starlette:
    state: dict[str, Any] = {}

    async def embed(request: Request) -> JSONResponse:
        body = await request.json()
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if (
            not isinstance(tokens, list)
            or not 1 <= len(tokens) <= MAX_BATCH
            or not all(isinstance(t, int) and 0 <= t < VOCAB for t in tokens)
        ):
            message = f"tokens: a list of 1 to {MAX_BATCH} ints in [0, {VOCAB})"
            return JSONResponse({"error": message}, status_code=422)
        pending = Request_(tokens)
        state["batcher"].requests.put_nowait(pending)
        return JSONResponse({"embeddings": await pending.answer})

    async def health(request: Request) -> JSONResponse:
        batcher: Batcher = state["batcher"]
        return JSONResponse(
            {
                "device": state["device"].name,
                "wait": wait,
                "gather": "kernel" if batcher.model.kernel is not None else "copies",
                "batches": batcher.batches,
            }
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        device = open_default_device("opencl")
        state["device"] = device
        state["batcher"] = batcher = Batcher(OpenCLModel(device, gather), wait)
        serving = asyncio.ensure_future(batcher.serve())
        yield
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        await batcher.slots.aclose()

    routes = [Route("/embed", embed, methods=["POST"]), Route("/health", health)]
    return Starlette(routes=routes, lifespan=lifespan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--wait", choices=("asyncfence", "to_thread"), default="asyncfence")
    parser.add_argument("--strategy", choices=("auto", "poll", "park"), default="auto")
    parser.add_argument(
        "--gather",
        choices=("auto", "kernel", "copies"),
        default="auto",
        help="the batch as one gather kernel, as one device copy per row, or "
        "a kernel where the device can build one (default)",
    )
    args = parser.parse_args()
    asyncfence.configure(strategy=args.strategy)
    app = make_app(args.wait, args.gather)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
