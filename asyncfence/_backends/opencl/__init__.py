"""The OpenCL backend: a fence is a marker on a ``pyopencl.CommandQueue``.

``_runtime`` is what the fence logic uses; ``_lab`` the device and test gate
for tests, the demo and the benchmark, loaded only when asked for.
"""

from ._runtime import OpenCLBackend as OpenCLBackend

__all__ = ["OpenCLBackend"]
