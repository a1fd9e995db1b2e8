"""The benchmark (``benchmarks/``) and the demo: every scenario, every contender, the arithmetic."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from benchmarks.bench import runner
from benchmarks.bench.base import (
    AUTO,
    CONTENDER_ORDER,
    DEVICE_FINISH,
    IMPORT_AWAITED,
    IMPORT_IDLE,
    LOCAL_WAITER,
    PARK,
    POLL,
    POLLED_10MS,
    RUNTIME_BLOCKING,
    SLEEP_0,
    SLEEP_1MS,
    TO_THREAD,
    WAIT_SYNC,
    BenchConfig,
    Results,
    default_executor_workers,
)
from benchmarks.bench.cross_process import CROSS_PROCESS_CONTENDERS
from benchmarks.bench.load import FENCE_PER_WAIT, FLOOR_PER_WAIT
from benchmarks.bench.report import (
    BELOW_FLOOR,
    build_report,
    plot,
    render,
    results_from_report,
    summarize,
)
from benchmarks.bench.signal_hold import PYTHON_CALLBACK, native_label
from benchmarks.bench.targets import (
    Contender,
    contenders,
    device_finish_row,
    make_target,
    probe_contenders,
)
from benchmarks.measure import percentile, plural

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
EVERYONE = [AUTO, PARK, POLL, TO_THREAD, SLEEP_1MS, SLEEP_0]
# What the latency scenarios time on OpenCL: every contender, and the device's own row.
TIMED = [*EVERYONE, DEVICE_FINISH]
LATENCY = [
    "wake_latency",
    "wake_latency_short_work",
    "wake_fresh_queue",
    "wake_64_queues",
    "wake_saturated_loop",
    "wake_cpu_thread",
    "out_of_order_park",
]
# A run small enough for a test in this process: one trial or two of everything.
TINY = dataclasses.replace(BenchConfig.smoke(), wake_trials=2, probe_timeout_s=2.0)
# Smaller still, for running every scenario once more on each loop.
ON_EACH_LOOP = dataclasses.replace(
    TINY,
    fresh_trials=2,
    many_queues=8,
    saturated_trials=1,
    cpu_thread_trials=2,
    out_of_order_trials=1,
    parked_queues=20,
    parked_cpu_window_s=0.02,
    cpu_work_s=0.02,
    throughput_window_s=0.05,
    scale_window_s=0.05,
    streams=4,
    drop_objects=1600,
)


def run_quick_bench(
    device: str, *args: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncfence", "bench", "--quick", "--device", device, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **env},
        timeout=300,
    )


# -- arithmetic ---------------------------------------------------------------------------


def test_percentile_is_nearest_rank() -> None:
    samples = [float(v) for v in range(1, 101)]
    assert percentile(samples, 0.5) == 50.0
    assert percentile(samples, 0.99) == 99.0
    assert percentile(samples, 1.0) == 100.0
    assert percentile([3.0], 0.99) == 3.0
    assert math.isnan(percentile([], 0.5))
    assert percentile([1.0, math.inf], 0.99) == math.inf  # a timeout sorts last


def test_plural() -> None:
    assert plural(1, "task") == "1 task"
    assert plural(64, "task") == "64 tasks"
    assert plural(1000, "query", "queries") == "1,000 queries"


def test_summary_takes_overheads_and_ratios_from_the_samples() -> None:
    results = Results(meta={})
    us = 1e-6
    results.latency["wake_latency"] = {
        # Deliberately out of table order: the summary sorts.
        TO_THREAD: [100 * us, 110 * us, 400 * us],
        SLEEP_0: [10 * us, 20 * us, 90 * us],
        AUTO: [60 * us, 50 * us, 300 * us],
    }
    results.latency["wake_saturated_loop"] = {
        SLEEP_0: [1000 * us, 1000 * us, 1200 * us],
        TO_THREAD: [5000 * us, math.inf, math.inf],
        AUTO: [3000 * us, 3500 * us, 4000 * us],
    }
    results.latency["wake_cpu_thread"] = {
        SLEEP_0: [1e-3, 2e-3, 3e-3, 4e-3],
        AUTO: [1e-3, 12e-3, 13e-3, math.inf],
    }
    results.cpu["cpu_while_parked"] = {SLEEP_0: [1.0, 0.9, 1.1], PARK: [0.01, 0.02, 0.03]}
    results.throughput = {
        TO_THREAD: {1: [1000.0], 64: [2000.0]},
        AUTO: {1: [3000.0], 64: [8000.0]},
    }
    summary = summarize(results)

    wake = summary["wake_latency"]
    assert list(wake) == [AUTO, TO_THREAD, SLEEP_0]  # table order
    assert wake[AUTO]["p50_us"] == pytest.approx(60)
    assert wake[AUTO]["p99_us"] == pytest.approx(300)
    assert wake[AUTO]["max_us"] == pytest.approx(300)
    assert wake[AUTO]["p50_over_floor_us"] == pytest.approx(60 - 20)
    assert wake[AUTO]["p99_over_floor_us"] == pytest.approx(300 - 90)
    assert wake[AUTO]["p50_vs_to_thread"] == pytest.approx(60 / 110)
    assert wake[SLEEP_0]["p50_over_floor_us"] == 0
    assert wake[TO_THREAD]["p50_vs_to_thread"] == pytest.approx(1.0)
    assert wake[AUTO]["trials"] == 3
    assert wake[AUTO]["timeouts"] == 0

    saturated = summary["wake_saturated_loop"]
    assert saturated[TO_THREAD]["timeouts"] == 2
    assert saturated[TO_THREAD]["p50_us"] is None  # lands on a timeout
    assert saturated[TO_THREAD]["p99_us"] is None
    assert saturated[TO_THREAD]["p99_over_floor_us"] is None
    assert saturated[AUTO]["p50_over_floor_us"] == pytest.approx(3500 - 1000)
    assert saturated[AUTO]["p99_over_floor_us"] == pytest.approx(4000 - 1200)
    assert saturated[AUTO]["p50_vs_to_thread"] is None

    late = summary["wake_cpu_thread"]
    assert late[AUTO]["late_share"] == pytest.approx(3 / 4)  # over 11 ms, the timeout too
    assert late[SLEEP_0]["late_share"] == 0

    parked = summary["cpu_while_parked"]
    assert parked[PARK]["cpu_per_wall"] == pytest.approx(0.02)
    assert parked[PARK]["vs_busy_poll"] == pytest.approx(0.02)
    rates = summary["throughput"]
    assert rates[AUTO]["1_tasks_vs_to_thread"] == pytest.approx(3.0)
    assert rates[AUTO]["64_tasks_vs_to_thread"] == pytest.approx(4.0)
    assert "scale" not in summary  # only what ran

    report = build_report(results)
    text = json.dumps(report, allow_nan=False)  # no NaN, no infinity
    assert json.loads(text)["samples"]["wake_saturated_loop_s"][TO_THREAD] == [5e-3, None, None]


def test_plain_tables_without_rich(capsys: pytest.CaptureFixture[str]) -> None:
    results = Results(
        meta={
            "backend": "opencl",
            "device": "a device",
            "cpu_count": 1,
            "python": "3",
            "loop": "asyncio",
            "asyncfence": "0",
            "quick": True,
            "default_executor_workers": 5,
            "left_out": {"numba async_done": "AttributeError: no"},
            "config": dataclasses.asdict(BenchConfig.smoke()),
        }
    )
    results.latency["wake_saturated_loop"] = {SLEEP_0: [1e-3], TO_THREAD: [math.inf]}
    results.throughput = {TO_THREAD: {1: [10.0], 16: [20.0]}}
    render(results.meta, summarize(results), plain=True)
    out = capsys.readouterr().out
    assert "1 core |" in out
    assert "left out numba async_done: AttributeError: no" in out
    assert "> 0.2 s" in out
    assert "1 task" in out
    assert "1 tasks" not in out
    assert "16 tasks" in out


#: A negative number in a table ("-12,908"), not a range ("0.5-3 ms") or a word.
NEGATIVE = r"(?<![\w.])-[\d,]*\d"


def _meta(**changes: Any) -> dict[str, Any]:
    """A report's meta, as :func:`benchmarks.bench.report.describe` makes it."""
    return {
        "backend": "opencl",
        "device": "a device",
        "cpu_count": 2,
        "python": "3",
        "loop": "asyncio",
        "asyncfence": "0",
        "quick": False,
        "default_executor_workers": 6,
        "left_out": {},
        "config": dataclasses.asdict(BenchConfig()),
        "date": "2026-12-03",
        **changes,
    }


