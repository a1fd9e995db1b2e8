"""The PyTorch CPU backend: torch's CPU streams, whose work is done when the call returns.

``torch.cpu.Stream`` (what ``torch.get_device_module("cpu").current_stream()``
gives device-agnostic code) exists so that such code runs unchanged on the
CPU: PyTorch runs CPU work synchronously, so a fence recorded on one is done
at once. ``_runtime`` is what the fence logic uses, ``_lab`` says that there
is no device to open and no stream to hold. Neither imports torch: a stream
is claimed only once its type's module says it comes from torch.
"""

from ._runtime import TorchCpuBackend as TorchCpuBackend

__all__ = ["TorchCpuBackend"]
