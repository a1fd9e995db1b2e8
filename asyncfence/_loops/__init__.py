"""The event loops asyncfence runs on: asyncio (uvloop included) and trio, and so anyio.

Each loop library has one driver (:class:`LoopDriver`, in ``_driver``), in a
module of its own; :func:`current_driver` finds the running loop's. Adding a
loop library is one such module and a line here.
"""

from __future__ import annotations

import asyncio
import sys
from asyncio import _get_running_loop

from ._asyncio import DRIVER_ATTRIBUTE, driver_of
from ._driver import Chain, LoopDriver, Waiter
from ._trio import driver_of_run

__all__ = ["Chain", "LoopDriver", "Waiter", "current_driver", "existing_driver"]


def _in_trio() -> bool:
    """Whether this runs in a trio task (trio is never imported to find out).

    Another thread may be importing trio meanwhile: ``sys.modules`` then holds
    a module still being filled in. Its ``lowlevel`` is bound only once that
    submodule is whole, and no trio run can have started before: without it,
    this is no trio task.
    """
    lowlevel = getattr(sys.modules.get("trio"), "lowlevel", None)
    return lowlevel is not None and bool(lowlevel.in_trio_task())


def _running_asyncio_loop() -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "awaiting a fence needs a running asyncio or trio event loop; "
            "from synchronous code, call fence.wait_sync()"
        ) from None


def current_driver() -> LoopDriver:
    """The driver of the loop that runs the calling task, made on first use.

    On every wait's path: the lookups are written out here.

    Raises:
        RuntimeError: No asyncio or trio loop runs the calling task.
    """
    # As _in_trio, written out: a trio still being imported has no lowlevel yet.
    trio_lowlevel = getattr(sys.modules.get("trio"), "lowlevel", None)
    if trio_lowlevel is not None and trio_lowlevel.in_trio_task():
        driver: LoopDriver | None = driver_of_run(create=True)
    else:
        loop = _get_running_loop() or _running_asyncio_loop()  # that raises, saying why
        driver = getattr(loop, DRIVER_ATTRIBUTE, None) or driver_of(loop, create=True)
    assert driver is not None
    return driver


def existing_driver() -> LoopDriver | None:
    """The running loop's driver if one was made; never makes one.

    Raises:
        RuntimeError: No asyncio or trio loop runs the calling task.
    """
    if _in_trio():
        return driver_of_run(create=False)
    return driver_of(_running_asyncio_loop(), create=False)
