"""The engine example on Ray: the engine a Ray actor, the API a Serve deployment.

Ray runs in a subprocess (``examples/engine/ray_app.py``), which starts a
local Ray, deploys, and serves until SIGINT, so that Ray's threads and signal
handlers never touch the pytest process. The fence tokens pass through Ray
calls. Without Ray the tests skip, except where ``ASYNCFENCE_REQUIRE_RAY=1``
is set (CI), where they fail instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "examples" / "engine" / "ray_app.py"
READY_LINE = "serving on "
# Hang guards, generous for a loaded 2-core machine: never timing assertions.
START_TIMEOUT_S = 150
STOP_TIMEOUT_S = 60

pytestmark = pytest.mark.timeout(START_TIMEOUT_S + STOP_TIMEOUT_S + 120)


def _why_ray_is_missing() -> str | None:
    # find_spec only: importing Ray in this process would touch it.
    for module in ("ray", "fastapi", "aiohttp", "pyopencl"):
        if importlib.util.find_spec(module) is None:
            return f"Ray Serve is not installed (no {module}): pip install -e '.[ray]'"
    return None


if (_missing := _why_ray_is_missing()) is not None:
    if os.environ.get("ASYNCFENCE_REQUIRE_RAY") == "1":
        pytest.fail(f"ASYNCFENCE_REQUIRE_RAY=1, but {_missing}", pytrace=False)
    pytest.skip(_missing, allow_module_level=True)

import httpx  # noqa: E402 (the dev extra's)

sys.path.insert(0, str(APP.parent))
from bigram import reference_tokens  # noqa: E402


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def ray_app(*options: str) -> Iterator[str]:
    """``ray_app.py`` serving on OpenCL, its URL; then SIGINT, which must end it cleanly."""
    ray_tmp = tempfile.mkdtemp(prefix="af-ray-", dir="/tmp")  # short: Ray's socket paths
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_TMPDIR=ray_tmp, ASYNCFENCE_CUDA_DRIVER="none", PYTHONUNBUFFERED="1")
    server = subprocess.Popen(
        [sys.executable, str(APP), f"--port={port}", "--device=opencl", *options],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,  # its own process group, killed whole if it hangs
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert server.stdout is not None
        for line in server.stdout:
            lines.append(line)
            if line.startswith(READY_LINE):
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not ready.wait(START_TIMEOUT_S) or server.poll() is not None:
            pytest.fail("ray_app.py is not serving:\n" + "".join(lines[-60:]))
        yield f"http://127.0.0.1:{port}"
        server.send_signal(signal.SIGINT)
        try:
            returncode = server.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail("not shut down:\n" + "".join(lines[-60:]))
        reader.join(STOP_TIMEOUT_S)
        assert returncode == 0, "".join(lines[-60:])
        assert lines[-1].strip() == "shut down", "".join(lines[-60:])
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        reader.join(STOP_TIMEOUT_S)
        assert server.stdout is not None
        server.stdout.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def stream(client: httpx.Client, prompt: str, count: int) -> list[tuple[str | None, Any]]:
    """``POST /generate``'s events, in order."""
    events: list[tuple[str | None, Any]] = []
    kind: str | None = None
    body = {"prompt": prompt, "max_tokens": count}
    with client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((kind, json.loads(line.removeprefix("data: "))))
                kind = None
    return events


def test_the_ray_engine_streams_checked_tokens_through_serve() -> None:
    prompts = {f"ray {i}": 3 + i % 7 for i in range(16)}
    with ray_app() as url, httpx.Client(base_url=url, timeout=60) as client:
        with ThreadPoolExecutor(max_workers=16) as pool:
            found = pool.map(lambda prompt: stream(client, prompt, prompts[prompt]), prompts)
            answers = dict(zip(prompts, found, strict=True))
        refused = client.post("/generate", json={"prompt": "", "max_tokens": 3})
        health = client.get("/health").json()
    for prompt, count in prompts.items():
        events = answers[prompt]
        assert events[-1][0] == "done", events[-3:]
        assert [data["token"] for kind, data in events if kind is None] == reference_tokens(
            prompt, count
        )
    assert refused.status_code == 422
    assert health["status"] == "ok"
    assert health["device"].startswith("OpenCL")
    assert (health["open_requests"], health["slots_held"]) == (0, 0)


def test_a_token_from_another_node_is_refused_with_an_error_event() -> None:
    with ray_app("--foreign-tokens") as url, httpx.Client(base_url=url, timeout=60) as client:
        events = stream(client, "elsewhere", 5)
    kind, data = events[-1]
    assert kind == "error"
    assert "cannot be awaited here" in data["error"]
    assert "TokenRefusedError" in data["error"] or "another machine" in data["error"]
