"""A PyTorch inference server: FastAPI on uvicorn, batches awaited on device streams.

``POST /predict`` with ``{"features": [64 numbers]}`` answers with the logits
of a small MLP and the label they pick. Requests are gathered into batches;
each batch is copied into a staging slot, uploaded and run on one of a few
device streams, and copied back, all queued without waiting; the handler then
awaits the batch's fence, ``await asyncfence.record(stream)``, and reads the
result. The event loop keeps serving meanwhile.

What the device still uses until the fence completes stays alive without
``tensor.record_stream()``: the staging slot (pinned host memory on CUDA)
goes back to its ``asyncfence.StagingPool`` only after the fence, and the
batch's device tensors are held by an ``asyncfence.DropQueue`` until it, so
a request cancelled mid-batch (a client gone) frees nothing the device reads.

``GET /health`` answers 503 once a fence on the loop has been pending longer
than ``--health-bound`` seconds (a hung kernel, a lost completion signal),
from :func:`asyncfence.current_statistics`; ``GET /metrics`` gives those
figures, the poller's wake counters and the batches' wait times as Prometheus
metrics (``prometheus_client``).

It runs on the first CUDA GPU where PyTorch sees one, else on CPU-only
PyTorch: there ``torch.cpu.Stream`` stands in for the streams, the model runs
when it is called (on the loop thread: a small model, on purpose), every
fence is done when recorded, and there is no pinned memory. The same code is
thus tested in CI on the CPU and on a GPU by the GPU check.

    python examples/torch_server/server.py --port 8000 [--wait synchronize]
        [--device auto|cpu|cuda] [--busy-loop US] [--health-bound S]

``--wait synchronize`` serves the same work but waits the usual way,
``await anyio.to_thread.run_sync(torch.cuda.synchronize)``
(``torch.cpu.synchronize`` on the CPU), for comparison (``load.py`` and
``README.md`` beside this file). ``--port 0`` picks a free port. Once it
serves, it prints one line: ``serving on http://HOST:PORT (WAIT, DEVICE)``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import anyio
import anyio.lowlevel
import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, Field

import asyncfence

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

    from anyio.abc import TaskStatus
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
    from prometheus_client import Metric

FEATURES = 64
HIDDEN = 256
CLASSES = 16
MAX_BATCH = 64  # requests (rows) a batch
IN_FLIGHT = 4  # batches queued at once, one stream and one staging slot each
WAITS = ("asyncfence", "synchronize")


def build_model(seed: int = 0) -> torch.nn.Module:
    """The model: a small MLP with fixed weights (``seed``), on the CPU, in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model.eval()


def pick_device(choice: str = "auto") -> torch.device:
    """``"auto"``: the first CUDA GPU where PyTorch sees one, else the CPU."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


class Features(BaseModel):
    """A request: one row of ``FEATURES`` finite numbers."""

    features: list[Annotated[float, Field(strict=True, allow_inf_nan=False)]] = Field(
        min_length=FEATURES, max_length=FEATURES
    )


class Prediction(BaseModel):
    """An answer: the model's logits for the row, and the label they pick."""

    logits: list[float]
    label: int


@dataclass
class Slot:
    """One batch's host staging: inputs in, logits out (pinned on CUDA).

    Handed out again by the :class:`asyncfence.StagingPool` only once the
    fence of the batch that used it has completed.
    """

    inputs: torch.Tensor
    outputs: torch.Tensor


