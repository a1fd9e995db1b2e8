"""The CUDA backend: a fence is a pooled CUDA event recorded on a CUDA stream.

``_runtime`` is what the fence logic uses, ``_driver`` how it loads and calls
the driver, ``_buffers`` the CUDA memory the drop queue typically holds, and
``_lab`` the device and test gate for tests, the demo and the benchmark
(loaded only when asked for).
"""

from ._buffers import DeviceBuffer as DeviceBuffer
from ._buffers import PinnedBuffer as PinnedBuffer
from ._runtime import CudaBackend as CudaBackend

__all__ = ["CudaBackend", "DeviceBuffer", "PinnedBuffer"]
