"""Command line: ``python -m asyncfence demo``."""

from __future__ import annotations

import argparse
import asyncio
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m asyncfence", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="record fences on the default device and await them")
    parser.parse_args(argv)

    from ._demo import demo

    return asyncio.run(demo())


if __name__ == "__main__":
    sys.exit(main())
