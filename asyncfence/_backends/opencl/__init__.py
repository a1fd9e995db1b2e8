"""The OpenCL backend: a fence is a marker on a ``pyopencl.CommandQueue``.

``_runtime`` is what the fence logic uses; ``_lab`` the device and test gate
for ``asyncfence.testing``, the demo and the benchmark. Neither imports
pyopencl until a caller hands it one of its queues or opens its device.
"""

from ._lab import OpenCLDevice as OpenCLDevice
from ._runtime import OpenCLBackend as OpenCLBackend

__all__ = ["OpenCLBackend", "OpenCLDevice"]
