"""Fences across processes: the importing side, a fence another process exported.

:func:`import_fence` connects to the exporting loop's relay
(:mod:`asyncfence._interprocess._exporting`), checks that the process there
is the token's exporter (:mod:`asyncfence._interprocess._peer`), and
presents the token's secret; the :class:`ImportedFence` it returns watches
that connection from a system task of the loop that awaits it, and on CUDA
also parks on the exporter's interprocess event, opened on this process's
device. Design:
``docs/design.md`` ("Fences across processes").

Thread-safety: an :class:`ImportedFence` belongs to the thread of the loop
that awaits it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any, final

from .._backend import backend_named
from .._config import check_timeout, current_config
from .._core import DONE, FAILED, PENDING, import_core
from .._exceptions import FenceError, FenceLostError, TokenRefusedError
from .._loops import current_driver
from .._poller import poller_of
from .._validation import type_name
from ._peer import Credentials, peer_credentials, process_started, this_process
from ._protocol import (
    ANSWER_ACCEPTED,
    PROTOCOL,
    SECRET_BYTES,
    FenceToken,
    parse_answer,
    take_message,
)

if TYPE_CHECKING:
    from collections.abc import Generator

    from .._core import FenceCore
    from .._loops import LoopDriver

__all__ = ["ImportedFence", "import_fence"]

_logger = logging.getLogger("asyncfence.relay")


def import_fence(token: FenceToken) -> ImportedFence:
    """Turn a token from another process's :meth:`~asyncfence.Fence.export` into a fence here.

    Connects to the exporting loop's relay and presents the token; it never
    blocks, and may be called off a loop or on one. What the exporter
    answers, the await of the returned fence raises: the work's
    :class:`~asyncfence.DeviceError`, or
    :class:`~asyncfence.TokenRefusedError`.

    Args:
        token: A :class:`FenceToken`, unpickled in this process.

    Returns:
        An :class:`ImportedFence` to await on this process's loop.

    Raises:
        TypeError: ``token`` is not a :class:`FenceToken`, or its fields
            have the wrong types.
        ValueError: Its secret is not 32 bytes long.
        TokenRefusedError: The token was exported on another machine, in
            another boot of this one, or in another network namespace (its
            relay cannot be reached from here); or its exporter runs as
            another user (a relay answers its own user only).
        FenceLostError: No process serves the token any more: its exporter
            exited, or its event loop ended. So too if another process
            listens at its address now: the secret is sent to the exporter
            only, checked by its pid and start time.

    Thread-safety: any thread.
    """
    if not isinstance(token, FenceToken):
        raise TypeError(
            "import_fence() expects an asyncfence.FenceToken (from Fence.export()), "
            f"got {type_name(token)}"
        )
    _check_fields(token)
    _check_host(token)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        connection.setblocking(False)
        # A Unix socket connects at once, or refuses: no wait on either.
        connection.connect("\0" + token.address)
        # Whoever listens there must be the exporter before it gets the secret.
        _check_listener(peer_credentials(connection), token)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            # Into an empty buffer: never blocks. The exporter may have
            # answered and closed already (a refusal needs no request): what
            # it sent, or the end of stream, is what the fence reads.
            connection.send(PROTOCOL + token.secret, socket.MSG_NOSIGNAL)
    except (ConnectionRefusedError, FileNotFoundError):
        connection.close()
        raise FenceLostError(
            f"no process serves this token: its exporter (pid {token.producer_pid}) "
            "exited, or the event loop that exported it ended"
        ) from None
    except BlockingIOError:
        connection.close()
        raise FenceError(
            f"the exporting process (pid {token.producer_pid}) has too many imports "
            "waiting to be accepted; try again"
        ) from None
    except BaseException:
        connection.close()
        raise
    # Opened only once connected: the exporter keeps the handle valid until
    # this connection ends, and closing it is the last thing this side does.
    local = _open_locally(token)
    # A plain descriptor from here on: no socket object's finalizer can close
    # it before the fence's own (a cycle's garbage is finalized in no set order).
    return ImportedFence._of(connection.detach(), token, local)


def _check_fields(token: FenceToken) -> None:
    """Refuse a token whose fields have the wrong types or sizes (one unpickled from anywhere)."""
    expected = {
        "address": str,
        "secret": bytes,
        "producer_pid": int,
        "backend": str,
        "producer_started": int,
        "host": str,
        "pid_namespace": int,
    }
    for name, kind in expected.items():
        value = getattr(token, name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TypeError(
                f"a FenceToken's {name} must be {kind.__name__}, got {type_name(value)}"
            )
    if token.interprocess is not None and not isinstance(token.interprocess, bytes):
        raise TypeError("a FenceToken's interprocess handle must be bytes or None")
    if len(token.secret) != SECRET_BYTES:
        raise ValueError(
            f"a FenceToken's secret is {SECRET_BYTES} bytes long, got {len(token.secret)}"
        )


def _check_host(token: FenceToken) -> None:
    """Refuse a token from where this process cannot reach its relay, saying why."""
    here = this_process().host
    if token.host == here:
        return
    boot, _, network = token.host.partition("/")
    if boot != here.partition("/")[0]:
        where = (
            "on another machine, or on this one before it restarted (another boot id): "
            "tokens work between processes of one host"
        )
    else:
        where = (
            f"in another network namespace ({network}, this process is in "
            f"{here.partition('/')[2]}): its relay's socket cannot be reached from here"
        )
    raise TokenRefusedError(
        f"this token was exported by pid {token.producer_pid} {where}; await the fence "
        "in a process beside its exporter, and send the result on"
    )


def _check_listener(listener: Credentials, token: FenceToken) -> None:
    """Raise unless the process listening at the token's address is the one that exported it.

    In one pid namespace its pid and that pid's start time must be the
    token's, so that no other process (one given the exporter's pid again,
    say) can pose as it; and its user must be this process's, as the relay
    answers no other.

    Raises:
        FenceLostError: Another process listens there: the exporter is gone.
        TokenRefusedError: The exporter itself runs as another user.
    """
    if token.pid_namespace == this_process().pid_namespace and (
        listener.pid != token.producer_pid
        or (token.producer_started and process_started(listener.pid) != token.producer_started)
    ):
        raise FenceLostError(
            f"no process serves this token: its exporter (pid {token.producer_pid}) "
            f"is gone, and another process (pid {listener.pid}, uid {listener.uid}) "
            "listens at its address; the token's secret was not sent"
        )
    if listener.uid != os.geteuid():
        raise TokenRefusedError(
            f"the process at the token's address (pid {listener.pid}) runs as another user "
            f"(uid {listener.uid}, this process is uid {os.geteuid()}), and a relay answers "
            "its own user only; the token's secret was not sent"
        )


def _open_locally(token: FenceToken) -> FenceCore | None:
    """The exporter's interprocess event, opened on this process's device; else ``None``.

    Without one (OpenCL; the device not visible here; the same process, whose
    runtime refuses its own handles) the relay's answer alone ends the wait.
    """
    if token.interprocess is None or token.producer_pid == os.getpid():
        return None
    try:
        return import_core(backend_named(token.backend), token.interprocess)
    except (FenceError, KeyError, ValueError) as error:
        _logger.debug("asyncfence: waiting for an imported fence by its relay only: %s", error)
        return None


@final
class ImportedFence:
    """A fence that another process exported, to await on this process's loop.

    Made by :func:`asyncfence.import_fence`. ``await fence`` (or
    :meth:`wait`) resumes once the exporting process's work before the fence
    is done, and never before. No thread is spent: this loop watches the
    connection to the exporter, and the exporter's loop parks its own wait
    and answers. On CUDA the fence also waits on this process's device: it
    opens the exporter's interprocess event and parks on it as on a local
    fence, so the wake needs nothing of the exporter's loop, and
    :meth:`enqueue_wait` makes a stream of this process wait for it.

    Cancellation: cancelling a wait cancels nothing in either process and
    leaves other waits on the fence waiting; the fence can be awaited again.

    Thread-safety: the thread of the event loop that awaits it, one loop at
    a time.
    """

    __slots__ = (
        "__weakref__",
        "_accepted",
        "_answer",
        "_failure",
        "_fd",
        "_local",
        "_reader",
        "_settled",
        "_token",
    )

    # The connection to the exporter (non-blocking); -1 once closed. With an
    # opened event it stays open while the event may be in use.
    _fd: int
    _token: FenceToken
    _answer: bytearray
    _accepted: bool  # the exporter took the token (sent before its answer)
    _settled: bool
    _failure: FenceError | None
    _local: FenceCore | None  # the exporter's interprocess event, opened here
    _reader: LoopDriver | None  # the driver of the loop whose system task reads

    def __new__(cls, *args: object, **kwargs: object) -> ImportedFence:
        raise TypeError("imported fences are made by asyncfence.import_fence(token)")

    @classmethod
    def _of(cls, fd: int, token: FenceToken, local: FenceCore | None) -> ImportedFence:
        fence = object.__new__(cls)
        fence._local = local
        fence._accepted = False
        fence._fd = fd
        fence._token = token
        fence._answer = bytearray()
        fence._settled = False
        fence._failure = None
        fence._reader = None
        return fence

    def __del__(self) -> None:
        # The opened event first (its core's release destroys it), then the
        # connection: the exporter frees its event once this side closes.
        self._local = None
        self._close()

    def __reduce__(self) -> Any:
        raise TypeError(
            "an ImportedFence cannot be pickled: send its FenceToken instead (a token "
            "answers one import)"
        )

    def __repr__(self) -> str:
        state = "pending" if not self._settled else ("failed" if self._failure else "done")
        token = self._token
        return f"<asyncfence.ImportedFence {token.backend} from pid {token.producer_pid} {state}>"

    @property
    def token(self) -> FenceToken:
        """The token this fence was imported with."""
        return self._token

    def done(self) -> bool:
        """Whether the work before the fence is done (as the exporter or this device saw).

        Never blocks.

        Raises:
            DeviceError: The work before the fence failed.
            FenceLostError: The exporting process went away first.
            TokenRefusedError: The exporting process refused the token.
        """
        if not self._settled and self._reader is None:
            self._receive()
        state = self.state
        if state == FAILED:
            raise self.failure()
        return state == DONE

    @property
    def state(self) -> int:
        """``PENDING``, ``DONE`` or ``FAILED``: how an await would end now. Never blocks.

        A refused token is refused, whatever else; the work is done once this
        device passed the exporter's event for a token the exporter took, or
        once the exporter said so; it failed if the exporter said so, or if
        it went away first, or if this device's wait on its event failed.
        """
        failure = self._failure
        if isinstance(failure, TokenRefusedError):
            return FAILED
        local = self._local
        opened = self._accepted and local is not None
        if opened and local is not None and local.poll() == DONE:
            return DONE  # the work is done, whatever became of the exporter since
        if failure is not None:
            return FAILED
        if self._settled:
            return DONE
        if opened and local is not None and local.state == FAILED:
            return FAILED  # this process's own device failed
        return PENDING

    def failure(self) -> FenceError:
        """A fresh copy of the failure of a fence whose :attr:`state` is ``FAILED``."""
        failure = self._failure
        if failure is None:
            local = self._local
            assert local is not None
            return local.failure()
        return copy.copy(failure).with_traceback(None)

    async def wait(self, timeout: float | None = None) -> None:
        """Wait until the exporting process has seen the fence complete.

        Always a checkpoint, even when the answer is in already.

        Cancellation: as for the class; the cancellation propagates.

        Args:
            timeout: Seconds to wait at most; ``None`` waits without limit.

        Raises:
            TimeoutError: The timeout expired first; the fence can be awaited again.
            DeviceError: The work before the fence failed (the exporter's
                backend, code and name).
            FenceLostError: The exporting process exited, crashed or stopped
                serving (its event loop ended) before the fence completed.
            TokenRefusedError: The exporting process refused the token
                (forged, used already, or presented by another user).
            RuntimeError: No asyncio or trio loop runs the calling task, or
                another loop awaits this fence.
        """
        seconds = check_timeout(timeout)
        driver = current_driver()
        if seconds == 0 or (self._reader is None and self._receive()) or self.state != PENDING:
            await driver.checkpoint()
            self._outcome(seconds)
            return
        self._ensure_reader(driver)
        deadline = time.monotonic() + seconds
        local = self._local
        poller = poller_of(driver)
        remaining = seconds
        while remaining > 0 and self.state == PENDING:
            waiter = driver.new_waiter()
            # Woken by whichever comes first, through the poller's one wake:
            # the reader's, once the exporter answered (or went away), or
            # (on CUDA) this device passing the opened event, parked like a
            # local fence's wait. Woken with a failure, it raises it here.
            parked = local is not None and local.state == PENDING
            try:
                poller.add_settled_elsewhere(self, waiter)
                if parked and local is not None:
                    poller.add(local, waiter, current_config().strategy)
                await driver.suspend(waiter, remaining)
            finally:
                poller.discard(self, waiter)  # a no-op once it woke the waiter
                if parked and local is not None:
                    poller.discard(local, waiter)
            remaining = deadline - time.monotonic()
        self._outcome(seconds)

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()

    def wait_sync(self, timeout: float | None = None) -> None:
        """Block the calling thread until the work before the fence is done.

        For synchronous code and worker threads, never a loop's own thread:
        it sleeps between looks at the connection (and, on CUDA, queries of
        the opened event), doubling from 20 µs up to a millisecond, so that
        Ctrl-C gets through.

        Args:
            timeout: Seconds to wait at most; ``None`` waits without limit.

        Raises:
            TimeoutError: The timeout expired first; the fence stays valid.
            DeviceError: The work before the fence failed.
            FenceLostError: The exporting process went away first.
            TokenRefusedError: The exporting process refused the token.

        Thread-safety: any one thread, while no loop awaits the fence.
        """
        deadline = time.monotonic() + check_timeout(timeout)
        sleep = 20e-6
        while not self.done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self!r} did not complete within {timeout} s")
            time.sleep(min(sleep, remaining))
            sleep = min(sleep * 2, 1e-3)

    def enqueue_wait(self, stream: object) -> None:
        """Make ``stream``, of this process, wait on the device for the exporter's work.

        Where the fence's backend has interprocess events (CUDA): the stream
        waits for the exporter's event, opened on the same device here. Never
        blocks the host.

        Args:
            stream: A stream of the fence's backend, on any context.

        Raises:
            FenceError: The fence has no interprocess event here (OpenCL; the
                exporter's device is not visible in this process; the
                exporting process itself): await it instead.
            TypeError: ``stream`` is not a stream of the fence's backend.
            DeviceError: The runtime refused.

        Thread-safety: any thread.
        """
        local = self._local
        if local is None:
            raise FenceError(
                f"{self!r} has no interprocess event in this process: only its await "
                "ends with the exporter's work (device waits need CUDA, and the "
                "exporter's device visible here)"
            )
        local.enqueue_wait(stream)

    # -- the answer ----------------------------------------------------------------

    def _ensure_reader(self, driver: LoopDriver) -> None:
        if self._reader is driver:
            return
        if self._reader is not None:
            raise RuntimeError(f"{self!r} is awaited on another event loop already")
        if not driver.spawn_system_task(self._read, "asyncfence imported fence"):
            raise RuntimeError("the event loop is shutting down")
        self._reader = driver

    async def _read(self) -> None:
        """The reader's system task: until the answer is in, then wake every wait."""
        driver = self._reader
        assert driver is not None
        try:
            while not self._receive():
                await driver.wait_readable(self._fd)
        finally:
            if self._settled:  # else cancelled, with its loop: so are the waits
                self._wake_all()
            self._reader = None

    def _wake_all(self) -> None:
        """Wake this loop's waits on the fence, through its poller's wake."""
        driver = self._reader
        if driver is not None:
            poller_of(driver).wake(self)

    def _receive(self) -> bool:
        """Read what the exporter sent, without blocking; whether the answer is complete."""
        if self._settled:
            return True
        while True:
            try:
                chunk = os.read(self._fd, 4096)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as error:
                self._settle(self._lost(f"reading its answer failed: {error}"))
                return True
            if not chunk:
                break
            self._answer += chunk
            try:
                while (message := take_message(self._answer)) is not None:
                    if message != ANSWER_ACCEPTED:
                        self._settle(parse_answer(message))
                        return True
                    self._accepted = True
                    self._wake_all()  # a wait the device already ended may end now
            except ValueError:  # a length no answer has
                self._settle(FenceError("the exporting process sent no asyncfence answer"))
                return True
        # The end of the stream before a whole answer: nobody will answer now.
        self._settle(self._lost("it went away before the fence completed"))
        return True

    def _settle(self, failure: FenceError | None) -> None:
        self._failure = failure
        self._settled = True
        self._answer = bytearray()
        # Nothing more to read. With an opened event, the exporter's must
        # outlive it: the connection is closed only after it (``__del__``).
        if self._local is None:
            self._close()

    def _close(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            self._fd = -1  # first: never close a number the system gave out again
            os.close(fd)

    def _lost(self, why: str) -> FenceLostError:
        return FenceLostError(
            f"the exporting process (pid {self._token.producer_pid}) cannot tell how the "
            f"work ended: {why} (it exited or crashed, or its event loop ended)"
        )

    def _outcome(self, seconds: float) -> None:
        state = self.state
        if state == DONE:
            return
        if state == FAILED:
            raise self.failure()
        raise TimeoutError(f"{self!r} did not complete within {seconds} s")
