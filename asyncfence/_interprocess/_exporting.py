"""Fences across processes: the exporting side, a loop's relay.

The exporting process's event loop serves its exports on a Unix socket in
Linux's abstract namespace (no file to leave behind), which admits only
processes of the same user (``SO_PEERCRED``, read as a connection is
accepted, before anything else). An importing process connects at
:func:`~asyncfence.import_fence` and presents its token's secret; the
relay pops the export (one answer per token) and answers once the fence
settles: the answer is a settle listener of the fence's core, sent by
whichever thread learns how the work ended, so that no task of the
exporter's can hold it back. The importer's loop watches its end of the
connection: it becomes readable with the answer, or at end of stream if
the exporter went away (exited, crashed, or its loop ended).

A token is a capability for one wait and nothing more. Nothing a token
holder sends can make the exporter free, fail or run anything; what a
connection may hold is bounded (see :class:`_Relay`). The threat model:
``docs/processes.md``. Design: ``docs/design.md`` ("Fences across processes").

Thread-safety: an exporting loop's relay belongs to its loop's thread; an
answer may be sent from any thread.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import secrets
import socket
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Final, NamedTuple

from .. import _fork
from .._config import current_config
from .._core import PENDING
from .._exceptions import FenceError
from .._loops import current_driver
from .._poller import poller_of
from ._peer import peer_credentials, this_process
from ._protocol import (
    ANSWER_ACCEPTED,
    ANSWER_ERROR,
    ANSWER_REFUSED,
    REQUEST_BYTES,
    SECRET_BYTES,
    FenceToken,
    answer_for,
    frame,
    parse_request,
)

if TYPE_CHECKING:
    from .._core import FenceCore
    from .._loops import LoopDriver

__all__ = [
    "ACCEPT_RETRY_S",
    "MAX_AWAITING_REQUEST",
    "REQUEST_DEADLINE_S",
    "export_core",
]

_logger = logging.getLogger("asyncfence.relay")

# An importer sends its request as it connects: a connection of the same user
# that has not, within this, is cut off; and so is the oldest of those waiting
# when more than this many are.
REQUEST_DEADLINE_S: Final = 5.0
MAX_AWAITING_REQUEST: Final = 64
# Connections accepted per turn of the loop, at most.
ACCEPT_BATCH: Final = 64
# After accept() failed (no descriptor free, say): the pause before the next try.
ACCEPT_RETRY_S: Final = 0.05
# At most one warning this often, for a relay short of descriptors.
_WARN_EVERY_S: Final = 60.0
_SHORT_OF_RESOURCES: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# The connection went away before it was accepted: nothing to tell anyone.
_TRANSIENT: Final = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})


class _Export(NamedTuple):
    """An exported fence, and what keeps its interprocess handle valid."""

    core: FenceCore
    kept: object  # or None


class _Answer:
    """Answers an importer the moment its export's fence settles, whoever settles it.

    It listens to the fence's settle (:meth:`FenceCore.on_settle`): the
    answer goes out on the thread that learns how the work ended, before
    that thread goes on. A task of the exporter's that awaits the same fence
    and then blocks its loop, or a worker thread's ``wait_sync``, cannot hold
    the answer back. It is also the poller waiter that has the fence
    queried, for when nothing else in the process waits on it.

    Thread-safety: any thread. The answer is sent once, under a lock that
    the loop also takes to withdraw it before closing the connection: no
    send can then land on a descriptor number the system gave out again.
    """

    __slots__ = ("_lock", "_unsent")

    def __init__(self, connection: socket.socket, *, shut_after: bool) -> None:
        # Without an interprocess handle nothing outlives the answer: shutting
        # the socket down then wakes the connection's task, which closes it.
        self._unsent = [(connection, shut_after)]
        self._lock = threading.Lock()

    def __call__(self, core: FenceCore) -> None:
        """The settle listener: send how the work ended. Never raises."""
        self.send(core.outcome())

    def wake(self, error: BaseException | None) -> None:
        """The poller's wake (a no-op once the settle sent the answer). Never raises."""
        self.send(error)

    def send(self, error: BaseException | None) -> None:
        """Send the answer for ``error`` (``None``: done), unless sent or withdrawn."""
        with self._lock:
            if not self._unsent:
                return
            connection, shut_after = self._unsent.pop()
            try:
                with contextlib.suppress(OSError):  # the importer went away
                    # A few hundred bytes on a socket that got one message
                    # at most before: never blocks.
                    connection.send(frame(answer_for(error)), socket.MSG_NOSIGNAL)
                if shut_after:
                    with contextlib.suppress(OSError):
                        connection.shutdown(socket.SHUT_RDWR)
            except Exception:
                _logger.exception("asyncfence: the fence relay failed to answer an import")

    def withdraw(self) -> bool:
        """Take the connection back unanswered; whether it was (no send follows, either way)."""
        with self._lock:
            unsent = bool(self._unsent)
            self._unsent.clear()
            return unsent


