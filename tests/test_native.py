"""The native shim (``asyncfence/_native.c``) and its mailboxes, through ctypes.

The device runtime calls the shim on its own thread; it writes the waiting
loop's mailbox fd, and the loop's own selector wakes the poller. These tests
skip where the shim is not in use (CI's run without it); parked waits
themselves are tested in ``test_poller.py``.
"""

from __future__ import annotations

import ctypes
import os
import random
import select
import subprocess
import sys
import threading

import pytest

from asyncfence._native import NativeMailbox, Shim, shim, unavailable_reason


@pytest.fixture
def native() -> Shim:
    loaded = shim()
    if loaded is None:
        pytest.skip(f"the native shim is not in use in this run: {unavailable_reason()}")
    return loaded


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def fire(native: Shim, slot: int) -> None:
    """Call the signal as the device runtime would (here from the calling thread)."""
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(native.fire)(slot)


# -- the library ------------------------------------------------------------------------


def _passes_in_a_fresh_process(code: str) -> None:
    """Run ``code`` in a new interpreter, which must print "ok".

    The shim's slot and mailbox counts are per process: here a slot left
    armed by an earlier test, firing on PoCL's thread, would move them.
    """
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


def test_the_shim_is_a_plain_shared_library(native: Shim) -> None:
    # One file for every Python version: no ABI tag in its name, nothing of Python's in it.
    assert os.path.basename(native.path) == "_shim.so"
    library = ctypes.CDLL(native.path)
    assert not hasattr(library, "PyInit__shim")
    for name in ("af_mailbox_new", "af_fire", "af_opencl_callback", "af_mailbox_take"):
        assert hasattr(library, name)


# -- the mailbox ------------------------------------------------------------------------


def test_a_fired_signal_makes_the_fd_readable_and_is_taken_once(native: Shim) -> None:
    mailbox = NativeMailbox(native)
    slot = mailbox.new_slot(7)
    assert not readable(mailbox.fileno())
    fire(native, slot)
    assert readable(mailbox.fileno())
    assert mailbox.take() == [7]
    assert not readable(mailbox.fileno())  # drained first
    assert mailbox.take() == []


def test_signals_from_many_threads_arrive_exactly_once(native: Shim) -> None:
    mailbox = NativeMailbox(native)
    slots = [mailbox.new_slot(token) for token in range(4000)]
    random.Random(0).shuffle(slots)

    def fire_all(part: list[int]) -> None:
        for slot in part:
            fire(native, slot)

    threads = [threading.Thread(target=fire_all, args=(slots[i::4],)) for i in range(4)]
    taken: list[int] = []
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads) or readable(mailbox.fileno()):
        taken.extend(mailbox.take())
    for thread in threads:
        thread.join()
    taken.extend(mailbox.take())
    assert sorted(taken) == list(range(4000))


def test_a_signal_after_the_loop_let_go_is_safe_and_frees_everything(native: Shim) -> None:
    # In a fresh process, for the process-wide counts (see the next test).
    code = """
import ctypes, os
from asyncfence._native import NativeMailbox, shim
native = shim()
fire = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(native.fire)
slots_before, mailboxes_before = native.live_slots(), native.live_mailboxes()
mailbox = NativeMailbox(native)
first = mailbox.new_slot(1)
second = mailbox.new_slot(2)
fd = mailbox.fileno()
del mailbox  # the loop is gone; two signals are still armed
assert native.live_mailboxes() == mailboxes_before + 1, "not kept open for its signals"
fire(first)
assert os.fstat(fd)  # still this mailbox's fd: never closed under a signal
fire(second)
assert native.live_mailboxes() == mailboxes_before, "the mailbox was not freed"
assert native.live_slots() == slots_before, "the slots were not freed"
print("ok")
"""
    _passes_in_a_fresh_process(code)


def test_the_wake_paths_takes_keep_the_gil_and_the_arm_releases_it(native: Shim) -> None:
    # The takes: ctypes must call them as it calls the Python C-API, never
    # releasing the GIL, or another Python thread takes the GIL from the
    # woken loop for a switch interval. The arm releases it: clSetEventCallback
    # takes the runtime's locks, which a runtime may hold while it runs
    # callbacks that need the GIL.
    for call in (native.take, native.take_undrained):
        flags = type(call)._flags_  # type: ignore[attr-defined]
        assert flags & ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]
    arm_flags = type(native.opencl_arm)._flags_  # type: ignore[attr-defined]
    assert not arm_flags & ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]
    mailbox = NativeMailbox(native)
    # The calls take(), take_undrained() and arm_event_callback() make.
    assert mailbox._take is native.take
    assert mailbox._take_undrained is native.take_undrained
    assert mailbox._opencl_arm is native.opencl_arm
    slot = mailbox.new_slot(11)
    fire(native, slot)
    assert mailbox.take() == [11]


