"""The inference server example serves real HTTP requests, and its load script compares."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "inference_server"

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")


def _import_server() -> Any:
    sys.path.insert(0, str(EXAMPLE))
    try:
        import server
    finally:
        sys.path.remove(str(EXAMPLE))
    return server


def _kernel_build_failure() -> str | None:
    """Why the default OpenCL device cannot build the server's kernel; None if it can."""
    import pyopencl as cl

    from asyncfence.testing import OpenCLDevice, open_default_device

    server = _import_server()
    device = open_default_device("opencl")
    assert isinstance(device, OpenCLDevice)
    program = cl.Program(device.context, server.GATHER)
    try:
        program.build()
    except cl.Error as error:
        lines = [line for line in str(error).splitlines() if "error:" in line]
        return (lines or [str(error)])[0].strip()
    finally:
        del program  # before its context: PoCL aborts on the reverse
    return None


def _skip_unless_kernels_build(gather: str) -> None:
    if gather == "kernel" and (why := _kernel_build_failure()) is not None:
        # PoCL 3.0 (LLVM 14, PyPI) does not know newer CPUs, e.g. Zen 5. CI
        # runs the kernel tests again on Debian's PoCL, where a skip is a failure.
        if os.environ.get("ASYNCFENCE_REQUIRE_KERNELS") == "1":
            pytest.fail(f"ASYNCFENCE_REQUIRE_KERNELS=1, but the device cannot build: {why}")
        pytest.skip(f"this OpenCL device cannot build kernels: {why}")


def _import_load() -> Any:
    sys.path.insert(0, str(EXAMPLE))
    try:
        import load
    finally:
        sys.path.remove(str(EXAMPLE))
    return load


