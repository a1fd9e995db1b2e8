"""Bad input, fuzzed with hypothesis: always a clear exception, never a crash or a hang."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import asyncfence
from asyncfence import DeviceError, DriverNotFoundError, DropQueue, FenceError
from asyncfence._interprocess._protocol import (
    ANSWER_ACCEPTED,
    ANSWER_DONE,
    ANSWER_ERROR,
    ANSWER_FAILED,
    ANSWER_LIMIT,
    ANSWER_REFUSED,
    LENGTH,
    PROTOCOL,
    REQUEST_BYTES,
    SECRET_BYTES,
    parse_answer,
    parse_request,
    take_message,
)
from asyncfence.testing import hold

if TYPE_CHECKING:
    from collections.abc import Iterator

    import pyopencl as cl

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

not_streams = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.builds(object),
    st.complex_numbers(),
)
timeouts = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.floats(), max_size=2),
)


def classify_timeout(timeout: object) -> type[Exception] | None:
    """The error a timeout must give, or None when it is valid."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        return TypeError
    if math.isnan(timeout) or timeout < 0:
        return ValueError
    return None


@pytest.fixture(scope="module")
def done_fence(device: Any) -> asyncfence.Fence:
    queue = device.new_stream()
    fence = asyncfence.record(queue)
    fence.wait_sync(timeout=30)
    return fence


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@FUZZ
@given(stream=not_streams)
def test_record_refuses_what_is_not_a_stream(stream: object) -> None:
    with pytest.raises(TypeError, match="expected a device stream"):
        asyncfence.record(stream)


@FUZZ
@given(handle=st.integers(min_value=-(2**70), max_value=2**70))
def test_record_on_any_int_handle_is_an_error_or_a_fence(handle: int, cuda_mode: str) -> None:
    if cuda_mode != "emulated":
        pytest.skip("random handles are for the emulated driver, which checks them")
    try:
        fence = asyncfence.record(handle)
    except (ValueError, DeviceError, DriverNotFoundError):
        return
    assert 0 <= handle <= 2  # only the default streams are valid without a stream
    fence.wait_sync(timeout=30)


@FUZZ
@given(timeout=timeouts)
def test_any_timeout_for_wait_sync(done_fence: asyncfence.Fence, timeout: object) -> None:
    expected = classify_timeout(timeout)
    if expected is None:
        done_fence.wait_sync(timeout=timeout)  # type: ignore[arg-type]
    else:
        with pytest.raises(expected, match="timeout"):
            done_fence.wait_sync(timeout=timeout)  # type: ignore[arg-type]


@FUZZ
@given(
    timeout=timeouts,
    strategy=st.one_of(
        st.sampled_from(["auto", "poll", "park"]), st.text(max_size=4), st.integers()
    ),
)
def test_any_timeout_and_strategy_for_wait(
    done_fence: asyncfence.Fence, loop: asyncio.AbstractEventLoop, timeout: object, strategy: object
) -> None:
    expected = classify_timeout(timeout)
    if expected is None:
        if not isinstance(strategy, str):
            expected = TypeError
        elif strategy not in ("auto", "poll", "park"):
            expected = ValueError
    coroutine = done_fence.wait(timeout=timeout, strategy=strategy)  # type: ignore[arg-type]
    if expected is None:
        loop.run_until_complete(coroutine)
    else:
        with pytest.raises(expected):
            loop.run_until_complete(coroutine)


@FUZZ
@given(
    spin_budget=st.one_of(
        st.none(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=2)
    ),
    poll_cap=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers()),
)
def test_configure_refuses_bad_values_and_keeps_the_old(spin_budget: Any, poll_cap: Any) -> None:
    before = asyncfence.configure()
    try:
        after = asyncfence.configure(spin_budget=spin_budget, poll_cap=poll_cap)
    except (TypeError, ValueError):
        assert asyncfence.configure() == before  # all or nothing
    else:
        assert math.isfinite(after.spin_budget)
        assert after.spin_budget >= 0
        assert math.isfinite(after.poll_cap)
        assert after.poll_cap > 0
    finally:
        asyncfence.configure(spin_budget=before.spin_budget, poll_cap=before.poll_cap)


@FUZZ
@given(
    fences=st.one_of(not_streams, st.lists(not_streams, min_size=1, max_size=2)),
    nbytes=st.one_of(
        st.none(), st.integers(min_value=-10, max_value=10), st.floats(), st.text(max_size=2)
    ),
    free=st.one_of(st.none(), st.integers(), st.just(print)),
)
def test_defer_refuses_bad_arguments_and_keeps_nothing(fences: Any, nbytes: Any, free: Any) -> None:
    assume(not (isinstance(fences, (list, dict)) and not fences))  # "no fences" is valid
    dq = DropQueue()
    with pytest.raises((TypeError, ValueError)):
        dq.defer(fences, object(), free=free, nbytes=nbytes)
    assert dq.statistics().pending_items == 0


