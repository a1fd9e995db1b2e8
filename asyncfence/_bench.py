"""``python -m asyncfence bench``: every waiting strategy beside what users do today.

All contenders run in one process, on one device, interleaved trial by trial so
that drift on a noisy machine hits them alike. Figures are medians (or
percentiles) over trials; ratios are taken within the run.

Scenarios:

* **wake latency**: from the instant the device passes the fence (the host
  releases a gate holding the stream; the timestamp is taken right at the
  release) to the instant the awaiting coroutine resumes; the gate released
  0.5 to 3 ms into the wait, and at once ("short work").
* **CPU while waiting**: CPU seconds of the process's Python threads per second
  of wall time, while awaiting one long piece of work. The device runtime's own
  threads are left out: on PoCL they *are* the device.
* **throughput**: record-and-await round trips per second on short work, with
  1 and with 64 concurrent tasks (one stream each).
* **scale**: 10, 1,000 and 10,000 pending fences over 64 held streams: the
  event loop's lag (the delay of a ``call_soon`` probe, p99) and, for
  asyncfence, the poller's cost per tick.
* **drop queue**: the cost of a ``defer``, memory per pending object, release
  latency after completion, and releases while one of 16 streams is stuck,
  beside a lazy free-at-next-allocation pool (``_bench_drop``).
* **signal hold** (CUDA): how long each completion signal holds the stream it
  runs on, by timing events.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.metadata
import json
import math
import os
import platform
import queue
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._bench_drop import drop_queue_scenarios
from ._config import STRATEGIES, Strategy, current_config
from ._devices import CudaDevice, Device, OpenCLDevice, open_default_device
from ._fence import record
from ._loops import current_statistics
from ._testing import StreamGate, hold

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator, Sequence

__all__ = ["BenchConfig", "run_bench"]

TO_THREAD = "to_thread"
SLEEP_1MS = "sleep(1ms) loop"
SLEEP_0 = "sleep(0) loop"
NUMBA = "numba async_done"


@dataclass(frozen=True)
class BenchConfig:
    """How long to run each scenario."""

    quick: bool = False
    wake_trials: int = 200
    cpu_trials: int = 5
    cpu_work_s: float = 0.2
    throughput_window_s: float = 0.5
    throughput_rounds: int = 5
    scale_sizes: tuple[int, ...] = (10, 1000, 10000)
    scale_window_s: float = 0.5
    streams: int = 64

    @classmethod
    def smoke(cls) -> BenchConfig:
        """A run of a few seconds, to check the benchmark itself works."""
        return cls(
            quick=True,
            wake_trials=12,
            cpu_trials=1,
            cpu_work_s=0.05,
            throughput_window_s=0.1,
            throughput_rounds=1,
            scale_sizes=(10, 1000),
            scale_window_s=0.1,
            streams=16,
        )


# -- the device, as the baselines use it -----------------------------------------------


class Target:
    """Raw events on one device, for the baselines, plus streams and work."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._streams: list[Any] = []

    def new_stream(self) -> Any:
        stream = self.device.new_stream()
        self._streams.append(stream)
        return stream

    def raw_record(self, stream: Any) -> Any:
        raise NotImplementedError

    def raw_query(self, event: Any) -> bool:
        raise NotImplementedError

    def raw_block(self, event: Any) -> None:
        raise NotImplementedError

    def raw_done(self, event: Any) -> None:
        """The baseline finished with ``event``."""

    def short_work(self, stream: Any) -> None:
        self.device.launch_chunks(stream, 1)

    def close(self) -> None:
        """Release the streams this target made."""


class OpenCLTarget(Target):
    """Markers, their status, and ``Event.wait()``."""

    def raw_record(self, stream: Any) -> Any:
        import pyopencl as cl

        marker = cl.enqueue_marker(stream)
        stream.flush()
        return marker

    def raw_query(self, event: Any) -> bool:
        status: int = event.command_execution_status
        if status < 0:
            raise RuntimeError(f"OpenCL event failed with status {status}")
        return status == 0

    def raw_block(self, event: Any) -> None:
        event.wait()

    def close(self) -> None:
        for stream in self._streams:
            stream.finish()


