"""What one parked wake costs the loop thread: instructions (callgrind) and memory (tracemalloc).

Run from a checkout, on OpenCL (PoCL)::

    python -m benchmarks.wake_cost instructions [--loop asyncio|uvloop|trio] [--cycles N]
    python -m benchmarks.wake_cost memory [--loop ...] [--fences N]

**Instructions.** A *cycle* is what a task does to wait for one piece of
device work with ``strategy="park"``: a gate holds an in-order queue (a user
event a marker waits for), the task records a fence and awaits it, and a loop
callback releases the gate once the task is suspended; the task resumes when
the completion signal has woken the loop. The *barest wake* does the same
with nothing but what a wake needs: a marker, ``clSetEventCallback`` with the
shim's C callback (which writes an eventfd), the loop watching that fd, and a
future set by its reader. Both pay the same gate and release. The *await*
cycle is the park cycle written ``await fence``, with ``park`` the
process-wide strategy.

The script runs itself under ``valgrind --tool=callgrind``, collecting only
inside one C function that runs the measured cycles (after warm-up ones), so
only the loop thread's instructions count, and divides by the cycles. With
``--functions``, it also routes a list of asyncfence's functions through C
functions of their own, one each, and reads each one's inclusive count; the
cost of that routing (measured around a function that does nothing) is taken
off. Instruction counts are stable under noise, unlike times.

**Memory.** The Python heap (tracemalloc) held per task waiting on a parked
fence, against a task awaiting a plain future (the least a waiting task costs).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import re
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

_HELPER_SOURCE = r"""
#include <valgrind/callgrind.h>
/* Collects what run() costs: the whole measured cycles, or one routed function. */
void af_cg_collect(void (*run)(void)) {
    CALLGRIND_TOGGLE_COLLECT;
    run();
    CALLGRIND_TOGGLE_COLLECT;
}
"""
#: Routes a function that does nothing: what routing itself costs per call.
_NOTHING = "@nothing"

#: The functions on the park path whose inclusive counts are reported:
#: ``module:qualified.name``. The last region measures the routing itself.
FUNCTIONS = (
    "asyncfence._fence:record",
    "asyncfence._backends.opencl._runtime:OpenCLBackend.record",
    "asyncfence._backends.opencl._runtime:OpenCLBackend._known",
    "asyncfence._fence:Fence.wait",
    "asyncfence._poller:Poller.add",
    "asyncfence._poller:Poller._park",
    "asyncfence._parking:Parking.park",
    "asyncfence._parking:Parking._arm",
    "asyncfence._parking:Parking._arm_one",
    "asyncfence._native:NativeMailbox.arm_event_callback",
    "asyncfence._core:FenceCore.arm",
    "asyncfence._backends.opencl._runtime:OpenCLBackend.arm",
    "asyncfence._parking:Parking._on_readable",
    "asyncfence._parking:Parking._wake_signalled",
    "asyncfence._parking:Parking._finish_wake",
    "asyncfence._poller:Poller.wake",
    "asyncfence._core:FenceCore.poll",
    "asyncfence._poller:Poller.discard",
)


def _build_helper(directory: Path) -> Path:
    source = directory / "cg_helper.c"
    library = directory / "cg_helper.so"
    source.write_text(_HELPER_SOURCE)
    subprocess.run(["cc", "-O0", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


class _Routed:
    """Calls one function, through the helper's collecting C function once measuring has begun."""

    measuring = False

    def __init__(self, helper: ctypes.PyDLL, original: Any) -> None:
        self._collect = helper.af_cg_collect
        self._collect.restype = None
        self._original = original
        self._frames: list[Any] = []
        self.calls = 0
        self._callback = ctypes.CFUNCTYPE(None)(self._run)

    def _run(self) -> None:
        args, kwargs = self._frames[-1]
        try:
            self._frames[-1] = (True, self._original(*args, **kwargs))
        except BaseException as error:
            self._frames[-1] = (False, error)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _Routed.measuring or self._frames:  # warm-up, or a nested call
            return self._original(*args, **kwargs)
        self.calls += 1
        self._frames.append((args, kwargs))
        self._collect(self._callback)
        ok, value = self._frames.pop()
        if not ok:
            raise value
        return value


