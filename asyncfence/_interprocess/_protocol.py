"""Fences across processes: what the exporter and the importer say to each other.

A request is :data:`PROTOCOL` then a token's 32-byte secret; an answer is a
4-byte big-endian length, then one of the ``ANSWER_*`` bytes and its details.
Both parsers take anything a peer could send and give a result or a clear
error (``tests/test_fuzz.py`` fuzzes them).

Thread-safety: pure functions and constants; any thread.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Final

from .._exceptions import DeviceError, FenceError, TokenRefusedError

__all__ = [
    "ANSWER_ACCEPTED",
    "ANSWER_DONE",
    "ANSWER_ERROR",
    "ANSWER_FAILED",
    "ANSWER_LIMIT",
    "ANSWER_REFUSED",
    "LENGTH",
    "PROTOCOL",
    "REQUEST_BYTES",
    "SECRET_BYTES",
    "FenceToken",
    "answer_for",
    "frame",
    "parse_answer",
    "parse_request",
    "take_message",
]

# A request: the protocol's tag, then the token's secret.
PROTOCOL: Final = b"AF1"
SECRET_BYTES: Final = 32
REQUEST_BYTES: Final = len(PROTOCOL) + SECRET_BYTES
# An answer: its length (4 bytes, big-endian), then one of these bytes and its
# details. The connection stays open after an answer where the importer may
# still wait on an interprocess handle: it closes, and the exporter then frees it.
# Before the answer, where the export has an interprocess handle: the token is
# good. Until then the importer's own device may not end its wait: a handle
# can outlive its token (used already, or presented twice).
ANSWER_ACCEPTED: Final = b"A"
ANSWER_DONE: Final = b"D"
ANSWER_FAILED: Final = b"F"  # then a DeviceError as JSON
ANSWER_REFUSED: Final = b"R"  # then why, in UTF-8
ANSWER_ERROR: Final = b"E"  # then a FenceError's message, in UTF-8
# Answers are a few hundred bytes; anything longer is not one.
ANSWER_LIMIT: Final = 64 * 1024
LENGTH: Final = struct.Struct("!I")


@dataclass(frozen=True, slots=True)
class FenceToken:
    """A capability to await, in another process on this machine, one exported fence.

    Made by :meth:`asyncfence.Fence.export`; picklable and small, to send
    however the processes talk (a pipe, a queue, an HTTP request). Turn it
    back into an awaitable fence with :func:`asyncfence.import_fence`. Its
    secret is unguessable and answers one import; ``repr()`` leaves it out.

    Attributes:
        address: The exporting loop's relay socket, in Linux's abstract
            namespace (without the leading NUL byte).
        secret: The 32 random bytes that name the export.
        producer_pid: The exporting process (in its pid namespace).
        backend: The exported fence's backend, ``"opencl"`` or ``"cuda"``.
        producer_started: When the exporting process started, in clock ticks
            after boot: a pid given out again comes with another.
        host: The exporter's boot and network namespace: an importer
            elsewhere (another machine, another boot, another network
            namespace) cannot reach its relay, and refuses the token at once.
        pid_namespace: The exporter's pid namespace (its inode): an importer
            in the same one checks the relay's pid as well as its user.
        interprocess: Where the backend has interprocess events (CUDA), the
            handle of one that completes with the fence, which the importer's
            own device waits on; ``None`` elsewhere, or once the fence was done.

    Thread-safety: immutable; any thread.
    """

    address: str
    secret: bytes = field(repr=False)
    producer_pid: int
    backend: str
    producer_started: int = field(repr=False)
    host: str = field(repr=False)
    pid_namespace: int = field(repr=False)
    interprocess: bytes | None = field(default=None, repr=False)


def frame(message: bytes) -> bytes:
    return LENGTH.pack(len(message)) + message


def answer_for(error: BaseException | None) -> bytes:
    """The answer for a fence that settled with ``error`` (``None``: done)."""
    if error is None:
        return ANSWER_DONE
    if isinstance(error, DeviceError):
        failure = {
            "backend": error.backend,
            "code": error.code,
            "name": error.name,
            "detail": error.detail,
        }
        return ANSWER_FAILED + json.dumps(failure).encode()
    if isinstance(error, FenceError):  # the wait itself failed (forked, say)
        return ANSWER_ERROR + str(error).encode()
    return ANSWER_ERROR + b"the exporting process failed to answer"


def take_message(buffer: bytearray) -> bytes | None:
    """Take the first whole message off the front of ``buffer``; ``None`` until one is whole.

    Raises:
        ValueError: Its length is more than :data:`ANSWER_LIMIT`: no answer
            is that long.
    """
    if len(buffer) < LENGTH.size:
        return None
    (length,) = LENGTH.unpack_from(buffer)
    if length > ANSWER_LIMIT:
        raise ValueError(f"a message of {length} bytes is no asyncfence answer")
    if len(buffer) < LENGTH.size + length:
        return None
    message = bytes(buffer[LENGTH.size : LENGTH.size + length])
    del buffer[: LENGTH.size + length]
    return message


def parse_answer(answer: bytes) -> FenceError | None:
    """What an answer other than :data:`ANSWER_ACCEPTED` says: ``None`` (done), or the error.

    Anything an exporter could send gives one or the other: this never raises.
    """
    kind, details = answer[:1], answer[1:]
    if kind == ANSWER_DONE and not details:
        return None
    if kind == ANSWER_FAILED:
        try:
            fields = json.loads(details)
            return DeviceError(
                str(fields["backend"]),
                int(fields["code"]),
                str(fields["name"]),
                str(fields["detail"]),
            )
        # OverflowError: a code of Infinity; RecursionError: JSON nested thousands deep.
        except (ValueError, LookupError, TypeError, OverflowError, RecursionError):
            return FenceError("the exporting process sent a malformed failure")
    if kind == ANSWER_REFUSED:
        reason = details.decode(errors="replace")
        return TokenRefusedError(f"the exporting process refused the token: {reason}")
    if kind == ANSWER_ERROR:
        return FenceError(details.decode(errors="replace"))
    return FenceError("the exporting process sent no asyncfence answer")


def parse_request(request: bytes) -> bytes | None:
    """The secret a request presents; ``None`` if it is not an asyncfence request."""
    if len(request) != REQUEST_BYTES or not request.startswith(PROTOCOL):
        return None
    return request[len(PROTOCOL) :]