class Model:
    """The model on its device, its streams, and how each batch is queued.

    Args:
        device: Where it runs (``pick_device()``).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = torch.get_device_module(device)  # torch.cuda or torch.cpu
        self.pinned = device.type == "cuda"  # no pinned memory without an accelerator
        self.net = build_model().to(device)
        self.lanes = [self.streams.Stream() for _ in range(IN_FLIGHT)]
        self._next_lane = 0

    @property
    def name(self) -> str:
        """The device, as a person reads it."""
        if self.device.type == "cuda":
            return f"{torch.cuda.get_device_name(self.device)} (CUDA)"
        return "cpu (CPU-only PyTorch: fences done when recorded)"

    def new_slot(self) -> Slot:
        """Allocate one batch's host staging."""
        return Slot(
            inputs=torch.empty(MAX_BATCH, FEATURES, pin_memory=self.pinned),
            outputs=torch.empty(MAX_BATCH, CLASSES, pin_memory=self.pinned),
        )

    def next_stream(self) -> Any:
        """The streams in turn: a ``torch.cuda.Stream``, or a ``torch.cpu.Stream``."""
        stream = self.lanes[self._next_lane % IN_FLIGHT]
        self._next_lane += 1
        return stream

    def queue(self, stream: Any, slot: Slot, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue the batch in ``slot.inputs[:rows]`` on ``stream``; never waits on CUDA.

        Returns:
            The batch's device tensors (its inputs and logits), which the
            device reads and writes until a fence recorded after this call.
        """
        with self.streams.stream(stream), torch.inference_mode():
            inputs = slot.inputs[:rows].to(self.device, non_blocking=True)
            logits = self.net(inputs)
            slot.outputs[:rows].copy_(logits, non_blocking=True)  # pinned: asynchronous
        return inputs, logits

    def synchronize(self) -> None:
        """The usual blocking wait, for the comparison: every stream of the device."""
        self.streams.synchronize(self.device)


@dataclass(eq=False)
class Pending:
    """A request waiting for its batch."""

    features: list[float]
    done: anyio.Event = field(default_factory=anyio.Event)
    logits: list[float] | None = None
    error: BaseException | None = None

    def answer(self, logits: list[float] | None, error: BaseException | None = None) -> None:
        """Answer the request (once)."""
        if not self.done.is_set():
            self.logits, self.error = logits, error
            self.done.set()


class Batcher:
    """Gathers requests into batches and runs each on the device.

    A batch takes every request waiting when a staging slot is free, up to
    ``MAX_BATCH``: under load, requests gather while the slots are busy;
    alone, a request is a batch of one, served at once.
    """

    def __init__(self, model: Model, wait: str, metrics: Metrics) -> None:
        self.model = model
        self.wait = wait
        self.metrics = metrics
        self.slots = asyncfence.StagingPool(model.new_slot, IN_FLIGHT)
        self.drops = asyncfence.DropQueue()
        send: MemoryObjectSendStream[Pending]
        receive: MemoryObjectReceiveStream[Pending]
        send, receive = anyio.create_memory_object_stream[Pending](math.inf)
        self._send, self._receive = send, receive
        self.batches = 0

    def submit(self, pending: Pending) -> None:
        """Queue a request for the next batch. Never blocks."""
        self._send.send_nowait(pending)

    async def serve(self, *, task_status: TaskStatus[None]) -> None:
        """Take requests, batch them, and run each batch; until cancelled."""
        async with anyio.create_task_group() as tasks:
            task_status.started()
            async for first in self._receive:
                try:
                    slot = await self.slots.acquire()  # IN_FLIGHT batches at most
                except BaseException as error:
                    first.answer(None, error)
                    raise
                batch = [first]
                while len(batch) < MAX_BATCH:
                    try:
                        batch.append(self._receive.receive_nowait())
                    except anyio.WouldBlock:
                        break
                tasks.start_soon(self.run, batch, slot)

    async def run(self, batch: list[Pending], slot: Slot) -> None:
        """Run one batch on the device and answer its requests.

        Cancellation: a batch cancelled (the server shutting down) answers its
        requests with the cancellation's error and propagates it; the slot and
        the device tensors still wait for the batch's fence.
        """
        rows = len(batch)
        stream = self.model.next_stream()
        fence: asyncfence.Fence | None = None
        try:
            slot.inputs[:rows].copy_(torch.tensor([request.features for request in batch]))
            tensors = self.model.queue(stream, slot, rows)
            fence = asyncfence.record(stream)
            # The device reads and writes these until the fence, whatever
            # becomes of this task: kept, then dropped, by the drop queue.
            self.drops.defer(fence, tensors)
            started = time.perf_counter()
            if self.wait == "asyncfence":
                await fence  # the loop serves other requests meanwhile
            else:
                await anyio.to_thread.run_sync(self.model.synchronize)
            self.metrics.batch_wait.observe(time.perf_counter() - started)
            logits = slot.outputs[:rows].tolist()  # the fence completed: no wait
        except BaseException as error:
            for request in batch:
                request.answer(None, error)
            if not isinstance(error, Exception):
                raise
            return
        finally:
            # Reused only once the device is done with this batch (and its rows read).
            self.slots.release_after(
                fence if fence is not None else asyncfence.record(stream), slot
            )
        self.batches += 1
        self.metrics.batches.inc()
        self.metrics.rows.inc(rows)
        for request, row in zip(batch, logits, strict=True):
            request.answer(row)

    async def aclose(self) -> None:
        """Once serving stopped: wait for the fences, then let go of every buffer."""
        await self.drops.aclose()
        await self.slots.aclose()


class FenceCollector(Collector):
    """The running loop's fence statistics, as Prometheus metrics.

    Collected on the event loop, where :func:`asyncfence.current_statistics`
    reads that loop's waits: ``/metrics`` is an ``async def`` endpoint.

    Args:
        stuck_after: The bound, in seconds, for ``asyncfence_stuck_fences``.
    """

    def __init__(self, stuck_after: float) -> None:
        self.stuck_after = stuck_after

    def describe(self) -> Iterator[Metric]:
        """The metrics' names and kinds, without reading the loop (at registration)."""
        return self._families(asyncfence.PollerStatistics(stuck_fences=0))

    def collect(self) -> Iterator[Metric]:
        """The running loop's figures now."""
        return self._families(asyncfence.current_statistics(stuck_after=self.stuck_after))

    def _families(self, stats: asyncfence.PollerStatistics) -> Iterator[Metric]:
        def gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"asyncfence_{name}", text, value=value)

        def counter(name: str, text: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"asyncfence_{name}", text, value=value)

        yield gauge("pending_fences", "Fences a wait on the loop waits for", stats.pending_fences)
        yield gauge("waiters", "Waits on those fences", stats.waiters)
        yield gauge("parked_fences", "Fences parked, woken by their signal", stats.parked)
        yield gauge(
            "oldest_pending_fence_age_seconds",
            "Seconds since the oldest pending fence was first awaited; 0 with none",
            stats.oldest_pending_age or 0.0,
        )
        yield gauge(
            "oldest_parked_fence_age_seconds",
            "Seconds since the oldest parked fence was first awaited; 0 with none",
            stats.oldest_parked_age or 0.0,
        )
        yield gauge(
            "stuck_fences",
            f"Fences pending for more than {self.stuck_after:g} s (the health bound)",
            stats.stuck_fences or 0,
        )
        yield counter("poller_ticks", "Checks of the polled fences", stats.ticks)
        yield counter("device_queries", "Device queries made by the poller", stats.queries)
        yield counter("signals", "Completion signals received by parked waits", stats.signals)
        yield counter("rechecks", "Periodic re-checks of the parked fences", stats.rechecks)


