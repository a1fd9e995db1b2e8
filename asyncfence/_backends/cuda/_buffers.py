"""CUDA memory the drop queue typically holds: pinned host memory and device memory."""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import TYPE_CHECKING, final

from ..._validation import check_int
from ._driver import check, current_context, driver, pop_context, push_context

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["DeviceBuffer", "PinnedBuffer"]


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
    return check_int("nbytes", nbytes, minimum=1, maximum=sys.maxsize)


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
        size = _check_nbytes(nbytes)
        drv = driver("pinned host memory (PinnedBuffer)")
        flags = drv.CU_MEMHOSTALLOC_PORTABLE | drv.CU_MEMHOSTALLOC_DEVICEMAP
        address = int(check(drv.cuMemHostAlloc(size, flags), "cuMemHostAlloc"))
        super().__init__(address, size, current_context(drv))

    def _release(self, drv: ModuleType, address: int) -> None:
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
        size = _check_nbytes(nbytes)
        drv = driver("device memory (DeviceBuffer)")
        address = int(check(drv.cuMemAlloc(size), "cuMemAlloc"))
        super().__init__(address, size, current_context(drv))

    def _release(self, drv: ModuleType, address: int) -> None:
        check(drv.cuMemFree(address), "cuMemFree")