class _Relay:
    """One loop's exports, and the socket its system task serves them on. Loop thread only.

    What a connection may hold is bounded: a peer of another user is
    answered and closed as it is accepted, before anything is read; a
    connection of the same user must send its request within
    :data:`REQUEST_DEADLINE_S`, and at most :data:`MAX_AWAITING_REQUEST`
    may be awaited at once (the oldest is cut off to make room). An
    importer sends its request as it connects, so neither limit touches
    one. Once a request names an export, the connection lasts as long as
    the export: one per token, at most.
    """

    def __init__(self, driver: LoopDriver) -> None:
        self._driver = driver
        self._exports: dict[bytes, _Export] = {}
        self.address = f"asyncfence-{os.getpid()}-{secrets.token_hex(12)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.setblocking(False)
            listener.bind("\0" + self.address)  # abstract: no file system call
            listener.listen(socket.SOMAXCONN)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._connections: set[socket.socket] = set()
        # Connections whose request is not in yet, oldest first, and when each
        # is cut off; those cut off (their tasks answer and close them).
        self._awaiting: dict[socket.socket, float] = {}
        self._cut_off: set[socket.socket] = set()
        self._deadlines = driver.chain(self._cut_off_late)
        self._warned_at = -math.inf
        if not driver.spawn_system_task(self._serve, "asyncfence relay"):
            listener.close()
            raise RuntimeError("cannot export a fence: the event loop is shutting down")
        _live_relays.add(self)

    def export(self, core: FenceCore) -> FenceToken:
        secret = secrets.token_bytes(SECRET_BYTES)
        exported = core.export_marker()  # DeviceError: the fence cannot be exported
        handle, kept = (None, None) if exported is None else exported
        self._exports[secret] = _Export(core, kept)
        identity = this_process()
        return FenceToken(
            address=self.address,
            secret=secret,
            producer_pid=identity.pid,
            backend=core.backend.name,
            producer_started=identity.started,
            host=identity.host,
            pid_namespace=identity.pid_namespace,
            interprocess=handle,
        )

    def _release_export(self, export: _Export) -> None:
        if export.kept is not None:
            try:
                export.core.backend.release_export(export.kept)
            except Exception:
                _logger.exception("asyncfence: releasing an exported fence's handle failed")

    # -- accepting -------------------------------------------------------------------

    async def _serve(self) -> None:
        """Accept importers for as long as the loop runs; each gets a task of its own.

        No error of ``accept()`` ends it: short of descriptors, it makes room
        and tries again a moment later, and the importers queued meanwhile
        wait in the listening socket's backlog. Only the loop's end does,
        and then the importers still waiting see the end of the stream.
        """
        listener = self._listener
        driver = self._driver
        try:
            while True:
                await driver.wait_readable(listener.fileno())
                # A batch at a time: a flood of connections never holds the loop.
                for _ in range(ACCEPT_BATCH):
                    try:
                        connection, _ = listener.accept()
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError as error:
                        await self._accept_failed(error)
                        break
                    self._admit(connection)
        finally:
            listener.close()
            # Never imported, so never opened: nobody can wait on their handles.
            exports, self._exports = self._exports, {}
            for export in exports.values():
                self._release_export(export)
            if driver.relay is self:
                driver.relay = None
            _live_relays.discard(self)

    async def _accept_failed(self, error: OSError) -> None:
        """After ``accept()`` failed: make room if short of a resource, and pause a moment.

        Short of descriptors, the connections that have sent no request for
        a moment give theirs up (an importer sends its request as it
        connects): idle connections cannot keep an importer out.
        """
        if error.errno in _SHORT_OF_RESOURCES:
            now = time.monotonic()
            if now - self._warned_at > _WARN_EVERY_S:
                self._warned_at = now
                _logger.warning(
                    "asyncfence: the fence relay cannot accept (%s); the importers wait "
                    "until a connection closes, and idle connections are cut off",
                    error,
                )
            awaited_since = now + REQUEST_DEADLINE_S - ACCEPT_RETRY_S
            for connection, due in list(self._awaiting.items()):  # oldest first
                if due > awaited_since:
                    break
                self._cut(connection)
        elif error.errno not in _TRANSIENT:
            _logger.error("asyncfence: the fence relay's accept() failed: %s; retrying", error)
        await self._driver.suspend(self._driver.new_waiter(), ACCEPT_RETRY_S)

    def _admit(self, connection: socket.socket) -> None:
        """A new connection: refuse another user at once, else answer it in a task."""
        try:
            connection.setblocking(False)
            uid = peer_credentials(connection).uid
        except OSError:
            connection.close()
            return
        if uid != os.geteuid():
            # Before reading anything: another user holds nothing here.
            with contextlib.suppress(OSError):
                connection.send(
                    frame(ANSWER_REFUSED + b"the token was presented by a process of another user"),
                    socket.MSG_NOSIGNAL,
                )
                connection.shutdown(socket.SHUT_WR)
            connection.close()
            return
        self._connections.add(connection)
        if not self._driver.spawn_system_task(
            lambda: self._answer(connection),
            "asyncfence relay answer",
        ):
            self._close(connection)

    # -- connections without a request -------------------------------------------------

    def _await_request(self, connection: socket.socket) -> None:
        """``connection`` sent no request yet: give it a deadline, and make room for it."""
        self._awaiting[connection] = time.monotonic() + REQUEST_DEADLINE_S
        if len(self._awaiting) > MAX_AWAITING_REQUEST:
            self._cut(next(iter(self._awaiting)))
        self._deadlines.ensure(REQUEST_DEADLINE_S)

    def _cut(self, connection: socket.socket) -> None:
        """Stop awaiting ``connection``'s request: its task reads the end of the stream."""
        del self._awaiting[connection]
        self._cut_off.add(connection)
        with contextlib.suppress(OSError):
            connection.shutdown(socket.SHUT_RD)  # wakes the task that waits on it

    def _cut_off_late(self) -> float | None:
        """The deadlines' chain step: cut off what is due; the delay to the next one."""
        now = time.monotonic()
        for connection, due in list(self._awaiting.items()):  # oldest first
            if due > now:
                return due - now
            self._cut(connection)
        return None

    # -- answering ---------------------------------------------------------------------

    async def _answer(self, connection: socket.socket) -> None:
        try:
            request = await self._request(connection)
            if request is None:
                refusal = ANSWER_ERROR + b"no request came within the relay's deadline"
                with contextlib.suppress(OSError):
                    connection.send(frame(refusal), socket.MSG_NOSIGNAL)
                return
            secret = parse_request(request)
            export = None if secret is None else self._exports.pop(secret, None)
            if export is None:
                why = (
                    b"that is not an asyncfence token"
                    if secret is None
                    else b"no such export: the token is forged, or was used already"
                )
                with contextlib.suppress(OSError):
                    connection.send(frame(ANSWER_REFUSED + why), socket.MSG_NOSIGNAL)
                return
            await self._answer_export(connection, export)
        except Exception:  # a system task must not raise: it would end a trio run
            _logger.exception("asyncfence: the fence relay failed to answer an import")
        finally:
            self._close(connection)

    async def _answer_export(self, connection: socket.socket, export: _Export) -> None:
        """Answer once the fence settles; then, with a handle, free it once the importer closes."""
        kept = export.kept is not None
        if kept:
            # The token is good: from now the importer's device may end its wait.
            with contextlib.suppress(OSError):
                connection.send(frame(ANSWER_ACCEPTED), socket.MSG_NOSIGNAL)
        answer = _Answer(connection, shut_after=not kept)
        core = export.core
        poller = poller_of(self._driver)
        try:
            state = core.poll()
        except FenceError as error:  # recorded before this process forked
            answer.send(error)
        else:
            if state != PENDING or not core.on_settle(answer):
                answer.send(core.outcome())
            else:
                poller.add(core, answer, current_config().strategy)
        try:
            # Until the importer closes its end (it sends nothing more), or,
            # without a handle, the answer shuts this end down.
            await self._until_closed(connection)
        finally:
            # Before the connection closes: no thread may send on it after.
            if answer.withdraw():  # the importer went away, or the loop ends
                core.forget_listener(answer)
            poller.discard(core, answer)  # a no-op once the poller woke it
        # The importer closed: nothing waits on the handle now. (Cancelled
        # before, by the loop's end, it is left to the process's end: freeing
        # it under a waiting importer is undefined.)
        self._release_export(export)

    async def _until_closed(self, connection: socket.socket) -> None:
        """Until the importer closes its end: a request is all it ever sends."""
        while True:
            try:
                if not connection.recv(64):
                    return
            except (BlockingIOError, InterruptedError):
                await self._driver.wait_readable(connection.fileno())
            except OSError:  # reset: gone as well
                return

    def _close(self, connection: socket.socket) -> None:
        self._connections.discard(connection)
        self._awaiting.pop(connection, None)
        self._cut_off.discard(connection)
        connection.close()

    async def _request(self, connection: socket.socket) -> bytes | None:
        """The request, up to its length or the end of stream; ``None`` if it was cut off.

        An importer sends its request as it connects: it is usually read at
        once, and only a connection that has not sent it is given a deadline.
        """
        request = b""
        try:
            while len(request) < REQUEST_BYTES:
                try:
                    chunk = connection.recv(REQUEST_BYTES - len(request))
                except (BlockingIOError, InterruptedError):
                    if connection not in self._awaiting:
                        self._await_request(connection)
                    await self._driver.wait_readable(connection.fileno())
                    continue
                except OSError:  # reset
                    break
                if not chunk:
                    if connection in self._cut_off:
                        return None
                    break
                request += chunk
        finally:
            self._awaiting.pop(connection, None)
        return request

    def close_in_forked_child(self) -> None:
        """A forked child must not hold the parent's relay open: importers would hang on it."""
        self._listener.close()
        for connection in self._connections:
            connection.close()
        self._connections.clear()
        self._awaiting.clear()
        self._exports.clear()


_live_relays: weakref.WeakSet[_Relay] = weakref.WeakSet()


def _close_relays_in_child() -> None:
    for relay in list(_live_relays):
        relay.close_in_forked_child()
    _live_relays.clear()


_fork.on_fork_in_child(_close_relays_in_child)
this_process()  # read now, off any loop: an export reads it again only after a fork


def export_core(core: FenceCore) -> FenceToken:
    """Export ``core`` on the running loop's relay (see :meth:`asyncfence.Fence.export`)."""
    if not sys.platform.startswith("linux"):
        raise NotImplementedError(
            "exporting a fence needs Linux: its relay is a Unix socket in Linux's abstract "
            f"namespace that checks its peers with SO_PEERCRED (this is {sys.platform})"
        )
    try:
        driver = current_driver()
    except RuntimeError:
        raise RuntimeError(
            "exporting a fence needs a running asyncio or trio event loop: that loop "
            "answers the importing process"
        ) from None
    relay = driver.relay
    if not isinstance(relay, _Relay):
        relay = driver.relay = _Relay(driver)
    return relay.export(core)
