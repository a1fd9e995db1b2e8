"""The native wake shim (``_native.c``), loaded with ctypes, and a loop's mailbox in it.

The shim is a plain shared library (``_shim.so``, no Python C-API), built at
install where a C compiler exists. Where it is missing, or disabled with
``ASYNCFENCE_NATIVE=0``, :func:`shim` returns ``None`` and parked waits are
re-checked on the loop instead. See ``docs/design.md`` ("The wake path").

Thread-safety: :func:`shim` may be called from any thread; a
:class:`NativeMailbox` belongs to its loop's thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from . import _fork

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "DISABLE_VARIABLE",
    "HOW_TO_BUILD",
    "LIBRARY_NAME",
    "NativeMailbox",
    "Shim",
    "shim",
    "unavailable_for_good",
    "unavailable_reason",
]

#: Set to ``0`` to re-check parked waits on the loop even where the shim is built.
DISABLE_VARIABLE: Final = "ASYNCFENCE_NATIVE"
#: The shim's file name, beside this module.
LIBRARY_NAME: Final = "_shim.so"
#: How to get the shim where it is missing, for the warning that says so.
HOW_TO_BUILD: Final = (
    "install a C compiler (gcc or clang) and reinstall asyncfence; without the shim, "
    "parked waits are re-checked on the loop, up to every poll_cap"
)
# The shim's interface, as af_abi_version() numbers it: a library of another
# version (left by an older install) is not used.
_ABI_VERSION = 2
# af_opencl_arm's answers besides OpenCL's own codes (0, or negative).
_ARM_NO_ENTRY = 2  # (1: no memory)
# Why a forked child may not arm a signal on a mailbox its parent made: the fd
# is the parent's too, and the parent would be the one woken.
_PARENTS_MAILBOX = "this mailbox belongs to the process this one was forked from"

_logger = logging.getLogger("asyncfence.native")


@dataclass(frozen=True, slots=True)
class Shim:
    """The loaded library and the addresses the device runtimes call.

    Attributes:
        library: The library, its functions typed.
        path: Where it was loaded from.
        fire: Address of ``af_fire``, a ``void f(void *)``: a CUDA host function.
        opencl_callback: Address of ``af_opencl_callback``, an OpenCL event callback.
        take: ``af_mailbox_take``, called with the GIL held and a ``c_void_p``
            only (see :func:`_gil_holding`).
        take_undrained: ``af_mailbox_take_undrained``, called the same way.
        opencl_arm: ``af_opencl_arm``, called with a ``c_void_p`` only and the
            GIL released.
        slot_new: ``af_slot_new`` (a CUDA host function's slot), called with the GIL
            held (it only allocates).
        take_batch: Tokens a take hands over at most.
    """

    library: ctypes.CDLL
    path: str
    fire: int
    opencl_callback: int
    take: Callable[[ctypes.c_void_p], int]
    take_undrained: Callable[[ctypes.c_void_p], int]
    opencl_arm: Callable[[ctypes.c_void_p], int]
    slot_new: Callable[[int, int], int | None]
    take_batch: int

    def set_opencl_entry(self, address: int) -> None:
        """Tell the shim the OpenCL library's ``clSetEventCallback``.

        :meth:`NativeMailbox.arm_event_callback` calls it; set once per process.
        """
        self.library.af_set_opencl_entry(address)

    def live_slots(self) -> int:
        """Signals armed (or fired) whose slots are not yet freed, process-wide."""
        return int(self.library.af_live_slots())

    def live_mailboxes(self) -> int:
        """Mailboxes not yet freed, process-wide (one per loop that parked)."""
        return int(self.library.af_live_mailboxes())


_lock = threading.Lock()
_fork.renew_after_fork(sys.modules[__name__], "_lock")
_loaded: Shim | None = None
_reason: str | None = None
_tried = False


def _typed(library: ctypes.CDLL) -> None:
    void_p, u64, size_t = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
    library.af_mailbox_new.restype = void_p
    library.af_mailbox_new.argtypes = []
    library.af_mailbox_fd.restype = ctypes.c_int
    library.af_mailbox_fd.argtypes = [void_p]
    library.af_mailbox_close.restype = None
    library.af_mailbox_close.argtypes = [void_p]
    library.af_abi_version.restype = ctypes.c_int
    library.af_abi_version.argtypes = []
    library.af_take_batch.restype = size_t
    library.af_take_batch.argtypes = []
    library.af_mailbox_tokens.restype = void_p
    library.af_mailbox_tokens.argtypes = [void_p]
    library.af_mailbox_arguments.restype = void_p
    library.af_mailbox_arguments.argtypes = [void_p]
    library.af_set_opencl_entry.restype = None
    library.af_set_opencl_entry.argtypes = [void_p]
    library.af_slot_new.restype = void_p
    library.af_slot_new.argtypes = [void_p, u64]
    library.af_slot_discard.restype = None
    library.af_slot_discard.argtypes = [void_p]
    library.af_live_slots.restype = ctypes.c_long
    library.af_live_slots.argtypes = []
    library.af_live_mailboxes.restype = ctypes.c_long
    library.af_live_mailboxes.argtypes = []


def _gil_holding(library: ctypes.CDLL, name: str) -> Callable[[ctypes.c_void_p], int]:
    """The take ``name``, a function of one mailbox, as a foreign function that keeps the GIL.

    ctypes releases the GIL around every call of a ``CDLL``'s functions. The
    takes never block (the fd is non-blocking) and run on the wake path, where
    releasing the GIL would let any other Python thread take it and hold the
    woken loop back for up to a switch interval (5 ms). It declares no
    argument types, so that a call converts nothing: pass the mailbox as a
    ``c_void_p``, never a plain int.
    """
    return ctypes.PYFUNCTYPE(ctypes.c_size_t)((name, library))


def _load() -> tuple[Shim | None, str | None, bool]:
    """The shim or why not, and whether that answer holds for the process.

    A library that is there but could not be loaded (no file descriptor to
    open it with, say) may load at the next try.
    """
    setting = os.environ.get(DISABLE_VARIABLE, "").strip()
    if setting == "0":
        return None, f"disabled by {DISABLE_VARIABLE}=0", True
    if setting not in ("", "1", "auto"):
        _logger.warning("%s=%r is not 0, 1 or auto; treating it as auto", DISABLE_VARIABLE, setting)
    path = Path(__file__).with_name(LIBRARY_NAME)
    if path.exists():
        try:
            # use_errno: af_mailbox_new's failures (EMFILE, say) read as themselves.
            library = ctypes.CDLL(str(path), use_errno=True)
            _typed(library)
            version = library.af_abi_version()
            if version != _ABI_VERSION:
                reason = f"the shim at {path} is of version {version}, not {_ABI_VERSION}"
                return None, f"{reason}; reinstall asyncfence", True
            take = _gil_holding(library, "af_mailbox_take")
            take_undrained = _gil_holding(library, "af_mailbox_take_undrained")
            # Called with the GIL released: clSetEventCallback takes the
            # runtime's locks, which it may hold while it runs callbacks
            # (another library's might need the GIL).
            opencl_arm = ctypes.CFUNCTYPE(ctypes.c_int32)(("af_opencl_arm", library))
            # On every CUDA park: a malloc, never worth giving up the GIL for.
            slot_new = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64)(
                ("af_slot_new", library)
            )
        except OSError as error:  # dlopen failed: out of descriptors or memory, say
            return None, f"the shim at {path} could not be loaded: {error}", False
        except AttributeError as error:  # a library of another version
            return None, f"the shim at {path} could not be loaded: {error}", True
        fire, opencl_callback = (
            ctypes.cast(f, ctypes.c_void_p).value or 0
            for f in (library.af_fire, library.af_opencl_callback)
        )
        shim = Shim(
            library,
            str(path),
            fire,
            opencl_callback,
            take,
            take_undrained,
            opencl_arm,
            slot_new,
            library.af_take_batch(),
        )
        return shim, None, True
    return None, "the shim was not built (no C compiler at install)", True


def shim() -> Shim | None:
    """The native shim, loaded on first use; ``None`` where it is unavailable.

    A failure to load a shim that is there is not remembered: the next call
    tries again (a later loop may have the descriptors an earlier one lacked).
    """
    global _loaded, _reason, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _loaded, _reason, _tried = _load()
                if _loaded is not None:
                    _logger.debug("native wake path: the shim at %s", _loaded.path)
                else:
                    _logger.debug("no native wake path: %s", _reason)
    return _loaded


def unavailable_reason() -> str | None:
    """Why :func:`shim` returns ``None``; ``None`` where the shim is in use."""
    shim()
    return _reason


def unavailable_for_good() -> bool:
    """Whether :func:`shim` will stay ``None`` in this process (not built, or disabled)."""
    return shim() is None and _tried


class NativeMailbox:
    """A loop's mailbox in the shim: a fd its selector watches, and the signals that fired.

    A signal is a slot in the shim that posts a token here once the device
    runtime calls it: an OpenCL event callback, armed in one call
    (:meth:`arm_event_callback`), or a CUDA host function whose argument is a
    slot made by :meth:`new_slot`.

    Thread-safety: the shim's signals may fire on any thread; every method
    here belongs to the loop's thread.

    Raises:
        OSError: The shim could not make the mailbox's fd (out of file
            descriptors, say); the error names why.
    """

    def __init__(self, native: Shim) -> None:
        self._shim = native
        self._library = native.library
        self._take = native.take
        self._take_undrained = native.take_undrained
        self._opencl_arm = native.opencl_arm
        self._slot_new = native.slot_new
        #: Address of the CUDA host function that fires a slot (``af_fire``).
        self.host_function = native.fire
        self._generation = _fork.fork_count
        handle = self._library.af_mailbox_new()
        if not handle:
            code = ctypes.get_errno()
            raise OSError(code, f"cannot create the native mailbox: {os.strerror(code)}")
        self._handle: int = handle
        # Made once: every call on the wake path passes it and converts nothing.
        self._handle_argument = ctypes.c_void_p(handle)
        # The arrays inside the mailbox that the calls read and write, in place.
        self._batch = native.take_batch
        self._tokens = (ctypes.c_uint64 * self._batch).from_address(
            self._library.af_mailbox_tokens(handle)
        )
        arguments = (ctypes.c_uint64 * 2).from_address(self._library.af_mailbox_arguments(handle))
        self._arguments = memoryview(arguments).cast("B").cast("Q")
        # Closed with its poller: the shim keeps the fd open while any
        # signal can still fire, so a late write never lands elsewhere. Never
        # at interpreter exit, from the main thread, while its loop may still
        # run on another (a daemon thread): a process's exit frees it anyway.
        self._finalizer = weakref.finalize(self, self._library.af_mailbox_close, handle)
        self._finalizer.atexit = False

    def fileno(self) -> int:
        """The fd that turns readable when a signal fired."""
        return int(self._library.af_mailbox_fd(self._handle))

    def arm_event_callback(self, event: int, token: int) -> int:
        """Have OpenCL post ``token`` here once ``event`` completes: a slot, registered.

        One call into the shim, which makes the slot and registers it (the
        runtime may call it at once, on this thread: it runs no Python).

        Args:
            event: The ``cl_event``'s address.
            token: What the signal posts.

        Returns:
            0 once armed, else OpenCL's error code (the slot freed).

        Raises:
            MemoryError: The shim could not allocate the slot.
            RuntimeError: No :meth:`Shim.set_opencl_entry` was made, or
                this process was forked from the one that made the mailbox.
        """
        if self._generation != _fork.fork_count:
            raise RuntimeError(_PARENTS_MAILBOX)
        arguments = self._arguments
        arguments[0] = event
        arguments[1] = token
        code = self._opencl_arm(self._handle_argument)
        if code > 0:  # the shim's own answers
            if code == _ARM_NO_ENTRY:
                raise RuntimeError("the shim was not told the OpenCL library's clSetEventCallback")
            raise MemoryError("the native shim could not allocate a signal slot")
        return code

    def new_slot(self, token: int) -> int:
        """A slot that posts ``token`` here once fired: a CUDA host function's argument.

        Fire it once (:attr:`host_function`), or :meth:`discard` it if the
        runtime refused it.

        Raises:
            MemoryError: The shim could not allocate the slot.
            RuntimeError: This process was forked from the one that made the
                mailbox.
        """
        if self._generation != _fork.fork_count:
            raise RuntimeError(_PARENTS_MAILBOX)
        slot = self._slot_new(self._handle, token)
        if not slot:
            raise MemoryError("the native shim could not allocate a signal slot")
        return slot

    def discard(self, slot: int) -> None:
        """Free a slot whose signal was never armed."""
        self._library.af_slot_discard(slot)

    def take(self) -> list[int]:
        """The tokens of the signals fired since the last take: the fd drained, then the list."""
        # Written out in both takes: a call less on every wake.
        if self._generation != _fork.fork_count:
            return []  # a forked child: the parent's mailbox is not ours
        count = self._take(self._handle_argument)
        if count < self._batch:
            return self._tokens[:count] if count else []
        return self._rest_of_batches(self._take)

    def take_undrained(self) -> list[int]:
        """The same, without draining the fd: a system call less.

        If it returns any, the fd stays readable, so the loop calls back;
        :meth:`take` then drains it.
        """
        if self._generation != _fork.fork_count:
            return []
        count = self._take_undrained(self._handle_argument)
        if count < self._batch:
            return self._tokens[:count] if count else []
        return self._rest_of_batches(self._take_undrained)

    def _rest_of_batches(self, take: Callable[[ctypes.c_void_p], int]) -> list[int]:
        """A full batch was taken (in the tokens array): it, and what the next takes give."""
        taken: list[int] = self._tokens[:]
        count = self._batch
        while count == self._batch:
            count = take(self._handle_argument)
            taken += self._tokens[:count]
        return taken


# Loaded as asyncfence is imported, off any loop: loading stats and maps a
# file, which would block a running loop at its first park. Should it fail
# for now (no file descriptor free), the first park tries again.
shim()
