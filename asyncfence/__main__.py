"""Command line: ``python -m asyncfence demo``, ``bench`` and ``soak``."""

from __future__ import annotations

import argparse
import asyncio
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m asyncfence", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="record fences on the default device and await them")
    bench = commands.add_parser(
        "bench", help="measure every waiting strategy beside the usual baselines"
    )
    bench.add_argument("--device", choices=("cuda", "opencl"), help="default: CUDA if present")
    bench.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    bench.add_argument("--json", metavar="PATH", help="write the report as JSON")
    bench.add_argument("--plot", metavar="PATH", help="plot the distributions (matplotlib)")
    bench.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    bench.add_argument("--quiet", action="store_true", help="no progress lines")
    bench.add_argument(
        "--spin-budget", type=float, metavar="SECONDS", help="the spin budget to measure with"
    )
    soak = commands.add_parser("soak", help="a long run that checks memory and loop lag stay flat")
    soak.add_argument("--minutes", type=float, default=10.0, help="how long (default 10)")
    args = parser.parse_args(argv)

    if args.command == "soak":
        from ._soak import run_soak

        return run_soak(args.minutes)

    if args.command == "bench":
        from ._bench import run_bench
        from ._config import configure

        if args.spin_budget is not None:
            configure(spin_budget=args.spin_budget)
        run_bench(
            device=args.device,
            quick=args.quick,
            json_path=args.json,
            plot_path=args.plot,
            loop=args.loop,
            quiet=args.quiet,
        )
        return 0
    from ._demo import demo

    return asyncio.run(demo())


if __name__ == "__main__":
    sys.exit(main())
