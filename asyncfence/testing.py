"""Helpers for testing and demonstrating code that awaits device work.

* :func:`hold` holds a stream from the host, so a test decides exactly when the
  work queued on it completes, or fails (:class:`StreamGate`).
* :func:`open_default_device` opens the device the demo, the benchmark and the
  tests run on (a :class:`Device`: :class:`CudaDevice` on a GPU, else
  :class:`OpenCLDevice`), with streams and busy work to await.
"""

from ._backends.cuda._lab import CudaDevice as CudaDevice
from ._backends.opencl._lab import OpenCLDevice as OpenCLDevice
from ._devices import Device as Device
from ._testing import StreamGate as StreamGate
from ._testing import hold as hold
from ._testing import open_default_device as open_default_device

__all__ = ("CudaDevice", "Device", "OpenCLDevice", "StreamGate", "hold", "open_default_device")

for _name in __all__:
    globals()[_name].__module__ = "asyncfence.testing"
del _name
