"""Whether code pays for the busy work's calibration inside a ``launch_busy`` it times.

A device learns how much busy work lasts how long at its first
:meth:`~asyncfence.testing.Device.chunks_for` call, which runs and times some
work. ``launch_busy`` makes that call, so the first ``launch_busy`` on a fresh
device lasts far longer than asked. The examples and the notebook calibrate
first; :class:`CalibrationWatch` tells whether they did. Imported by the
notebook's test into the Jupyter kernel, so it needs nothing but the library.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CalibrationWatch"]


class CalibrationWatch:
    """Watches devices: is their first ``chunks_for`` call made from inside ``launch_busy``?

    Attributes:
        launches: ``launch_busy`` calls on the watched devices.
        calibrated_in_launch: Per watched device, in order: whether its first
            ``chunks_for`` call (the one that calibrates) came from inside a
            ``launch_busy``; ``None`` while it has had none.
    """

    def __init__(self) -> None:
        self.launches = 0
        self.calibrated_in_launch: list[bool | None] = []

    def watch(self, device: Any) -> Any:
        """Wrap ``device``'s ``chunks_for`` and ``launch_busy`` to watch them; returns it."""
        index = len(self.calibrated_in_launch)
        self.calibrated_in_launch.append(None)
        real_chunks_for, real_launch_busy = device.chunks_for, device.launch_busy
        inside = False

        def chunks_for(seconds: float) -> int:
            if self.calibrated_in_launch[index] is None:
                self.calibrated_in_launch[index] = inside
            return int(real_chunks_for(seconds))

        def launch_busy(stream: Any, seconds: float) -> None:
            nonlocal inside
            self.launches += 1
            inside = True
            try:
                real_launch_busy(stream, seconds)  # calls chunks_for: the wrapper above
            finally:
                inside = False

        device.chunks_for = chunks_for
        device.launch_busy = launch_busy
        return device
