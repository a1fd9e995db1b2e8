"""The CUDA backend: a fence is a pooled CUDA event recorded on a CUDA stream.

``_runtime`` is what the fence logic uses, ``_driver`` how it loads and calls
the driver, ``_buffers`` the CUDA memory the drop queue typically holds, and
``_lab`` the device and test gate for ``asyncfence.testing``, the demo and
the benchmark. None loads the driver until CUDA is first used.
"""

from ._buffers import DeviceBuffer as DeviceBuffer
from ._buffers import PinnedBuffer as PinnedBuffer
from ._lab import CudaDevice as CudaDevice
from ._runtime import CudaBackend as CudaBackend

__all__ = ["CudaBackend", "CudaDevice", "DeviceBuffer", "PinnedBuffer"]
