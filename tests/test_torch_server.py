"""The torch server example: answers, bad input, health on a stuck fence, metrics, load.

In-process tests drive the FastAPI app with httpx on the test's own loop
(asyncio, uvloop and trio), its lifespan entered by the test, so that a fence
held by the test is one the server's health check sees. Another test runs the
real server under uvicorn in a subprocess, and one its load script under wrk.
On CPU-only PyTorch (CI) every fence of the server's own is done when recorded,
so the stuck fence is an OpenCL one held from the host; on a CUDA GPU (the GPU
check) a further test holds the server's own streams.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import asyncfence
from asyncfence.testing import hold

from .conftest import until
from .torch_support import import_torch

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    import pyopencl as cl

torch = import_torch()
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="needs the torch-server extra")
prometheus_parser = pytest.importorskip(
    "prometheus_client.parser", reason="needs the torch-server extra"
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torch_server"


def _import_load() -> Any:
    import importlib.util

    module = sys.modules.get("torch_server_load")
    if module is None:
        spec = importlib.util.spec_from_file_location("torch_server_load", EXAMPLE / "load.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


load = _import_load()
server = load.import_server()


def rows(count: int, seed: int = 0) -> list[list[float]]:
    generator = torch.Generator().manual_seed(seed)
    values: list[list[float]] = (
        torch.rand(count, server.FEATURES, generator=generator) * 2 - 1
    ).tolist()
    return values


@contextlib.asynccontextmanager
async def serving(**settings: Any) -> AsyncIterator[Any]:
    """The app, its lifespan entered on this loop, and an httpx client that calls it in-process."""
    app = server.make_app(device="cpu", **settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://torch-server") as client:
            yield client


@pytest.mark.parametrize("wait", ["asyncfence", "synchronize"])
async def test_concurrent_requests_get_the_models_answers(wait: str) -> None:
    features = rows(40)
    expected = load.expected_logits(features)
    answers: dict[int, Any] = {}
    async with serving(wait=wait) as client:

        async def ask(index: int) -> None:
            answers[index] = await client.post("/predict", json={"features": features[index]})

        async with anyio.create_task_group() as tg:
            for index in range(len(features)):
                tg.start_soon(ask, index)
        health = (await client.get("/health")).json()
    assert health["wait"] == wait
    assert health["status"] == "ok"
    assert 1 <= health["batches"] <= len(features)
    for index, answer in answers.items():
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["logits"] == pytest.approx(expected[index], rel=1e-4, abs=1e-5)
        assert body["label"] == max(range(server.CLASSES), key=expected[index].__getitem__)


BAD_BODIES = {
    "malformed JSON": b'{"features": [1, 2',
    "not an object": b"[1, 2]",
    "no features": b"{}",
    "too few": b'{"features": [1, 2, 3]}',
    "too many": b'{"features": [' + b", ".join([b"0.5"] * 65) + b"]}",
    "a string": b'{"features": [' + b", ".join([b'"0.5"'] * 64) + b"]}",
    "a bool": b'{"features": [' + b", ".join([b"true"] * 64) + b"]}",
    "NaN": b'{"features": [' + b", ".join([b"NaN"] * 64) + b"]}",
    "infinite": b'{"features": [' + b", ".join([b"1e999"] * 64) + b"]}",
}


async def test_bad_input_is_a_422_not_a_500() -> None:
    headers = {"Content-Type": "application/json"}
    async with serving() as client:
        for what, body in BAD_BODIES.items():
            # An exception in the app would raise here (ASGITransport re-raises it).
            answer = await client.post("/predict", content=body, headers=headers)
            assert answer.status_code == 422, (what, answer.status_code, answer.text)
            assert answer.json()["detail"], what
        # FastAPI's answer to a body that is not even text: 400, a client error too.
        undecodable = await client.post("/predict", content=b'{"a": 1}\xff', headers=headers)
        assert undecodable.status_code == 400, undecodable.text
        good = await client.post("/predict", json={"features": rows(1)[0]})
        assert good.status_code == 200  # still serving


async def _await_held(stream: cl.CommandQueue, *, task_status: Any) -> None:
    fence = asyncfence.record(stream)
    task_status.started()
    await fence.wait(strategy="park")


async def test_health_turns_503_on_a_fence_held_past_the_bound(
    opencl_queue: cl.CommandQueue,
) -> None:
    bound = 0.001  # past it as soon as the statistics say so: no sleeping, no timing
    async with serving(health_bound_s=bound) as client:
        first = await client.get("/health")
        assert first.status_code == 200, first.text
        assert first.json()["stuck_fences"] == 0
        with hold(opencl_queue) as gate:
            async with anyio.create_task_group() as tg:
                await tg.start(_await_held, opencl_queue)  # a wait on the server's loop
                await until(
                    lambda: asyncfence.current_statistics(stuck_after=bound).stuck_fences == 1
                )
                stuck = await client.get("/health")
                assert stuck.status_code == 503, stuck.text
                body = stuck.json()
                assert (body["status"], body["stuck_fences"], body["pending_fences"]) == (
                    "unhealthy",
                    1,
                    1,
                )
                assert body["oldest_pending_age_s"] > bound
                gate.release()
        await until(lambda: asyncfence.current_statistics().pending_fences == 0)
        again = await client.get("/health")
        assert again.status_code == 200, again.text
        assert again.json()["status"] == "ok"


def _samples(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in prometheus_parser.text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


async def test_metrics_expose_the_fences_and_the_batches(opencl_queue: cl.CommandQueue) -> None:
    bound = 0.001
    async with serving(health_bound_s=bound) as client:
        for features in rows(3):
            assert (await client.post("/predict", json={"features": features})).status_code == 200
        scraped = await client.get("/metrics")
        assert scraped.status_code == 200
        assert scraped.headers["content-type"].startswith("text/plain")
        idle = _samples(scraped.text)
        assert idle["torch_server_rows_total"] == 3
        assert 1 <= idle["torch_server_batches_total"] <= 3
        assert idle["torch_server_batch_wait_seconds_count"] == idle["torch_server_batches_total"]
        assert idle["asyncfence_pending_fences"] == 0
        assert idle["asyncfence_stuck_fences"] == 0
        assert idle["asyncfence_oldest_pending_fence_age_seconds"] == 0
        for counter in ("poller_ticks", "device_queries", "signals", "rechecks"):
            assert f"asyncfence_{counter}_total" in idle
        with hold(opencl_queue) as gate:
            async with anyio.create_task_group() as tg:
                await tg.start(_await_held, opencl_queue)
                await until(lambda: asyncfence.current_statistics().parked == 1)
                await until(
                    lambda: asyncfence.current_statistics(stuck_after=bound).stuck_fences == 1
                )
                held = _samples((await client.get("/metrics")).text)
                gate.release()
    assert (held["asyncfence_pending_fences"], held["asyncfence_waiters"]) == (1, 1)
    assert (held["asyncfence_parked_fences"], held["asyncfence_stuck_fences"]) == (1, 1)
    assert held["asyncfence_oldest_pending_fence_age_seconds"] > bound
    assert held["asyncfence_oldest_parked_fence_age_seconds"] > bound


async def test_a_held_cuda_batch_turns_the_health_check_503() -> None:
    # On a GPU (the GPU check): the server's own streams held, a request waits on
    # its batch's fence, /health says so; released, the request is answered.
    if not torch.cuda.is_available():
        pytest.skip("needs PyTorch with a CUDA GPU")
    bound = 0.001
    app = server.make_app(device="cuda", health_bound_s=bound)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://torch-server") as client:
            model = app.state.batcher.model
            with contextlib.ExitStack() as gates:
                held = [gates.enter_context(hold(stream)) for stream in model.lanes]
                answers: list[Any] = []

                async def ask() -> None:
                    answers.append(await client.post("/predict", json={"features": rows(1)[0]}))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(ask)
                    await until(
                        lambda: asyncfence.current_statistics(stuck_after=bound).stuck_fences
                    )
                    assert (await client.get("/health")).status_code == 503
                    assert not answers
                    for gate in held:
                        gate.release()
            assert answers[0].status_code == 200
            await until(lambda: asyncfence.current_statistics().pending_fences == 0)
            assert (await client.get("/health")).status_code == 200


# -- the real server under uvicorn, and the load script under wrk ---------------------------

_CPU_ONLY = {**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none", "CUDA_VISIBLE_DEVICES": ""}


def test_the_server_serves_real_requests_under_uvicorn() -> None:
    with load.start_server("--device", "cpu", env=_CPU_ONLY) as running:
        assert running.banner.startswith("serving on http://127.0.0.1:")
        assert running.banner.endswith(
            "(asyncfence, cpu (CPU-only PyTorch: fences done when recorded))"
        )
        assert load.check_answers(running.url) == 0  # right answers, and 422s for bad input
        with httpx.Client(base_url=running.url, timeout=30) as client:
            health = client.get("/health")
            assert health.status_code == 200
            assert health.json()["batches"] >= 1
            assert "asyncfence_pending_fences 0.0" in client.get("/metrics").text
            nan = b'{"features": [' + b", ".join([b"NaN"] * 64) + b"]}"
            headers = {"Content-Type": "application/json"}
            assert client.post("/predict", content=nan, headers=headers).status_code == 422
        assert "Traceback" not in running.errors()
    assert running.process.returncode is not None


def test_the_load_script_compares_both_servers_with_wrk(tmp_path: Path) -> None:
    if shutil.which("wrk") is None:
        pytest.skip("wrk is not installed (apt-get install -y wrk); .ci/run installs it")
    figures = tmp_path / "load.json"
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE / "load.py"),
            "--quick",
            "--device",
            "cpu",
            "--json",
            str(figures),
        ],
        capture_output=True,
        text=True,
        env=_CPU_ONLY,
        timeout=110,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    summary = json.loads(figures.read_text())
    runs = {(run["variant"], run["wait"]): run for run in summary["runs"]}
    assert set(runs) == {
        (variant, wait) for variant in ("idle", "busy") for wait in ("asyncfence", "synchronize")
    }
    for run in runs.values():
        assert run["requests"] > 0
        assert run["errors"] == 0
        assert run["wrong"] == 0
        assert 0 < run["p50_ms"] <= run["p90_ms"] <= run["p99_ms"]
    for variant in ("idle", "busy"):
        assert set(summary["variants"][variant]["ratios"]) == {"rps", "p50_ms", "p90_ms", "p99_ms"}
        assert f"asyncfence vs synchronize, loop {variant}:" in result.stdout
    assert summary["quick"] is True
    assert "too short to compare them" in result.stdout  # the ratios are not a result
