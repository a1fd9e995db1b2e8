"""Load the inference server two ways, side by side: awaiting fences, and to_thread.

For each variant, ``idle`` (the loop has nothing to do but serve) and ``busy``
(the server's ``--busy-loop``: a task on the loop runs Python between yields),
this starts ``server.py`` with ``--wait asyncfence`` and with ``--wait
to_thread`` (the same server waiting with ``asyncio.to_thread``), one at a
time, each alone on the machine; checks its answers with httpx; then drives it
with wrk (one thread, 32 connections, loopback, the request bodies of
``embed.lua``). The two servers take turns over a few rounds, the order
swapped each round, so drift hits both alike. It prints, per server and
variant, requests per second and wrk's latency percentiles (p50, p90, p99),
their medians over the rounds and the ratios of those medians.

    python examples/inference_server/load.py [--seconds 5] [--rounds 3]
        [--connections 32] [--variants idle,busy] [--busy-us 200]
        [--device-ms 0] [--gather auto] [--json PATH] [--quick]

Needs wrk (Debian: ``apt-get install -y wrk``). Exits with 1 if an answer was
wrong or wrk saw an error, 2 if wrk is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from collections.abc import Iterator

HERE = Path(__file__).resolve().parent
SERVER = HERE / "server.py"
WRK_SCRIPT = HERE / "embed.lua"
DIM, VOCAB = 16, 4096
WAITS = ("asyncfence", "to_thread")
VARIANTS = ("idle", "busy")


def expected(token: int) -> list[float]:
    """The embedding the server must answer for ``token``."""
    return [token + column / DIM for column in range(DIM)]


@dataclass
class RunningServer:
    """A server process started by :func:`start_server`."""

    process: subprocess.Popen[str]
    url: str
    banner: str
    stderr: IO[str]

    def errors(self) -> str:
        """The end of what the server wrote to stderr."""
        self.stderr.seek(0)
        return self.stderr.read()[-2000:]


@contextlib.contextmanager
def start_server(
    *arguments: str, env: dict[str, str] | None = None, startup_s: float = 120
) -> Iterator[RunningServer]:
    """Start ``server.py --port 0 ARGUMENTS`` and wait for its ``serving on`` line.

    Args:
        arguments: More command-line arguments for the server.
        env: Its environment; by default this process's.
        startup_s: How long it may take to come up before it is killed.

    Raises:
        RuntimeError: The server exited, or did not come up in time.
    """
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(SERVER), "--port", "0", *arguments],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
        watchdog = threading.Timer(startup_s, process.kill)
        watchdog.start()
        try:
            assert process.stdout is not None
            banner = process.stdout.readline().strip()  # "" once it exits, or is killed
            watchdog.cancel()
            if not banner.startswith("serving on http://"):
                process.kill()
                process.wait()
                stderr.seek(0)
                raise RuntimeError(
                    f"the server did not come up (exit status {process.returncode}): "
                    f"{banner!r}\n{stderr.read()[-2000:]}"
                )
            url = banner.split()[2]
            yield RunningServer(process, url, banner, stderr)
        finally:
            watchdog.cancel()
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            if process.stdout is not None:
                process.stdout.close()


def check_answers(url: str, requests: int = 16, seed: int = 0) -> int:
    """Send ``requests`` requests of random tokens; return how many answers were wrong."""
    rng = random.Random(seed)
    wrong = 0
    with httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(requests):
            tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
            response = client.post("/embed", json={"tokens": tokens})
            if response.status_code != 200 or response.json() != {
                "embeddings": [expected(token) for token in tokens]
            }:
                wrong += 1
        if client.post("/embed", json={"tokens": [VOCAB]}).status_code != 422:
            wrong += 1
    return wrong


def health(url: str) -> dict[str, Any]:
    """The server's ``/health``."""
    answer: dict[str, Any] = httpx.get(f"{url}/health", timeout=30).json()
    return answer


