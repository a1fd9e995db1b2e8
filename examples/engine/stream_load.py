"""Load the engine example both ways, in one run: awaited fences, then synchronize.

Starts ``api_server.py`` once per way (``--wait fence``, ``--wait synchronize``)
on a free loopback port, keeps ``--streams`` concurrent streams going for
``--seconds`` (each a ``POST /generate`` of ``--max-tokens`` tokens, read as
server-sent events), and prints one table: time to first token (p50, p99),
tokens per second, and the API process's CPU and threads.

    python stream_load.py [--streams 64] [--seconds 10] [--max-tokens 32]
        [--device auto] [--step-ms 0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bigram import reference_tokens

SERVER = Path(__file__).resolve().with_name("api_server.py")
WAYS = ("fence", "synchronize")


@dataclass
class Result:
    way: str
    device: str = ""
    first_token_s: list[float] = field(default_factory=list)
    tokens: int = 0
    streams: int = 0
    errors: int = 0
    wrong: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    threads_before: int = 0
    threads_after: int = 0


def start_server(way: str, device: str, step_ms: float) -> tuple[subprocess.Popen[str], str, str]:
    """Start ``api_server.py``; return it, its URL and its device once it serves."""
    process = subprocess.Popen(
        [
            sys.executable,
            str(SERVER),
            "--port=0",
            f"--wait={way}",
            f"--device={device}",
            f"--step-ms={step_ms}",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    found = re.match(r"serving on (\S+) \(\w+, (.*)\)$", line.strip())
    if not found:
        process.kill()
        raise SystemExit(f"api_server.py did not start: {line!r}")
    return process, found.group(1), found.group(2)


async def stream_once(
    client: httpx.AsyncClient, prompt: str, max_tokens: int, result: Result
) -> None:
    started = time.perf_counter()
    tokens: list[int] = []
    body = {"prompt": prompt, "max_tokens": max_tokens}
    async with client.stream("POST", "/generate", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("event: error"):
                result.errors += 1
            elif line.startswith("data: ") and '"token"' in line:
                if not tokens:
                    result.first_token_s.append(time.perf_counter() - started)
                tokens.append(json.loads(line.removeprefix("data: "))["token"])
    result.tokens += len(tokens)
    result.streams += 1
    if tokens != reference_tokens(prompt, max_tokens):
        result.wrong += 1


async def load(url: str, streams: int, seconds: float, max_tokens: int, result: Result) -> None:
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        deadline = time.perf_counter() + seconds

        async def worker(number: int) -> None:
            count = 0
            while time.perf_counter() < deadline:
                await stream_once(client, f"stream {number}, request {count}", max_tokens, result)
                count += 1

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for number in range(streams):
                tg.start_soon(worker, number)
        result.seconds = time.perf_counter() - started


def run_way(way: str, args: argparse.Namespace) -> Result:
    process, url, device = start_server(way, args.device, args.step_ms)
    result = Result(way, device)
    try:
        api = psutil.Process(process.pid)
        result.threads_before = api.num_threads()
        cpu_before = sum(api.cpu_times()[:2])
        anyio.run(load, url, args.streams, args.seconds, args.max_tokens, result)
        result.cpu_s = sum(api.cpu_times()[:2]) - cpu_before
        result.threads_after = api.num_threads()
        health = httpx.get(f"{url}/health").json()
        if health["open_requests"] or health["slots_held"]:
            raise SystemExit(f"the API still holds requests or slots: {json.dumps(health)}")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    return result


def table(results: list[Result], args: argparse.Namespace) -> Table:
    title = (
        f"{args.streams} concurrent streams of {args.max_tokens} tokens for {args.seconds:g} s, "
        f"loopback; {results[0].device}"
    )
    out = Table(title=title)
    for column in (
        "wait",
        "streams done",
        "errors",
        "wrong tokens",
        "first token p50 ms",
        "p99 ms",
        "tokens/s",
        "API CPU s/s",
        "API threads",
    ):
        out.add_column(column, justify="left" if column == "wait" else "right", no_wrap=True)
    for r in results:
        p50, p99 = (np.percentile(r.first_token_s, [50, 99]) * 1e3) if r.first_token_s else (0, 0)
        out.add_row(
            r.way,
            f"{r.streams:,}",
            f"{r.errors:,}",
            f"{r.wrong:,}",
            f"{p50:.1f}",
            f"{p99:.1f}",
            f"{r.tokens / r.seconds:,.0f}",
            f"{r.cpu_s / r.seconds:.2f}",
            f"{r.threads_before} -> {r.threads_after}",
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--step-ms", type=float, default=0.0)
    args = parser.parse_args()
    results = [run_way(way, args) for way in WAYS]
    console = Console(width=max(140, Console().width))
    console.print(table(results, args))
    console.print(
        f"{os.cpu_count()} CPUs; the API process's threads before and after the load "
        "(uvicorn's and Python's own; none started for waiting)"
    )
    if any(r.errors or r.wrong for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
