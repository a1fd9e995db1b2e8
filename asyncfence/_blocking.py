"""A thread's blocking wait: it sleeps on the completion signal a parked await uses.

``Fence.wait_sync()`` arms the fence's completion signal (the native shim,
:mod:`asyncfence._native`) on a mailbox of the calling thread's own and
blocks in ``poll()`` on that mailbox's fd, with the timeout: no CPU while it
waits, awake as soon as the runtime calls the signal. A device fault sends
no signal (CUDA runs no host function after one; PoCL calls no callback for
a failed event), so the thread also queries the fence every
``recheck_interval``, the bound a parked await's re-checks keep. Ctrl-C gets
through: ``poll()`` returns to the interpreter, which raises
``KeyboardInterrupt`` in the main thread. No thread is started.

Without the shim, or where the runtime cannot arm a signal, the thread
sleeps between queries instead, doubling from 20 µs up to a millisecond.

Thread-safety: any thread; each thread has a mailbox of its own.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from typing import TYPE_CHECKING, Final

from . import _fork
from ._config import current_config
from ._core import DONE, FAILED, PENDING
from ._native import NativeMailbox, shim

if TYPE_CHECKING:
    from ._core import FenceCore

__all__ = ["block_until_settled"]

_logger = logging.getLogger("asyncfence.poller")

# Without a signal: sleeps between queries, doubling from the first up to the cap.
_FIRST_SLEEP_S: Final = 20e-6
_SLEEP_CAP_S: Final = 1e-3

_mailboxes = threading.local()


def block_until_settled(core: FenceCore, seconds: float, describe: str) -> None:
    """Block the calling thread until ``core`` settles; return, or raise its failure.

    Args:
        core: The fence's core.
        seconds: The timeout (``math.inf``: none).
        describe: How a timeout names the fence.

    Raises:
        TimeoutError: ``seconds`` passed first.
        DeviceError: The work before the fence failed.
        FenceError: It was recorded before this process forked.
    """
    deadline = time.monotonic() + seconds
    if _settled(core):
        return
    mailbox = _thread_mailbox()
    if mailbox is not None and _armed(core, mailbox):
        _sleep_on_signal(core, mailbox, deadline, seconds, describe)
    else:
        _sleep_between_queries(core, deadline, seconds, describe)


def _settled(core: FenceCore) -> bool:
    """Query ``core``: True if done, raise if failed, False if pending."""
    state = core.poll()
    if state == FAILED:
        core.raise_failure()
    return state == DONE


def _thread_mailbox() -> NativeMailbox | None:
    """The calling thread's mailbox, made on its first wait; ``None`` where there is none."""
    mailbox: NativeMailbox | None = getattr(_mailboxes, "mailbox", None)
    generation = getattr(_mailboxes, "generation", None)
    if mailbox is not None and generation == _fork.fork_count:
        return mailbox
    native = shim()
    if native is None:
        return None
    try:
        mailbox = NativeMailbox(native)
    except OSError as error:  # out of descriptors, say: this wait sleeps instead
        _logger.debug("asyncfence: no mailbox for a blocking wait (%s)", error)
        return None
    _mailboxes.mailbox, _mailboxes.generation = mailbox, _fork.fork_count
    return mailbox


def _armed(core: FenceCore, mailbox: NativeMailbox) -> bool:
    """Arm ``core``'s signal on ``mailbox``; False if it got none (then it is queried)."""
    try:
        return core.arm(mailbox, core.seq) == "armed"
    except Exception as error:  # refused (a faulted context): the queries see why
        _logger.debug("asyncfence: arming %r for a blocking wait failed (%s)", core, error)
        return False


def _sleep_on_signal(
    core: FenceCore, mailbox: NativeMailbox, deadline: float, seconds: float, describe: str
) -> None:
    """Block in ``poll()`` on the mailbox's fd until the signal, a re-check, or the deadline."""
    watcher = select.poll()
    watcher.register(mailbox.fileno(), select.POLLIN)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{describe} did not complete within {seconds} s")
        # A fault sends no signal: a query at least every recheck_interval.
        slice_s = min(remaining, current_config().recheck_interval)
        if watcher.poll(max(1, round(slice_s * 1000))):
            # Drained: a signal of an earlier wait of this thread's (one
            # that timed out) may be among them; the query below decides.
            mailbox.take()
        if core.state != PENDING or core.poll() != PENDING:
            if core.state == FAILED:
                core.raise_failure()
            return


def _sleep_between_queries(core: FenceCore, deadline: float, seconds: float, describe: str) -> None:
    """No signal: query, sleeping between queries, doubling up to a millisecond."""
    sleep = _FIRST_SLEEP_S
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{describe} did not complete within {seconds} s")
        time.sleep(min(sleep, remaining))
        sleep = min(sleep * 2, _SLEEP_CAP_S)
        if _settled(core):
            return