def test_an_undrained_take_leaves_the_fd_readable_until_a_take_drains_it(native: Shim) -> None:
    # The wake's first look takes the signals without a read; the loop sees
    # the fd readable again and calls back, and that take drains it.
    mailbox = NativeMailbox(native)
    first = mailbox.new_slot(1)
    second = mailbox.new_slot(2)
    fire(native, first)
    assert mailbox.take_undrained() == [1]
    assert readable(mailbox.fileno())
    fire(native, second)  # onto an empty list: written too
    assert mailbox.take_undrained() == [2]
    assert readable(mailbox.fileno())
    assert mailbox.take() == []
    assert not readable(mailbox.fileno())
    assert mailbox.take_undrained() == []


def test_a_take_of_more_than_a_batch_hands_over_every_token(native: Shim) -> None:
    # The shim hands over a batch per call, through the mailbox's own array.
    mailbox = NativeMailbox(native)
    count = 3 * native.take_batch + 5
    for token in range(count):
        fire(native, mailbox.new_slot(token))
    assert sorted(mailbox.take()) == list(range(count))
    assert mailbox.take() == []


def test_a_shim_of_another_version_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # A library left by an older install would be called with the wrong arguments.
    from asyncfence import _native

    monkeypatch.setattr(_native, "_ABI_VERSION", _native._ABI_VERSION + 1)
    loaded, reason, for_good = _native._load()
    if reason is not None and "version" not in reason:
        pytest.skip(f"the shim is not in use in this run: {reason}")
    assert loaded is None
    assert reason is not None
    assert "reinstall asyncfence" in reason
    assert for_good


_ARM_EVENT_CALLBACK = """
import ctypes, select
import pyopencl as cl
from asyncfence._native import NativeMailbox, shim
from asyncfence.testing import open_default_device

native = shim()
mailbox = NativeMailbox(native)
before = native.live_slots()
try:
    mailbox.arm_event_callback(0, 1)
except RuntimeError as error:  # nobody told the shim of clSetEventCallback yet
    assert "clSetEventCallback" in str(error)
else:
    raise AssertionError("armed with no entry")
assert native.live_slots() == before, "a slot was left"

from asyncfence._backends.opencl._runtime import _give_entry_to_shim
_give_entry_to_shim()  # as the OpenCL backend's first arm, or warm_up(), does
queue = open_default_device("opencl").new_stream()
context = queue.context
readable = lambda: bool(select.select([mailbox.fileno()], [], [], 0)[0])

gate = cl.UserEvent(context)
marker = cl.enqueue_marker(queue, wait_for=[gate])
queue.flush()
assert mailbox.arm_event_callback(marker.int_ptr, 41) == 0
assert native.live_slots() == before + 1
assert mailbox.take() == [] and not readable()  # held by the gate
gate.set_status(cl.command_execution_status.COMPLETE)
marker.wait()
assert select.select([mailbox.fileno()], [], [], 30)[0], "no signal came"
assert mailbox.take() == [41]

done = cl.enqueue_marker(queue)
done.wait()
assert mailbox.arm_event_callback(done.int_ptr, 42) == 0  # complete already: at once
assert select.select([mailbox.fileno()], [], [], 30)[0], "no signal came"
assert mailbox.take() == [42]
assert native.live_slots() == before

assert mailbox.arm_event_callback(0, 43) == -58  # CL_INVALID_EVENT: refused
assert native.live_slots() == before, "the refused slot was not freed"
assert mailbox.take() == [] and not readable()
print("ok")
"""


def test_an_event_callback_is_armed_in_one_call_and_freed_if_refused(native: Shim) -> None:
    # In a fresh process: the entry must not be set yet, and the slot counts
    # are per process.
    pytest.importorskip("pyopencl")
    _passes_in_a_fresh_process(_ARM_EVENT_CALLBACK)


# For the fresh-process scripts: park one fence on ``stream``, read a
# statistic of the loop while it is parked, then release it and await it.
_PARK_ONCE = """
import asyncio
import asyncfence
from asyncfence.testing import hold


async def park_once(stream, statistic):
    with hold(stream) as gate:
        fence = asyncfence.record(stream)
        task = asyncio.ensure_future(fence.wait(strategy="park"))
        while asyncfence.current_statistics().parked < 1:
            await asyncio.sleep(0.001)
        seen = getattr(asyncfence.current_statistics(), statistic)
        gate.release()
        await asyncio.wait_for(task, 30)
    return seen
"""

