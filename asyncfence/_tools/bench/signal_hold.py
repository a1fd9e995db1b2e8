"""The CUDA signal-hold scenario: how long each completion signal holds its stream.

asyncfence's signal is the native shim's host function (or, without the shim,
libc's ``sem_post``, as the fallback watcher uses), launched through the
driver's own ``cuLaunchHostFunc`` entry point (``_v2`` from CUDA 13.2, the
plain one before): no Python. The comparison is a Python callback through
cuda.bindings' ``cuLaunchHostFunc`` (what numba's ``async_done`` and CuPy's
callbacks do), while the main thread runs Python, as a busy event loop would.
Each signal sits between two timing events on a held stream; the events'
elapsed time is how long the signal held the stream.

It uses the package-internal pieces documented for it:
:class:`asyncfence._poller.NativeMailbox`, :func:`asyncfence._native.shim` and
:meth:`asyncfence._backends.cuda.CudaBackend.host_functions`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import TYPE_CHECKING, Any

from asyncfence.testing import hold

from ..measure import hold_gil

if TYPE_CHECKING:
    from collections.abc import Callable

    from .targets import Context

__all__ = ["PYTHON_CALLBACK", "native_label", "signal_hold"]

PYTHON_CALLBACK = "Python callback: cuLaunchHostFunc"
# How long the main thread runs Python once the stream is let go.
_BUSY_S = 0.002


def native_label(path: str, shim_loaded: bool) -> str:
    """The row name of asyncfence's signal, for a launcher ``path`` ("v2" or "v1")."""
    how = "shim" if shim_loaded else "sem_post"
    return f"asyncfence: native host function ({how}), cuLaunchHostFunc {path}"


class _SemPost:
    """libc's ``sem_post`` on a semaphore of its own: the fallback watcher's kind of signal."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
        self._libc = libc
        self.address = int(libc.malloc(64) or 0)
        if not self.address or libc.sem_init(self.address, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        self.function = ctypes.cast(libc.sem_post, ctypes.c_void_p).value or 0

    def free(self) -> None:
        """Free the semaphore; only once no launched post can still run."""
        self._libc.free(self.address)


async def signal_hold(ctx: Context) -> None:
    """Time each signal between two timing events; see the module's docstring."""
    from asyncfence._backend import backend_named
    from asyncfence._backends.cuda import CudaBackend
    from asyncfence._backends.cuda._driver import check, driver
    from asyncfence._native import shim
    from asyncfence._poller import NativeMailbox

    target = ctx.target
    drv = driver()
    backend = backend_named("cuda")
    assert isinstance(backend, CudaBackend)
    launcher = backend.host_functions()
    native = shim()
    mailbox = NativeMailbox(native) if native is not None else None
    semaphore = None if mailbox is not None else _SemPost()
    stream = target.new_stream()
    timing = drv.CUevent_flags.CU_EVENT_DEFAULT
    start = check(drv.cuEventCreate(timing), "cuEventCreate")
    end = check(drv.cuEventCreate(timing), "cuEventCreate")

    def native_signal() -> int:
        if mailbox is not None:
            signal, _slot = mailbox.signal(0)
            return launcher.launch(int(stream), signal.host_function, signal.argument)
        assert semaphore is not None
        return launcher.launch(int(stream), semaphore.function, semaphore.address)

    # A callback that runs Python, as numba's and CuPy's do (a ctypes thunk,
    # which takes the GIL; the v1 wrapper of cuda.bindings takes it as well).
    python_callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _data: None)
    python_fn = drv.CUhostFn(ctypes.cast(python_callback, ctypes.c_void_p).value)
    signals: dict[str, Callable[[], Any]] = {}
    if launcher.path == "none":
        ctx.results.meta.setdefault("left_out", {})[native_label("none", mailbox is not None)] = (
            "the driver offers no cuLaunchHostFunc entry point"
        )
    else:
        signals[native_label(launcher.path, mailbox is not None)] = lambda: (native_signal(),)
    signals[PYTHON_CALLBACK] = lambda: drv.cuLaunchHostFunc(stream, python_fn, 0)
    samples = ctx.results.signal_hold
    try:
        for _ in range(max(3, ctx.config.wake_trials // 4)):
            for label, launch in signals.items():
                with hold(stream) as gate:  # queue it all before the stream runs
                    check(drv.cuEventRecord(start, stream), "cuEventRecord")
                    check(launch(), label)
                    check(drv.cuEventRecord(end, stream), "cuEventRecord")
                    gate.release()
                    hold_gil(_BUSY_S)
                check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")
                if mailbox is not None:
                    mailbox.take()
                elapsed_ms = check(drv.cuEventElapsedTime(start, end), "cuEventElapsedTime")
                samples.setdefault(label, []).append(float(elapsed_ms) / 1e3)
    finally:
        drv.cuStreamSynchronize(stream)
        drv.cuEventDestroy(start)
        drv.cuEventDestroy(end)
        if semaphore is not None:
            semaphore.free()
