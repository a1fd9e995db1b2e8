"""Fences: recorded points on a device stream that code can wait for, and the wait itself.

A :class:`Fence` is the user's handle on a :class:`~asyncfence._core.FenceCore`
(its marker, state and outcome). The wait is written once, here, for every
loop: it asks the running loop's driver to suspend the task, and the loop's
poller to wake it. Design: ``docs/design.md`` ("Fences", "Waiting").
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, final

from ._backend import backend_for
from ._blocking import block_until_settled
from ._config import STRATEGIES, Strategy, check_strategy, check_timeout, current_config
from ._core import DONE, FAILED, PENDING, FenceCore, adopt_core, record_core
from ._loops import current_driver
from ._native import shim
from ._poller import poller_of

if TYPE_CHECKING:
    from collections.abc import Generator

    from typing_extensions import Self

    from ._interprocess import FenceToken

__all__ = ["Fence", "cores_of", "from_event", "record"]

_KNOWN_STRATEGIES = frozenset(STRATEGIES)
# How record() makes a handle around its core (Fence.__new__ refuses callers):
# inline, since a classmethod's call would cost as much again.
_new_handle = object.__new__


@final
class Fence:
    """A point on a device stream; awaiting it resumes once the device passed it.

    Make one with :func:`asyncfence.record`. A fence is recorded when it is
    made, so there is no empty fence to wait on by mistake. Once the device
    has passed it, it stays done: waiting again returns at once.

    Cancellation: cancelling a wait cancels no device work and leaves other
    waiters on the same fence waiting.

    Thread-safety: :meth:`done`, :meth:`wait_sync` and :meth:`enqueue_wait`
    may be called from any thread. ``await`` it from any event loop; several
    loops may await one fence at once.
    """

    __slots__ = ("__weakref__", "_core")

    _core: FenceCore

    def __new__(cls, *args: object, **kwargs: object) -> Self:
        raise TypeError("fences are made by asyncfence.record(stream)")

    def __reduce__(self) -> Any:
        # A fence is a point on a stream of this process's device runtime: it
        # means nothing in another process, so it never travels there.
        raise TypeError(
            "a Fence cannot be pickled: it belongs to the process that recorded it "
            "(record a fence in the process that waits, or send the result instead)"
        )

    def __copy__(self) -> Self:
        return self  # a handle to one point on a stream: a copy is the same fence

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        return self

    def __repr__(self) -> str:
        return repr(self._core)

    def done(self) -> bool:
        """Whether the device has passed this fence. Never blocks.

        Raises:
            DeviceError: The work before the fence failed.
        """
        core = self._core
        state = core.poll()
        if state == FAILED:
            core.raise_failure()
        return state == DONE

    def wait_sync(self, timeout: float | None = None) -> None:
        """Block the calling thread until the device has passed this fence.

        For synchronous code and worker threads (an engine's step loop, say);
        in a coroutine, ``await`` the fence instead. The thread sleeps on the
        same completion signal a parked await uses (the native shim): it
        spends no CPU while it waits and wakes as soon as the runtime says
        the work is done. A fault sends no signal, so it also queries the
        fence every ``recheck_interval`` (see :func:`asyncfence.configure`):
        a failure ends the wait within that. Without the shim it sleeps
        between queries, doubling from 20 µs up to a millisecond. The wait
        stays interruptible (``KeyboardInterrupt``), and starts no thread.

        It never blocks in the runtime's own wait, which takes no timeout
        (``clWaitForEvents``) or spins (``cuEventSynchronize`` without
        ``CU_EVENT_BLOCKING_SYNC``): a drop-in for ``event.synchronize()``
        with a bound (see [waiting](waiting.md#from-synchronous-code)).

        Args:
            timeout: Seconds to wait at most; ``None`` waits without limit.

        Raises:
            TimeoutError: The timeout expired first. The fence stays valid.
            DeviceError: The work before the fence failed.

        Thread-safety: any thread, any number at once.
        """
        block_until_settled(self._core, check_timeout(timeout), repr(self))

    def enqueue_wait(self, stream: object) -> None:
        """Make ``stream`` wait on the device for this fence. Never blocks the host.

        Work queued on ``stream`` after this call starts only once the device
        has passed the fence. A fence already done adds nothing. Should the
        work before the fence fail later, the device fails or stops that
        stream's later work too (OpenCL propagates the failure; CUDA errors
        are sticky for the whole context).

        Args:
            stream: A stream of the same backend as the fence. OpenCL queues
                must also share the fence's context; CUDA streams may be on
                any context or device.

        Raises:
            TypeError: ``stream`` is not a stream of the fence's backend.
            ValueError: ``stream`` cannot wait for this fence (other context).
            DeviceError: The work before the fence failed. On OpenCL, if it
                failed while this call ran, the waiting queue may never run
                its later work: PoCL never fails a command queued behind an
                event that had already failed.
        """
        self._core.enqueue_wait(stream)

    async def wait(self, timeout: float | None = None, *, strategy: Strategy | None = None) -> None:
        """Wait until the device has passed this fence, without blocking the loop.

        Works under asyncio (uvloop included) and trio, and so under anyio. No
        thread is spent on the wait. It is always a checkpoint, even when the
        fence is already done.

        Cancellation: cancelling the wait cancels no device work and does not
        disturb other tasks waiting on the fence; the cancellation propagates.

        Args:
            timeout: Seconds to wait at most; ``None`` waits without limit.
            strategy: ``"auto"``, ``"poll"`` or ``"park"``; ``None`` uses the
                process-wide default (see :func:`asyncfence.configure`).

        Raises:
            TimeoutError: The timeout expired first. The fence stays valid and
                can be awaited again.
            DeviceError: The work before the fence failed.
            ValueError: ``strategy`` is not a known strategy.
            RuntimeError: No asyncio or trio loop runs the calling task.
        """
        # The wait is written here, not in a helper coroutine: each frame a
        # parked task holds is memory per wait, a hundred thousand of them
        # in a busy server. For the same reason the arguments are reassigned,
        # not copied (a local is a slot in that frame), and the usual ones
        # skip their validators.
        timeout = math.inf if timeout is None else check_timeout(timeout)
        if strategy is None:
            strategy = current_config().strategy
        elif not (isinstance(strategy, str) and strategy in _KNOWN_STRATEGIES):
            strategy = check_strategy(strategy)
        core = self._core
        driver = current_driver()
        if core.poll() != PENDING or timeout == 0:
            await driver.checkpoint()  # a checkpoint, even when there is nothing to wait for
            _settled_outcome(core, timeout)
            return
        poller = poller_of(driver)
        waiter = driver.new_waiter()
        woken = False
        try:
            poller.add(core, waiter, strategy)
            woken = await driver.suspend(waiter, timeout)
        finally:
            if not woken:  # cancelled, timed out or failed: a wake unregisters its waiters
                poller.discard(core, waiter)
            # A failure's traceback keeps this frame: through the future
            # holding it, a cycle would keep the caller's locals until the
            # garbage collector runs.
            del waiter
        if woken is not True:
            if woken is not False:  # neither woken nor timed out: resumed by a StopIteration
                raise RuntimeError("StopIteration was thrown into an await of a fence")
            _settled_outcome(core, timeout)

    def __await__(self) -> Generator[Any, None, None]:
        """``await fence``: :meth:`wait` with no timeout and the process-wide strategy.

        On asyncio (uvloop included) a pending fence is awaited with no
        coroutine frame of asyncfence's, the lightest wait there is; on trio,
        and for a fence that is settled already, it is :meth:`wait`.

        Cancellation: as :meth:`wait`.
        """
        core = self._core
        driver = current_driver()
        untimed_wait = driver.untimed_wait
        if untimed_wait is not None and core.poll() == PENDING:
            # The usual wait, with no coroutine frame where the loop allows
            # it: memory per wait in flight (see AsyncioDriver's).
            return untimed_wait(poller_of(driver), core, current_config().strategy)
        return self.wait().__await__()

    def export(self) -> FenceToken:
        """A token with which another process on this machine can await this fence.

        Send the token (it pickles) to the other process, which turns it into
        an awaitable fence with :func:`asyncfence.import_fence`. This loop
        answers it: it serves its exports on a Unix socket of its own that
        only processes of the same user may use, and once the fence completes
        it tells the importer how the work ended (a failure arrives there as
        the same :class:`~asyncfence.DeviceError`). No thread is started, and
        nothing need be done here after the export but keep the loop running.

        A token answers one import; export again for each importing process.
        An export not yet imported keeps the fence until this loop ends.

        Returns:
            A picklable :class:`~asyncfence.FenceToken`.

        Raises:
            RuntimeError: No asyncio or trio loop runs the calling task.
            OSError: The relay's socket could not be made (no descriptor free).
            NotImplementedError: Not on Linux (the relay needs its abstract
                Unix sockets and ``SO_PEERCRED``).

        Thread-safety: the thread of the loop that serves the export.
        """
        from ._interprocess import export_core

        return export_core(self._core)


def _settled_outcome(core: FenceCore, seconds: float) -> None:
    """After a checkpoint or a timeout: return if done, raise its failure, or time out."""
    state = core.poll()
    if state == DONE:
        return
    if state == FAILED:
        core.raise_failure()
    raise TimeoutError(f"{core!r} did not complete within {seconds} s")


def record(stream: object) -> Fence:
    """Record a fence at the current end of the work queued on ``stream``.

    Args:
        stream: A stream of a registered backend: a ``pyopencl.CommandQueue``,
            a CUDA stream (an object with ``__cuda_stream__``, a CuPy or
            numba-cuda stream, a ``torch.Stream`` on CUDA as
            ``torch.accelerator.current_stream()`` gives, or a raw handle),
            or one of torch's CPU streams (``torch.cpu.Stream``, as
            ``torch.get_device_module("cpu").current_stream()`` gives).

    Returns:
        A fence that completes once the device has passed all work queued on
        ``stream`` before this call. On a torch CPU stream that work ran when
        it was queued: the fence is done already, and awaiting it is still a
        checkpoint.

    Raises:
        TypeError: ``stream`` is not a stream any backend accepts; the message
            names the accepted types.
        DeviceError: The backend failed to record.
        FenceError: This process was forked after the backend was used.

    Thread-safety: safe to call from any thread; the fence may be awaited on
    any loop.
    """
    core = record_core(stream)  # first: a record that raises leaves no empty handle
    fence = _new_handle(Fence)
    fence._core = core
    return fence


def from_event(event: object) -> Fence:
    """A fence at an event your own code recorded: a copy's, a kernel's, a marker's.

    Everything a recorded fence offers: ``await`` on asyncio, uvloop and
    trio, :meth:`~Fence.done`, :meth:`~Fence.wait_sync`,
    :meth:`~Fence.enqueue_wait`, timeouts, cancellation, a
    :class:`~asyncfence.DeviceError` when the work failed, and a place in a
    :class:`~asyncfence.DropQueue`. The fence keeps ``event`` alive until it
    settles: a non-blocking ``pyopencl`` transfer's event, dropped early,
    blocks with the GIL held when collected; handed here, it is kept.

    Where it differs from :func:`record`: it completes with ``event``
    itself, which may stand anywhere in its stream, so it is watched on its
    own (it gets a completion signal of its own when parked). An OpenCL
    ``UserEvent`` is done when your code sets it. A CUDA event is taken as
    ``cuStreamWaitEvent`` takes it: the fence completes with the record the
    event had at this call (record it again at once if you like), and an
    event never recorded (a ``torch.cuda.Event`` before its first record)
    is done.

    Args:
        event: A ``pyopencl.Event`` (from ``enqueue_copy``, a kernel's call,
            ``enqueue_marker``) or ``pyopencl.UserEvent``; or a CUDA event:
            a ``cuda.bindings.driver.CUevent``, a ``torch.cuda.Event``, a
            ``torch.Event`` on CUDA, a ``cupy.cuda.Event``, a cuda.core
            ``Event``, or a numba-cuda event.

    Returns:
        A :class:`Fence` that completes once the device has finished ``event``.

    Raises:
        TypeError: ``event`` is not an event any backend accepts (the
            message names what is accepted), or a closed one, or a
            ``torch.Event`` off CUDA.
        FenceError: The CUDA event was last recorded inside a graph capture
            (it never completes as such), or this process was forked after
            the runtime was used.
        DeviceError: The CUDA driver refused to wait for the event.

    Thread-safety: any thread.
    """
    core = adopt_core(event)
    fence = _new_handle(Fence)
    fence._core = core
    return fence


def warm_up(*streams: object) -> None:
    """Load now what the first record and the first parked wait would load.

    The native wake shim is loaded when asyncfence is imported; a CUDA
    stream's first record would import ``cuda.bindings`` and initialise the
    driver, and its first parked wait resolve the driver's host-function
    entry point, and an OpenCL queue's first parked wait find the OpenCL
    library to arm its signal through: each a blocking call that a running
    loop should not make (tools such as blockbuster fail it; a blocked arm
    leaves the fence re-checked rather than signalled). Call this before the
    loop runs, or
    in a server's startup off the loop::

        await anyio.to_thread.run_sync(asyncfence.warm_up, stream)

    Args:
        *streams: Streams of any registered backend, as :func:`record` takes
            them; each backend loads what its first use on that stream needs
            (for CUDA: the driver, the host-function entry point, and an event
            pooled in the stream's context; for OpenCL: its
            ``clSetEventCallback``). None: the shim only.

    Raises:
        TypeError: A stream is not one any backend accepts.
        DeviceError: The runtime refused, as a record would.
        DriverNotFoundError: A CUDA stream, and no NVIDIA driver.

    Thread-safety: any thread. It blocks: never call it on a running loop.
    """
    shim()
    for stream in streams:
        backend_for(stream).warm_up(stream)


def cores_of(fence_or_fences: object) -> list[FenceCore]:
    """The cores of a fence or of an iterable of fences, for the drop queue and pools.

    Raises:
        TypeError: Not a :class:`Fence` or an iterable of them; the message
            names what was given.
    """
    if isinstance(fence_or_fences, Fence):
        return [fence_or_fences._core]
    if isinstance(fence_or_fences, (str, bytes)) or not isinstance(fence_or_fences, Iterable):
        raise TypeError(
            "expected an asyncfence.Fence or an iterable of them, "
            f"got {type(fence_or_fences).__qualname__}"
        )
    cores = []
    for fence in fence_or_fences:
        if not isinstance(fence, Fence):
            raise TypeError(f"expected asyncfence.Fence objects, got {type(fence).__qualname__}")
        cores.append(fence._core)
    return cores