def _route(helper: ctypes.PyDLL, dotted: str) -> _Routed:
    module_name, _, qualified = dotted.partition(":")
    owner: Any = importlib.import_module(module_name)
    *path, name = qualified.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = owner.__dict__[name]
    routed = _Routed(helper, original)
    if path:  # a method: a plain function in the class, so that it binds

        def method(*args: Any, **kwargs: Any) -> Any:
            return routed(*args, **kwargs)

        setattr(owner, name, method)
    else:
        setattr(owner, name, routed)
        for module in list(sys.modules.values()):  # names imported elsewhere too
            if module is not None and getattr(module, name, None) is original:
                setattr(module, name, routed)
    return routed


# -- the cycles (run inside valgrind) --------------------------------------------------


def _cycle_runner(kind: str, loop_name: str) -> tuple[Any, Any]:
    """``(run, queue)``: ``run(n)`` does ``n`` cycles of ``kind`` on ``loop_name``'s loop."""
    import pyopencl as cl

    import asyncfence
    from asyncfence._native import shim
    from asyncfence.testing import StreamGate, open_default_device

    device = open_default_device("opencl")
    queue = device.new_stream()
    asyncfence.warm_up(queue)
    native = shim()
    assert native is not None, "the shim is not built"
    from asyncfence._backends.opencl._runtime import _set_event_callback

    set_callback = _set_event_callback()
    library = native.library

    def bare_arm(mailbox: int) -> StreamGate:
        """A held queue, and a marker behind it whose callback posts to ``mailbox``."""
        gate = StreamGate(queue)
        marker = cl.enqueue_marker(queue)
        queue.flush()
        slot = library.af_slot_new(mailbox, 1)
        set_callback(marker.int_ptr, 0, native.opencl_callback, slot)
        return gate

    async def park_cycles(n: int, soon: Any) -> None:
        for _ in range(n):
            gate = StreamGate(queue)
            fence = asyncfence.record(queue)
            soon(gate.release)
            await fence.wait(strategy="park")

    async def await_cycles(n: int, soon: Any) -> None:
        for _ in range(n):
            gate = StreamGate(queue)
            fence = asyncfence.record(queue)
            soon(gate.release)
            await fence

    if kind == "await":
        asyncfence.configure(strategy="park")
        park_cycles = await_cycles

    if loop_name == "trio":
        import trio

        async def bare_cycles(n: int, soon: Any) -> None:
            mailbox = library.af_mailbox_new()
            fd = library.af_mailbox_fd(mailbox)
            argument = ctypes.c_void_p(mailbox)
            for _ in range(n):
                gate = bare_arm(mailbox)
                soon(gate.release)
                await trio.lowlevel.wait_readable(fd)
                native.take(argument)

        async def main(n: int) -> None:
            token = trio.lowlevel.current_trio_token()
            cycles = bare_cycles if kind == "bare" else park_cycles
            await cycles(n, token.run_sync_soon)

        def run(n: int) -> None:
            trio.run(main, n)

        return run, queue

    import asyncio

    loop: asyncio.AbstractEventLoop
    if loop_name == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()

    async def bare_cycles_asyncio(n: int, soon: Any) -> None:
        mailbox = library.af_mailbox_new()
        fd = library.af_mailbox_fd(mailbox)
        argument = ctypes.c_void_p(mailbox)
        waiting: list[asyncio.Future[None]] = []

        def on_readable() -> None:
            native.take(argument)
            if waiting:
                waiting.pop().set_result(None)

        loop.add_reader(fd, on_readable)
        try:
            for _ in range(n):
                gate = bare_arm(mailbox)
                future = loop.create_future()
                waiting.append(future)
                soon(gate.release)
                await future
        finally:
            loop.remove_reader(fd)

    def run_asyncio(n: int) -> None:
        cycles = bare_cycles_asyncio if kind == "bare" else park_cycles
        loop.run_until_complete(cycles(n, loop.call_soon))

    return run_asyncio, queue


