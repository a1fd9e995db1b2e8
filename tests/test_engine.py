"""The engine example: an engine process and its API server, streaming tokens by fences.

The API app runs in this process, on the test's own loop (asyncio, uvloop,
trio), its lifespan entered by the test, which starts a real engine process
on the default device: OpenCL where it builds the model's kernel (PoCL), else
CPU PyTorch. Streams are driven through the app's ASGI interface directly,
so that a test sees each event as it is sent and can disconnect a client at
a point it chooses. Faults are injected in the engine on the device itself
(a copy whose dependency fails, or one that waits for an event never set):
OpenCL only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from .conftest import HANG_GUARD_S

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="needs the torch-server extra (FastAPI)")
prometheus_parser = pytest.importorskip(
    "prometheus_client.parser", reason="needs the torch-server extra"
)
psutil = pytest.importorskip("psutil")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "engine"


def _import(name: str, path: Path) -> Any:
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


server = _import("engine_server_example", EXAMPLE / "api_server.py")
from bigram import reference_tokens  # noqa: E402  (api_server.py put its folder on sys.path)

#: Set where the default device must build the model's kernel (Debian's PoCL in CI).
REQUIRE_KERNELS = os.environ.get("ASYNCFENCE_REQUIRE_KERNELS") == "1"


if importlib.util.find_spec("pyopencl") is None and importlib.util.find_spec("torch") is None:
    pytest.skip("the engine needs pyopencl or PyTorch", allow_module_level=True)


@contextlib.asynccontextmanager
async def serving(**settings: Any) -> AsyncIterator[Any]:
    """The app with its engine running, on this loop."""
    app = server.make_app(**settings)
    async with app.router.lifespan_context(app):
        device = app.state.engine.info["device"]
        if REQUIRE_KERNELS and settings.get("device", "auto") == "auto":
            assert device.startswith("OpenCL"), f"the engine runs on {device}, not OpenCL"
        yield app


def needs_opencl(app: Any) -> None:
    if not app.state.engine.info["device"].startswith("OpenCL"):
        pytest.skip("fault injection needs the OpenCL engine (this device cannot build kernels)")


async def get(app: Any, path: str) -> Any:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        return await client.get(path)


async def until_async(predicate: Callable[[], Awaitable[bool]]) -> None:
    """Yield to the loop until ``predicate()`` holds; a guard fails a hang."""
    with anyio.fail_after(HANG_GUARD_S):
        while not await predicate():  # noqa: ASYNC110 (a predicate, not an event)
            await anyio.sleep(0.005)


async def health_is(app: Any, status: int) -> Any:
    """The app's ``/health`` once it answers ``status``."""
    found: Any = None

    async def answers() -> bool:
        nonlocal found
        found = await get(app, "/health")
        return bool(found.status_code == status)

    await until_async(answers)
    return found


@dataclass
class Call:
    """One ``POST /generate``: its status, and the events it streamed, as they came."""

    status: int = 0
    events: list[tuple[str | None, dict[str, Any]]] = field(default_factory=list)
    body: bytes = b""

    @property
    def tokens(self) -> list[int]:
        return [data["token"] for kind, data in self.events if kind is None]

    @property
    def last(self) -> str | None:
        return self.events[-1][0] if self.events else None


async def post(
    app: Any,
    body: bytes | dict[str, Any],
    *,
    on_event: Callable[[Call], None] | None = None,
    disconnect: anyio.Event | None = None,
) -> Call:
    """Drive ``POST /generate`` through the app's ASGI interface; the client may disconnect."""
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    call = Call()
    sent_request = False
    gone = disconnect or anyio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent_request
        if not sent_request:
            sent_request = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            call.status = message["status"]
        elif message["type"] == "http.response.body":
            call.body += message.get("body", b"")
            *complete, rest = call.body.split(b"\n\n")
            call.body = rest
            for chunk in complete:
                kind, data = None, {}
                for line in chunk.decode().splitlines():
                    if line.startswith("event: "):
                        kind = line.removeprefix("event: ")
                    elif line.startswith("data: "):
                        data = json.loads(line.removeprefix("data: "))
                call.events.append((kind, data))
                if on_event is not None:
                    on_event(call)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/generate",
        "raw_path": b"/generate",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"host", b"engine")],
        "client": ("127.0.0.1", 40000),
        "server": ("engine", 80),
    }
    await app(scope, receive, send)
    return call


# anyio's pytest plugin runs trio in guest mode, whose I/O waits take a thread
# of trio's own ("Trio thread N"): the harness's, absent under trio.run().
_HARNESS = "Trio thread"


def threads() -> tuple[list[str], int]:
    """This process's Python threads by name, and its native threads, the harness's left out."""
    names = sorted(thread.name for thread in threading.enumerate())
    harness = sum(name.startswith(_HARNESS) for name in names)
    ours = [name for name in names if not name.startswith(_HARNESS)]
    return ours, int(psutil.Process().num_threads()) - harness


