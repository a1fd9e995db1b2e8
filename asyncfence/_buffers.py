"""Buffers the drop queue typically holds: pinned host memory, device memory, a staging pool."""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from collections import deque
from typing import TYPE_CHECKING, Generic, TypeVar, final

import anyio

from ._drop_queue import DropQueue

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from types import ModuleType

    from ._fence import Fence

__all__ = ["DeviceBuffer", "PinnedBuffer", "StagingPool"]

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import ExceptionGroup

_logger = logging.getLogger("asyncfence.buffers")
T = TypeVar("T")


class _CudaAllocation:
    """Memory from the CUDA driver, freed once, by :meth:`free`.

    It remembers the context that was current when it was allocated: the
    driver frees memory only with a context current, so :meth:`free` makes
    that one current around the call, on whichever thread frees it (a drop
    queue's loop, a worker thread).
    """

    __slots__ = ("_address", "_context", "_lock", "nbytes")

    def __init__(self, address: int, nbytes: int, context: int) -> None:
        self._address = address
        self._context = context
        self.nbytes = nbytes
        self._lock = threading.Lock()

    @property
    def address(self) -> int:
        """The address; raises once freed.

        Raises:
            ValueError: The memory was freed.
        """
        if not self._address:
            raise ValueError(f"{self!r} was freed")
        return self._address

    @property
    def freed(self) -> bool:
        """Whether :meth:`free` has run."""
        return not self._address

    def _release(self, drv: ModuleType, address: int) -> None:
        raise NotImplementedError

    def free(self) -> None:
        """Give the memory back to the driver. A no-op the second time. Thread-safe.

        Raises:
            DeviceError: Its context could not be made current (it was
                destroyed, say), or the driver refused the free.
        """
        from ._cuda import driver, pop_context, push_context

        with self._lock:
            address, self._address = self._address, 0
        if not address:
            return
        drv = driver()
        pushed = push_context(drv, self._context, "the allocation's")
        try:
            self._release(drv, address)
        finally:
            if pushed:
                pop_context(drv)

    def __repr__(self) -> str:
        state = "freed" if self.freed else hex(self._address)
        return f"<asyncfence.{type(self).__name__} {self.nbytes} bytes at {state}>"


def _check_nbytes(nbytes: object) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__qualname__}")
    if not 1 <= nbytes <= sys.maxsize:
        raise ValueError(f"nbytes must be in [1, {sys.maxsize}], got {nbytes}")
    return nbytes


@final
class PinnedBuffer(_CudaAllocation):
    """Page-locked host memory (``cuMemHostAlloc``), for async copies to the device.

    Mapped into the device's address space and usable from every context
    (``CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP``). Hand it to a
    :class:`DropQueue` with ``free=PinnedBuffer.free`` behind the copy that
    reads it.

    Thread-safety: :meth:`free` may be called from any thread, once or more,
    with or without a current context: it makes the allocation's own current.

    Args:
        nbytes: Its size.

    Raises:
        DriverNotFoundError: No NVIDIA driver.
        DeviceError: The allocation failed, or no context is current.
    """

    def __init__(self, nbytes: int) -> None:
        from ._cuda import check, current_context, driver

        size = _check_nbytes(nbytes)
        drv = driver()
        flags = drv.CU_MEMHOSTALLOC_PORTABLE | drv.CU_MEMHOSTALLOC_DEVICEMAP
        address = int(check(drv.cuMemHostAlloc(size, flags), "cuMemHostAlloc"))
        super().__init__(address, size, current_context(drv))

    def _release(self, drv: ModuleType, address: int) -> None:
        from ._cuda import check

        check(drv.cuMemFreeHost(address), "cuMemFreeHost")

    def view(self) -> memoryview:
        """A writable byte view of the buffer; do not use it after :meth:`free`."""
        return memoryview((ctypes.c_char * self.nbytes).from_address(self.address)).cast("B")


@final
class DeviceBuffer(_CudaAllocation):
    """Device memory (``cuMemAlloc``) in the current context.

    ``free`` is ``cuMemFree``, which may wait for the device: behind a
    :class:`DropQueue` the work that used the memory is already done.

    Thread-safety: :meth:`free` may be called from any thread, once or more,
    with or without a current context: it makes the allocation's own current.

    Args:
        nbytes: Its size.

    Raises:
        DriverNotFoundError: No NVIDIA driver.
        DeviceError: The allocation failed, or no context is current.
    """

    def __init__(self, nbytes: int) -> None:
        from ._cuda import check, current_context, driver

        size = _check_nbytes(nbytes)
        drv = driver()
        address = int(check(drv.cuMemAlloc(size), "cuMemAlloc"))
        super().__init__(address, size, current_context(drv))

    def _release(self, drv: ModuleType, address: int) -> None:
        from ._cuda import check

        check(drv.cuMemFree(address), "cuMemFree")


