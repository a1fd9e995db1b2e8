"""The PyTorch CPU backend's lab: nothing to open, nothing to hold."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

from ..._validation import type_name

if TYPE_CHECKING:
    from ..._backend import GateParts

__all__ = ["TorchCpuLab"]

_NOTHING_TO_HOLD = (
    "work on torch's CPU streams is done when the call that queues it returns: there is "
    "no device to open and no stream to hold"
)


class TorchCpuLab:
    """Refuses both: the backend is registered without devices (``devices=False``)."""

    fails_gates = False

    def open_device(self) -> NoReturn:
        """Raises, always.

        Raises:
            RuntimeError: There is no device behind torch's CPU streams.
        """
        raise RuntimeError(_NOTHING_TO_HOLD)

    def gate(self, stream: Any) -> GateParts:
        """Raises, always: a CPU stream cannot be held.

        Raises:
            TypeError: ``stream`` is a torch CPU stream, which cannot be held;
                hold an OpenCL queue or a CUDA stream instead.
        """
        raise TypeError(
            f"cannot hold a {type_name(stream)}: {_NOTHING_TO_HOLD}; hold an OpenCL queue or "
            "a CUDA stream instead (the pytest plugin's held_stream fixture gives one)"
        )