def _under_the_floor() -> Results:
    """Beside a CPU-bound thread, busy polling's p99 is far above every contender's."""
    results = Results(meta=_meta(device_row=True))
    ms = 1e-3
    results.latency["wake_cpu_thread"] = {
        SLEEP_0: [0.015 * ms] * 98 + [13.4 * ms] * 2,
        AUTO: [0.037 * ms] * 98 + [0.09 * ms] * 2,
        TO_THREAD: [0.08 * ms] * 98 + [10.3 * ms] * 2,
        DEVICE_FINISH: [0.013 * ms] * 100,
    }
    results.latency["out_of_order_park"] = {AUTO: [0.1 * ms], TO_THREAD: [0.3 * ms]}
    return results


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "rich"])
def test_a_contender_under_the_floor_shows_no_negative_overhead(
    capsys: pytest.CaptureFixture[str], plain: bool
) -> None:
    results = _under_the_floor()
    summary = summarize(results)
    # The JSON keeps the signed difference; the tables must not print it.
    assert summary["wake_cpu_thread"][AUTO]["p99_over_floor_us"] == pytest.approx(90 - 13_400)
    render(results.meta, summary, plain=plain)
    out = capsys.readouterr().out
    assert not re.search(NEGATIVE, out), out  # no negative number anywhere
    row = next(line for line in out.splitlines() if line.lstrip("│ ").startswith(AUTO))
    assert "+22" in row  # its p50: 37 µs against the floor's 15
    assert BELOW_FLOOR in row  # its p99
    floor_row = next(line for line in out.splitlines() if line.lstrip("│ ").startswith(SLEEP_0))
    assert floor_row.count("floor") == 2  # its own two overhead cells
    text = " ".join(out.split())  # the notes, as one would read them, unwrapped
    assert "over floor: µs above the sleep(0) loop's p50 (or p99) in this run" in text
    assert f"{BELOW_FLOOR}: under the sleep(0) loop's figure at that percentile" in text
    # Both latency tables say lower is better; the out-of-order one has no floor to be above.
    assert text.count("lower is better") >= 4  # in each title and each table's notes
    out_of_order = text[text.index("out-of-order parking") :]
    assert "over floor" not in out_of_order


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "rich"])
def test_the_heading_ends_no_line_on_a_separator(
    capsys: pytest.CaptureFixture[str], plain: bool
) -> None:
    # A device name as long as PoCL's: the heading used to wrap after a "|".
    device = "pthread-Intel(R) Xeon(R) Platinum 8480+ Processor (Portable Computing Language)"
    meta = _meta(device=device, wake_path="native", cuda_signal="v2")
    render(meta, {}, plain=plain)
    lines = capsys.readouterr().out.splitlines()
    assert f"asyncfence bench on opencl: {device}" in lines  # whole, on its own line
    assert "2 cores | Python 3 | asyncio | asyncfence 0" in lines
    assert "to_thread's default executor: 6 threads | wake path: native | CUDA signal: v2" in lines
    for line in lines:
        assert not line.rstrip().endswith("|"), line
        assert not line.lstrip().startswith("|"), line


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "rich"])
def test_a_quick_run_says_its_figures_are_not_to_quote(
    capsys: pytest.CaptureFixture[str], plain: bool
) -> None:
    config = dataclasses.asdict(BenchConfig.smoke())
    results = _under_the_floor()
    render(_meta(quick=True, config=config), summarize(results), plain=plain)
    out = " ".join(capsys.readouterr().out.split())
    note = (
        f"QUICK RUN: a smoke run with few samples ({config['wake_trials']} trials per "
        "contender of one waiter's wake latency), too few for figures to quote"
    )
    assert out.count(note) == 2  # above the tables and below them
    render(_meta(), summarize(results), plain=plain)
    assert "QUICK RUN" not in capsys.readouterr().out  # a full run says nothing of the kind


