"""The GPU check's Python parts: the per-test log plugin and the summary it feeds.

``scripts/gpu-check.sh`` itself runs in CI, on the emulated driver; these
check, without a driver, that a run stopped by a hang still says what ran,
what failed and which test was running.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from types import ModuleType

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture
def report() -> ModuleType:
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module("gpu_check_report")
    finally:
        sys.path.remove(str(SCRIPTS))


def plugin_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a pytest subprocess load ``-p gpu_check_log`` from ``scripts/``."""
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SCRIPTS), path])))


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_log_has_a_line_per_phase_as_the_tests_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = pytester.path / "tests.jsonl"
    monkeypatch.setenv("ASYNCFENCE_GPU_CHECK_LOG", str(log))
    plugin_on_path(monkeypatch)
    pytester.makepyfile(
        """
        import pytest

        def test_passes():
            pass

        def test_fails():
            assert 1 == 2, "one is not two"

        def test_skips():
            pytest.skip("no GPU here")
        """
    )
    result = pytester.runpytest_subprocess("-p", "gpu_check_log", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    entries = read_log(log)
    starts = [e["nodeid"] for e in entries if e["event"] == "start"]
    assert [n.rpartition("::")[2] for n in starts] == ["test_passes", "test_fails", "test_skips"]
    calls = {
        e["nodeid"].rpartition("::")[2]: e
        for e in entries
        if e["event"] == "phase" and e["when"] in ("call", "setup") and e["outcome"] != "passed"
    }
    assert "one is not two" in calls["test_fails"]["message"]
    assert calls["test_skips"]["message"] == "Skipped: no GPU here"
    assert entries[-1] == {"event": "finish", "exitstatus": 1}


def test_without_the_variable_the_plugin_writes_nothing(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ASYNCFENCE_GPU_CHECK_LOG", raising=False)
    plugin_on_path(monkeypatch)
    pytester.makepyfile("def test_passes():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "gpu_check_log", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert not list(pytester.path.glob("*.jsonl"))


def test_a_run_stopped_by_a_hang_names_the_test_it_stopped_in(
    report: ModuleType, tmp_path: Path
) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    lines = [
        {"event": "start", "nodeid": "t.py::test_a"},
        {"event": "phase", "nodeid": "t.py::test_a", "when": "setup", "outcome": "passed"},
        {"event": "phase", "nodeid": "t.py::test_a", "when": "call", "outcome": "passed"},
        {"event": "phase", "nodeid": "t.py::test_a", "when": "teardown", "outcome": "passed"},
        {"event": "start", "nodeid": "t.py::test_b"},
        {"event": "phase", "nodeid": "t.py::test_b", "when": "setup", "outcome": "passed"},
        {
            "event": "phase",
            "nodeid": "t.py::test_b",
            "when": "call",
            "outcome": "failed",
            "message": "Timeout (>45.0s) from pytest-timeout.",
        },
        {"event": "start", "nodeid": "t.py::test_c"},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"event": "pha'  # cut short
    (out / "tests.jsonl").write_text(text)
    (work / "steps.tsv").write_text("versions\t0\t40\t1\ntests\t124\t130\t130\n")
    (work / "done").touch()
    assert report.summary(out, work) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False
    assert summary["failed_steps"] == ["tests"]
    assert summary["steps"]["tests"]["timed_out"] is True
    tests = summary["tests"]
    assert tests["counts"] == {"failed": 1, "passed": 1}
    assert "Timeout" in tests["failed"]["t.py::test_b"]
    assert tests["running_when_stopped"] == ["t.py::test_c"]
    assert tests["finished"] is False
    assert "no junit report" in summary["junit"]["error"]


def test_a_step_skipped_for_time_is_not_ok(report: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "steps.tsv").write_text("tests\t0\t130\t20\nbench\tskipped: out of time\t0\t0\n")
    (tmp_path / "done").touch()
    assert report.summary(tmp_path, tmp_path) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failed_steps"] == []
    assert summary["skipped_steps"] == ["bench"]
    assert summary["ok"] is False


def test_note_converts_what_the_shell_hands_it(report: ModuleType, tmp_path: Path) -> None:
    report.note(tmp_path, "shim", ["built=true", "path=/x/_shim.so", "stale=null", "n=3"])
    data = json.loads((tmp_path / "shim.json").read_text())
    assert data == {"built": True, "path": "/x/_shim.so", "stale": None, "n": 3}


def write_bench(path: Path, planned: list[str], completed: list[str]) -> None:
    meta = {"scenarios": planned, "completed": completed}
    path.write_text(json.dumps({"meta": meta, "summary": {}, "samples": {}}))


def test_a_timed_out_full_bench_keeps_its_partial_result_beside_the_quick_one(
    report: ModuleType, tmp_path: Path
) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    write_bench(out / "bench.json", ["wake_latency", "scale"], ["wake_latency"])
    write_bench(out / "bench-quick.json", ["wake_latency", "scale"], ["wake_latency", "scale"])
    (work / "steps.tsv").write_text("bench\t124\t300\t300\nbench_quick\t0\t50\t20\n")
    (work / "done").touch()
    assert report.summary(out, work) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_steps"] == ["bench"]  # the quick run does not excuse it
    full, quick = summary["bench"]["full"], summary["bench"]["quick"]
    assert full["timed_out"] is True
    assert full["complete"] is False
    assert full["scenarios_completed"] == ["wake_latency"]
    assert full["scenarios_missing"] == ["scale"]
    assert quick["complete"] is True
    assert quick["json"] == "bench-quick.json"


def test_a_finished_full_bench_needs_no_quick_one(report: ModuleType, tmp_path: Path) -> None:
    write_bench(tmp_path / "bench.json", ["wake_latency"], ["wake_latency"])
    (tmp_path / "steps.tsv").write_text("bench\t0\t300\t120\n")
    (tmp_path / "done").touch()
    assert report.summary(tmp_path, tmp_path) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["bench"]["full"]["complete"] is True
    assert summary["bench"]["quick"] is None


def test_the_summary_names_the_commit_and_the_hardware_queues(
    report: ModuleType, tmp_path: Path
) -> None:
    report.note(tmp_path, "meta", ["commit=abc123", "CUDA_DEVICE_MAX_CONNECTIONS=32"])
    (tmp_path / "steps.tsv").write_text("")
    report.summary(tmp_path, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["commit"] == "abc123"
    queues = summary["hardware_queues"]
    assert queues["CUDA_DEVICE_MAX_CONNECTIONS"] == 32
    assert "wake_64_queues" in queues["scenarios_affected"]
    assert "beyond 32" in queues["note"]


def test_the_summary_says_which_libraries_events_were_tried(
    report: ModuleType, tmp_path: Path
) -> None:
    def phase(name: str, outcome: str, when: str = "call") -> str:
        nodeid = f"tests/test_cuda.py::{name}"
        return json.dumps({"event": "phase", "nodeid": nodeid, "when": when, "outcome": outcome})

    (tmp_path / "tests.jsonl").write_text(
        "\n".join(
            [
                phase("test_a_cuda_core_event_is_adopted[asyncio]", "passed"),
                phase("test_a_cuda_core_event_is_adopted[trio]", "passed"),
                phase("test_a_cupy_event_is_adopted[asyncio]", "skipped", "setup"),
                phase("test_a_numba_event_is_adopted[asyncio]", "failed"),
            ]
        )
    )
    rows = {"wait_sync": {"wait_sync": {"p50_us": 130.0}}, "wait_sync_cpu": {"wait_sync": {}}}
    (tmp_path / "bench.json").write_text(json.dumps({"meta": {}, "summary": rows}))
    (tmp_path / "steps.tsv").write_text("")
    report.summary(tmp_path, tmp_path)
    stacks = json.loads((tmp_path / "summary.json").read_text())["stacks"]
    assert stacks["tests"]["from_event(cuda.core Event)"] == {"passed": 2}
    assert stacks["tests"]["from_event(cupy.cuda.Event)"] == {"skipped": 1}
    assert stacks["tests"]["from_event(numba-cuda event)"] == {"failed": 1}
    assert stacks["tests"]["from_event(CUevent)"] == {}
    assert stacks["wait_sync"] == {"wait_sync": {"p50_us": 130.0}}


@pytest.mark.parametrize(
    ("installed", "problem"),
    [
        ({"anyio": "4.10.0"}, "anyio is 4.10.0; the check needs 4.11 or newer"),
        ({}, "anyio is missing"),
        ({"anyio": "4.11.0rc1"}, None),
        ({"anyio": "4.12"}, None),
    ],
)
def test_versions_older_than_the_check_relies_on_are_named(
    report: ModuleType, installed: dict[str, str], problem: str | None
) -> None:
    others = {name: {"version": "99"} for name in report.MINIMUM_VERSIONS if name != "anyio"}
    packages = {**others, **{name: {"version": v} for name, v in installed.items()}}
    problems = report._too_old(packages)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1
        assert problem in problems[0]


def test_a_forced_time_out_leaves_the_partial_full_bench_beside_the_quick_one(
    tmp_path: Path, cuda_mode: str
) -> None:
    """The script itself, on the emulated driver: its bench step only, capped short."""
    if cuda_mode != "emulated":
        pytest.skip("runs the check's bench on the emulated driver")
    import shutil
    import subprocess

    if shutil.which("timeout") is None:
        pytest.skip("needs timeout(1)")
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "ASYNCFENCE_CUDA_DRIVER": "emulated",
        "ASYNCFENCE_GPU_CHECK_STEPS": "bench",
        "ASYNCFENCE_GPU_CHECK_BENCH_CAP": "8",  # far short of a full run
        "TMPDIR": str(tmp_path),
    }
    result = subprocess.run(
        ["bash", str(SCRIPTS / "gpu-check.sh"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    full, quick = summary["bench"]["full"], summary["bench"]["quick"]
    assert full["timed_out"] is True
    assert full["complete"] is False
    assert full["scenarios_missing"]  # what the cut left out, named
    assert quick["exit_code"] == 0
    assert quick["complete"] is True
    # Each run kept its own files: the quick one never overwrote the full one.
    assert json.loads((out / "bench.json").read_text())["meta"]["quick"] is False
    assert json.loads((out / "bench-quick.json").read_text())["meta"]["quick"] is True
    assert summary["failed_steps"] == ["bench"]
    assert summary["commit"]  # from git here
