"""asyncfence under Ray Serve: replicas that await their device work.

``POST /`` with ``{"numbers": [3, 1, 4]}`` answers
``{"numbers": [3, 1, 4], "sum": 8, "pid": ..., "device": ...}``. Each request
uploads its numbers into device memory with a non-blocking copy, copies them
on the device into a second buffer, downloads that one into a staging buffer
with a non-blocking copy, and awaits the fence of that work with asyncfence:
the replica's event loop serves other requests meanwhile. The answer is what
came back from the device. The staging buffers go back to the replica's
``StagingPool`` once the device has passed the fence of the work that used
them.

Serve routes the requests over two replicas. Each replica is a separate
process with its own event loop, so each has its own asyncfence poller, device
context, streams and staging pool: nothing is shared between processes, and
no fence or buffer crosses a process boundary.

The device is CUDA where a GPU is present, else OpenCL (PoCL on the CPU).
Start a local Ray, deploy, and serve until Ctrl-C with::

    python examples/ray_serve/app.py [--port 8000] [--backend auto|opencl|cuda]

or deploy onto a running cluster with ``serve run app:app`` from this folder.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from starlette.responses import JSONResponse

import asyncfence
from asyncfence.testing import open_default_device

if TYPE_CHECKING:
    from starlette.requests import Request

MAX_NUMBERS = 1024  # per request
LIMIT = 2**31  # each number in [-LIMIT, LIMIT): their sum is exact in int64
SLOTS = 4  # requests on the device at once, per replica


@dataclass
class Slot:
    """What one request on the device uses: reused only once the device is done.

    On OpenCL, ``transfers`` keeps the events of the last work queued: pyopencl
    waits for a non-blocking copy's transfer, with the GIL held, when its event
    is garbage-collected, so they live as long as the slot, which is reused
    only once its fence completed. On CUDA, ``memory`` keeps the pinned
    buffers that ``upload_from`` and ``download_to`` view.
    """

    stream: Any
    upload_from: np.ndarray  # host staging: the upload reads it
    download_to: np.ndarray  # host staging: the download writes it
    device_in: Any
    device_out: Any
    transfers: list[Any] = field(default_factory=list)
    memory: tuple[Any, ...] = ()


class OpenCLWork:
    """Slots and transfers on an OpenCL device: PoCL's CPU device where there is no GPU."""

    def __init__(self, device: Any) -> None:
        import pyopencl as cl

        self.cl = cl
        self.device = device

    def new_slot(self) -> Slot:
        """Make a slot: a stream, two host staging arrays and two device buffers."""
        cl = self.cl
        context, flags, nbytes = self.device.context, cl.mem_flags.READ_WRITE, MAX_NUMBERS * 8
        return Slot(
            stream=self.device.new_stream(),
            upload_from=np.zeros(MAX_NUMBERS, dtype=np.int64),
            download_to=np.zeros(MAX_NUMBERS, dtype=np.int64),
            device_in=cl.Buffer(context, flags, size=nbytes),
            device_out=cl.Buffer(context, flags, size=nbytes),
        )

    def queue(self, slot: Slot, count: int) -> None:
        """Upload, copy on the device, download: all queued, none waited for."""
        cl, stream, keep = self.cl, slot.stream, slot.transfers.append
        slot.transfers.clear()  # the last request's: complete, since the slot came back
        keep(cl.enqueue_copy(stream, slot.device_in, slot.upload_from[:count], is_blocking=False))
        keep(cl.enqueue_copy(stream, slot.device_out, slot.device_in, byte_count=count * 8))
        keep(cl.enqueue_copy(stream, slot.download_to[:count], slot.device_out, is_blocking=False))
        stream.flush()


class CudaWork:
    """Slots and transfers on a CUDA device, through pinned staging memory."""

    def __init__(self, device: Any) -> None:
        from cuda.bindings import driver

        self.driver = driver
        self.device = device

    def new_slot(self) -> Slot:
        """Make a slot: a stream, two pinned host buffers and two device buffers."""
        self.device.make_current()
        nbytes = MAX_NUMBERS * 8
        pinned_in, pinned_out = asyncfence.PinnedBuffer(nbytes), asyncfence.PinnedBuffer(nbytes)
        return Slot(
            stream=self.device.new_stream(),
            upload_from=np.frombuffer(pinned_in.view(), dtype=np.int64),
            download_to=np.frombuffer(pinned_out.view(), dtype=np.int64),
            device_in=asyncfence.DeviceBuffer(nbytes),
            device_out=asyncfence.DeviceBuffer(nbytes),
            memory=(pinned_in, pinned_out),
        )

    def queue(self, slot: Slot, count: int) -> None:
        """Upload, copy on the device, download: all queued, none waited for."""
        drv, stream, nbytes = self.driver, slot.stream, count * 8
        self.device.make_current()  # on this thread: the replica's event loop
        pinned_in, pinned_out = slot.memory
        for name, (status,) in (
            (
                "cuMemcpyHtoDAsync",
                drv.cuMemcpyHtoDAsync(slot.device_in.address, pinned_in.address, nbytes, stream),
            ),
            (
                "cuMemcpyDtoDAsync",
                drv.cuMemcpyDtoDAsync(
                    slot.device_out.address, slot.device_in.address, nbytes, stream
                ),
            ),
            (
                "cuMemcpyDtoHAsync",
                drv.cuMemcpyDtoHAsync(pinned_out.address, slot.device_out.address, nbytes, stream),
            ),
        ):
            if status != drv.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"{name} failed: {status}")