@FUZZ
@given(stream=not_streams)
def test_enqueue_wait_refuses_what_is_not_a_stream(
    done_fence: asyncfence.Fence, stream: object
) -> None:
    with pytest.raises(TypeError):
        done_fence.enqueue_wait(stream)


def test_a_fence_from_another_context_is_refused(device: Any) -> None:
    import pyopencl as cl

    queue = device.new_stream()
    other: cl.CommandQueue = cl.CommandQueue(cl.Context(device.context.devices))
    from asyncfence.testing import hold

    with hold(queue):
        fence = asyncfence.record(queue)
        with pytest.raises(ValueError, match="context"):
            fence.enqueue_wait(other)


# -- the relay's protocol, both ways ----------------------------------------------------

requests = st.one_of(
    st.binary(max_size=80),
    st.binary(min_size=REQUEST_BYTES, max_size=REQUEST_BYTES),
    st.builds(lambda tail: PROTOCOL + tail, st.binary(max_size=40)),
    st.builds(lambda n: PROTOCOL + bytes(n), st.integers(min_value=0, max_value=2 * SECRET_BYTES)),
)
framed = st.builds(lambda body: LENGTH.pack(len(body)) + body, st.binary(max_size=64))
failure_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
answers = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([ANSWER_DONE, ANSWER_ACCEPTED]).map(lambda kind: kind + b""),
    st.builds(
        lambda kind, body: kind + body,
        st.sampled_from([ANSWER_DONE, ANSWER_FAILED, ANSWER_REFUSED, ANSWER_ERROR, b"?"]),
        st.binary(max_size=40),
    ),
    st.builds(
        lambda fields: ANSWER_FAILED + json.dumps(fields).encode(),
        st.fixed_dictionaries(
            {"backend": failure_json, "code": failure_json, "name": failure_json},
            optional={"detail": failure_json},
        ),
    ),
    st.just(ANSWER_FAILED + b"[" * 100_000),
    st.just(ANSWER_FAILED + b'{"backend": "b", "code": Infinity, "name": "n", "detail": ""}'),
)


@FUZZ
@given(request=requests)
def test_any_request_is_a_secret_or_nothing(request: bytes) -> None:
    secret = parse_request(request)
    well_formed = len(request) == REQUEST_BYTES and request.startswith(PROTOCOL)
    assert secret == (request[len(PROTOCOL) :] if well_formed else None)


@FUZZ
@given(stream=st.lists(st.one_of(framed, st.binary(max_size=16)), max_size=6))
def test_any_bytes_from_an_exporter_frame_into_messages_or_a_clear_error(
    stream: list[bytes],
) -> None:
    whole = b"".join(stream)
    buffer = bytearray(whole)
    messages: list[bytes] = []
    refusal = ""
    try:
        while (message := take_message(buffer)) is not None:
            messages.append(message)
    except ValueError as error:
        refusal = str(error)
    framed_again = b"".join(LENGTH.pack(len(m)) + m for m in messages)
    assert whole == framed_again + buffer  # nothing lost, nothing made up
    assert all(len(message) <= ANSWER_LIMIT for message in messages)
    if refusal:  # stopped at a length no answer has
        (length,) = LENGTH.unpack_from(buffer)
        assert length > ANSWER_LIMIT
        assert "no asyncfence answer" in refusal


@FUZZ
@given(answer=answers)
def test_any_answer_parses_to_done_or_a_fence_error(answer: bytes) -> None:
    parsed = parse_answer(answer)
    if answer == ANSWER_DONE:
        assert parsed is None
    else:
        assert isinstance(parsed, FenceError)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(garbage=st.lists(requests, min_size=20, max_size=60))
def test_a_relay_fed_garbage_refuses_each_and_still_serves_its_export(
    device: Any, garbage: list[bytes]
) -> None:
    # Garbage on raw connections, from a thread, while the loop serves; then
    # the export it never saw is imported and answered as ever.
    async def main() -> list[FenceError | str | None]:
        queue = device.new_stream()
        with hold(queue) as gate:
            token = asyncfence.record(queue).export()
            outcomes = await asyncio.to_thread(_send_each, token.address, garbage)
            imported = asyncfence.import_fence(token)
            gate.release()
            await asyncio.wait_for(imported.wait(), timeout=30)
        return outcomes

    for outcome in asyncio.run(main()):
        assert isinstance(outcome, FenceError), outcome


def _send_each(address: str, payloads: list[bytes]) -> list[FenceError | str | None]:
    """Send each payload on a connection of its own, then read what the relay answered."""
    outcomes: list[FenceError | str | None] = []
    for payload in payloads:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(30)
            connection.connect("\0" + address)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                connection.sendall(payload)
                connection.shutdown(socket.SHUT_WR)  # a short request ends here
            received = bytearray()
            # The answer, then the end of the stream; a reset once the relay
            # closed with more sent than a request (read first, still).
            with contextlib.suppress(ConnectionResetError):
                while chunk := connection.recv(4096):
                    received += chunk
            message = take_message(received)
            outcomes.append("no answer" if message is None else parse_answer(message))
    return outcomes
