"""Everything asyncfence does about ``fork()``, in one place.

Device runtimes do not survive ``fork()``: their threads stay behind in the
parent and their locks may be held there. So a forked child:

* refuses, with a :class:`~asyncfence.FenceError` that says what to do
  instead, a fence recorded before the fork (:func:`generation`) and a
  runtime used before it (:func:`check_unused_by_parent`): used through
  asyncfence (:func:`note_used`), or initialised by anyone, as each backend's
  probe finds at the fork (:func:`watch_runtime`: a pyopencl context made in
  a gunicorn master under ``--preload``, say);
* gets fresh locks wherever asyncfence keeps one (:func:`renew_after_fork`):
  a lock that another thread held at the fork would never be released there;
* starts without the parent's handles on a runtime (:func:`clear_after_fork`),
  so that the next use finds the runtime refused rather than hangs in it;
* never touches what it inherited of the native wake shim (its mailboxes
  compare :func:`generation`).

* runs what other modules ask to be run in the child (:func:`on_fork_in_child`:
  the relays of fences across processes close there).

This module holds the one ``os.register_at_fork`` hook of the package.

Thread-safety: every function may be called from any thread.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Final

from ._exceptions import FenceError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "ADVICE",
    "check_unused_by_parent",
    "clear_after_fork",
    "fork_count",
    "generation",
    "note_used",
    "on_fork_in_child",
    "renew_after_fork",
    "unwatch_runtime",
    "used",
    "used_by_parent",
    "watch_runtime",
]

#: What to do instead, for every error about a fork.
ADVICE: Final = (
    "device runtimes do not survive fork(); open devices only after the fork (under "
    "gunicorn, drop --preload, or open them in the app's lifespan or startup), or "
    "start processes that use the device with the 'spawn' or 'forkserver' start method"
)

_logger = logging.getLogger("asyncfence.fork")

#: How many forks separate this process from the one that imported asyncfence
#: (:func:`generation`). Read as ``_fork.fork_count`` on hot paths, never
#: imported by name: a forked child counts one more.
fork_count = 0
#: The backends this process used (:func:`note_used`); read it, never change it.
used: set[str] = set()
#: The backends a forked child's parent had used (:func:`check_unused_by_parent`);
#: read as ``_fork.used_by_parent``, for the same reason.
used_by_parent: frozenset[str] = frozenset()
# Per backend, whether this process has initialised its runtime, asked at each fork.
_probes: dict[str, Callable[[], bool]] = {}
_initialised_at_fork: frozenset[str] = frozenset()
# Owners (modules and objects) and the names of their lock attributes, and
# of the attributes a child starts without.
_locks: weakref.WeakKeyDictionary[object, tuple[str, ...]] = weakref.WeakKeyDictionary()
_cleared: weakref.WeakKeyDictionary[object, tuple[str, ...]] = weakref.WeakKeyDictionary()
_child_callbacks: list[Callable[[], None]] = []


def generation() -> int:
    """How many forks separate this process from the one that imported asyncfence."""
    return fork_count


def note_used(backend: str) -> None:
    """Record that this process has used ``backend``'s runtime (a forked child may not)."""
    used.add(backend)


def watch_runtime(backend: str, initialised: Callable[[], bool]) -> None:
    """Ask ``initialised()`` at each fork whether this process initialised ``backend``'s runtime.

    It runs in the parent, just before the fork: it must be quick, take no
    lock another thread may hold, and call nothing of the runtime.
    """
    _probes[backend] = initialised


def unwatch_runtime(backend: str) -> None:
    """Stop asking about ``backend`` at forks (it was unregistered)."""
    _probes.pop(backend, None)


def check_unused_by_parent(backend: str, title: str) -> None:
    """Refuse a runtime that the process this one was forked from had used.

    Args:
        backend: The backend's name, as given to :func:`note_used`.
        title: The runtime's name, for the message.

    Raises:
        FenceError: The parent used or initialised it before the fork.
    """
    if backend in used_by_parent:
        raise FenceError(
            f"{title} was initialised before fork(), in the parent process, and this "
            f"process is its forked child: {ADVICE}"
        )


def renew_after_fork(owner: object, *attributes: str) -> None:
    """Give ``owner`` a fresh lock in each of these attributes in a forked child.

    Each attribute holds a ``threading.Lock`` (or ``RLock``), or a tuple of
    them. ``owner`` is held weakly: a module, or any object with weak
    references.
    """
    _locks[owner] = (*_locks.get(owner, ()), *attributes)


def clear_after_fork(owner: object, *attributes: str) -> None:
    """Set these attributes of ``owner`` to ``None`` in a forked child.

    For what the parent made of a runtime (a loaded driver, say): the
    child's next use then takes the slow path, which refuses it.
    """
    _cleared[owner] = (*_cleared.get(owner, ()), *attributes)


def on_fork_in_child(callback: Callable[[], None]) -> None:
    """Have ``callback()`` called in a forked child, after the locks are renewed.

    It must not raise: what it raises is logged, and the others still run.
    """
    _child_callbacks.append(callback)


def _fresh(lock: object) -> object:
    if isinstance(lock, tuple):
        return tuple(_fresh(each) for each in lock)
    return threading.RLock() if isinstance(lock, type(threading.RLock())) else threading.Lock()


def _before_fork() -> None:
    global _initialised_at_fork
    initialised = set()
    for backend, probe in list(_probes.items()):
        try:
            if probe():
                initialised.add(backend)
        except Exception:  # a probe must never break a fork
            _logger.exception("asyncfence: probing %s before fork() raised", backend)
    _initialised_at_fork = frozenset(initialised)


def _after_fork_in_child() -> None:
    global fork_count, used_by_parent
    fork_count += 1
    used_by_parent = frozenset(used) | _initialised_at_fork
    for owner, attributes in list(_cleared.items()):
        for attribute in attributes:
            setattr(owner, attribute, None)
    for owner, attributes in list(_locks.items()):
        for attribute in attributes:
            setattr(owner, attribute, _fresh(getattr(owner, attribute)))
    for callback in list(_child_callbacks):
        try:
            callback()
        except Exception:  # one must never keep the others from running
            _logger.exception("asyncfence: %r raised in a forked child", callback)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