def run_wrk(wrk: str, url: str, seconds: int, connections: int) -> dict[str, Any]:
    """Drive ``POST /embed`` with wrk for ``seconds``; return embed.lua's summary."""
    command = [wrk, "-t1", f"-c{connections}", f"-d{seconds}s", "--latency"]
    command += ["-s", str(WRK_SCRIPT), f"{url}/embed"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
    for line in result.stdout.splitlines():
        if line.startswith("load.py: "):
            summary: dict[str, Any] = json.loads(line.removeprefix("load.py: "))
            return summary
    raise RuntimeError(f"wrk failed ({result.returncode}): {result.stdout}{result.stderr}")


@dataclass
class Measurement:
    """One server under wrk for one round of one variant."""

    variant: str
    wait: str
    round: int
    requests: int
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    errors: int
    wrong: int
    batches: int
    gather: str
    loop: str
    device: str


def measure(
    wrk: str, variant: str, wait: str, round_: int, args: argparse.Namespace
) -> Measurement:
    """Start the server for ``wait`` and ``variant``, check it, warm it up, and measure."""
    flags = ["--wait", wait, "--gather", args.gather, "--device-ms", str(args.device_ms)]
    if variant == "busy":
        flags += ["--busy-loop", str(args.busy_us)]
    with start_server(*flags) as server:
        wrong = check_answers(server.url, seed=round_)
        if args.warmup:
            run_wrk(wrk, server.url, args.warmup, args.connections)
        before = health(server.url)
        summary = run_wrk(wrk, server.url, args.seconds, args.connections)
        after = health(server.url)
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited under load:\n{server.errors()}")
    return Measurement(
        variant=variant,
        wait=wait,
        round=round_,
        requests=summary["requests"],
        rps=summary["requests"] / (summary["duration_us"] / 1e6),
        p50_ms=summary["p50_us"] / 1e3,
        p90_ms=summary["p90_us"] / 1e3,
        p99_ms=summary["p99_us"] / 1e3,
        errors=sum(summary["errors"].values()),
        wrong=wrong,
        batches=after["batches"] - before["batches"],
        gather=after["gather"],
        loop=after["loop"],
        device=after["device"],
    )


def medians(runs: list[Measurement]) -> dict[str, float]:
    """The median of each figure over ``runs``."""
    return {
        key: statistics.median(getattr(run, key) for run in runs)
        for key in ("rps", "p50_ms", "p90_ms", "p99_ms")
    }


def report(runs: list[Measurement], args: argparse.Namespace) -> dict[str, Any]:
    """Print the table; return the figures for ``--json``."""
    first = runs[0]
    print(
        f"wrk -t1 -c{args.connections}, loopback, {args.rounds} round(s) of {args.seconds} s "
        f"per server and variant, interleaved; gather by {first.gather}, {first.loop}, "
        f"{first.device}; device work {args.device_ms:g} ms a batch"
    )
    summary: dict[str, Any] = {"runs": [asdict(run) for run in runs], "variants": {}}
    for variant in args.variants:
        what = "idle" if variant == "idle" else f"busy ({args.busy_us:g} µs of Python per yield)"
        print(f"\nloop {what}")
        print(
            f"{'round':<7}{'server waits with':<19}{'req/s':>8}{'p50 ms':>9}{'p90 ms':>9}"
            f"{'p99 ms':>9}{'errors':>8}{'wrong':>7}{'req/batch':>11}"
        )
        ours = [run for run in runs if run.variant == variant]
        for run in ours:
            per_batch = run.requests / max(run.batches, 1)
            print(
                f"{run.round:<7}{run.wait:<19}{run.rps:>8.0f}{run.p50_ms:>9.2f}"
                f"{run.p90_ms:>9.2f}{run.p99_ms:>9.2f}{run.errors:>8}{run.wrong:>7}"
                f"{per_batch:>11.1f}"
            )
        by_wait = {wait: medians([run for run in ours if run.wait == wait]) for wait in WAITS}
        for wait, figures in by_wait.items():
            print(
                f"{'median':<7}{wait:<19}{figures['rps']:>8.0f}{figures['p50_ms']:>9.2f}"
                f"{figures['p90_ms']:>9.2f}{figures['p99_ms']:>9.2f}"
            )
        a, t = by_wait["asyncfence"], by_wait["to_thread"]
        ratios = {key: a[key] / t[key] for key in a}
        print(
            f"asyncfence vs to_thread, loop {variant}: {ratios['rps']:.2f}x req/s; latency "
            f"p50 {ratios['p50_ms']:.2f}x, p90 {ratios['p90_ms']:.2f}x, "
            f"p99 {ratios['p99_ms']:.2f}x"
        )
        summary["variants"][variant] = {"medians": by_wait, "ratios": ratios}
    print("\n(ratios are of the medians: for req/s higher is better, for latency lower)")
    return summary


def main() -> int:
    """Parse the command line, measure, report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=5, help="per server and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="seconds of wrk before each")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument(
        "--variants",
        type=lambda text: [v for v in text.split(",") if v],
        default=list(VARIANTS),
        help="comma-separated: idle, busy (default both)",
    )
    parser.add_argument("--busy-us", type=float, default=200.0, help="for the busy variant")
    parser.add_argument("--device-ms", type=float, default=0.0, help="device work per batch")
    parser.add_argument("--gather", choices=("auto", "kernel", "copies"), default="auto")
    parser.add_argument("--wrk", default=os.environ.get("WRK", "wrk"), help="wrk's path")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--quick", action="store_true", help="1 s, one round, no warm-up: a functional check"
    )
    args = parser.parse_args()
    if unknown := set(args.variants) - set(VARIANTS):
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {VARIANTS}")
    if args.quick:
        args.seconds, args.rounds, args.warmup = 1, 1, 0
    wrk = shutil.which(args.wrk)
    if wrk is None:
        print(
            f"{args.wrk} not found: install wrk (Debian: apt-get install -y wrk)", file=sys.stderr
        )
        return 2
    runs = []
    for variant in args.variants:
        for round_ in range(1, args.rounds + 1):
            order = WAITS if round_ % 2 else WAITS[::-1]
            runs += [measure(wrk, variant, wait, round_, args) for wait in order]
    summary = report(runs, args)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if any(run.errors or run.wrong for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