@pytest.mark.parametrize("device", ["auto", "torch"])
@pytest.mark.parametrize("wait", ["fence", "synchronize"])
async def test_64_streams_get_their_tokens_in_order_and_complete(wait: str, device: str) -> None:
    if device == "torch" and importlib.util.find_spec("torch") is None:
        pytest.skip("could not import 'torch': the engine's PyTorch runner needs it")
    threads_before = threads()
    requests = {f"prompt {i}": 4 + i % 13 for i in range(64)}
    calls: dict[str, Call] = {}
    async with serving(wait=wait, device=device) as app:
        threads_serving = threads()

        async def one(prompt: str, count: int) -> None:
            calls[prompt] = await post(app, {"prompt": prompt, "max_tokens": count})

        with anyio.fail_after(HANG_GUARD_S):
            async with anyio.create_task_group() as tg:
                for prompt, count in requests.items():
                    tg.start_soon(one, prompt, count)
        threads_streaming = threads()
        health = (await get(app, "/health")).json()
        metrics = (await get(app, "/metrics")).text
    for prompt, count in requests.items():
        call = calls[prompt]
        assert call.status == 200
        assert call.last == "done", call.events[-3:]
        assert [data["index"] for kind, data in call.events if kind is None] == list(range(count))
        assert call.tokens == reference_tokens(prompt, count)
    assert health["status"] == "ok"
    assert health["wait"] == wait
    assert (health["open_requests"], health["slots_held"]) == (0, 0)
    assert health["engine_active_requests"] == 0
    # No thread is started for waiting: not by the app, not while it streams.
    assert threads_before == threads_serving == threads_streaming
    samples = {
        sample.name: sample.value
        for family in prometheus_parser.text_string_to_metric_families(metrics)
        for sample in family.samples
    }
    assert samples["engine_tokens_total"] == sum(requests.values())
    assert samples["engine_steps_total"] >= max(requests.values())
    assert samples["engine_up"] == 1
    assert samples["engine_stuck_fences"] == 0


async def test_a_killed_engine_ends_every_open_stream_with_an_error() -> None:
    async with serving(step_ms=5) as app:
        engine = app.state.engine
        started = anyio.Event()
        first_tokens: set[int] = set()
        calls: list[Call] = []

        def seen(call: Call) -> None:
            first_tokens.add(id(call))
            if len(first_tokens) == 4:
                started.set()

        async def one(number: int) -> None:
            calls.append(
                await post(app, {"prompt": f"{number}", "max_tokens": 1000}, on_event=seen)
            )

        with anyio.fail_after(HANG_GUARD_S):
            async with anyio.create_task_group() as tg:
                for number in range(4):
                    tg.start_soon(one, number)
                await started.wait()  # every stream is under way
                os.kill(engine.info["pid"], signal.SIGKILL)
        health = await health_is(app, 503)
    assert len(calls) == 4
    for call in calls:
        assert call.tokens, "the stream had begun"
        assert call.last == "error"
        assert "engine" in call.events[-1][1]["error"]
    assert health.status_code == 503
    assert health.json()["engine"] != "running"
    assert health.json()["open_requests"] == 0


async def test_a_failed_step_reaches_its_streams_as_an_error_event() -> None:
    async with serving(engine_args=["--fail-at-step=3"]) as app:
        needs_opencl(app)
        with anyio.fail_after(HANG_GUARD_S):
            call = await post(app, {"prompt": "fails", "max_tokens": 100})
        # The engine stops on the device error, and says so: /health follows.
        health = await health_is(app, 503)
    assert call.tokens == reference_tokens("fails", 2)  # the steps before the failed one
    assert call.last == "error"
    message = call.events[-1][1]["error"]
    assert "step 3 failed: DeviceError" in message
    assert "DeviceError" in health.json()["engine"]


async def test_a_client_that_disconnects_frees_its_request() -> None:
    async with serving(step_ms=2) as app:
        leave = anyio.Event()

        def after_three(call: Call) -> None:
            if len(call.events) == 3:
                leave.set()

        with anyio.fail_after(HANG_GUARD_S):
            call = await post(
                app,
                {"prompt": "leaves", "max_tokens": 1000},
                on_event=after_three,
                disconnect=leave,
            )

        async def freed() -> bool:
            health = (await get(app, "/health")).json()
            held = ("engine_active_requests", "open_requests", "slots_held")
            return all(health[key] == 0 for key in held)

        await until_async(freed)
    assert call.status == 200
    assert 3 <= len(call.tokens) < 1000
    assert call.tokens == reference_tokens("leaves", len(call.tokens))


BAD_BODIES = {
    "malformed JSON": b'{"prompt": "a',
    "not an object": b'["a"]',
    "no prompt": b'{"max_tokens": 4}',
    "an empty prompt": b'{"prompt": ""}',
    "a number for a prompt": b'{"prompt": 5}',
    "no tokens": b'{"prompt": "a", "max_tokens": 0}',
    "too many tokens": b'{"prompt": "a", "max_tokens": 100000}',
    "a string for max_tokens": b'{"prompt": "a", "max_tokens": "4"}',
    "a bool for max_tokens": b'{"prompt": "a", "max_tokens": true}',
    "an unknown field": b'{"prompt": "a", "temperature": 0.5}',
}


async def test_bad_input_is_a_422() -> None:
    async with serving() as app:
        for name, body in BAD_BODIES.items():
            call = await post(app, body)
            assert call.status == 422, name
        health = (await get(app, "/health")).json()
    assert health["open_requests"] == 0
    assert health["steps"] == 0  # nothing reached the engine


async def test_health_turns_503_while_a_steps_fence_is_stuck() -> None:
    async with serving(engine_args=["--stall-at-step=2"], health_bound_s=0.05) as app:
        needs_opencl(app)
        async with anyio.create_task_group() as tg:
            tg.start_soon(post, app, {"prompt": "stalls", "max_tokens": 100})
            health = await health_is(app, 503)
            metrics = (await get(app, "/metrics")).text
            tg.cancel_scope.cancel()
    assert health.json()["stuck_fences"] == 1
    assert health.json()["engine"] == "running"  # stuck, not gone
    assert "engine_stuck_fences 1.0" in metrics


def test_the_load_script_compares_both_ways() -> None:
    load = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE / "stream_load.py"),
            "--streams=8",
            "--seconds=1",
            "--max-tokens=8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert load.returncode == 0, load.stdout + load.stderr
    rows = [line for line in load.stdout.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["fence", "synchronize"]