@pytest.mark.parametrize("gather", ["copies", "kernel"])
def test_the_server_answers_real_requests(gather: str) -> None:
    _skip_unless_kernels_build(gather)
    load = _import_load()
    env = {**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"}
    with load.start_server("--gather", gather, env=env) as server:
        assert server.banner == f"serving on {server.url} (asyncfence, gather={gather})"
        assert server.url.startswith("http://127.0.0.1:")
        with httpx.Client(base_url=server.url, timeout=30) as client:
            health = client.get("/health").json()
            assert health["wait"] == "asyncfence"
            assert health["gather"] == gather
            tokens = [0, 7, 4095, 7]
            answer = client.post("/embed", json={"tokens": tokens})
            assert answer.status_code == 200
            assert answer.json() == {"embeddings": [load.expected(t) for t in tokens]}
            refused = client.post("/embed", json={"tokens": [4096]})
            assert refused.status_code == 422
            assert "tokens" in refused.json()["error"]
    assert server.process.returncode is not None


def test_the_server_answers_bad_input_with_422_not_a_traceback() -> None:
    load = _import_load()
    env = {**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"}
    bodies = {
        "malformed JSON": b'{"tokens": [1, 2',
        "not UTF-8": b'{"tokens": [1]}\xff',
        "not an object": b"[1, 2]",
        "no tokens": b"{}",
        "no list": b'{"tokens": 3}',
        "empty": b'{"tokens": []}',
        "a bool": b'{"tokens": [true]}',
        "a float": b'{"tokens": [1.0]}',
        "out of range": b'{"tokens": [-1]}',
        "too many": b'{"tokens": [' + b", ".join([b"1"] * 65) + b"]}",
    }
    with load.start_server("--gather", "copies", env=env) as server:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            headers = {"Content-Type": "application/json"}
            for what, body in bodies.items():
                answer = client.post("/embed", content=body, headers=headers)
                assert answer.status_code == 422, (what, answer.status_code, answer.text)
                assert "tokens" in answer.json()["error"], what
            good = client.post("/embed", json={"tokens": [5]})  # still serving
            assert good.json() == {"embeddings": [load.expected(5)]}
        assert "Traceback" not in server.errors()


# -- nothing on the loop waits for the device, even with the queue held ------------------
#
# pyopencl's event for a copy between host and device, garbage-collected, waits for
# the copy with the GIL held. Dropped on a held queue, it stops the whole process for
# good (nothing else can take the GIL, a pytest timeout neither), so these checks run
# in a child interpreter that the test can stop and report.

CHILD_TIMEOUT_S = 45


def _in_child(function: str, *arguments: str) -> dict[str, Any]:
    """Run ``function(*arguments)`` of this module in a new interpreter; return its report.

    A child that hangs prints its threads' stacks (faulthandler needs no GIL) and exits.
    """
    code = (
        "import faulthandler, json, sys; "
        f"faulthandler.dump_traceback_later({CHILD_TIMEOUT_S}, exit=True); "
        f"sys.path[:0] = [{str(Path(__file__).parent)!r}]; "
        "import test_inference_server as t; "
        f"print(json.dumps(t.{function}(*sys.argv[1:])))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *arguments],
        capture_output=True,
        text=True,
        env={**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"},
        timeout=CHILD_TIMEOUT_S + 30,
    )
    if "Timeout (" in result.stderr:
        pytest.fail(
            f"{function}{arguments} hung for {CHILD_TIMEOUT_S} s: a host transfer blocked "
            f"its thread on the held queue (a dropped pyopencl event?). Its stacks:\n"
            f"{result.stderr[-3000:]}"
        )
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return report


async def _until(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(100_000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


async def _held_batch(gather: str) -> dict[str, Any]:
    import asyncfence
    from asyncfence.testing import hold, open_default_device

    server = _import_server()
    model = server.OpenCLModel(open_default_device("opencl"), gather)
    tokens = [0, 7, 4095, 7]
    rows = [server.embedding(token) for token in tokens]
    report: dict[str, Any] = {"gather": "kernel" if model.kernel is not None else "copies"}
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    beating = asyncio.ensure_future(heartbeat())

    # OpenCLModel.run() itself, on a held queue.
    stream, slot = model.streams[0], model.new_slot()
    slot.ids_host[: len(tokens)] = tokens
    with hold(stream) as gate:
        model.run(stream, slot, len(tokens))  # the old example never returned from this
        fence = asyncfence.record(stream)
        start = ticks
        await _until(lambda: ticks >= start + 200, "the heartbeat ticks while the queue is held")
        report["run_returned_while_held"] = gate.held and not fence.done()
        gate.release()
    await fence
    report["run_rows_right"] = slot.out_host[: len(tokens)].tolist() == rows

    # The batcher's whole path: a request, batched, run, awaited, answered.
    batcher = server.Batcher(model, "asyncfence")
    serving = asyncio.ensure_future(batcher.serve())
    with contextlib.ExitStack() as gates:
        held = [gates.enter_context(hold(stream)) for stream in model.streams]
        request = server.Request_(tokens)
        batcher.requests.put_nowait(request)
        await _until(
            lambda: asyncfence.current_statistics().waiters == 1, "the batch awaits its fence"
        )
        start = ticks
        await _until(lambda: ticks >= start + 200, "the heartbeat ticks while the batch waits")
        report["answer_pending_while_held"] = not request.answer.done() and all(
            gate.held for gate in held
        )
        for gate in held:
            gate.release()
        report["answer_right"] = await request.answer == rows
    serving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await serving
    await batcher.slots.aclose()
    beating.cancel()
    report["loop"] = f"{type(asyncio.get_running_loop()).__module__}"
    return report


def held_batch(gather: str, loop: str) -> dict[str, Any]:
    """In the child: :func:`_held_batch` on ``loop`` (``asyncio`` or ``uvloop``)."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(_held_batch(gather))
    return asyncio.run(_held_batch(gather))


@pytest.mark.parametrize(
    "loop",
    [
        "asyncio",
        pytest.param(
            "uvloop",  # what uvicorn serves on where it is installed
            marks=pytest.mark.skipif(
                importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"
            ),
        ),
    ],
)
@pytest.mark.parametrize("gather", ["copies", "kernel"])
def test_a_batch_on_a_held_queue_leaves_the_loop_running(gather: str, loop: str) -> None:
    _skip_unless_kernels_build(gather)
    report = _in_child("held_batch", gather, loop)
    assert report["gather"] == gather
    assert report["loop"] == ("uvloop" if loop == "uvloop" else "asyncio.unix_events")
    # run() queued the batch and returned with the queue still held; the heartbeat
    # ticked meanwhile; once released, the rows are right.
    assert report["run_returned_while_held"]
    assert report["run_rows_right"]
    # The same through the batcher: the request waits, the loop runs, then it is answered.
    assert report["answer_pending_while_held"]
    assert report["answer_right"]


# -- the load script: wrk against both servers, idle and busy loop -----------------------


def test_the_load_script_compares_both_servers_with_wrk(tmp_path: Path) -> None:
    import shutil

    if shutil.which("wrk") is None:
        pytest.skip("wrk is not installed (apt-get install -y wrk); .ci/run installs it")
    figures = tmp_path / "load.json"
    result = subprocess.run(
        [sys.executable, str(EXAMPLE / "load.py"), "--quick", "--json", str(figures)],
        capture_output=True,
        text=True,
        env={**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"},
        timeout=110,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    summary = json.loads(figures.read_text())
    runs = {(run["variant"], run["wait"]): run for run in summary["runs"]}
    assert set(runs) == {
        (variant, wait) for variant in ("idle", "busy") for wait in ("asyncfence", "to_thread")
    }
    for run in runs.values():
        assert run["requests"] > 0
        assert run["errors"] == 0
        assert run["wrong"] == 0
        assert 0 < run["p50_ms"] <= run["p90_ms"] <= run["p99_ms"]
    for variant in ("idle", "busy"):
        ratios = summary["variants"][variant]["ratios"]
        assert set(ratios) == {"rps", "p50_ms", "p90_ms", "p99_ms"}
        assert f"asyncfence vs to_thread, loop {variant}:" in result.stdout
