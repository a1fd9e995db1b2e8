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


class _BrokenPyopencl:
    """A meta-path finder for which ``import pyopencl`` fails as a broken install does."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "pyopencl":
            raise ImportError("libOpenCL.so.1: cannot open shared object file")


def test_a_broken_pyopencl_is_named_as_the_cause_not_install_advice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from asyncfence._backends.opencl._lab import OpenCLLab

    monkeypatch.delitem(sys.modules, "pyopencl", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenPyopencl(), *sys.meta_path])
    with pytest.raises(RuntimeError, match="pyopencl does not import") as caught:
        OpenCLLab().open_device()
    assert "cannot open shared object file" in str(caught.value.__cause__)
    assert "install the opencl extra" not in str(caught.value)


def test_a_missing_pyopencl_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from asyncfence._backends.opencl._lab import OpenCLLab

    monkeypatch.setitem(sys.modules, "pyopencl", None)  # import raises ModuleNotFoundError
    with pytest.raises(RuntimeError, match="install the opencl extra"):
        OpenCLLab().open_device()


def test_open_default_device_chains_the_reason_beneath_its_advice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from asyncfence import testing

    monkeypatch.delitem(sys.modules, "pyopencl", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenPyopencl(), *sys.meta_path])
    monkeypatch.setattr(testing._gates, "backend_names", lambda: ("opencl",))
    with pytest.raises(RuntimeError, match="pyopencl does not import") as caught:
        testing.open_default_device()
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert isinstance(caught.value.__cause__.__cause__, ImportError)