class CudaTarget(Target):
    """Pooled timing-disabled events, ``cuEventQuery`` and ``cuEventSynchronize``."""

    def __init__(self, device: CudaDevice) -> None:
        super().__init__(device)
        from ._cuda import driver

        self._drv = driver()
        self._pool: list[Any] = []

    def raw_record(self, stream: Any) -> Any:
        from ._cuda import check

        drv = self._drv
        if self._pool:
            event = self._pool.pop()
        else:
            flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
            event = check(drv.cuEventCreate(flags), "cuEventCreate")
        check(drv.cuEventRecord(event, stream), "cuEventRecord")
        return event

    def raw_query(self, event: Any) -> bool:
        (err,) = self._drv.cuEventQuery(event)
        if err == self._drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if err != self._drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuEventQuery failed: {err}")
        return True

    def raw_block(self, event: Any) -> None:
        self._drv.cuEventSynchronize(event)

    def raw_done(self, event: Any) -> None:
        self._pool.append(event)

    def close(self) -> None:
        for stream in self._streams:
            self._drv.cuStreamSynchronize(stream)
            self._drv.cuStreamDestroy(stream)
        for event in self._pool:
            self._drv.cuEventDestroy(event)


def make_target(device: Device) -> Target:
    if isinstance(device, CudaDevice):
        return CudaTarget(device)
    assert isinstance(device, OpenCLDevice)
    return OpenCLTarget(device)


# -- contenders -----------------------------------------------------------------------


@dataclass(frozen=True)
class Contender:
    """A way to wait: what it records on a stream, and how it awaits that."""

    name: str
    record: Callable[[Any], Any]
    wait: Callable[[Any], Awaitable[None]]
    done: Callable[[Any], None] = lambda token: None
    is_asyncfence: bool = False


def contenders(target: Target) -> list[Contender]:
    """The strategies of asyncfence, then the baselines users write today."""

    def strategy(name: Strategy) -> Callable[[Any], Awaitable[None]]:
        async def fence_wait(fence: Any) -> None:
            await fence.wait(strategy=name)

        return fence_wait

    async def to_thread(event: Any) -> None:
        await asyncio.to_thread(target.raw_block, event)

    # The loops users write by hand; the very thing the linter warns about.
    async def sleep_loop(event: Any) -> None:
        while not target.raw_query(event):  # noqa: ASYNC110
            await asyncio.sleep(0.001)

    async def busy_loop(event: Any) -> None:
        while not target.raw_query(event):  # noqa: ASYNC110
            await asyncio.sleep(0)

    found = [
        *(
            Contender(f"asyncfence {name}", record, strategy(name), is_asyncfence=True)
            for name in STRATEGIES
        ),
        Contender(TO_THREAD, target.raw_record, to_thread, target.raw_done),
        Contender(SLEEP_1MS, target.raw_record, sleep_loop, target.raw_done),
        Contender(SLEEP_0, target.raw_record, busy_loop, target.raw_done),
    ]
    numba = _numba_contender(target)
    if numba is not None:
        found.append(numba)
    return found


def _numba_contender(target: Target) -> Contender | None:
    if not isinstance(target, CudaTarget):
        return None
    try:
        from numba import cuda as numba_cuda
    except ImportError:
        return None

    async def async_done(stream: Any) -> None:
        await stream.async_done()

    return Contender(NUMBA, lambda stream: numba_cuda.external_stream(int(stream)), async_done)


# -- measuring ----------------------------------------------------------------------------