class Body(BaseModel):
    """A request's body: ``{"numbers": [1 to MAX_NUMBERS ints in [-LIMIT, LIMIT)]}``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    numbers: list[Annotated[int, Field(ge=-LIMIT, lt=LIMIT)]] = Field(
        min_length=1, max_length=MAX_NUMBERS
    )


class DeviceSum:
    """One replica: a process of its own, with its own device, streams and staging.

    Args:
        backend: ``"cuda"``, ``"opencl"``, or None for the default device
            (CUDA where a GPU is present, else OpenCL).
    """

    def __init__(self, backend: str | None = None) -> None:
        self.device = open_default_device(backend)
        self.work = (
            CudaWork(self.device) if self.device.backend == "cuda" else OpenCLWork(self.device)
        )
        self.slots: asyncfence.StagingPool[Slot] | None = None

    def staging(self) -> asyncfence.StagingPool[Slot]:
        """The replica's staging pool, made on the event loop that serves its requests.

        Made on the first request rather than in ``__init__``: a pool's
        returns are driven by the asyncfence poller of one event loop, and
        the loop that runs the handler is the one that awaits the fences,
        whichever thread Serve runs ``__init__`` on.
        """
        if self.slots is None:
            self.slots = asyncfence.StagingPool(self.work.new_slot, SLOTS)
        return self.slots

    async def __call__(self, request: Request) -> JSONResponse:
        """Send the numbers through the device and answer with what came back."""
        try:  # malformed JSON too: a 422, as FastAPI answers, never a 500
            numbers = Body.model_validate_json(await request.body()).numbers
        except ValidationError as error:
            message = f"numbers: a list of 1 to {MAX_NUMBERS} ints in [{-LIMIT}, {LIMIT})"
            detail = error.errors(include_url=False, include_context=False, include_input=False)
            return JSONResponse({"error": message, "detail": detail}, status_code=422)
        pool = self.staging()
        slot = await pool.acquire()  # backpressure: SLOTS requests on the device at most
        try:
            count = len(numbers)
            slot.upload_from[:count] = numbers
            self.work.queue(slot, count)
            await asyncfence.record(slot.stream)  # the loop serves other requests meanwhile
            downloaded = slot.download_to[:count].tolist()
        finally:
            # Back to the pool once the device has passed all the slot's work,
            # also when the work failed or the request was cancelled meanwhile.
            pool.release_after(asyncfence.record(slot.stream), slot)
        return JSONResponse(
            {
                "numbers": downloaded,
                "sum": sum(downloaded),
                "pid": os.getpid(),
                "device": self.device.name,
            }
        )


# The deployment: as ``@serve.deployment(num_replicas=2)`` would make it, but
# called, so that type checkers keep seeing ``DeviceSum`` as the class it is.
deployment = serve.deployment(num_replicas=2)(DeviceSum)
app = deployment.bind()  # for ``serve run app:app``


def _free_port() -> int:
    """A loopback port free now, for ``--port 0``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def main() -> None:
    """Start a local Ray, deploy two replicas, serve until Ctrl-C or SIGTERM, shut down."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--backend", choices=("auto", "opencl", "cuda"), default="auto")
    parser.add_argument("--num-cpus", type=int, default=2, help="for the local Ray (default 2)")
    args = parser.parse_args()

    import ray

    # A new local Ray, whatever RAY_ADDRESS says; Serve's HTTP port on the loopback only.
    ray.init(
        address="local",
        num_cpus=args.num_cpus,
        include_dashboard=False,
        object_store_memory=100 << 20,
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        port = args.port or _free_port()  # Serve's proxy says not which port 0 became
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        backend = None if args.backend == "auto" else args.backend
        serve.run(deployment.options(num_replicas=args.replicas).bind(backend), route_prefix="/")
        print(f"serving on http://127.0.0.1:{port}/ with {args.replicas} replicas", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    print("shut down", flush=True)


if __name__ == "__main__":
    main()