def _inner(args: argparse.Namespace) -> int:
    helper = ctypes.PyDLL(args.helper)
    nothing = routed = None
    if args.function == _NOTHING:
        nothing = routed = _Routed(helper, lambda: None)
    elif args.function:
        routed = _route(helper, args.function)
    run, _queue = _cycle_runner(args.kind, args.loop)
    run(args.warmup)
    if args.function:  # collected inside the routed function only
        _Routed.measuring = True
        run(args.cycles)
        if nothing is not None:
            for _ in range(args.cycles):
                nothing()
        assert routed is not None
        print(f"calls={routed.calls}")
        return 0
    collect = helper.af_cg_collect
    collect.restype = None
    collect(ctypes.CFUNCTYPE(None)(lambda: run(args.cycles)))
    return 0


# -- the orchestrator ------------------------------------------------------------------


def _collected(
    kind: str, loop: str, cycles: int, helper: Path, function: str | None
) -> tuple[int, int]:
    """Instructions callgrind collected on the loop thread in one run, and the routed calls."""
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "callgrind.out"
        command = [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            f"--callgrind-out-file={output}",
            sys.executable,
            "-m",
            "benchmarks.wake_cost",
            "_inner",
            f"--kind={kind}",
            f"--loop={loop}",
            f"--cycles={cycles}",
            f"--helper={helper}",
            *([f"--function={function}"] if function else []),
        ]
        printed = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        match = re.search(r"^summary: (\d+)", output.read_text(), re.MULTILINE)
        assert match, "callgrind wrote no summary"
        calls = re.search(r"^calls=(\d+)", printed, re.MULTILINE)
        return int(match.group(1)), int(calls.group(1)) if calls else 0


def _measure(kind: str, loop: str, cycles: int, functions: bool, helper: Path) -> dict[str, Any]:
    result: dict[str, Any] = {
        "kind": kind,
        "loop": loop,
        "cycles": cycles,
        "per_cycle": _collected(kind, loop, cycles, helper, None)[0] / cycles,
    }
    if functions:
        routing, calls = _collected(kind, loop, cycles, helper, _NOTHING)
        per_routing = routing / max(calls, 1)
        result["routing_per_call"] = per_routing
        figures = {}
        for dotted in FUNCTIONS:
            collected, calls = _collected(kind, loop, cycles, helper, dotted)
            figures[dotted] = {
                "calls_per_cycle": calls / cycles,
                # Inclusive; the routing of each call taken off.
                "per_cycle": (collected - calls * per_routing) / cycles,
            }
        result["functions"] = figures
    return result


