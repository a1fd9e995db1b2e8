"""The PyTorch CPU backend's runtime side: a fence on a CPU stream is done at once.

PyTorch runs CPU work synchronously: by the time ``record()`` is called,
everything queued on a CPU stream before it has run. A fence recorded there
has nothing to wait for, so its marker is a constant that every query finds
passed, a stream wait adds nothing, and no signal is ever armed. Awaiting
such a fence is still a checkpoint, as every await of asyncfence is.

Streams accepted, by type (``claims`` never imports torch: it first checks
that the type's module is torch's):

* ``torch.cpu.Stream`` and its subclasses: what
  ``torch.get_device_module("cpu").current_stream()``, ``torch.cpu.Stream()``
  and ``torch.cpu.current_stream()`` give;
* ``torch.Stream`` itself, PyTorch's device-generic stream, on the CPU
  (``torch.Stream(device="cpu")``). Its type is the same on every device, so
  it is claimed by the object: one on CUDA is the CUDA backend's (registered
  before this one), one on another device is claimed here, then refused with
  a ``TypeError`` that says which stream to pass instead.

``torch.cuda.Stream`` is the CUDA backend's.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Final, final

from ..._backend import Backend, BackendStatistics, QueueInfo
from ..._validation import type_name
from ._lab import TorchCpuLab

if TYPE_CHECKING:
    from collections.abc import Hashable

    from ..._native import NativeMailbox

__all__ = ["TorchCpuBackend"]

_ACCEPTS = (
    "a torch CPU stream: torch.cpu.Stream (torch.get_device_module('cpu').current_stream()) "
    "or a torch.Stream on the CPU"
)
# Every CPU stream is one in-order queue as far as fences go: their work is
# done before any fence is recorded.
_QUEUE: Final = QueueInfo(key="torch-cpu")


@final
class _Passed:
    """The marker of every fence on a CPU stream: passed when it is recorded."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<torch CPU marker: passed>"


_PASSED: Final = _Passed()


def _is_torch_type(kind: type) -> bool:
    return kind.__module__.partition(".")[0] == "torch"


class TorchCpuBackend(Backend[_Passed]):
    """Fences on torch's CPU streams: done when recorded.

    Thread-safety: stateless; every method may be called from any thread.
    """

    name = "torch-cpu"
    title = "PyTorch CPU"
    accepts = _ACCEPTS
    default_rank = 2  # registered without devices: never the default device
    fork_safe = True  # no runtime: a forked child (a DataLoader worker) records as well
    refcounted_markers = True  # a marker is a plain object, with nothing to give back
    claimed_by_object = frozenset({("torch", "Stream")})  # torch.Stream: by its device

    def claims(self, stream: object) -> bool:
        kind = type(stream)
        if not _is_torch_type(kind):  # torch is never imported for another library's stream
            return False
        torch = sys.modules.get("torch")
        if torch is None:  # a type of torch's exists, so torch is imported
            return False
        return issubclass(kind, torch.cpu.Stream) or kind is torch.Stream

    def _check(self, stream: object) -> None:
        """Refuse what is not a CPU stream (a ``torch.Stream`` on another device, say).

        Raises:
            TypeError: ``stream`` is not a torch CPU stream; the message says
                what to pass instead.
        """
        if not self.claims(stream):
            raise TypeError(f"expected {_ACCEPTS}; got {type_name(stream)} object")
        device = getattr(stream, "device", None)  # a torch.device; torch.cpu.Stream has none
        device_type = "cpu" if device is None else getattr(device, "type", device)
        if device_type != "cpu":
            raise TypeError(
                f"expected {_ACCEPTS}; got a torch.Stream on {device_type!r}: for work on "
                f"that device pass its own stream, torch.get_device_module({device_type!r})"
                ".current_stream()"
            )

    def stream_key(self, stream: object) -> Hashable:
        self._check(stream)
        return _QUEUE.key

    def record(self, stream: object) -> tuple[_Passed, QueueInfo]:
        self._check(stream)
        return _PASSED, _QUEUE

    def query(self, marker: _Passed) -> bool:
        return True

    def check_stream(self, origin: QueueInfo, stream: object) -> None:
        self._check(stream)

    def stream_wait(self, marker: _Passed, origin: QueueInfo, stream: object) -> None:
        """Nothing to do: the fence was passed when it was recorded."""

    def arm(self, marker: _Passed, queue: QueueInfo, mailbox: NativeMailbox, token: int) -> bool:
        # Never needed (the fence settles at its first query, before any wait
        # parks it); no signal can be armed, so a caller would poll instead.
        return False

    def statistics(self) -> BackendStatistics:
        return BackendStatistics(backend=self.name)

    def release(self, marker: _Passed) -> None:
        """Nothing to give back."""

    def warm_up(self, stream: object) -> None:
        """Nothing to load (no runtime, no signal): only refuses what a record would."""
        self._check(stream)

    def lab(self) -> TorchCpuLab:
        return TorchCpuLab()

    def runtime_initialised(self) -> bool:
        # No runtime: a forked child may record on CPU streams as its parent did.
        return False