def test_a_report_read_back_gives_the_samples_it_was_made_from() -> None:
    results = Results(meta=_meta())
    results.latency["wake_saturated_loop"] = {AUTO: [1e-3, 2e-3], TO_THREAD: [3e-3, math.inf]}
    results.throughput = {AUTO: {1: [10.0], 64: [20.0, 30.0]}}
    report = json.loads(json.dumps(build_report(results), allow_nan=False))
    again = results_from_report(report)
    assert again.latency == results.latency  # the timeout is infinite again
    assert again.throughput == results.throughput
    assert again.meta == json.loads(json.dumps(results.meta))  # as JSON keeps it


def test_the_plot_draws_what_a_run_has_and_says_what_it_has_not(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = _under_the_floor()  # no unloaded wake latency, no saturated loop, no throughput
    path = tmp_path / "partial.png"
    plot(results, _meta(quick=True), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results.latency["wake_latency"] = results.latency.pop("wake_cpu_thread")
    results.latency["wake_saturated_loop"] = {AUTO: [5e-3, 6e-3], TO_THREAD: [math.inf]}
    results.throughput = {AUTO: {1: [10.0]}, TO_THREAD: {1: [5.0]}}
    path = tmp_path / "whole.svg"
    plot(results, _meta(), str(path))
    drawn = path.read_text()
    assert "1 of 1 timed out" in drawn  # to_thread's row on the saturated loop says so
    assert "lower is better" in drawn
    assert "higher is better" in drawn


# -- probe and incremental report, in this process -------------------------------------------


async def _hangs(token: Any) -> None:
    await asyncio.Event().wait()


async def _raises(token: Any) -> None:
    raise AttributeError("'CUstream' object has no attribute 'value'")


def test_a_contender_whose_probe_fails_is_left_out_with_the_reason() -> None:
    from asyncfence.testing import open_default_device

    target = make_target(open_default_device("opencl"))
    found = contenders(target)
    broken = Contender("broken", target.raw_record, _raises)
    stuck = Contender("stuck", target.raw_record, _hangs)

    async def probe() -> tuple[list[Contender], dict[str, str]]:
        return await probe_contenders(target, [*found, broken, stuck], 0.2, quiet=True)

    try:
        admitted, left_out = asyncio.run(probe())
    finally:
        target.close()
    assert [c.name for c in admitted] == EVERYONE
    assert left_out == {
        "broken": "AttributeError: 'CUstream' object has no attribute 'value'",
        "stuck": "its probe did not finish within 0.2 s",
    }


# -- the device's own row ------------------------------------------------------------------


@pytest.fixture
def stamped_device() -> Iterator[Any]:
    """A device of its own (stamping changes every queue it makes from then on)."""
    from asyncfence._backends.opencl._lab import OpenCLLab

    device = OpenCLLab().open_device()
    try:
        yield device
    finally:
        device.close()


def test_pocl_stamps_a_marker_done_between_its_release_and_the_end_of_the_wait(
    stamped_device: Any,
) -> None:
    from asyncfence.testing import StreamGate

    unstamped = stamped_device.new_stream()
    stamped = stamped_device.stamp_streams()
    if "Portable Computing Language" in stamped_device.name:
        assert stamped  # PoCL stamps on CLOCK_MONOTONIC_RAW
    elif not stamped:
        pytest.skip(f"{stamped_device.name} stamps on none of the host clocks tried")
    stream = stamped_device.new_stream()
    for _ in range(5):
        gate = StreamGate(stream)
        marker = stamped_device.raw_record(stream)
        released = time.perf_counter()
        gate.release()
        stamped_device.raw_block(marker)
        returned = time.perf_counter()
        finished = stamped_device.raw_finished_at(marker)
        assert finished is not None
        assert released <= finished <= returned  # on perf_counter's clock, so ordered
    # A queue made before stamping has no stamps to read.
    old = stamped_device.raw_record(unstamped)
    stamped_device.raw_block(old)
    assert stamped_device.raw_finished_at(old) is None


def test_stamps_on_a_clock_other_than_the_ones_tried_give_no_row(
    stamped_device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncfence._backends.opencl import _lab

    # PoCL stamps on CLOCK_MONOTONIC_RAW; the wall clock is never within microseconds of it.
    monkeypatch.setattr(_lab, "_STAMP_CLOCKS", ("CLOCK_REALTIME",))
    assert not stamped_device.stamp_streams()
    stream = stamped_device.new_stream()
    marker = stamped_device.raw_record(stream)
    stamped_device.raw_block(marker)
    assert stamped_device.raw_finished_at(marker) is None
    assert device_finish_row(make_target(stamped_device)) is None


def test_a_device_without_host_clock_stamps_has_no_row() -> None:
    from asyncfence.testing import Device

    device = Device()
    assert not device.stamp_streams()
    assert device.raw_finished_at(object()) is None
    target = make_target(device)
    assert not target.stamped
    assert device_finish_row(target) is None


def test_the_device_row_runs_to_the_stamp_and_a_missing_one_counts_as_a_timeout(
    stamped_device: Any,
) -> None:
    target = make_target(stamped_device)
    row = device_finish_row(target)
    assert row is not None
    assert row.name == DEVICE_FINISH
    stamps = {"stamped": 1.5, "unstamped": None}
    row = dataclasses.replace(row, finished_at=stamps.__getitem__)
    assert row.latency_end("stamped", resumed=2.0) == 1.5
    assert row.latency_end("unstamped", resumed=2.0) == math.inf
    assert row.latency_end("stamped", resumed=math.inf) == math.inf  # the wait itself timed out
    waiting = next(c for c in contenders(target) if c.name == AUTO)
    assert waiting.latency_end("anything", resumed=2.0) == 2.0


def stamp_every_device_row(
    monkeypatch: pytest.MonkeyPatch, finished_at: Callable[[Any], float | None]
) -> None:
    """Make the runs' device rows read their stamps from ``finished_at``."""

    def stamped(target: Any) -> Contender:
        row = device_finish_row(target)
        assert row is not None
        return dataclasses.replace(row, finished_at=finished_at)

    monkeypatch.setattr(runner, "device_finish_row", stamped)


def test_every_latency_scenario_times_the_device_row_to_its_stamp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stamp_every_device_row(monkeypatch, lambda token: 0.0)
    timed = [key for key in LATENCY if key != "out_of_order_park"]
    report = runner.run_bench(device="opencl", config=ON_EACH_LOOP, scenarios=timed, quiet=True)
    for key in timed:
        samples = report["samples"][f"{key}_s"]
        assert list(samples) == TIMED, key
        # From each release's stamp (perf_counter's, so positive) to the zero stamp.
        assert samples[DEVICE_FINISH], key
        assert all(value is not None and value < 0 for value in samples[DEVICE_FINISH]), key
        assert all(value > 0 for value in samples[AUTO] if value is not None), key


def test_a_device_row_without_stamps_is_left_out_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stamp_every_device_row(monkeypatch, lambda token: None)
    report = runner.run_bench(device="opencl", config=TINY, scenarios=["wake_latency"], quiet=True)
    meta = report["meta"]
    assert meta["device_row"] is False
    assert meta["left_out"] == {DEVICE_FINISH: "the device gave no stamp of its finish"}
    assert list(report["summary"]["wake_latency"]) == EVERYONE


def test_a_run_without_latency_scenarios_has_no_device_row() -> None:
    report = runner.run_bench(device="opencl", config=TINY, scenarios=["throughput"], quiet=True)
    assert report["meta"]["device_row"] is False
    assert report["meta"]["left_out"] == {}


def test_the_device_row_is_listed_last_with_no_overhead_above_the_floor() -> None:
    us = 1e-6
    results = Results(meta={"device_row": True})
    results.latency["wake_latency"] = {
        DEVICE_FINISH: [30 * us],
        SLEEP_0: [50 * us],
        TO_THREAD: [300 * us],
    }
    summary = summarize(results)
    assert list(summary["wake_latency"]) == [TO_THREAD, SLEEP_0, DEVICE_FINISH]
    device = summary["wake_latency"][DEVICE_FINISH]
    assert device["p50_vs_to_thread"] == pytest.approx(0.1)
    assert device["p50_over_floor_us"] is None
    assert device["p99_over_floor_us"] is None
    assert summary["wake_latency"][TO_THREAD]["p50_over_floor_us"] == pytest.approx(250)


@pytest.fixture
def with_broken_contender(monkeypatch: pytest.MonkeyPatch) -> None:
    def more(target: Any) -> list[Contender]:
        return [*contenders(target), Contender("numba async_done", target.raw_record, _raises)]

    monkeypatch.setattr(runner, "contenders", more)


@pytest.mark.usefixtures("with_broken_contender")
def test_a_run_leaves_out_a_contender_that_cannot_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bench.json"
    report = runner.run_bench(
        device="opencl", json_path=str(path), config=TINY, scenarios=["wake_latency"]
    )
    written = json.loads(path.read_text())
    assert written["meta"]["left_out"] == {
        "numba async_done": "AttributeError: 'CUstream' object has no attribute 'value'"
    }
    assert written["meta"]["contenders"] == EVERYONE
    assert list(written["summary"]["wake_latency"]) == TIMED
    assert report["meta"]["left_out"] == written["meta"]["left_out"]
    captured = capsys.readouterr()
    assert "left out numba async_done: AttributeError" in captured.err  # at once
    assert "left out numba async_done: AttributeError" in captured.out  # and in the report


def test_the_report_keeps_what_was_measured_when_a_later_scenario_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def boom(ctx: Any) -> None:
        raise RuntimeError("the device fell over")

    failing = runner.Scenario("boom", "a scenario that fails", boom, lambda c, n: 0.0)
    monkeypatch.setattr(runner, "SCENARIOS", [*runner.SCENARIOS, failing])
    path = tmp_path / "bench.json"
    with pytest.raises(RuntimeError, match="fell over"):
        runner.run_bench(
            device="opencl",
            json_path=str(path),
            config=TINY,
            scenarios=["wake_latency", "boom"],
            quiet=True,
        )
    written = json.loads(path.read_text())
    assert written["meta"]["completed"] == ["wake_latency"]
    assert written["meta"]["scenarios"] == ["wake_latency", "boom"]
    assert "boom raised RuntimeError: the device fell over" in written["meta"]["incomplete"]
    assert list(written["summary"]) == ["wake_latency"]
    for figures in written["summary"]["wake_latency"].values():
        assert figures["trials"] == TINY.wake_trials
    assert written["samples"]["wake_latency_s"][AUTO]


@pytest.mark.parametrize("loop", ["uvloop", "trio"])
def test_every_scenario_runs_on_uvloop_and_trio(loop: str, tmp_path: Path) -> None:
    pytest.importorskip(loop)
    path = tmp_path / "bench.json"
    report = runner.run_bench(
        device="opencl", loop=loop, json_path=str(path), config=ON_EACH_LOOP, quiet=True
    )
    meta = report["meta"]
    assert meta["loop"] == loop
    assert meta["completed"] == meta["scenarios"]
    assert meta["contenders"] == EVERYONE
    assert meta["device_row"] is True
    # to_thread runs on trio's default limiter of 40 threads, on asyncio's default executor.
    assert meta["default_executor_workers"] == (
        40 if loop == "trio" else default_executor_workers()
    )
    assert meta["wake_path"] in ("native", "polling")
    check_every_scenario(
        report["summary"],
        EVERYONE,
        device_row=True,
        thread_pool=meta["default_executor_workers"],
        parked_queues=ON_EACH_LOOP.parked_queues,
    )
    assert json.loads(path.read_text())["meta"]["loop"] == loop


def test_an_unknown_loop_is_refused_and_a_missing_one_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="loop must be 'asyncio', 'uvloop' or 'trio', not 'curio'"):
        runner.run_bench(device="opencl", loop="curio")
    monkeypatch.setitem(sys.modules, "trio", None)  # import trio fails
    with pytest.raises(SystemExit, match="--loop trio needs trio: pip install trio"):
        runner.run_bench(device="opencl", loop="trio")


def test_progress_draws_a_bar_that_the_scenario_moves_and_a_line_per_scenario() -> None:
    import io

    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    progress = runner.Progress([1.0, 2.0], quiet=False, console=console)
    progress.start("asyncfence bench: 2 scenarios")
    advance = progress.begin("the first")
    advance(0.5)
    drawn = out.getvalue()
    assert "[1/2] the first" in drawn
    assert "50%" in drawn  # the scenario's own word on how far it is
    progress.step("the first", 1.0)
    progress.begin("the second")(1.0)
    progress.step("the second", 2.0)
    progress.stop()
    text = out.getvalue()
    assert "asyncfence bench: 2 scenarios: about 3 s (estimate)" in text
    assert "[1/2] the first: 1.0 s; ~2 s left" in text
    assert "[2/2] the second: 2.0 s; done" in text


def test_quiet_progress_says_nothing() -> None:
    import io

    from rich.console import Console

    out = io.StringIO()
    progress = runner.Progress([1.0], quiet=True, console=Console(file=out, force_terminal=True))
    progress.start("asyncfence bench")
    progress.begin("the one")(0.5)
    progress.step("the one", 1.0)
    progress.stop()
    assert out.getvalue() == ""


def test_an_unknown_scenario_is_refused() -> None:
    with pytest.raises(ValueError, match="no such scenarios: nope"):
        runner.run_bench(device="opencl", scenarios=["nope"])


def test_plot_without_matplotlib_fails_before_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(backend: str | None = None) -> None:
        raise AssertionError("measured before checking for matplotlib")

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    monkeypatch.setattr(runner, "open_default_device", never)
    with pytest.raises(SystemExit, match="--plot needs matplotlib"):
        runner.run_bench(device="opencl", plot_path="never.png")


# -- the command line ------------------------------------------------------------------------


def test_bench_help_names_every_scenario_and_how_long(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncfence.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["bench", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out
    assert "A full run takes about" in out
    assert out.startswith("usage: python -m asyncfence bench ")  # the command as typed
    for scenario in runner.SCENARIOS:
        assert scenario.key in out


@pytest.mark.parametrize(
    ("option", "path", "why"),
    [
        ("--plot", "{tmp}/no/such/folder/bench.png", "no such directory"),
        ("--plot", "{tmp}", "it is a directory"),
        ("--plot", "{tmp}/bench.xyz", "matplotlib cannot write .xyz files"),
        ("--json", "{tmp}/no/such/folder/bench.json", "no such directory"),
    ],
)
def test_an_output_that_cannot_be_written_fails_in_one_line_before_measuring(
    tmp_path: Path, option: str, path: str, why: str
) -> None:
    pytest.importorskip("matplotlib")
    target = path.format(tmp=tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "asyncfence", "bench", option, target],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stdout == ""  # nothing was measured: a run prints its plan first
    assert result.stderr.splitlines() == [
        f"python -m asyncfence bench: cannot write {option} {target}: {why}"
        + result.stderr.partition(why)[2].rstrip("\n")
    ]


def test_the_library_does_not_import_its_lab() -> None:
    code = (
        "import sys, asyncfence, asyncfence.testing, asyncfence.pytest_plugin\n"
        "assert not [m for m in sys.modules if m.partition('.')[0] == 'benchmarks']"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_bench_outside_a_checkout_says_where_it_lives(tmp_path: Path) -> None:
    # An installed copy (not this checkout's editable one) run elsewhere: simulated
    # by pointing the package at a folder with no benchmarks/ beside it.
    code = (
        "import sys, pathlib, asyncfence.__main__ as cli\n"
        "cli.__file__ = str(pathlib.Path.cwd() / 'site' / 'asyncfence' / '__main__.py')\n"
        "sys.exit(cli.main(['bench', '--quick']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert result.returncode == 2
    assert "not part of the installed package" in result.stderr
    assert "from a checkout" in result.stderr


@pytest.mark.skipif(
    os.path.exists("/dev/nvidiactl"), reason="a real NVIDIA driver is installed here"
)
def test_bench_on_cuda_without_a_driver_ends_in_one_line() -> None:
    # A plain subprocess has no CUDA driver here: the emulated one is loaded only
    # where LD_LIBRARY_PATH points at it (the driver_env fixture), and it is left out.
    env = {key: value for key, value in os.environ.items() if key != "LD_LIBRARY_PATH"}
    result = subprocess.run(
        [sys.executable, "-m", "asyncfence", "bench", "--quick", "--device", "cuda"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "ASYNCFENCE_CUDA_DRIVER": "none"},
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == ""  # nothing was measured, so no tables
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("bench --device cuda: no CUDA device: "), lines[0]
    assert "libcuda.so.1" in lines[0]  # the cause, named


def test_the_demo_succeeds_on_opencl(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncfence._demo import demo

    assert asyncio.run(demo("opencl")) == 0
    out = capsys.readouterr().out
    assert "3 of 3 waiters got DeviceError" in out
    assert "wake through the" in out


def test_the_demo_succeeds_on_cuda(capsys: pytest.CaptureFixture[str], cuda_mode: str) -> None:
    from asyncfence._demo import demo

    assert asyncio.run(demo("cuda")) == 0
    out = capsys.readouterr().out
    assert "asyncfence demo on cuda" in out
    assert "3. (skipped: a CUDA stream cannot be failed from the host" in out


# -- whole quick runs, as CI and the GPU check do them ------------------------------------------


def check_cross_process(figures: dict[str, Any]) -> None:
    """The ways to resume across processes, each measured, as multiples of polling's p50."""
    assert list(figures) == list(CROSS_PROCESS_CONTENDERS)
    for name, f in figures.items():
        assert f["trials"] == BenchConfig.smoke().cross_process_trials, name
        present = [v for v in (f["p50_us"], f["p99_us"], f["max_us"]) if v is not None]
        assert present == sorted(present), (name, f)
        assert all(v > 0 for v in present), (name, f)
    polled = figures[POLLED_10MS]
    if polled["p50_us"] is not None:
        assert polled["p50_vs_polled"] == 1.0
        for f in figures.values():
            if f["p50_us"] is not None:
                assert f["p50_vs_polled"] == pytest.approx(f["p50_us"] / polled["p50_us"])


def check_wait_sync(summary: dict[str, Any]) -> None:
    """A thread's synchronous wait beside the runtime's own: measured, and idle while blocked."""
    figures = summary["wait_sync"]
    assert sorted(figures) == sorted([WAIT_SYNC, RUNTIME_BLOCKING])
    for name, f in figures.items():
        assert f["trials"] == BenchConfig.smoke().wait_sync_trials, name
        assert f["timeouts"] == 0, name
        assert 0 < f["p50_us"] <= f["p99_us"] <= f["max_us"], name
    assert figures[RUNTIME_BLOCKING]["p50_vs_runtime"] == 1.0
    cpu = summary["wait_sync_cpu"]
    assert sorted(cpu) == sorted([WAIT_SYNC, RUNTIME_BLOCKING])
    assert all(0 <= f["cpu_per_wall"] < 1 for f in cpu.values())


def check_relay(summary: dict[str, Any]) -> None:
    """A failure crossed every trial, as fast as a local waiter; each flood was answered."""
    failure = summary["failure_cross_process"]
    assert sorted(failure) == sorted([LOCAL_WAITER, IMPORT_IDLE, IMPORT_AWAITED])
    for name, f in failure.items():
        assert f["trials"] == BenchConfig.smoke().relay_failure_trials, name
        assert f["timeouts"] == 0, name
        assert 0 < f["p50_us"] <= f["p99_us"] <= f["max_us"], name
        assert f["p50_vs_local_waiter"] == pytest.approx(
            f["p50_us"] / failure[LOCAL_WAITER]["p50_us"]
        )
    floods = summary["relay_floods"]
    connections = BenchConfig.smoke().relay_flood_connections
    assert next(iter(floods)) == "no flood"
    assert f"{connections:,} garbage requests" in floods
    assert f"{connections:,} idle connections, this user" in floods
    for name, f in floods.items():
        assert f["import_us"] is not None, name  # the owner's import completed
        assert 0 <= f["lag_p99_ms"] <= f["lag_max_ms"], name
        assert f["beats"] > 0, name
        if name == "no flood":
            assert f["answered"] is None
        elif "idle connections, this user" in name:
            # Past 64 waiting for a request, the oldest are cut off.
            assert f["answered"] >= connections - 64, name
        else:  # refused at accept (another user), or a garbage request refused
            assert f["answered"] == connections, name


def check_every_scenario(
    summary: dict[str, Any],
    names: list[str],
    *,
    device_row: bool,
    thread_pool: int | None = None,
    parked_queues: int = BenchConfig.smoke().parked_queues,
) -> None:
    """Every figure of a quick run, sane; ``to_thread`` used at most ``thread_pool`` threads.

    The device's own row, where it has one, is in the latency scenarios but
    the out-of-order one (only the contenders that park are there), and in
    no other: it is not a way to wait.

    asyncio's ``to_thread`` starts from a fresh default executor, so it starts
    at least one thread; trio's keeps idle threads for a while and may need none.
    """
    check_cross_process(summary["wake_cross_process"])
    for key in LATENCY:
        parks = (AUTO, PARK, POLL, TO_THREAD)
        expected = [n for n in names if key != "out_of_order_park" or n in parks]
        if device_row and key != "out_of_order_park":
            expected.append(DEVICE_FINISH)
        figures = summary[key]
        assert list(figures) == expected, key
        for name, f in figures.items():
            assert f["trials"] > 0
            assert 0 <= f["timeouts"] <= f["trials"]
            values = [f["p50_us"], f["p99_us"], f["max_us"]]
            assert all(v is None or v >= 0 for v in values), (key, name, f)
            present = [v for v in values if v is not None]
            assert present == sorted(present), (key, name, f)
            if key != "out_of_order_park":
                assert f["p50_over_floor_us"] is None or isinstance(f["p50_over_floor_us"], float)
        if key != "out_of_order_park":
            floor = figures[SLEEP_0]
            if floor["p50_us"] is None:  # the floor itself timed out (a loaded machine)
                assert all(f["p50_over_floor_us"] is None for f in figures.values())
                continue
            assert floor["p50_over_floor_us"] == 0
            assert floor["p99_over_floor_us"] in (0, None)
            for name, f in figures.items():
                if name == DEVICE_FINISH:  # under the floor by its nature: no overhead
                    assert f["p50_over_floor_us"] is None
                    assert f["p99_over_floor_us"] is None
                elif f["p50_us"] is not None:
                    assert f["p50_over_floor_us"] == pytest.approx(f["p50_us"] - floor["p50_us"])
    assert 0 <= summary["wake_cpu_thread"][AUTO]["late_share"] <= 1
    for key in ("cpu_while_parked", "cpu_while_waiting"):
        assert list(summary[key]) == names
        assert all(f["cpu_per_wall"] >= 0 for f in summary[key].values())
    parked = summary["parked_queues"]
    assert list(parked) == names
    for f in parked.values():
        assert f["queues"] == parked_queues
        assert f["python_threads_delta"] >= 0
        assert f["python_heap_mb"] >= 0
    least = 0 if thread_pool is not None else 1
    most = default_executor_workers() if thread_pool is None else thread_pool
    assert least <= parked[TO_THREAD]["python_threads_delta"] <= most
    rates = summary["throughput"]
    assert list(rates) == names
    for f in rates.values():
        assert f["1_tasks_per_s"] > 0
        assert len([k for k in f if k.endswith("_per_s")]) == 2
    assert list(summary["scale"]) == names
    for per in summary["scale"].values():
        assert set(per) == {"10", "1000"}
        assert all(figures["lag_p99_s"] >= 0 for figures in per.values())
    assert summary["scale"][POLL]["10"]["tick_mean_s"] > 0
    heap = summary["heap_per_wait"]
    assert list(heap) == [FLOOR_PER_WAIT, FENCE_PER_WAIT, "the fence's share"]
    assert heap[FLOOR_PER_WAIT] > 0
    assert heap[FENCE_PER_WAIT] > 0
    assert heap["the fence's share"] == pytest.approx(heap[FENCE_PER_WAIT] - heap[FLOOR_PER_WAIT])
    if device_row:  # OpenCL: its out-of-order queues, beside in-order ones; and the scale
        smoke = BenchConfig.smoke()
        at_scale = summary["parked_at_scale"]
        assert list(at_scale) == [str(size) for size in smoke.scaling_sizes]
        for size, figures in at_scale.items():
            assert figures["queues"] == int(size)
            assert figures["wakes"] == smoke.scaling_released * smoke.scaling_rounds
            assert 0 < figures["wake_p50_s"] <= figures["wake_p99_s"] < math.inf
            assert 0 <= figures["lag_p99_s"] <= figures["lag_max_s"]
            # The runtime alone, beside it: the same gates, no fence.
            assert 0 <= figures["alone_lag_p99_s"] <= figures["alone_lag_max_s"]
            assert figures["queries_per_wake"] >= 1  # each woken fence asked at least once
        one_by_one = summary["parked_one_by_one"]
        for kind in ("in-order", "out-of-order"):
            figures = one_by_one[kind]
            assert figures["fences"] == BenchConfig.smoke().one_by_one_fences
            assert figures["loop_cpu_s"] > 0
            assert figures["wall_s"] > 0
            assert figures["queries_per_fence"] >= 1  # each fence asked at least once
            assert figures["signals_per_fence"] > 0  # parked: woken by their signals
            assert figures["runtime_alone_wall_s"] > 0  # the runtime's own row beside it
        assert one_by_one["out-of-order vs in-order"]["loop_cpu"] > 0
        assert one_by_one["out-of-order vs in-order"]["queries"] > 0
    else:
        assert "parked_one_by_one" not in summary
        assert "parked_at_scale" not in summary


def test_quick_bench_reports_every_scenario_for_every_contender(tmp_path: Path) -> None:
    report_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    result = run_quick_bench(
        "opencl",
        "--json",
        str(report_path),
        "--plot",
        str(plot_path),
        env={"ASYNCFENCE_CUDA_DRIVER": "none"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    meta, summary = report["meta"], report["summary"]
    assert meta["backend"] == "opencl"
    assert meta["cpu_count"] >= 1
    assert meta["default_executor_workers"] == default_executor_workers()
    assert meta["contenders"] == EVERYONE
    assert meta["device_row"] is True
    assert meta["left_out"] == {}
    assert meta["completed"] == meta["scenarios"]
    assert "incomplete" not in meta
    assert "signal_hold" not in meta["scenarios"]  # a CUDA-only scenario
    check_every_scenario(summary, EVERYONE, device_row=True)
    drop = summary["drop_queue"]
    ours, lazy = drop["asyncfence DropQueue"], drop["lazy pool (free at next alloc)"]
    assert ours["objects"] == lazy["objects"] == 10_000
    # Work on 15 of 16 streams completed: the drop queue released all of it; a
    # lazy FIFO pool is stuck behind the first object, on the stuck stream.
    assert ours["released_with_one_stream_stuck"] == 10_000 - 10_000 // 16
    assert lazy["released_with_one_stream_stuck"] == 0
    for figures in (ours, lazy):
        assert figures["defer_us"] > 0
        assert figures["bytes_per_pending_object"] > 0
        assert 0 < figures["release_latency_p50_us"] <= figures["release_latency_p99_us"]
    for table in ("saturated loop", "CPU-bound", "out-of-order", "parked waits", "throughput"):
        assert table in result.stdout
    assert "device finished: the instant the device stamped" in result.stdout
    assert "1 task" in result.stdout
    assert "1 tasks" not in result.stdout
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote the plot to {plot_path.resolve()}" in result.stdout
    assert f"wrote the report (JSON) to {report_path.resolve()}" in result.stdout
    assert "QUICK RUN: a smoke run with few samples" in result.stdout
    latency_tables = [
        block for block in result.stdout.split("\n\n") if block.startswith("wake latency, µs")
    ]
    # And the two across processes (the wake, and a failure), and a thread's.
    assert len(latency_tables) == len(LATENCY) + 3
    check_relay(summary)
    check_wait_sync(summary)
    assert "the exporting loop beside floods of its relay" in result.stdout
    for block in latency_tables:
        assert not re.search(NEGATIVE, block), block
    # The same plot, drawn again from the report alone.
    from benchmarks.__main__ import main as lab_main

    again = tmp_path / "again.png"
    assert lab_main(["plot", str(report_path), str(again)]) == 0
    assert again.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"[1/{len(meta['scenarios'])}]" in result.stderr  # progress
    assert "left" in result.stderr
    assert "(estimate)" in result.stderr


@pytest.mark.parametrize(("version", "path"), [("13000", "v1"), ("13020", "v2")])
def test_quick_bench_on_the_emulated_cuda_driver(
    tmp_path: Path, cuda_mode: str, version: str, path: str
) -> None:
    if cuda_mode != "emulated":
        pytest.skip("the GPU check runs the CUDA benchmark on a real driver")
    from .cuda_emulator import build

    report_path = tmp_path / "bench.json"
    result = run_quick_bench(
        "cuda",
        "--json",
        str(report_path),
        "--quiet",
        env={
            "LD_LIBRARY_PATH": str(build().parent),
            "ASYNCFENCE_EMULATED_DRIVER_VERSION": version,
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    meta = report["meta"]
    assert meta["backend"] == "cuda"
    assert meta["device"] == "asyncfence emulated device 0"
    assert meta["cuda_signal"] == path
    assert meta["completed"] == meta["scenarios"]
    names = [n for n in CONTENDER_ORDER if n in meta["contenders"]]
    assert names == meta["contenders"]
    assert set(EVERYONE) <= set(names)
    assert meta["device_row"] is False  # CUDA events have no host-clock stamps
    check_every_scenario(report["summary"], names, device_row=False)
    hold = report["summary"]["signal_hold"]
    assert set(hold) == {native_label(path), PYTHON_CALLBACK}
    for figures in hold.values():
        assert 0 <= figures["p50_us"] <= figures["max_us"]
    assert "holds its stream" in result.stdout


# -- the wake-cost lab script (benchmarks/wake_cost.py) ---------------------------------


def _wake_cost(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.wake_cost", *arguments],
        capture_output=True,
        text=True,
        env={**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"},
        timeout=600,
        check=False,
    )


def test_wake_cost_traces_more_memory_per_parked_wait_than_per_plain_one() -> None:
    result = _wake_cost("memory", "--fences", "50")
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout)
    assert figures["loop"] == "asyncio"
    # A parked wait is a waiting task and more: its fence, its registration.
    assert 0 < figures["plain_wait_bytes"] < figures["parked_fence_bytes"]
    assert figures["plain_wait_bytes"] < figures["awaited_fence_bytes"]


def test_wake_cost_counts_the_instructions_of_a_parked_and_of_the_barest_wake(
    tmp_path: Path,
) -> None:
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed")
    if os.environ.get("ASYNCFENCE_CALLGRIND") != "1":
        # Two Python start-ups under valgrind take a minute: asked for only.
        pytest.skip("a minute under callgrind: set ASYNCFENCE_CALLGRIND=1 to run it")
    report_path = tmp_path / "cost.json"
    result = _wake_cost("instructions", "--cycles", "5", "--json", str(report_path))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    park, bare = report["park"]["per_cycle"], report["bare"]["per_cycle"]
    assert 0 < bare < park  # the barest wake does less than asyncfence's
    assert 0 < bare < report["await"]["per_cycle"]
    assert f"park {park / 1e3:,.1f}k instructions per cycle" in result.stdout
