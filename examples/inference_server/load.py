"""Load the inference server two ways, side by side: awaiting fences, and to_thread.

Starts ``server.py`` on a free loopback port, once with ``--wait asyncfence`` and
once with ``--wait to_thread``, sends the same load with an async HTTP client
(httpx), checks every answer, and prints requests per second and latency.

    python examples/inference_server/load.py [--seconds 5] [--clients 32] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

SERVER = Path(__file__).with_name("server.py")
DIM, VOCAB = 16, 4096


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def expected(token: int) -> list[float]:
    return [token + column / DIM for column in range(DIM)]


async def wait_until_up(
    client: httpx.AsyncClient, server: subprocess.Popen[bytes]
) -> dict[str, object]:
    for _ in range(600):
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            response = await client.get("/health")
            health: dict[str, object] = response.json()
            return health
        except httpx.TransportError:
            await asyncio.sleep(0.05)
    raise RuntimeError("the server did not come up within 30 s")


async def load(
    wait: str, seconds: float, clients: int, extra: tuple[str, ...] = ()
) -> dict[str, float | str]:
    port = free_port()
    server = subprocess.Popen(  # noqa: ASYNC220 (started once, before the load)
        [sys.executable, str(SERVER), "--port", str(port), "--wait", wait, *extra],
        stdout=subprocess.DEVNULL,
    )
    latencies: list[float] = []
    wrong = 0
    try:
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=30
        ) as client:
            health = await wait_until_up(client, server)
            deadline = time.perf_counter() + seconds
            rng = random.Random(0)

            async def one_client() -> None:
                nonlocal wrong
                while time.perf_counter() < deadline:
                    tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
                    start = time.perf_counter()
                    response = await client.post("/embed", json={"tokens": tokens})
                    latencies.append(time.perf_counter() - start)
                    rows = response.json()["embeddings"]
                    if rows != [expected(token) for token in tokens]:
                        wrong += 1

            start = time.perf_counter()
            await asyncio.gather(*(one_client() for _ in range(clients)))
            elapsed = time.perf_counter() - start
            batches = (await client.get("/health")).json()["batches"]
    finally:
        server.terminate()
        server.wait(30)
    ordered = sorted(latencies)
    return {
        "wait": wait,
        "gather": str(health["gather"]),
        "requests": len(latencies),
        "wrong": wrong,
        "rps": len(latencies) / elapsed,
        "p50_ms": statistics.median(ordered) * 1e3,
        "p99_ms": ordered[int(0.99 * (len(ordered) - 1))] * 1e3,
        "batches": batches,
    }


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="one second each, for CI")
    args = parser.parse_args()
    seconds = 1.0 if args.quick else args.seconds
    results = [await load(wait, seconds, args.clients) for wait in ("asyncfence", "to_thread")]
    print(f"{args.clients} clients, {seconds:g} s each, gather by {results[0]['gather']}")
    columns = ("requests", "wrong", "req/s", "p50 ms", "p99 ms")
    widths = (9, 7, 9, 9, 9)
    header = "".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))
    print("server waits with".ljust(18) + header)
    for r in results:
        print(
            f"{r['wait']:<18}{r['requests']:>9}{r['wrong']:>7}{r['rps']:>9.0f}"
            f"{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}"
        )
    ours, theirs = results
    print(
        f"asyncfence vs to_thread: {float(ours['rps']) / float(theirs['rps']):.2f}x req/s, "
        f"{float(ours['p99_ms']) / float(theirs['p99_ms']):.2f}x p99 latency"
    )
    return 1 if any(r["wrong"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