@final
class StagingPool(Generic[T]):
    """A fixed set of staging buffers, each handed out again only once reusable.

    The pattern of an async host-to-device pipeline: :meth:`acquire` a buffer,
    fill it, queue the copy that reads it, record a fence, then
    :meth:`release_after` that fence. The buffer returns to the pool only when
    the device has passed the fence, so the next producer can never overwrite
    data a copy is still reading. A buffer whose fence failed is not reused.

    Cancellation: a cancelled :meth:`acquire` takes no buffer.

    Thread-safety: :meth:`release_after` may be called from any thread; the
    rest belongs to the pool's event loop.

    Args:
        make: Makes one buffer; called ``count`` times up front.
        count: How many buffers.
        dispose: Called with each buffer by :meth:`aclose` (``PinnedBuffer.free``,
            say); by default the pool just lets go of them.
    """

    def __init__(
        self,
        make: Callable[[], T],
        count: int,
        *,
        dispose: Callable[[T], object] | None = None,
    ) -> None:
        if not callable(make):
            raise TypeError(f"make must be callable, got {type(make).__qualname__}")
        if dispose is not None and not callable(dispose):
            raise TypeError(f"dispose must be None or callable, got {type(dispose).__qualname__}")
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"count must be an int, got {type(count).__qualname__}")
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        self._dispose = dispose
        self._free: deque[T] = deque()
        try:
            for _ in range(count):
                self._free.append(make())
        except BaseException:
            # None of them leaks; make()'s error is the one the caller sees.
            for error in self._dispose_each(list(self._free)):
                _logger.error("dispose raised for a staging buffer", exc_info=error)
            raise
        self._count = count
        self._returns = DropQueue(on_fault=self._lose)
        self._lost: list[T] = []
        self._changed: anyio.Event | None = None
        self._closed = False

    @classmethod
    def pinned(cls, nbytes: int, count: int) -> StagingPool[PinnedBuffer]:
        """A pool of ``count`` pinned host buffers of ``nbytes`` each, freed on close."""
        return StagingPool(lambda: PinnedBuffer(nbytes), count, dispose=PinnedBuffer.free)

    @property
    def available(self) -> int:
        """Buffers ready to hand out now."""
        return len(self._free)

    async def acquire(self) -> T:
        """Take a buffer, waiting until one is reusable. Always a checkpoint.

        Raises:
            RuntimeError: The pool is closed, or every buffer was lost to
                device faults.
        """
        # Binds the returns to this loop, if the pool was made outside one:
        # buffers handed back from other threads then reach it.
        self._returns._bind()
        await anyio.lowlevel.checkpoint()
        while not self._free or self._closed:
            if self._closed:
                raise RuntimeError("the StagingPool is closed")
            if len(self._lost) == self._count:
                raise RuntimeError("every staging buffer was lost to a device fault")
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()
        return self._free.popleft()

    def release_after(self, fence_or_fences: Fence | Iterable[Fence], buffer: T) -> None:
        """Return ``buffer`` to the pool once the fences given have completed.

        After :meth:`aclose`, the buffer is disposed of once they have
        completed instead, so none taken before the close leaks.

        Thread-safety: safe from any thread.
        """
        self._returns.defer(fence_or_fences, buffer, free=self._give_back)

    def _give_back(self, buffer: T) -> None:
        if self._closed:  # came back after the close: nobody will take it
            if self._dispose is not None:
                self._dispose(buffer)  # what it raises, the DropQueue reports
            return
        self._free.append(buffer)
        self._wake()

    def _dispose_each(self, buffers: list[T]) -> list[Exception]:
        """Dispose of every one of ``buffers``; return what ``dispose`` raised."""
        errors: list[Exception] = []
        if self._dispose is not None:
            for buffer in buffers:
                try:
                    self._dispose(buffer)
                except Exception as error:  # the rest are still disposed of
                    errors.append(error)
        return errors

    def _dispose_free(self) -> list[Exception]:
        buffers, self._free = list(self._free), deque()
        return self._dispose_each(buffers)

    def _lose(self, buffer: T, error: BaseException) -> None:
        _logger.warning("a staging buffer is retired: the work that read it failed (%s)", error)
        self._lost.append(buffer)
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    async def aclose(self) -> None:
        """Wait for every buffer out on the device to come back, then dispose of all.

        From the start of the call, :meth:`acquire` raises (waiting ones too).
        A buffer still held by its taker is disposed of once it is handed to
        :meth:`release_after` and its fences complete. Buffers lost to faults
        are kept, never disposed: the device may still touch them.

        Cancellation: the pool stays closed, the buffers in it are disposed of
        all the same (what ``dispose`` raises then is logged), and those not
        yet back are disposed of as they come back.

        Raises:
            ExceptionGroup: ``dispose`` raised for some buffers; the others
                were disposed of all the same.
        """
        self._closed = True
        self._wake()
        errors: list[Exception] = []
        try:
            await self._returns.drain()
        except ExceptionGroup as group:  # disposing of buffers that came back meanwhile
            errors.extend(group.exceptions)
        except BaseException:
            for error in self._dispose_free():
                _logger.error("dispose raised for a staging buffer", exc_info=error)
            raise
        errors.extend(self._dispose_free())
        if errors:
            raise ExceptionGroup("dispose raised for some staging buffers", errors)