def percentile(samples: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile of ``samples`` (nearest rank)."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def python_threads_cpu() -> float:
    """CPU seconds used so far by the process's Python threads."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        with contextlib.suppress(OSError, OverflowError):
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total


class Releaser:
    """A thread that releases gates after a delay, stamping the instant of release."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[float, StreamGate, list[float]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="bench releaser", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            delay, gate, stamp = job
            time.sleep(delay)
            stamp.append(time.perf_counter())
            gate.release()

    def release_after(self, delay: float, gate: StreamGate) -> list[float]:
        stamp: list[float] = []
        self._jobs.put((delay, gate, stamp))
        return stamp

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


@dataclass
class Results:
    meta: dict[str, Any]
    wake: dict[str, list[float]] = field(default_factory=dict)
    wake_short: dict[str, list[float]] = field(default_factory=dict)
    signal_hold: dict[str, list[float]] = field(default_factory=dict)
    drop: dict[str, dict[str, float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    throughput: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    scale: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)


class Progress:
    """One line per step on stderr, so long runs show where they are."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.done, self.quiet = total, 0, quiet

    def step(self, text: str) -> None:
        self.done += 1
        if not self.quiet:
            print(f"[{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)


async def wake_latency(
    target: Target,
    entrants: list[Contender],
    config: BenchConfig,
    samples: dict[str, list[float]],
    delays: tuple[float, float],
) -> None:
    """Release a held stream after a random delay in ``delays``; time the resumption."""
    releaser = Releaser()
    stream = target.new_stream()
    rng = random.Random(1)
    try:
        # One untimed round first: the first park starts the watcher thread
        # and loads the runtime's callback entry point.
        for trial in range(config.wake_trials + 1):
            for contender in rng.sample(entrants, len(entrants)):
                gate = StreamGate(stream)
                token = contender.record(stream)
                stamp = releaser.release_after(rng.uniform(*delays), gate)
                await contender.wait(token)
                resumed = time.perf_counter()
                contender.done(token)
                if trial:
                    samples.setdefault(contender.name, []).append(resumed - stamp[0])
    finally:
        releaser.close()


async def cpu_while_waiting(
    target: Target, entrants: list[Contender], config: BenchConfig, results: Results
) -> None:
    stream = target.new_stream()
    rng = random.Random(2)
    for _ in range(config.cpu_trials):
        for contender in rng.sample(entrants, len(entrants)):
            target.device.launch_busy(stream, config.cpu_work_s)
            token = contender.record(stream)
            cpu, wall = python_threads_cpu(), time.perf_counter()
            await contender.wait(token)
            wall = time.perf_counter() - wall
            cpu = python_threads_cpu() - cpu
            contender.done(token)
            results.cpu.setdefault(contender.name, []).append(cpu / wall)


async def throughput(
    target: Target, entrants: list[Contender], config: BenchConfig, results: Results
) -> None:
    streams = [target.new_stream() for _ in range(config.streams)]
    rng = random.Random(3)
    for tasks in (1, config.streams):
        for _ in range(config.throughput_rounds):
            for contender in rng.sample(entrants, len(entrants)):
                deadline = time.perf_counter() + config.throughput_window_s
                counts = [0] * tasks

                async def loop(
                    index: int,
                    contender: Contender = contender,
                    deadline: float = deadline,
                    counts: list[int] = counts,
                ) -> None:
                    stream = streams[index]
                    while time.perf_counter() < deadline:
                        target.short_work(stream)
                        token = contender.record(stream)
                        await contender.wait(token)
                        contender.done(token)
                        counts[index] += 1

                start = time.perf_counter()
                await asyncio.gather(*(loop(i) for i in range(tasks)))
                rate = sum(counts) / (time.perf_counter() - start)
                per_tasks = results.throughput.setdefault(contender.name, {})
                per_tasks.setdefault(tasks, []).append(rate)


def _hold_gil(seconds: float) -> None:
    """Keep this thread running Python, as a busy event loop does."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def signal_hold(target: CudaTarget, config: BenchConfig, results: Results) -> None:
    """How long each completion signal holds the stream it runs on, by timing events.

    asyncfence's signal is the native shim's host function (or, without the
    shim, libc's ``sem_post``), launched through the driver's raw entry point:
    no Python. The comparison is a Python callback through cuda.bindings'
    ``cuLaunchHostFunc`` (what numba's ``async_done`` and CuPy's callbacks do),
    while the main thread runs Python, as a busy event loop would.
    """
    from ._backend import backend_for
    from ._cuda import CudaBackend, check
    from ._native import shim
    from ._poller import NativeMailbox

    drv = target._drv
    backend = backend_for(0)
    assert isinstance(backend, CudaBackend)
    launcher = backend.host_functions()
    if launcher.path == "none":
        return
    native = shim()
    mailbox = NativeMailbox(native) if native is not None else None
    stream = target.new_stream()
    timing = drv.CUevent_flags.CU_EVENT_DEFAULT
    start = check(drv.cuEventCreate(timing), "cuEventCreate")
    end = check(drv.cuEventCreate(timing), "cuEventCreate")

    def native_signal() -> int:
        if mailbox is not None:
            signal, _slot = mailbox.signal(0)
            return launcher.launch(int(stream), signal.host_function, signal.argument)
        from ._watcher import _Semaphore

        semaphore = _Semaphore()
        assert semaphore.signal is not None
        return launcher.launch(int(stream), semaphore.signal.host_function, semaphore.address)

    # A callback that runs Python, as numba's and CuPy's do (a ctypes thunk,
    # which takes the GIL; the v1 wrapper of cuda.bindings takes it as well).
    python_callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _data: None)
    python_fn = drv.CUhostFn(ctypes.cast(python_callback, ctypes.c_void_p).value)
    name = "asyncfence: native host function" + (" (shim)" if mailbox else " (sem_post)")
    signals: dict[str, Callable[[], Any]] = {
        f"{name}, cuLaunchHostFunc {launcher.path}": lambda: (native_signal(),),
        "Python callback: cuLaunchHostFunc": lambda: drv.cuLaunchHostFunc(stream, python_fn, 0),
    }
    try:
        for _ in range(max(3, config.wake_trials // 4)):
            for label, launch in signals.items():
                with hold(stream) as gate:  # queue it all before the stream runs
                    check(drv.cuEventRecord(start, stream), "cuEventRecord")
                    check(launch(), label)
                    check(drv.cuEventRecord(end, stream), "cuEventRecord")
                    gate.release()
                    _hold_gil(0.002)
                check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")
                if mailbox is not None:
                    mailbox.take()
                elapsed_ms = check(drv.cuEventElapsedTime(start, end), "cuEventElapsedTime")
                results.signal_hold.setdefault(label, []).append(float(elapsed_ms) / 1e3)
    finally:
        drv.cuEventDestroy(start)
        drv.cuEventDestroy(end)


@contextlib.contextmanager
def timed_ticks(figures: dict[str, float]) -> Iterator[None]:
    """Measure the running loop's poller ticks over the block, from its statistics."""
    before = current_statistics()
    yield
    after = current_statistics()
    ticks = after.ticks - before.ticks
    if ticks:
        figures["ticks"] = float(ticks)
        figures["tick_mean_s"] = (after.tick_seconds - before.tick_seconds) / ticks


def _stamp(probe: asyncio.Future[float]) -> None:
    probe.set_result(time.perf_counter())


async def loop_lag(until: float) -> list[float]:
    """Delays of ``call_soon`` probes, one a millisecond, until ``until``."""
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    while time.perf_counter() < until:
        probe: asyncio.Future[float] = loop.create_future()
        sent = time.perf_counter()
        loop.call_soon(_stamp, probe)
        lags.append(await probe - sent)
        await asyncio.sleep(0.001)
    return lags


async def scale(
    target: Target,
    entrants: list[Contender],
    config: BenchConfig,
    results: Results,
    progress: Progress,
) -> None:
    streams = [target.new_stream() for _ in range(config.streams)]
    for size in config.scale_sizes:
        for contender in entrants:
            gates = [StreamGate(stream) for stream in streams]
            tokens = [contender.record(streams[i % len(streams)]) for i in range(size)]
            waiters = [asyncio.ensure_future(contender.wait(token)) for token in tokens]
            await asyncio.sleep(0.01)  # every waiter is parked in its wait
            ticks: dict[str, float] = {}
            with timed_ticks(ticks) if contender.is_asyncfence else contextlib.nullcontext():
                lags = await loop_lag(time.perf_counter() + config.scale_window_s)
            for gate in gates:
                gate.release()
            await asyncio.wait_for(asyncio.gather(*waiters), timeout=120)
            for token in tokens:
                contender.done(token)
            figures = {"lag_p99_s": percentile(lags, 0.99), "lag_p50_s": percentile(lags, 0.5)}
            figures.update(ticks)
            results.scale.setdefault(contender.name, {})[size] = figures
            progress.step(f"scale: {size} pending, {contender.name}")


# -- reporting ------------------------------------------------------------------------------


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe(device: Device, config: BenchConfig, loop_name: str) -> dict[str, Any]:
    """Device, backend, versions and machine, as a report needs them."""
    from . import __version__

    packages = ("anyio", "uvloop", "pyopencl", "pocl-binary-distribution", "cuda-bindings")
    versions = {name: _version(name) for name in packages}
    versions = {name: version for name, version in versions.items() if version}
    return {
        "date": time.strftime("%Y-%m-%d"),
        "device": device.name,
        "backend": device.backend,
        "asyncfence": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "loop": loop_name,
        "quick": config.quick,
        "spin_budget_s": current_config().spin_budget,
        "versions": versions,
    }


def _latencies(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    latencies = {
        name: {
            "p50_us": percentile(s, 0.5) * 1e6,
            "p99_us": percentile(s, 0.99) * 1e6,
            "max_us": max(s) * 1e6,
            "trials": len(s),
        }
        for name, s in samples.items()
    }
    reference = latencies.get(TO_THREAD, {}).get("p50_us")
    for figures in latencies.values():
        if reference:
            figures["p50_vs_to_thread"] = figures["p50_us"] / reference
    return latencies


def summarize(results: Results) -> dict[str, Any]:
    """Medians and ratios, as the table and the JSON show them."""
    wake = _latencies(results.wake)
    cpu = {name: {"cpu_per_wall": statistics.median(s)} for name, s in results.cpu.items()}
    rates = {
        name: {f"{tasks}_tasks_per_s": statistics.median(r) for tasks, r in per.items()}
        for name, per in results.throughput.items()
    }
    reference_cpu = cpu.get(SLEEP_0, {}).get("cpu_per_wall")
    for figures in cpu.values():
        if reference_cpu:
            figures["vs_busy_poll"] = figures["cpu_per_wall"] / reference_cpu
    for figures in rates.values():
        for key in list(figures):
            reference = rates.get(TO_THREAD, {}).get(key)
            if reference:
                figures[key.replace("_per_s", "_vs_to_thread")] = figures[key] / reference
    scale = {
        name: {str(size): figures for size, figures in per.items()}
        for name, per in results.scale.items()
    }
    hold = {
        name: {"p50_us": percentile(s, 0.5) * 1e6, "max_us": max(s) * 1e6, "trials": len(s)}
        for name, s in results.signal_hold.items()
    }
    return {
        "drop_queue": results.drop,
        "signal_hold": hold,
        "wake_latency": wake,
        "wake_latency_short_work": _latencies(results.wake_short),
        "cpu_while_waiting": cpu,
        "throughput": rates,
        "scale": scale,
    }


def _rows(summary: dict[str, Any]) -> dict[str, tuple[list[str], list[list[str]]]]:
    def number(value: float | None, digits: int = 0) -> str:
        return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    tables: dict[str, tuple[list[str], list[list[str]]]] = {}
    for key, title in (
        ("wake_latency", "wake latency (µs; release of the gate 0.5-3 ms in, to resumption)"),
        ("wake_latency_short_work", "wake latency, short work (µs; gate released at once)"),
    ):
        tables[title] = (
            ["contender", "p50", "p99", "max", "p50 vs to_thread"],
            [
                [
                    n,
                    number(f["p50_us"]),
                    number(f["p99_us"]),
                    number(f["max_us"]),
                    ratio(f.get("p50_vs_to_thread")),
                ]
                for n, f in summary[key].items()
            ],
        )
    cpu = summary["cpu_while_waiting"]
    tables["CPU while waiting (Python threads' CPU s per wall s)"] = (
        ["contender", "cpu/wall", "vs sleep(0) loop"],
        [[n, number(f["cpu_per_wall"], 3), ratio(f.get("vs_busy_poll"))] for n, f in cpu.items()],
    )
    rates = summary["throughput"]
    keys = sorted(
        {k for f in rates.values() for k in f if k.endswith("_per_s")},
        key=lambda k: int(k.split("_")[0]),
    )
    tables["throughput (record-and-await round trips per second)"] = (
        ["contender"]
        + [k.replace("_tasks_per_s", " tasks") for k in keys]
        + [k.replace("_tasks_per_s", " vs to_thread") for k in keys],
        [
            [n]
            + [number(f.get(k)) for k in keys]
            + [ratio(f.get(k.replace("_per_s", "_vs_to_thread"))) for k in keys]
            for n, f in rates.items()
        ],
    )
    if summary["drop_queue"]:
        objects = next(iter(summary["drop_queue"].values()))["objects"]
        tables[
            f"drop queue: {objects:,} objects on 16 streams, one stream stuck, then all done"
        ] = (
            [
                "contender",
                "defer µs",
                "bytes/object",
                "release p50 µs",
                "release p99 µs",
                "released, 1 stuck",
                "the rest, ms",
            ],
            [
                [
                    n,
                    number(f["defer_us"], 2),
                    number(f["bytes_per_pending_object"]),
                    number(f["release_latency_p50_us"]),
                    number(f["release_latency_p99_us"]),
                    number(f["released_with_one_stream_stuck"]),
                    number(f["release_rest_ms"], 1),
                ]
                for n, f in summary["drop_queue"].items()
            ],
        )
    if summary["signal_hold"]:
        tables["how long a completion signal holds its stream (µs, CUDA timing events)"] = (
            ["signal", "p50", "max"],
            [
                [n, number(f["p50_us"], 1), number(f["max_us"], 1)]
                for n, f in summary["signal_hold"].items()
            ],
        )
    scale = summary["scale"]
    sizes = sorted({int(s) for per in scale.values() for s in per})
    tables["scale (pending fences on held streams): loop lag p99 µs / poller tick µs"] = (
        ["contender"] + [f"{s:,} pending" for s in sizes],
        [
            [n]
            + [
                "-"
                if str(s) not in per
                else number(per[str(s)]["lag_p99_s"] * 1e6)
                + (
                    f" / {number(per[str(s)]['tick_mean_s'] * 1e6, 1)}"
                    if "tick_mean_s" in per[str(s)]
                    else ""
                )
                for s in sizes
            ]
            for n, per in scale.items()
        ],
    )
    return tables


def render(meta: dict[str, Any], summary: dict[str, Any]) -> None:
    """Print the tables, with rich where it is installed."""
    heading = (
        f"asyncfence bench on {meta['backend']}: {meta['device']} | {meta['cpu_count']} cores | "
        f"Python {meta['python']} | {meta['loop']} | asyncfence {meta['asyncfence']}"
        + (" | quick" if meta["quick"] else "")
    )
    tables = _rows(summary)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(heading)
        for title, (columns, rows) in tables.items():
            widths = [
                max(len(str(c)) for c in column) for column in zip(columns, *rows, strict=True)
            ]
            print(f"\n{title}")
            for line in [columns, *rows]:
                print("  ".join(str(c).rjust(w) for c, w in zip(line, widths, strict=True)))
        return
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(heading, style="bold")
    for title, (columns, rows) in tables.items():
        table = Table(title=title, title_justify="left")
        for index, column in enumerate(columns):
            table.add_column(column, justify="left" if index == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)


def plot(results: Results, meta: dict[str, Any], path: str) -> None:
    """Wake-latency distributions per contender, and throughput, to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'asyncfence[bench]'") from None
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, samples in results.wake.items():
        ordered = sorted(s * 1e6 for s in samples)
        fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
        left.step(ordered, fractions, where="post", label=name)
    left.set_xscale("log")
    left.set_xlabel("wake latency (µs, log scale)")
    left.set_ylabel("fraction of waits")
    left.set_title("wake latency, cumulative")
    left.legend(fontsize="small")
    names = list(results.throughput)
    task_counts = sorted({t for per in results.throughput.values() for t in per})
    width = 0.8 / max(1, len(task_counts))
    for offset, tasks in enumerate(task_counts):
        values = [statistics.median(results.throughput[n].get(tasks, [0.0])) for n in names]
        right.bar(
            [i + offset * width for i in range(len(names))],
            values,
            width,
            label=f"{tasks} task{'s' if tasks > 1 else ''}",
        )
    right.set_xticks([i + width * (len(task_counts) - 1) / 2 for i in range(len(names))])
    right.set_xticklabels(names, rotation=20, ha="right", fontsize="small")
    right.set_ylabel("round trips per second")
    right.set_title("throughput on short work")
    right.legend(fontsize="small")
    figure.suptitle(f"asyncfence bench: {meta['backend']} on {meta['device']} ({meta['date']})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# -- entry point ---------------------------------------------------------------------------


async def _run(device: Device, config: BenchConfig, loop_name: str, quiet: bool) -> Results:
    target = make_target(device)
    entrants = contenders(target)
    results = Results(describe(device, config, loop_name))
    results.meta["contenders"] = [c.name for c in entrants]
    device.chunks_for(config.cpu_work_s)  # calibrate before anything is timed
    steps = 5 + len(config.scale_sizes) * len(entrants) + isinstance(target, CudaTarget)
    progress = Progress(steps, quiet)
    try:
        await wake_latency(target, entrants, config, results.wake, (0.0005, 0.003))
        progress.step("wake latency")
        await wake_latency(target, entrants, config, results.wake_short, (0.0, 0.0))
        progress.step("wake latency, short work")
        await cpu_while_waiting(target, entrants, config, results)
        progress.step("CPU while waiting")
        await throughput(target, entrants, config, results)
        progress.step("throughput")
        await scale(target, entrants, config, results, progress)
        results.drop = await drop_queue_scenarios(target, config)
        progress.step("drop queue")
        if isinstance(target, CudaTarget):
            signal_hold(target, config, results)
            progress.step("signal hold")
    finally:
        target.close()
    return results


def run_bench(
    *,
    device: str | None = None,
    quick: bool = False,
    json_path: str | None = None,
    plot_path: str | None = None,
    loop: str = "asyncio",
    quiet: bool = False,
) -> dict[str, Any]:
    """Run the benchmark, print its tables, and write JSON or a plot if asked.

    Returns:
        The report: ``{"meta": ..., "summary": ..., "samples": ...}``.
    """
    config = BenchConfig.smoke() if quick else BenchConfig()
    opened = open_default_device(device)
    if loop == "uvloop":
        import uvloop

        results = uvloop.run(_run(opened, config, loop, quiet))
    else:
        results = asyncio.run(_run(opened, config, loop, quiet))
    summary = summarize(results)
    render(results.meta, summary)
    report = {
        "meta": results.meta,
        "summary": summary,
        "samples": {
            "wake_latency_s": results.wake,
            "wake_latency_short_work_s": results.wake_short,
            "signal_hold_s": results.signal_hold,
            "cpu_per_wall": results.cpu,
        },
    }
    if json_path:
        with open(json_path, "w") as file:
            json.dump(report, file, indent=1)
            file.write("\n")
    if plot_path:
        plot(results, results.meta, plot_path)
    return report
