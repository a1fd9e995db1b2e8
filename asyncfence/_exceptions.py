"""The exception hierarchy shared by every backend."""

from __future__ import annotations

import anyio

__all__ = [
    "ClosedResourceError",
    "DeviceError",
    "DriverNotFoundError",
    "FenceError",
    "FenceLostError",
    "TokenRefusedError",
]


class ClosedResourceError(anyio.ClosedResourceError):
    """A closed :class:`~asyncfence.DropQueue` or :class:`~asyncfence.StagingPool` was used.

    It is anyio's ``ClosedResourceError``, as trio and anyio raise for a
    closed channel or stream: ``except anyio.ClosedResourceError`` catches it.
    """


class FenceError(Exception):
    """Base class of every error asyncfence raises about device work.

    Errors about the caller's input are the builtin ``TypeError`` and
    ``ValueError``, and an expired wait is the builtin ``TimeoutError``.
    """


class DeviceError(FenceError):
    """The device reported that the work before a fence failed.

    Every waiter on the fence receives its own instance, so tracebacks from
    different tasks never mix.

    Attributes:
        backend: The backend that reported it, ``"opencl"`` or ``"cuda"``.
        code: The backend's numeric code: a negative OpenCL execution status,
            or a ``CUresult`` value.
        name: The backend's symbolic name for ``code``, such as
            ``"CUDA_ERROR_ILLEGAL_ADDRESS"``.
    """

    def __init__(self, backend: str, code: int, name: str, detail: str = "") -> None:
        self.backend = backend
        self.code = code
        self.name = name
        self.detail = detail
        message = f"{backend} device error {code} ({name})"
        super().__init__(f"{message}: {detail}" if detail else message)

    def __reduce__(self) -> tuple[type[DeviceError], tuple[str, int, str, str]]:
        return (type(self), (self.backend, self.code, self.name, self.detail))


class DriverNotFoundError(FenceError):
    """A device runtime the stream needs is not installed.

    Raised when a CUDA stream is used on a machine without the NVIDIA driver
    (``libcuda.so.1``). OpenCL keeps working without it.
    """


class FenceLostError(FenceError):
    """An imported fence's outcome can never be known: its exporting process went away.

    The process that exported the fence exited, crashed or stopped serving its
    exports (its event loop ended) before it could say how the work ended.
    The work may have completed; nothing can tell.
    """


class TokenRefusedError(FenceError):
    """The exporting process refused an imported fence's token.

    The token was forged, was used already (a token answers one import), or
    was presented by a process of another user. Nothing was done on the
    exporting side.
    """
