"""asyncfence's pytest plugin: device fixtures and a ``gpu`` marker.

Loaded by pytest wherever asyncfence is installed (the ``pytest11`` entry
point). It works with pytest-asyncio and with anyio's plugin alike: the
fixtures are synchronous, and the fences they help make are awaited in the
tests' own loops.

Fixtures:

* ``fence_device``: the default device, a GPU if present, otherwise PoCL's
  OpenCL on the CPU. ``--fence-device=cuda|opencl`` (or the ``fence_device``
  ini option) picks one; a missing device skips the test.
* ``fence_stream``: a fresh stream (a command queue on OpenCL) on it, waited
  for and released afterwards.
* ``held_stream``: an :class:`asyncfence.testing.StreamGate` holding a fresh
  stream (``held_stream.stream``): work queued on it waits until the test calls
  ``held_stream.release()``, so "work still running" is deterministic. Released
  at teardown if the test did not.
* ``torch_stream``: a fresh PyTorch stream, a ``torch.cuda.Stream`` on CUDA
  device 0 where PyTorch sees a GPU, else a ``torch.cpu.Stream`` (CPU-only
  PyTorch: a fence on it is done when recorded). Skips where PyTorch is not
  installed.
* ``cuda_core_stream``: a fresh ``cuda.core`` stream on CUDA device 0. Skips
  where cuda.core or a CUDA device is missing.

Async tests under anyio's plugin run on each backend its ``anyio_backend``
fixture names (since anyio 4.12, by default, every one installed: trio too,
where it is); the fixtures here serve each.

The ``gpu`` marker skips a test where no registered backend finds a GPU (an
NVIDIA GPU with its driver, say).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import pytest

from ._backend import backend_named, backend_names
from .testing import StreamGate, hold, open_default_device

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .testing import Device

__all__ = ("cuda_core_stream", "fence_device", "fence_stream", "held_stream", "torch_stream")

_gpu_found: bool | None = None


def _choices() -> tuple[str, ...]:
    return ("auto", *backend_names())


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--fence-device`` and the ``fence_device`` ini option."""
    group = parser.getgroup("asyncfence")
    names = backend_names()
    group.addoption(
        "--fence-device",
        choices=_choices(),
        default=None,
        help=f"device for the fence_device fixture: auto (a GPU if present), {', '.join(names)}",
    )
    parser.addini("fence_device", "device for the fence_device fixture", default="auto")


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``gpu`` marker."""
    config.addinivalue_line("markers", "gpu: needs a GPU; skipped without one")


def gpu_present() -> bool:
    """Whether any registered backend opens a device that is a GPU (cached)."""
    global _gpu_found
    if _gpu_found is None:
        _gpu_found = False
        for name in backend_names():  # a GPU's backend first
            try:
                device = backend_named(name).lab().open_device()
            except (RuntimeError, ImportError):
                continue
            if device.is_gpu:
                _gpu_found = True
                break
    return _gpu_found


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests where there is no GPU, reported at each test."""
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if marked and not gpu_present():
        skip = pytest.mark.skip(reason="needs a GPU; no backend found one")
        for item in marked:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fence_device(pytestconfig: pytest.Config) -> Device:
    """The device to test on: a GPU if present, otherwise PoCL (see the module doc)."""
    choice = pytestconfig.getoption("fence_device") or pytestconfig.getini("fence_device")
    if choice not in _choices():
        raise pytest.UsageError(
            f"fence_device must be one of {', '.join(_choices())}; got {choice!r}"
        )
    try:
        return open_default_device(None if choice == "auto" else choice)
    except RuntimeError as missing:
        pytest.skip(str(missing))


@pytest.fixture
def fence_stream(fence_device: Device) -> Iterator[Any]:
    """A fresh stream on ``fence_device``, waited for and released afterwards."""
    stream = fence_device.new_stream()
    yield stream
    fence_device.close_stream(stream)


@pytest.fixture
def held_stream(fence_device: Device) -> Iterator[StreamGate]:
    """A gate holding a fresh stream until the test releases it (see the module doc)."""
    stream = fence_device.new_stream()
    with hold(stream) as gate:
        yield gate
    fence_device.close_stream(stream)


def _import_or_skip(module: str, what: str) -> Any:
    """``module``, or skip the test where it is not installed.

    Only a missing ``module`` skips: one that is installed but fails to
    import (a missing shared library) fails the test, with its error.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as missing:
        top = module.partition(".")[0]
        name = missing.name
        if name is None or not (module == name or module.startswith(f"{name}.")):
            raise
        pytest.skip(f"{what} is not installed (the {top!r} package)")


@pytest.fixture
def torch_stream() -> Iterator[Any]:
    """A fresh PyTorch stream: on CUDA device 0 where PyTorch sees a GPU, else on the CPU.

    A ``torch.cuda.Stream``, or a ``torch.cpu.Stream`` on CPU-only PyTorch,
    where work is done when the call that queues it returns and so is every
    fence recorded on it. Skips where PyTorch is not installed.
    """
    torch = _import_or_skip("torch", "PyTorch")
    if torch.cuda.is_available():
        stream = torch.cuda.Stream(device=0)
        yield stream
        stream.synchronize()
    else:
        yield torch.cpu.Stream()


@pytest.fixture
def cuda_core_stream() -> Iterator[Any]:
    """A fresh ``cuda.core`` stream on CUDA device 0, synchronised and closed afterwards.

    Skips where cuda.core is not installed or there is no CUDA device (no
    NVIDIA driver, say), saying which.
    """
    core = _import_or_skip("cuda.core", "cuda.core")
    try:
        backend_named("cuda").lab().open_device()  # a driver and a device, or why not
    except RuntimeError as missing:
        pytest.skip(str(missing))
    device_class = getattr(core, "Device", None)
    if device_class is None:  # cuda.core before 0.4: under experimental
        device_class = importlib.import_module("cuda.core.experimental").Device
    device = device_class(0)
    device.set_current()
    stream = device.create_stream()
    yield stream
    stream.sync()
    stream.close()
