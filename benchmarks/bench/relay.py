"""The relay on trial: a failure crossing processes, and the exporting loop under floods.

One producer process (``cross_process_producer.py``) and this one, the consumer:

* **A failure crosses** (``failure_cross_process``): the producer fails its
  gate 0.5 to 3 ms in, stamping the instant, and the consumer's import of
  the fence raises ``DeviceError``. Either nothing in the producer awaits the
  fence (``import, producer idle``), or a task of the producer's awaits it
  too and, once woken, holds its loop for 20 ms, as a busy task would
  (``import, producer awaits``). That task's own wake is the row of a local
  waiter on the same failure (``local waiter``): the bound an importer is
  held to.
* **The relay under floods** (``relay_floods``): while the producer's loop
  measures its own lag (a task asking for 1 ms sleeps), a forked process
  holds idle connections to its relay (of this user; of another user, when
  this runs as root) or sends garbage requests, each on a connection of its
  own; meanwhile the consumer imports a fresh fence and awaits it (the
  owner's import: from the producer's release to the consumer's wake).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import resource
import socket
from typing import TYPE_CHECKING

import anyio

import asyncfence

from .base import IMPORT_AWAITED, IMPORT_IDLE, LOCAL_WAITER, bounded, latency
from .cross_process import _Producer

if TYPE_CHECKING:
    from .targets import Context

__all__ = ["relay_failure", "relay_floods"]

_DELAYS_S = (0.0005, 0.003)
_NOBODY = 65534
# How long the producer's lag is watched after the owner's import, the flood still on.
_HELD_S = 0.3


async def relay_failure(ctx: Context) -> None:
    """A failed gate, awaited through an import; the producer idle or awaiting it too."""
    samples = ctx.results.latency.setdefault("failure_cross_process", {})
    limit_s = ctx.config.trial_timeout_s
    rng = random.Random(11)
    producer = _Producer(ctx.target.device.backend)
    try:
        for trial in range(ctx.config.relay_failure_trials + 1):  # the first is untimed
            for method in rng.sample(("fail-idle", "fail-await"), 2):
                token = producer.start(method, rng.uniform(*_DELAYS_S))
                imported = asyncfence.import_fence(token)
                resumed = await bounded(_raises_device_error(imported), limit_s)
                stamp, local_wake = producer.read()
                if not trial:
                    continue
                name = IMPORT_AWAITED if method == "fail-await" else IMPORT_IDLE
                samples.setdefault(name, []).append(latency(resumed, [stamp]))
                if local_wake is not None:
                    samples.setdefault(LOCAL_WAITER, []).append(local_wake - stamp)
    finally:
        producer.close()


async def _raises_device_error(imported: asyncfence.ImportedFence) -> None:
    try:
        await imported
    except asyncfence.DeviceError:
        return
    raise AssertionError("the producer's failed work crossed as done")


async def relay_floods(ctx: Context) -> None:
    """The producer's loop lag, and the owner's import, beside each flood."""
    rows = ctx.results.relay
    connections = ctx.config.relay_flood_connections
    _raise_descriptor_limit(connections + 256)
    producer = _Producer(ctx.target.device.backend)
    floods: list[tuple[str, str | None, bool]] = [("no flood", None, False)]
    floods.append((f"{connections:,} idle connections, this user", "idle", False))
    if os.geteuid() == 0:
        floods.append((f"{connections:,} idle connections, another user", "idle", True))
    floods.append((f"{connections:,} garbage requests", "garbage", False))
    address = ""  # the relay's, from the first token (one relay per loop)
    try:
        for step, (name, mode, other_user) in enumerate(floods):
            ctx.progress(step / len(floods))
            producer.command("lag-start")
            flood = None if mode is None else _Flood(address, mode, connections, other_user)
            try:
                if flood is not None:
                    await anyio.to_thread.run_sync(flood.wait_ready)
                token = producer.start("import", 0.001)
                address = token.address
                resumed = await bounded(asyncfence.import_fence(token).wait(), 30.0)
                stamp = producer.read()
                await anyio.sleep(_HELD_S)  # the flood's connections stay meanwhile
                if flood is not None:
                    await anyio.to_thread.run_sync(flood.finish)
            finally:
                if flood is not None:
                    flood.close()
            lag_p99_s, lag_max_s, beats = producer.command("lag-stop")
            rows[name] = {
                "connections": 0 if mode is None else connections,
                "import_us": latency(resumed, [stamp]) * 1e6 if math.isfinite(resumed) else None,
                "lag_p99_ms": lag_p99_s * 1e3,
                "lag_max_ms": lag_max_s * 1e3,
                "beats": beats,
                "answered": None if flood is None else flood.answered,
            }
    finally:
        producer.close()


def _raise_descriptor_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        limit = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


class _Flood:
    """A forked process that floods a relay: idle connections, or garbage requests.

    Forked (not spawned) so that it may become another user without that
    user reading this checkout; it runs no Python of asyncfence's.
    """

    def __init__(self, address: str, mode: str, count: int, other_user: bool) -> None:
        self._ready_read, ready_write = os.pipe()
        go_read, self._go_write = os.pipe()
        self.answered = 0
        self._pid = os.fork()
        if self._pid == 0:
            code = 0
            try:
                if other_user:
                    os.setgid(_NOBODY)
                    os.setuid(_NOBODY)
                answered = _flood(address, mode, count, ready_write, go_read)
                os.write(ready_write, answered.to_bytes(4, "big"))
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(ready_write)
        os.close(go_read)

    def wait_ready(self) -> None:
        if os.read(self._ready_read, 1) != b"r":
            raise RuntimeError("the flood process failed to start")

    def finish(self) -> None:
        """Let it go (idle connections close), and take how many answers it read."""
        os.write(self._go_write, b"g")
        answered = os.read(self._ready_read, 4)
        self.answered = int.from_bytes(answered, "big") if len(answered) == 4 else -1

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._go_write)
        os.waitpid(self._pid, 0)
        os.close(self._ready_read)


def _flood(address: str, mode: str, count: int, ready_write: int, go_read: int) -> int:
    """In the forked process: the flood, then how many connections the relay answered."""
    if mode == "idle":
        held = []
        for _ in range(count):
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.connect("\0" + address)
            held.append(connection)
        os.write(ready_write, b"r")
        os.read(go_read, 1)
        answered = 0
        for connection in held:  # a refusal or a cut-off, then the end of the stream
            connection.setblocking(False)
            with contextlib.suppress(OSError):
                answered += bool(connection.recv(4096))
            connection.close()
        return answered
    os.write(ready_write, b"r")
    rng = random.Random(3)
    answered = 0
    for _ in range(count):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(10)
            connection.connect("\0" + address)
            with contextlib.suppress(OSError):
                connection.sendall(rng.randbytes(rng.randrange(80)))
                connection.shutdown(socket.SHUT_WR)
            with contextlib.suppress(OSError):
                answered += bool(connection.recv(4096))
    os.read(go_read, 1)
    return answered