class Metrics:
    """The server's Prometheus registry: the loop's fences, and its batches.

    Args:
        stuck_after: The health bound, in seconds.
    """

    def __init__(self, stuck_after: float) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(FenceCollector(stuck_after))
        self.batch_wait = Histogram(
            "torch_server_batch_wait_seconds",
            "From a batch's record to the end of its wait: device time plus wake",
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
            registry=self.registry,
        )
        self.batches = Counter("torch_server_batches", "Batches answered", registry=self.registry)
        self.rows = Counter("torch_server_rows", "Requests answered", registry=self.registry)


async def keep_loop_busy(work_s: float) -> None:
    """Other work on the loop: ``work_s`` of Python at a time, then a yield; forever."""
    while True:
        end = time.perf_counter() + work_s
        while time.perf_counter() < end:
            pass
        await anyio.lowlevel.checkpoint()


def make_app(
    wait: str = "asyncfence",
    *,
    device: str = "auto",
    health_bound_s: float = 30.0,
    busy_loop_s: float = 0.0,
) -> FastAPI:
    """The service: ``POST /predict``, ``GET /health`` and ``GET /metrics``.

    Args:
        wait: ``"asyncfence"`` (await the batch's fence) or ``"synchronize"``
            (``synchronize()`` in a worker thread).
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        health_bound_s: ``/health`` answers 503 while a fence on the loop has
            been pending longer than this.
        busy_loop_s: Keep the loop busy with a background task running this
            much Python between yields; 0 for none.

    Raises:
        ValueError: ``wait`` is not one of ``WAITS``.
    """
    if wait not in WAITS:
        raise ValueError(f"wait must be one of {WAITS}; got {wait!r}")
    metrics = Metrics(health_bound_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Not serving yet: the first CUDA call (seconds) and the warm-up are
        # paid here, before the first request, and off the loop: torch's and
        # asyncfence's first calls load drivers, which would block it.
        model = await anyio.to_thread.run_sync(Model, pick_device(device))
        await anyio.to_thread.run_sync(asyncfence.warm_up, *model.lanes)
        batcher = Batcher(model, wait, metrics)
        for _ in range(IN_FLIGHT):  # every stream once, to the end
            slot = model.new_slot()
            slot.inputs.zero_()
            stream = model.next_stream()
            model.queue(stream, slot, MAX_BATCH)
            await asyncfence.record(stream)
        app.state.settings = {
            "device": model.name,
            "wait": wait,
            "health_bound_s": health_bound_s,
            "busy_loop_us": busy_loop_s * 1e6,
        }
        app.state.batcher = batcher
        async with anyio.create_task_group() as background:
            await background.start(batcher.serve)
            if busy_loop_s > 0:
                background.start_soon(keep_loop_busy, busy_loop_s)
            try:
                yield
            finally:
                background.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):
            await batcher.aclose()

    app = FastAPI(title="asyncfence torch server", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes each bad input back, and a NaN in the body
        # (Python's json reads it) cannot be written as JSON: a 500 with a
        # traceback. Where and what, without the input, is a 422 always.
        detail = [
            {"loc": list(item["loc"]), "msg": item["msg"], "type": item["type"]}
            for item in error.errors()
        ]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.post("/predict")
    async def predict(body: Features) -> Prediction:
        pending = Pending(body.features)
        batcher: Batcher = app.state.batcher
        batcher.submit(pending)
        await pending.done.wait()
        if pending.error is not None:
            if isinstance(pending.error, Exception):
                raise HTTPException(500, f"the batch failed: {pending.error}")
            raise HTTPException(503, "the server is shutting down")
        logits = pending.logits
        assert logits is not None
        return Prediction(logits=logits, label=max(range(CLASSES), key=logits.__getitem__))

    @app.get("/health")
    async def health() -> JSONResponse:
        stats = asyncfence.current_statistics(stuck_after=health_bound_s)
        healthy = not stats.stuck_fences
        body = {
            "status": "ok" if healthy else "unhealthy",
            "stuck_fences": stats.stuck_fences,
            "oldest_pending_age_s": stats.oldest_pending_age,
            "pending_fences": stats.pending_fences,
            "batches": app.state.batcher.batches,
            **app.state.settings,
        }
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        # On the loop (an async endpoint): the fence figures are this loop's.
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class Server(uvicorn.Server):
    """uvicorn's server, saying where it serves once it does."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start serving, then print ``serving on http://HOST:PORT (WAIT, DEVICE)``."""
        await super().startup(sockets)
        if not self.started or not sockets:
            return
        host, port = sockets[0].getsockname()[:2]
        app = self.config.app
        assert isinstance(app, FastAPI)
        settings = app.state.settings
        extra = f", busy loop {settings['busy_loop_us']:g} µs" if settings["busy_loop_us"] else ""
        print(
            f"serving on http://{host}:{port} ({settings['wait']}, {settings['device']}{extra})",
            flush=True,
        )


def main() -> None:
    """Parse the command line and serve."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 for a free one")
    parser.add_argument("--wait", choices=WAITS, default="asyncfence")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--strategy", choices=("auto", "poll", "park"), default="auto")
    parser.add_argument(
        "--health-bound",
        type=float,
        default=30.0,
        metavar="S",
        help="/health answers 503 while a fence has been pending longer than S seconds",
    )
    parser.add_argument(
        "--busy-loop",
        type=float,
        default=0.0,
        metavar="US",
        help="keep the loop busy: a background task runs US microseconds of Python, "
        "then yields, forever; 0 (the default) for none",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        metavar="N",
        help="torch.set_num_threads(N) for CPU work; 0 (the default) leaves PyTorch's",
    )
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    asyncfence.configure(strategy=args.strategy)
    app = make_app(
        args.wait,
        device=args.device,
        health_bound_s=args.health_bound,
        busy_loop_s=args.busy_loop * 1e-6,
    )
    listening = socket.create_server((args.host, args.port))
    Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listening])


if __name__ == "__main__":
    main()