def _memory(loop_name: str, fences: int) -> dict[str, float]:
    """Traced bytes per task awaiting a parked fence, and per task awaiting a future.

    A parked fence is awaited both ways: ``fence.wait(strategy="park")``, and
    ``await fence`` with ``park`` the process-wide strategy.

    Tasks are the loop's own (``asyncio.create_task``, a trio nursery's), not
    anyio's, whose wrappers would count in both. The fence's record is in
    the figure; its gate, made before, is not.
    """
    import asyncfence
    from asyncfence.testing import StreamGate, open_default_device

    device = open_default_device("opencl")
    queues = [device.new_stream() for _ in range(fences)]

    async def wait_parked(queue: Any) -> None:
        await asyncfence.record(queue).wait(strategy="park")

    async def await_parked(queue: Any) -> None:
        await asyncfence.record(queue)  # `await fence`, under configure(strategy="park")

    if loop_name == "trio":
        import trio

        async def held(wait: Any, arguments: list[Any], ready: Any, release: Any) -> float:
            async with trio.open_nursery() as nursery:
                tracemalloc.start()
                before = tracemalloc.get_traced_memory()[0]
                for argument in arguments:
                    nursery.start_soon(wait, argument)
                while not ready():  # noqa: ASYNC110 (polling a count, not an event)
                    await trio.sleep(0.01)
                traced = tracemalloc.get_traced_memory()[0] - before
                tracemalloc.stop()
                release()
            return traced / len(arguments)

        def run(main: Any) -> Any:
            return trio.run(main)

        def new_event() -> Any:
            return trio.Event()
    else:
        import asyncio

        async def held(wait: Any, arguments: list[Any], ready: Any, release: Any) -> float:
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            tasks = [asyncio.create_task(wait(argument)) for argument in arguments]
            while not ready():  # noqa: ASYNC110 (polling a count, not an event)
                await asyncio.sleep(0.01)
            traced = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            release()
            await asyncio.gather(*tasks)
            return traced / len(arguments)

        def run(main: Any) -> Any:
            if loop_name == "uvloop":
                import uvloop

                return uvloop.run(main())
            return asyncio.run(main())

        def new_event() -> Any:
            return asyncio.Event()

    async def parked(wait: Any = wait_parked) -> float:
        gates = [StreamGate(queue) for queue in queues]

        def release() -> None:
            for gate in gates:
                gate.release()

        return await held(
            wait, queues, lambda: asyncfence.current_statistics().parked == fences, release
        )

    async def plain() -> float:
        event = new_event()
        started = [0]

        async def wait(_: object) -> None:
            started[0] += 1
            await event.wait()

        return await held(wait, list(range(fences)), lambda: started[0] == fences, event.set)

    async def main() -> dict[str, float]:
        await parked()  # warm: first-use tables and caches
        await parked(await_parked)
        await plain()
        return {
            "parked_fence_bytes": await parked(),
            "awaited_fence_bytes": await parked(await_parked),
            "plain_wait_bytes": await plain(),
        }

    previous = asyncfence.configure().strategy
    asyncfence.configure(strategy="park")
    try:
        result: dict[str, float] = run(main)
    finally:
        asyncfence.configure(strategy=previous)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the command line; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wake_cost", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    instructions = commands.add_parser("instructions", help="instructions per cycle (callgrind)")
    instructions.add_argument("--loop", choices=("asyncio", "uvloop", "trio"), default="asyncio")
    instructions.add_argument("--cycles", type=int, default=200)
    instructions.add_argument("--functions", action="store_true", help="per-function counts")
    instructions.add_argument("--json", metavar="PATH")
    memory = commands.add_parser("memory", help="traced memory per parked fence")
    memory.add_argument("--loop", choices=("asyncio", "uvloop", "trio"), default="asyncio")
    memory.add_argument("--fences", type=int, default=2000)
    inner = commands.add_parser("_inner")
    inner.add_argument("--kind", choices=("park", "await", "bare"), required=True)
    inner.add_argument("--loop", required=True)
    inner.add_argument("--cycles", type=int, required=True)
    inner.add_argument("--warmup", type=int, default=30)
    inner.add_argument("--helper", required=True)
    inner.add_argument("--function", help="collect inside this function only")
    args = parser.parse_args(argv)
    if args.command == "_inner":
        return _inner(args)
    if args.command == "memory":
        print(json.dumps({"loop": args.loop, **_memory(args.loop, args.fences)}, indent=2))
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        helper = _build_helper(Path(scratch))
        report = {
            "park": _measure("park", args.loop, args.cycles, args.functions, helper),
            "await": _measure("await", args.loop, args.cycles, False, helper),
            "bare": _measure("bare", args.loop, args.cycles, False, helper),
        }
    park, bare = report["park"]["per_cycle"], report["bare"]["per_cycle"]
    awaited = report["await"]["per_cycle"]
    print(
        f"{args.loop}: park {park / 1e3:,.1f}k instructions per cycle "
        f"(`await fence` {awaited / 1e3:,.1f}k), "
        f"barest wake {bare / 1e3:,.1f}k ({park / bare:.2f}x)"
    )
    routing = report["park"].get("routing_per_call", 0.0)
    functions = report["park"].get("functions", {})
    for name, figures in sorted(functions.items(), key=lambda item: -item[1]["per_cycle"]):
        print(f"  {figures['per_cycle'] / 1e3:8.1f}k  x{figures['calls_per_cycle']:.2f}  {name}")
    if routing:
        print(f"  (inclusive, per cycle; routing, {routing / 1e3:.1f}k a call, taken off)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
