"""Who is at each end of a relay connection: this process, and the kernel's word on a peer.

A token names its exporter by more than an address that anyone may bind
once the exporter is gone: by its user, its pid and the pid's start time
(a pid is reused, a start time with it is not), in one boot of one host and
one network namespace (a Unix socket in the abstract namespace is local to
those). The importer checks the listening peer's credentials before it
sends the token's secret; the exporter checks each connecting peer's before
it reads anything.

Everything here reads the kernel without blocking: ``/proc`` files are
opened non-blocking (they are made in memory, never read from a disk), and
a socket's credentials are one ``getsockopt``.

Thread-safety: any thread.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Final, NamedTuple

__all__ = ["Credentials", "ProcessIdentity", "peer_credentials", "process_started", "this_process"]

_UCRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Credentials(NamedTuple):
    """A socket peer's process and user, as the kernel recorded them at connect or listen."""

    pid: int
    uid: int
    gid: int


class ProcessIdentity(NamedTuple):
    """What tells this process apart from any other, on this host and across pid reuse.

    Attributes:
        pid: The process id, as this process's pid namespace numbers it.
        started: When it started, in clock ticks after boot (``/proc/PID/stat``
            field 22); 0 where ``/proc`` cannot tell.
        host: The boot and the network namespace: ``BOOT_ID/net:INODE``. Two
            processes can reach each other's abstract sockets only with the
            same network namespace, on the same running kernel.
        pid_namespace: The pid namespace's inode (0 where unknown): a pid
            means the same process only within one.
    """

    pid: int
    started: int
    host: str
    pid_namespace: int


def peer_credentials(connection: socket.socket) -> Credentials:
    """The credentials of the process at the other end of a connected Unix socket.

    For an accepting server, those of the process that connected; for a
    client, those of the process that listened. The pid is translated into
    this process's pid namespace (0 if the peer is outside it).
    """
    return Credentials(
        *_UCRED.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    )


def _read_proc(path: str) -> bytes | None:
    """A small ``/proc`` file's contents, read without blocking; ``None`` if unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def _inode(path: str) -> int:
    """The inode of a ``/proc/self/ns`` entry (it names the namespace); 0 if unknown."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


def process_started(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot; ``None`` if it is not visible."""
    stat = _read_proc(f"/proc/{pid}/stat")
    if not stat:
        return None
    # The command name (field 2) is in parentheses and may hold anything but
    # its last ")": the fields after it are plain numbers. Field 22 is the
    # 20th after the state (field 3).
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _read_identity() -> ProcessIdentity:
    boot = (_read_proc("/proc/sys/kernel/random/boot_id") or b"unknown-boot").strip().decode()
    pid = os.getpid()
    return ProcessIdentity(
        pid=pid,
        started=process_started(pid) or 0,
        host=f"{boot}/net:{_inode('/proc/self/ns/net')}",
        pid_namespace=_inode("/proc/self/ns/pid"),
    )


_identity: ProcessIdentity | None = None


def this_process() -> ProcessIdentity:
    """This process's identity: read once, and again in a forked child (another pid)."""
    global _identity
    identity = _identity
    if identity is None or identity.pid != os.getpid():
        identity = _identity = _read_identity()
    return identity
