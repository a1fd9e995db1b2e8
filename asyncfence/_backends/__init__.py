"""The device backends, one package each, registered here (see :mod:`asyncfence._backend`).

Streams are matched against them in this order; the default device is the
one of lowest ``default_rank`` that has a device (a GPU first).
"""

from .._backend import register_backend
from .cuda import CudaBackend
from .opencl import OpenCLBackend

register_backend(OpenCLBackend())
register_backend(CudaBackend())
