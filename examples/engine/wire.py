"""The messages between the API process and the engine: length-prefixed pickles.

Both ends are processes of the same user, started together; nothing else
can reach their socket pair. Every message is a tuple whose first item names
it.

API to engine:
    ``("add", request_id, prompt_token, max_tokens)``,
    ``("cancel", request_id)``: a client left, or its stream failed,
    ``("ack", slot)``: the API has read the slot; the engine may reuse it.

Engine to API:
    ``("ready", info)``: a dict naming the device, the rows and the slots,
    ``("step", number, slot, token, rows, finished, active)``: the step's
    tokens are in ``slot`` once its fence is done (``token``, a
    :class:`asyncfence.FenceToken`, or ``None`` when the engine synchronized
    before sending); ``rows`` lists ``(request_id, index, row)``;
    ``finished``, the requests whose last token this step made,
    ``("active", count)``: the requests in the batch, after a cancel,
    ``("fatal", text)``: the engine stops (a device error).
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

__all__ = ["Unframer", "frame"]

_LENGTH = struct.Struct("!I")


def frame(message: tuple[Any, ...]) -> bytes:
    """``message`` as bytes to send: its pickle's length, then the pickle."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


class Unframer:
    """Collects received bytes; gives back each whole message."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[Any, ...]]:
        """Add ``data``; return the messages now complete, in order."""
        self._buffer += data
        messages = []
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            end = _LENGTH.size + length
            if len(self._buffer) < end:
                break
            messages.append(pickle.loads(self._buffer[_LENGTH.size : end]))
            del self._buffer[:end]
        return messages
