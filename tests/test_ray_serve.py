"""The Ray Serve example: two replicas behind Serve's router, each awaiting its own fences.

Ray runs in a subprocess (``examples/ray_serve/app.py``), which starts a local
Ray, deploys the example and serves until SIGINT, so that Ray's threads and
signal handlers never touch the pytest process. This process sends the HTTP
requests, checks every answer, stops the subprocess and checks that none of
Ray's processes is left. Without Ray the test skips, except where
``ASYNCFENCE_REQUIRE_RAY=1`` is set (CI), where it fails instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "examples" / "ray_serve" / "app.py"
REPLICAS = 2
READY_LINE = "serving on "
# Hang guards, generous for a loaded 2-core machine: never timing assertions.
START_TIMEOUT_S = 150
STOP_TIMEOUT_S = 60

pytestmark = pytest.mark.timeout(START_TIMEOUT_S + STOP_TIMEOUT_S + 120)


def _why_ray_is_missing() -> str | None:
    # find_spec only: importing Ray in this process would touch it.
    for module in ("ray", "fastapi", "aiohttp"):  # Ray, and two of ray[serve]'s dependencies
        if importlib.util.find_spec(module) is None:
            return f"Ray Serve is not installed (no {module}): pip install -e '.[ray]'"
    return None


if (_missing := _why_ray_is_missing()) is not None:
    if os.environ.get("ASYNCFENCE_REQUIRE_RAY") == "1":
        pytest.fail(f"ASYNCFENCE_REQUIRE_RAY=1, but {_missing}", pytrace=False)
    pytest.skip(_missing, allow_module_level=True)

import httpx  # noqa: E402 (the dev extra's)
import psutil  # noqa: E402 (the dev extra's; Ray carries its own copy too)


class _Output:
    """Collects a subprocess's output on a thread; tells when a line has appeared."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._process = process
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self.lines.append(line)
            if line.startswith(READY_LINE):
                self.ready.set()
        self.ready.set()  # at EOF too: the waiter then sees the process has exited

    def tail(self, count: int = 60) -> str:
        return "".join(self.lines[-count:])

    def join(self) -> None:
        self._thread.join(STOP_TIMEOUT_S)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return []


def _mentioning(marker: str) -> list[psutil.Process]:
    """Processes whose command line names ``marker`` (Ray's: its session directory)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in process.info["cmdline"] or ()):
            found.append(process)
    return found


def _numbers(index: int) -> list[int]:
    """Request ``index``'s numbers: distinct from every other request's."""
    count = 1 + index * 7 % 300
    return [(-1) ** k * (index * 100_000 + k) for k in range(count)]


def test_two_replicas_serve_checked_answers_and_shut_down_cleanly() -> None:
    # Short, under /tmp: Ray's Unix socket paths live under it.
    ray_tmp = tempfile.mkdtemp(prefix="af-ray-", dir="/tmp")
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("RAY_ADDRESS") and key != "RAY_TMPDIR"
    }
    # This checkout's asyncfence, in the example and in its replicas alike.
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update(
        RAY_TMPDIR=ray_tmp,
        PYTHONPATH=pythonpath,
        ASYNCFENCE_CUDA_DRIVER="none",
        PYTHONUNBUFFERED="1",
    )
    server = subprocess.Popen(
        [sys.executable, str(APP), "--port", "0", "--backend", "opencl"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,  # its own process group, killed whole if it hangs
    )
    output = _Output(server)
    ray_processes: list[psutil.Process] = []
    try:
        if not output.ready.wait(START_TIMEOUT_S):
            pytest.fail(f"not serving after {START_TIMEOUT_S} s:\n{output.tail()}")
        if server.poll() is not None:
            pytest.fail(f"the example exited with {server.returncode}:\n{output.tail()}")
        ray_processes = _descendants(server.pid) + _mentioning(ray_tmp)
        # --port 0: the line names the port it became.
        (ready,) = [line for line in output.lines if line.startswith(READY_LINE)]
        found = re.fullmatch(
            r"serving on http://127\.0\.0\.1:(\d+)/ with \d+ replicas", ready.strip()
        )
        assert found, ready
        port = int(found.group(1))
        assert port != 0

        replicas: set[int] = set()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:

            def ask(index: int) -> int:
                numbers = _numbers(index)
                answer = client.post("/", json={"numbers": numbers})
                assert answer.status_code == 200, (index, answer.text)
                body = answer.json()
                assert body["numbers"] == numbers, f"request {index}: wrong numbers came back"
                assert body["sum"] == sum(numbers), f"request {index}: wrong sum"
                assert "Portable Computing Language" in body["device"], body["device"]
                pid: int = body["pid"]
                return pid

            # Serve's router picks replicas at random (power of two choices):
            # rounds of concurrent requests until both have answered, boundedly.
            with ThreadPoolExecutor(max_workers=8) as pool:
                for round_ in range(8):
                    first = round_ * 32
                    replicas.update(pool.map(ask, range(first, first + 32)))
                    if len(replicas) == REPLICAS:
                        break
            for bad in (b'{"numbers": [1.5]}', b'{"numbers": [1, 2', b"not JSON", b"[1, 2]"):
                refused = client.post("/", content=bad)
                assert refused.status_code == 422, (bad, refused.text)
                assert "numbers" in refused.json()["error"]

        assert len(replicas) == REPLICAS, f"only replicas {replicas} answered"
        known = {process.pid for process in ray_processes}
        for pid in replicas:
            assert pid != server.pid
            assert pid in known, f"replica {pid} is not one of Ray's processes here"
            assert "ServeReplica" in " ".join(psutil.Process(pid).cmdline())

        server.send_signal(signal.SIGINT)
        try:
            returncode = server.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"not shut down after {STOP_TIMEOUT_S} s:\n{output.tail()}")
        output.join()
        assert returncode == 0, output.tail()
        assert output.lines[-1].strip() == "shut down", output.tail()
        _, alive = psutil.wait_procs(ray_processes, timeout=STOP_TIMEOUT_S)
        left = alive + [p for p in _mentioning(ray_tmp) if p not in alive]
        assert not left, f"Ray processes left after the shutdown: {left}"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        output.join()
        assert server.stdout is not None
        server.stdout.close()
        for process in ray_processes + _mentioning(ray_tmp):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
