"""Helpers for testing and demonstrating code that awaits device work.

* :func:`hold` holds a stream from the host, so a test decides exactly when the
  work queued on it completes, or fails.
* :func:`open_default_device` opens the device the demo, the benchmark and the
  tests run on, with streams and busy work to await.
"""

from ._devices import OpenCLDevice as OpenCLDevice
from ._devices import open_default_device as open_default_device
from ._testing import StreamGate as StreamGate
from ._testing import hold as hold

__all__ = ("OpenCLDevice", "StreamGate", "hold", "open_default_device")

for _name in __all__:
    globals()[_name].__module__ = "asyncfence.testing"
del _name
