"""Helpers for testing and demonstrating code that awaits device work.

* :func:`hold` holds a stream from the host, so a test decides exactly when the
  work queued on it completes, or fails (:class:`StreamGate`).
* :func:`open_default_device` opens the device the demo, the benchmark and the
  tests run on (a :class:`Device`: the first registered backend's that has
  one, a GPU first), with streams and busy work to await.

The pytest plugin (:mod:`asyncfence.pytest_plugin`) gives them as fixtures.
"""

from .._backends import CudaDevice as CudaDevice
from .._backends import OpenCLDevice as OpenCLDevice
from .._devices import Device as Device
from ._gates import StreamGate as StreamGate
from ._gates import hold as hold
from ._gates import open_default_device as open_default_device

__all__ = ("CudaDevice", "Device", "OpenCLDevice", "StreamGate", "hold", "open_default_device")

for _name in __all__:
    globals()[_name].__module__ = "asyncfence.testing"
del _name
