"""Load the torch server two ways, side by side: awaiting fences, and synchronize() in a thread.

For each variant, ``idle`` (the loop has nothing to do but serve) and ``busy``
(the server's ``--busy-loop``: a task on the loop runs Python between yields),
this starts ``server.py`` with ``--wait asyncfence`` and with ``--wait
synchronize`` (the same server waiting with ``synchronize()`` in
``anyio.to_thread``), one at a time, each alone on the machine; checks its
answers against the model run directly, and that bad input is a 422; then
drives it with wrk (one thread, 32 connections, loopback, the request bodies
of ``predict.lua``). The two servers take turns over a few rounds, the order
swapped each round, so drift hits both alike. It prints, per server and
variant, requests per second and wrk's latency percentiles (p50, p90, p99),
their medians over the rounds and the ratios of those medians.

    python examples/torch_server/load.py [--seconds 5] [--rounds 3]
        [--connections 32] [--variants idle,busy] [--busy-us 200]
        [--device auto] [--torch-threads 0] [--json PATH] [--quick]

Needs wrk (Debian: ``apt-get install -y wrk``). Exits with 1 if an answer was
wrong or wrk saw an error, 2 if wrk is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
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
WRK_SCRIPT = HERE / "predict.lua"
FEATURES = 64
WAITS = ("asyncfence", "synchronize")
VARIANTS = ("idle", "busy")


@dataclass
class RunningServer:
    """A server process started by :func:`start_server`."""

    process: subprocess.Popen[str]
    url: str
    banner: str
    stderr: IO[str]

    def errors(self) -> str:
        """What the server wrote to stderr (its end)."""
        self.stderr.seek(0)
        return self.stderr.read()[-4000:]


@contextlib.contextmanager
def start_server(
    *arguments: str, env: dict[str, str] | None = None, startup_s: float = 120
) -> Iterator[RunningServer]:
    """Start ``server.py --port 0 ARGUMENTS`` and wait for its ``serving on`` line.

    Raises:
        RuntimeError: The server exited, or did not come up within ``startup_s``.
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
            yield RunningServer(process, banner.split()[2], banner, stderr)
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


def import_server() -> Any:
    """``server.py`` as a module, ``torch_server_example`` (not ``server``: other examples')."""
    module = sys.modules.get("torch_server_example")
    if module is None:
        spec = importlib.util.spec_from_file_location("torch_server_example", SERVER)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def expected_logits(rows: list[list[float]]) -> list[list[float]]:
    """The model's logits for ``rows``, computed here on the CPU."""
    import torch

    with torch.inference_mode():
        logits: list[list[float]] = import_server().build_model()(torch.tensor(rows)).tolist()
    return logits


def check_answers(url: str, requests: int = 16, seed: int = 0) -> int:
    """Send ``requests`` rows and two bad bodies; return how many answers were wrong."""
    rng = random.Random(seed)
    rows = [[rng.uniform(-1, 1) for _ in range(FEATURES)] for _ in range(requests)]
    wrong = 0
    with httpx.Client(base_url=url, timeout=30) as client:
        for row, logits in zip(rows, expected_logits(rows), strict=True):
            answer = client.post("/predict", json={"features": row})
            if answer.status_code != 200 or not all(
                abs(got - want) <= 1e-4 * (1 + abs(want))
                for got, want in zip(answer.json()["logits"], logits, strict=True)
            ):
                wrong += 1
        for bad in (b'{"features": [1, 2', b'{"features": [1]}'):
            headers = {"Content-Type": "application/json"}
            if client.post("/predict", content=bad, headers=headers).status_code != 422:
                wrong += 1
    return wrong


def health(url: str) -> dict[str, Any]:
    """The server's ``/health``."""
    answer: dict[str, Any] = httpx.get(f"{url}/health", timeout=30).json()
    return answer


def run_wrk(wrk: str, url: str, seconds: int, connections: int) -> dict[str, Any]:
    """Drive ``POST /predict`` with wrk for ``seconds``; return predict.lua's summary."""
    command = [wrk, "-t1", f"-c{connections}", f"-d{seconds}s", "--latency"]
    command += ["-s", str(WRK_SCRIPT), f"{url}/predict"]
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
    device: str


def measure(
    wrk: str, variant: str, wait: str, round_: int, args: argparse.Namespace
) -> Measurement:
    """Start the server for ``wait`` and ``variant``, check it, warm it up, and measure."""
    flags = ["--wait", wait, "--device", args.device, "--torch-threads", str(args.torch_threads)]
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
    import torch

    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    print(
        f"wrk -t1 -c{args.connections}, loopback, {args.rounds} round(s) of {args.seconds} s "
        f"per server and variant, interleaved; {runs[0].device}; {machine}"
    )
    summary: dict[str, Any] = {"machine": machine, "runs": [asdict(r) for r in runs]}
    summary["variants"] = {}
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
        a, s = by_wait["asyncfence"], by_wait["synchronize"]
        ratios = {key: a[key] / s[key] for key in a}
        print(
            f"asyncfence vs synchronize, loop {variant}: {ratios['rps']:.2f}x req/s; latency "
            f"p50 {ratios['p50_ms']:.2f}x, p90 {ratios['p90_ms']:.2f}x, "
            f"p99 {ratios['p99_ms']:.2f}x"
        )
        summary["variants"][variant] = {"medians": by_wait, "ratios": ratios}
    print("\n(ratios are of the medians: for req/s higher is better, for latency lower)")
    if args.quick:
        summary["quick"] = True
        print(
            f"--quick: one round of {args.seconds} s, no warm-up, to check that both servers "
            "answer correctly; too short to compare them (the ratios above are noise): "
            "run without --quick for that"
        )
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
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--torch-threads", type=int, default=0, help="the servers' torch.set_num_threads"
    )
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
