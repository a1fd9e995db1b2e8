"""asyncfence.testing: gates that hold streams, for tests that decide when work completes."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

import asyncfence
from asyncfence.testing import hold

if TYPE_CHECKING:
    import pyopencl as cl


@pytest.mark.parametrize(("code", "error"), [("x", TypeError), (-5.5, TypeError), (0, ValueError)])
def test_fail_refuses_what_is_not_a_negative_int(
    queue: cl.CommandQueue, code: object, error: type[Exception]
) -> None:
    with hold(queue) as gate:
        with pytest.raises(error, match="code must be a negative int"):
            gate.fail(code)  # type: ignore[arg-type]
        assert gate.held  # a refused call changes nothing


def test_a_failed_gate_fails_the_fences_behind_it(queue: cl.CommandQueue) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        gate.fail(-5)
    with pytest.raises(asyncfence.DeviceError) as caught:
        fence.wait_sync(timeout=30)
    assert (caught.value.code, caught.value.name) == (-1, "CL_FAILED")  # PoCL's one code


def test_a_child_forked_while_locks_are_held_gets_fresh_ones() -> None:
    # In a fresh process: forking this multi-threaded one is not what the test is about.
    code = """
import os, threading
from asyncfence._backends.cuda import _lab as cuda_lab
from asyncfence._backend import backend_for
from asyncfence.testing import StreamGate, open_default_device
queue = open_default_device("opencl").new_stream()
gate = StreamGate(queue)
backend = backend_for(queue)
locks = lambda: (gate._lock, cuda_lab._flag_lock, backend._sweep_lock)
held, done = threading.Event(), threading.Event()
def hold_them():
    for lock in locks():
        lock.acquire()
    held.set()
    done.wait(30)
    for lock in locks():
        lock.release()
holder = threading.Thread(target=hold_them)
holder.start()
assert held.wait(30)
pid = os.fork()
if pid == 0:  # the child: none of them may block it
    os._exit(0 if all(lock.acquire(blocking=False) for lock in locks()) else 1)
_, status = os.waitpid(pid, 0)
done.set()
holder.join(30)
gate.release()
raise SystemExit(os.waitstatus_to_exitcode(status))
"""
    env = {**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
