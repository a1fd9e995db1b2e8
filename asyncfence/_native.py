"""The native wake shim (``_native.c``), loaded with ctypes.

The shim is a plain shared library, built at install where a C compiler
exists. Where it is missing, or disabled with ``ASYNCFENCE_NATIVE=0``,
:func:`shim` returns ``None`` and parked waits use the thread-based fallback
(:mod:`asyncfence._watcher`). See ``docs/design.md`` for the wake path.

Thread-safety: :func:`shim` may be called from any thread.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["DISABLE_VARIABLE", "Shim", "shim", "unavailable_reason"]

#: Set to ``0`` to use the thread-based fallback even where the shim is built.
DISABLE_VARIABLE = "ASYNCFENCE_NATIVE"

_logger = logging.getLogger("asyncfence.native")


@dataclass(frozen=True, slots=True)
class Shim:
    """The loaded library and the addresses the device runtimes call.

    Attributes:
        library: The library, its functions typed.
        path: Where it was loaded from.
        fire: Address of ``af_fire``, a ``void f(void *)``: a CUDA host function.
        opencl_callback: Address of ``af_opencl_callback``, an OpenCL event callback.
        take: ``af_mailbox_take``, called with the GIL held and ctypes
            arguments only (see :func:`_gil_holding`).
        take_undrained: ``af_mailbox_take_undrained``, called the same way.
    """

    library: ctypes.CDLL
    path: str
    fire: int
    opencl_callback: int
    take: Callable[..., int]
    take_undrained: Callable[..., int]

    def live_slots(self) -> int:
        """Signals armed (or fired) whose slots are not yet freed, process-wide."""
        return int(self.library.af_live_slots())

    def live_mailboxes(self) -> int:
        """Mailboxes not yet freed, process-wide (one per loop that parked)."""
        return int(self.library.af_live_mailboxes())


_lock = threading.Lock()
_loaded: Shim | None = None
_reason: str | None = None
_tried = False


def _candidates() -> list[Path]:
    here = Path(__file__).parent
    return [here / f"_shim{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]


def _typed(library: ctypes.CDLL) -> None:
    void_p, u64, size_t = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
    library.af_mailbox_new.restype = void_p
    library.af_mailbox_new.argtypes = []
    library.af_mailbox_fd.restype = ctypes.c_int
    library.af_mailbox_fd.argtypes = [void_p]
    library.af_mailbox_close.restype = None
    library.af_mailbox_close.argtypes = [void_p]
    library.af_mailbox_take.restype = size_t
    library.af_mailbox_take.argtypes = [void_p, ctypes.POINTER(u64), size_t]
    library.af_mailbox_take_undrained.restype = size_t
    library.af_mailbox_take_undrained.argtypes = [void_p, ctypes.POINTER(u64), size_t]
    library.af_slot_new.restype = void_p
    library.af_slot_new.argtypes = [void_p, u64]
    library.af_slot_discard.restype = None
    library.af_slot_discard.argtypes = [void_p]
    library.af_live_slots.restype = ctypes.c_long
    library.af_live_slots.argtypes = []
    library.af_live_mailboxes.restype = ctypes.c_long
    library.af_live_mailboxes.argtypes = []


def _gil_holding(library: ctypes.CDLL, name: str) -> Callable[..., int]:
    """The take ``name`` as a foreign function that keeps the GIL across the call.

    ctypes releases the GIL around every call of a ``CDLL``'s functions. This
    one never blocks (its fd is non-blocking) and runs on the wake path, where
    releasing the GIL would let any other Python thread take it and hold the
    woken loop back for up to a switch interval (5 ms). It declares no
    argument types, so that a call converts nothing: pass ctypes objects only
    (a ``c_void_p``, a ``c_uint64`` array, a ``c_size_t``), never plain ints.
    """
    return ctypes.PYFUNCTYPE(ctypes.c_size_t)((name, library))


def _load() -> tuple[Shim | None, str | None]:
    setting = os.environ.get(DISABLE_VARIABLE, "").strip()
    if setting == "0":
        return None, f"disabled by {DISABLE_VARIABLE}=0"
    if setting not in ("", "1", "auto"):
        _logger.warning("%s=%r is not 0, 1 or auto; treating it as auto", DISABLE_VARIABLE, setting)
    for path in _candidates():
        if not path.exists():
            continue
        try:
            library = ctypes.CDLL(str(path))
            _typed(library)
            take = _gil_holding(library, "af_mailbox_take")
            take_undrained = _gil_holding(library, "af_mailbox_take_undrained")
        except (OSError, AttributeError) as error:
            return None, f"the shim at {path} could not be loaded: {error}"
        fire, opencl_callback = (
            ctypes.cast(f, ctypes.c_void_p).value or 0
            for f in (library.af_fire, library.af_opencl_callback)
        )
        return Shim(library, str(path), fire, opencl_callback, take, take_undrained), None
    return None, "the shim was not built (no C compiler at install)"


def shim() -> Shim | None:
    """The native shim, loaded on first use; ``None`` where it is unavailable."""
    global _loaded, _reason, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _loaded, _reason = _load()
                if _loaded is not None:
                    _logger.debug("native wake path: the shim at %s", _loaded.path)
                else:
                    _logger.debug("thread-based wake path: %s", _reason)
                _tried = True
    return _loaded


def unavailable_reason() -> str | None:
    """Why :func:`shim` returns ``None``; ``None`` where the shim is in use."""
    shim()
    return _reason
