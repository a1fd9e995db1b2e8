"""The device backends, one package each, registered here (see :mod:`asyncfence._backend`).

Streams are matched against them in this order; the default device is the
one of lowest ``default_rank`` that has a device (a GPU first). A backend's
public classes (CUDA's buffers, each lab's device) are re-exported from here
for ``asyncfence`` and ``asyncfence.testing``.
"""

from .._backend import register_backend
from .cuda import CudaBackend, CudaDevice, DeviceBuffer, PinnedBuffer
from .opencl import OpenCLBackend, OpenCLDevice
from .torch_cpu import TorchCpuBackend

__all__ = ["CudaDevice", "DeviceBuffer", "OpenCLDevice", "PinnedBuffer"]

register_backend(OpenCLBackend())
register_backend(CudaBackend())
# After CUDA's, which takes torch.cuda.Stream; no device to open or hold.
register_backend(TorchCpuBackend(), devices=False)
