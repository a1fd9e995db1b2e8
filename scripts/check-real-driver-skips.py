"""Check a CUDA test run with the emulator's hooks hidden: only what needs them skips.

Usage: ``pytest -rs ... | python scripts/check-real-driver-skips.py``, from the
checkout. The run's output passes through; then two checks, either of which
fails the run (exit 1):

* every skip in the run's ``-rs`` summary gives a reason a real driver would
  give too: the hooks, the emulator under test, a library not installed;
* every test function under ``tests/`` that takes the ``emulator`` fixture
  calls its hooks, so that taking it never hides a test from a real driver.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

#: Skip reasons a run on a real driver may give (matched at the start).
ALLOWED = (
    "needs the emulated driver's hooks",
    "tests the emulated driver itself",
    "pretends to be an older emulated driver",
    "could not import",  # an optional library (CuPy, numba-cuda) not installed
    "no new thread got the exited thread's ident",  # left to the OS's ident reuse
    "needs a real GPU",  # PyTorch, CuPy, numba-cuda: beyond what is emulated
    "needs PyTorch with a CUDA GPU",
)
_SKIP_LINE = re.compile(r"^SKIPPED \[\d+\] (?P<where>[^:]+:\d+): (?P<reason>.*)$")


def fixture_takers_without_hooks(tests: Path) -> list[str]:
    """Test functions that take ``emulator`` and never use it."""
    found = []
    for path in sorted(tests.glob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if not node.name.startswith("test_"):
                continue
            if "emulator" not in [argument.arg for argument in node.args.args]:
                continue
            used = any(
                isinstance(name, ast.Name) and name.id == "emulator"
                for statement in node.body
                for name in ast.walk(statement)
            )
            if not used:
                found.append(f"{path.name}:{node.lineno} {node.name}")
    return found


def main() -> int:
    """Pass the run's output through, then check it; see the module's docstring."""
    problems = []
    for line in sys.stdin:
        sys.stdout.write(line)
        match = _SKIP_LINE.match(line.rstrip("\n"))
        if match and not match["reason"].startswith(ALLOWED):
            problems.append(f"{match['where']} skips on a real driver: {match['reason']}")
    tests = Path(__file__).resolve().parent.parent / "tests"
    for taker in fixture_takers_without_hooks(tests):
        problems.append(f"{taker} takes the emulator fixture without using its hooks")
    for problem in problems:
        print(f"check-real-driver-skips: {problem}", file=sys.stderr)
    if not problems:
        print("check-real-driver-skips: only what needs the emulator skipped")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
