"""Waiting on Python state (not device state) from the loop, for the drop queue and pools.

They use anyio's ``Event``, which works on asyncio and trio alike; the device
waits go through the poller. Loop thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Changes"]


class Changes:
    """Tasks wait until a condition holds; whoever changes the state calls :meth:`notify`.

    A fresh event per round of changes, so every waiter re-checks its own
    condition after each change. Not thread-safe: the loop's thread only.
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    def notify(self) -> None:
        """Wake every waiter to re-check its condition."""
        event, self._event = self._event, None
        if event is not None:
            event.set()

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Return once ``condition()`` holds. Always a checkpoint.

        Cancellation: a cancelled wait changes nothing.
        """
        await anyio.lowlevel.checkpoint()
        while not condition():
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
