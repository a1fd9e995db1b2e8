"""Command line of the lab: ``python -m benchmarks bench``, ``plot`` and ``soak``, from a checkout.

``python -m asyncfence bench`` (and ``soak``) hand over to it when run there.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap

_DESCRIPTION = "asyncfence's lab: the benchmark, its plot and the soak run, from a checkout."


def _bench_description() -> str:
    from .bench import SCENARIOS, BenchConfig, estimate_seconds

    full = estimate_seconds(BenchConfig(), 6, backend="opencl")
    quick = estimate_seconds(BenchConfig.smoke(), 6, backend="opencl")
    listed = "\n".join(f"  {s.key:<24} {s.title}" for s in SCENARIOS)
    about = textwrap.fill(
        "Measure every waiting strategy beside the usual baselines, in one process, "
        f"interleaved. A full run takes about {full / 60:.0f} minutes on a 2-core machine, "
        f"--quick about {quick:.0f} s (each run prints its own estimate as it starts).",
        width=88,
    )
    return f"{about}\n\nScenarios:\n{listed}"


def _positive_minutes(text: str) -> float:
    """An argparse type: a finite number of minutes above zero."""
    try:
        minutes = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of minutes, got {text!r}") from None
    if not math.isfinite(minutes) or minutes <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of minutes > 0, got {text}")
    return minutes


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, zero or more."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text}")
    return seconds


def _plot(report_path: str, image_path: str) -> int:
    """``plot``: draw a saved report's plot; returns the exit status."""
    import json
    from pathlib import Path

    from .bench.report import plot, require_matplotlib, results_from_report

    require_matplotlib()
    try:
        report = json.loads(Path(report_path).read_text())
        results = results_from_report(report)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"plot: cannot read {report_path} as a bench report: {error}") from None
    plot(results, results.meta, image_path)
    print(f"wrote the plot to {Path(image_path).resolve()}")
    return 0


def _unwritable(path: str, *, image: bool) -> str | None:
    """Why ``path`` cannot be written as an output (checked before measuring), or None."""
    import os
    from pathlib import Path

    target = Path(path)
    if target.is_dir():
        return "it is a directory"
    folder = target.parent
    if not folder.is_dir():
        return f"no such directory: {folder}"
    if not os.access(folder if not target.exists() else target, os.W_OK):
        return "permission denied"
    if image:
        from matplotlib.figure import Figure

        kinds = Figure().canvas.get_supported_filetypes()
        kind = target.suffix.lstrip(".").lower()
        if kind not in kinds:
            known = ", ".join(sorted(kinds))
            return f"matplotlib cannot write .{kind or '(none)'} files (it writes {known})"
    return None


def main(argv: list[str] | None = None, *, prog: str = "python -m benchmarks") -> int:
    """Parse ``argv`` and run the chosen command; returns the exit status.

    ``prog`` names the command in the help and in errors (``python -m
    asyncfence`` hands over to this with its own name).
    """
    import asyncfence

    parser = argparse.ArgumentParser(prog=prog, description=_DESCRIPTION)
    parser.add_argument(
        "--version", action="version", version=f"asyncfence {asyncfence.__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser(
        "bench",
        help="measure every waiting strategy beside the usual baselines",
        description=_bench_description(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "--device",
        choices=[stats.backend for stats in asyncfence.backend_statistics()],
        help="default: the first with a device (a GPU first)",
    )
    bench.add_argument(
        "--quick", action="store_true", help="a smoke run: every scenario, tiny trial counts"
    )
    bench.add_argument(
        "--json", metavar="PATH", help="write the report as JSON, rewritten after each scenario"
    )
    bench.add_argument(
        "--plot", metavar="PATH", help="plot the distributions (needs matplotlib: the bench extra)"
    )
    bench.add_argument(
        "--loop",
        choices=("asyncio", "uvloop", "trio"),
        default="asyncio",
        help="the event loop to run on (uvloop and trio must be installed)",
    )
    bench.add_argument("--quiet", action="store_true", help="no progress lines")
    bench.add_argument(
        "--spin-budget", type=_seconds, metavar="SECONDS", help="the spin budget to measure with"
    )
    redraw = commands.add_parser(
        "plot",
        help="draw the plot of a report that bench --json wrote",
        description="Draw the plot of a report that bench --json wrote, as bench --plot does.",
    )
    redraw.add_argument("report", metavar="REPORT", help="the JSON report")
    redraw.add_argument("path", metavar="PATH", help="the image to write (.png, .svg)")
    soak = commands.add_parser(
        "soak",
        help="a long run that checks memory and loop lag stay flat",
        description="A long run that checks memory and loop lag stay flat.",
    )
    soak.add_argument(
        "--minutes", type=_positive_minutes, default=10.0, help="how long (default 10)"
    )
    args = parser.parse_args(argv)

    if args.command == "soak":
        from .soak import run_soak

        return run_soak(args.minutes)
    if args.command == "plot":
        return _plot(args.report, args.path)

    from .bench import run_bench

    if args.plot:
        from .bench.report import require_matplotlib

        require_matplotlib()
    # Outputs are checked before anything is measured: a run is minutes long.
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path and (why := _unwritable(path, image=option == "--plot")):
            print(f"{prog} bench: cannot write {option} {path}: {why}", file=sys.stderr)
            return 2
    if args.spin_budget is not None:
        asyncfence.configure(spin_budget=args.spin_budget)
    run_bench(
        device=args.device,
        quick=args.quick,
        json_path=args.json,
        plot_path=args.plot,
        loop=args.loop,
        quiet=args.quiet,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
