"""Command line: ``python -m asyncfence demo``; ``bench`` and ``soak`` from a checkout.

The demo ships with the library. The benchmark and the soak run are the lab,
in the repository's ``benchmarks/`` folder and not in the installed package:
run from a checkout, ``bench`` and ``soak`` hand over to it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

_DESCRIPTION = (
    "asyncfence: record fences on the default device and await them (demo); from a "
    "checkout of the repository, the benchmark (bench) and the soak run (soak)."
)
_LAB_COMMANDS = ("bench", "soak")


def _checkout_root() -> Path | None:
    """The root of the checkout whose ``benchmarks/`` lab is at hand, if any.

    The one this package was installed from in editable mode (or is run
    from), else the working directory's.
    """
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        if (root / "benchmarks" / "bench" / "runner.py").is_file():
            return root
    return None


def _run_lab(argv: list[str]) -> int:
    root = _checkout_root()
    if root is None:
        print(
            f"python -m asyncfence {argv[0]}: the benchmark and the soak run are not part "
            "of the installed package; run them from a checkout of the asyncfence "
            "repository (git clone, then python -m asyncfence bench in it)",
            file=sys.stderr,
        )
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks.__main__ import main as lab_main

    return lab_main(argv, prog="python -m asyncfence")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the exit status."""
    from . import __version__

    arguments = sys.argv[1:] if argv is None else argv
    if arguments and arguments[0] in _LAB_COMMANDS:
        return _run_lab(arguments)
    parser = argparse.ArgumentParser(prog="python -m asyncfence", description=_DESCRIPTION)
    parser.add_argument("-V", "--version", action="version", version=f"asyncfence {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "demo",
        help="record fences on the default device and await them",
        description="Record fences on the default device and await them.",
    )
    for command in _LAB_COMMANDS:
        commands.add_parser(command, help=f"from a checkout: python -m benchmarks {command}")
    parser.parse_args(arguments)
    from ._demo import demo

    return asyncio.run(demo())


if __name__ == "__main__":
    sys.exit(main())
