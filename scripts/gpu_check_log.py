"""A pytest plugin for the GPU check: one JSON line per test phase, written as it goes.

``scripts/gpu-check.sh`` loads it with ``-p gpu_check_log``. pytest writes its
junit report only at the end, so a run killed by a hang would leave none; this
log is flushed line by line, and its last ``start`` without an outcome names the
test that hung. The path comes from ``ASYNCFENCE_GPU_CHECK_LOG``; without it the
plugin does nothing.

Each line is a JSON object with ``event``: ``"start"`` (``nodeid``), ``"phase"``
(``nodeid``, ``when``, ``outcome``, ``duration``, and ``message`` for a failure
or a skip), ``"collect"`` (a module that failed to collect: ``nodeid``,
``message``), or ``"finish"`` (``exitstatus``).
"""

from __future__ import annotations

import json
import os
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

VARIABLE = "ASYNCFENCE_GPU_CHECK_LOG"
_MESSAGE_CHARS = 2000

_log: IO[str] | None = None


def _write(entry: dict[str, Any]) -> None:
    if _log is None:
        return
    _log.write(json.dumps(entry) + "\n")
    _log.flush()


def pytest_configure(config: pytest.Config) -> None:
    """Open the log named by ``ASYNCFENCE_GPU_CHECK_LOG``, if set."""
    global _log
    path = os.environ.get(VARIABLE)
    if path and _log is None:
        _log = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the session)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """Log a module that failed to collect: its tests never start."""
    if report.failed:
        message = report.longreprtext[-_MESSAGE_CHARS:]
        _write(
            {"event": "collect", "nodeid": report.nodeid, "outcome": "failed", "message": message}
        )


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """Log that a test starts: a hang leaves this as the last word on it."""
    _write({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Log each phase's outcome (setup, call, teardown)."""
    entry: dict[str, Any] = {
        "event": "phase",
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "duration": round(report.duration, 6),
    }
    if report.failed:
        entry["message"] = report.longreprtext[-_MESSAGE_CHARS:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        entry["message"] = str(report.longrepr[2])
    if hasattr(report, "wasxfail"):
        entry["xfail"] = True
    _write(entry)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Log the session's exit status and close the log."""
    global _log
    _write({"event": "finish", "exitstatus": int(exitstatus)})
    if _log is not None:
        _log.close()
        _log = None