_ENTRY_AFTER_A_FAILED_LOAD = (
    _PARK_ONCE
    + """
from asyncfence._backends.opencl import _runtime
from asyncfence.testing import open_default_device

loaded = _runtime.shim
_runtime.shim = lambda: None  # warm_up() while the shim could not be loaded (no fd, say)
queue = open_default_device("opencl").new_stream()
asyncfence.warm_up(queue)
assert not _runtime._shim_has_entry
_runtime.shim = loaded  # loaded since: the first arm gives it the entry
armed = asyncio.run(park_once(queue, "armed"))
assert armed == 1, "parked unsignalled: the shim had no clSetEventCallback"
print("ok")
"""
)


def test_the_shim_gets_its_opencl_entry_at_the_first_arm_if_warm_up_could_not_give_it(
    native: Shim,
) -> None:
    pytest.importorskip("pyopencl")
    _passes_in_a_fresh_process(_ENTRY_AFTER_A_FAILED_LOAD)


def test_an_unused_slot_is_freed(native: Shim) -> None:
    # In a fresh process: here, a slot an earlier test left armed may fire (and
    # be freed, its loop gone) on the runtime's thread at any moment, moving
    # the process-wide count under the test.
    code = """
from asyncfence._native import NativeMailbox, shim
native = shim()
before = native.live_slots()
mailbox = NativeMailbox(native)
slot = mailbox.new_slot(1)
assert native.live_slots() == before + 1, "no slot was made"
mailbox.discard(slot)
assert native.live_slots() == before, "the discarded slot was not freed"
print("ok")
"""
    _passes_in_a_fresh_process(code)


def test_a_forked_child_never_drains_its_parents_mailbox_nor_arms_on_it(native: Shim) -> None:
    # In a fresh process, with no other thread: forking this one is not the point.
    code = """
import ctypes, os, select
from asyncfence._native import NativeMailbox, shim
native = shim()
mailbox = NativeMailbox(native)
slot = mailbox.new_slot(3)
ctypes.CFUNCTYPE(None, ctypes.c_void_p)(native.fire)(slot)
readable = lambda: bool(select.select([mailbox.fileno()], [], [], 0)[0])
pid = os.fork()
def refused(arm):
    try:
        arm()
    except RuntimeError as error:
        return "forked from" in str(error)
    return False
if pid == 0:  # the child: the fd is shared with the parent, the mailbox is not its own
    ok = mailbox.take() == [] and mailbox.take_undrained() == [] and readable()
    # A signal armed here would wake the parent's loop, not the child's.
    ok = ok and refused(lambda: mailbox.new_slot(4))
    ok = ok and refused(lambda: mailbox.arm_event_callback(0, 5))
    del mailbox  # its finalizer must leave the parent's fd alone too
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, "the child touched the mailbox"
assert readable(), "the child drained the parent's wake"
assert mailbox.take() == [3]
print("ok")
"""
    _passes_in_a_fresh_process(code)


# -- parked waits, woken by their own signals ------------------------------------------------


# -- CUDA: the raw host-function entry points ------------------------------------------------


# -- out of descriptors ------------------------------------------------------------------

_OUT_OF_DESCRIPTORS = (
    _PARK_ONCE
    + """
import logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
from asyncfence import _native
from asyncfence.testing import open_default_device

device = open_default_device("opencl")
streams = [device.new_stream() for _ in range(2)]
if sys.argv[1] == "loaded":
    assert _native.shim() is not None  # the library is in: only the eventfd fails


loop = asyncio.new_event_loop()
spent = []
while True:  # every descriptor left, taken
    try:
        spent.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        break
print("first loop:", loop.run_until_complete(park_once(streams[0], "wake_path")))
loop.close()
for fd in spent:
    os.close(fd)
print("later loop:", asyncio.run(park_once(streams[1], "wake_path")))
"""
)


@pytest.mark.parametrize("shim_state", ["loaded", "not yet loaded"])
def test_a_loop_out_of_descriptors_says_why_and_a_later_loop_parks_natively(
    native: Shim, shim_state: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _OUT_OF_DESCRIPTORS, shim_state.split()[0]],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "first loop: polling" in lines
    assert "later loop: native" in lines  # the shortage was not remembered
    warnings = [line for line in lines if "no native wake path on this loop" in line]
    assert len(warnings) == 1, lines
    assert "Too many open files" in warnings[0]
    if shim_state == "loaded":  # the eventfd's own errno, not [Errno 0]
        assert "[Errno 24]" in warnings[0]
