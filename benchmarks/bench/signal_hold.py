"""The CUDA signal-hold scenario: how long each completion signal holds its stream.

asyncfence's signal is the native shim's host function, launched through the
driver's own ``cuLaunchHostFunc`` entry point (``_v2`` from CUDA 13.2, the
plain one before): no Python. The comparison is a Python callback through
cuda.bindings' ``cuLaunchHostFunc`` (what numba's ``async_done`` and CuPy's
callbacks do), while the main thread runs Python, as a busy event loop would.
Each signal sits between two timing events on a held stream; the events'
elapsed time is how long the signal held the stream.

asyncfence's signal comes from :meth:`asyncfence.testing.CudaDevice.launch_wake_signal`,
which ``asyncfence.testing`` offers for this measurement.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from asyncfence.testing import CudaDevice, hold

from ..measure import hold_gil

if TYPE_CHECKING:
    from collections.abc import Callable

    from .targets import Context

__all__ = ["PYTHON_CALLBACK", "native_label", "signal_hold"]

PYTHON_CALLBACK = "Python callback: cuLaunchHostFunc"
# How long the main thread runs Python once the stream is let go.
_BUSY_S = 0.002


def native_label(path: str) -> str:
    """The row name of asyncfence's signal, for a launcher ``path`` ("v2" or "v1")."""
    return f"asyncfence: native host function (shim), cuLaunchHostFunc {path}"


def _check(result: tuple[Any, ...], what: str) -> Any:
    """Unpack a cuda.bindings ``(CUresult, value...)`` tuple, raising on error."""
    if int(result[0]) != 0:
        raise RuntimeError(f"{what} failed: {result[0]!r}")
    return result[1] if len(result) > 1 else None


async def signal_hold(ctx: Context) -> None:
    """Time each signal between two timing events; see the module's docstring."""
    from cuda.bindings import driver as drv

    target = ctx.target
    device = target.device
    assert isinstance(device, CudaDevice)
    stream = target.new_stream()
    timing = drv.CUevent_flags.CU_EVENT_DEFAULT
    start = _check(drv.cuEventCreate(timing), "cuEventCreate")
    end = _check(drv.cuEventCreate(timing), "cuEventCreate")
    signals: dict[str, Callable[[], object]] = {}  # each raises if the launch fails
    try:
        with hold(stream):  # a first launch, to learn its entry point
            path = device.launch_wake_signal(stream)
    except RuntimeError as unavailable:
        ctx.results.meta.setdefault("left_out", {})[native_label("none")] = str(unavailable)
    else:
        signals[native_label(path)] = lambda: device.launch_wake_signal(stream)
    _check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")

    # A callback that runs Python, as numba's and CuPy's do (a ctypes thunk,
    # which takes the GIL; the v1 wrapper of cuda.bindings takes it as well).
    python_callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _data: None)
    python_fn = drv.CUhostFn(ctypes.cast(python_callback, ctypes.c_void_p).value)
    signals[PYTHON_CALLBACK] = lambda: _check(
        drv.cuLaunchHostFunc(stream, python_fn, 0), "cuLaunchHostFunc"
    )
    samples = ctx.results.signal_hold
    try:
        for _ in range(max(3, ctx.config.wake_trials // 4)):
            for label, launch in signals.items():
                with hold(stream) as gate:  # queue it all before the stream runs
                    _check(drv.cuEventRecord(start, stream), "cuEventRecord")
                    launch()
                    _check(drv.cuEventRecord(end, stream), "cuEventRecord")
                    gate.release()
                    hold_gil(_BUSY_S)
                _check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")
                elapsed_ms = _check(drv.cuEventElapsedTime(start, end), "cuEventElapsedTime")
                samples.setdefault(label, []).append(float(elapsed_ms) / 1e3)
    finally:
        drv.cuStreamSynchronize(stream)
        drv.cuEventDestroy(start)
        drv.cuEventDestroy(end)
