"""The benchmark: a quick run reports every scenario for every contender."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncfence._bench import TO_THREAD, Results, percentile, summarize

ROOT = Path(__file__).resolve().parent.parent


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


def test_percentile_is_nearest_rank() -> None:
    samples = [float(v) for v in range(1, 101)]
    assert percentile(samples, 0.5) == 50.0
    assert percentile(samples, 0.99) == 99.0
    assert percentile(samples, 1.0) == 100.0
    assert percentile([3.0], 0.99) == 3.0
    assert math.isnan(percentile([], 0.5))


def test_summary_takes_ratios_within_the_run() -> None:
    results = Results(meta={})
    results.wake = {TO_THREAD: [100e-6, 100e-6, 100e-6], "fast": [50e-6, 50e-6, 50e-6]}
    results.cpu = {"sleep(0) loop": [1.0], "fast": [0.01]}
    results.throughput = {
        TO_THREAD: {1: [1000.0], 64: [2000.0]},
        "fast": {1: [3000.0], 64: [8000.0]},
    }
    summary = summarize(results)
    assert summary["wake_latency"]["fast"]["p50_vs_to_thread"] == pytest.approx(0.5)
    assert summary["cpu_while_waiting"]["fast"]["vs_busy_poll"] == pytest.approx(0.01)
    assert summary["throughput"]["fast"]["1_tasks_vs_to_thread"] == pytest.approx(3.0)
    assert summary["throughput"]["fast"]["64_tasks_vs_to_thread"] == pytest.approx(4.0)


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
    contenders = meta["contenders"]
    strategies = {"asyncfence auto", "asyncfence poll", "asyncfence park"}
    assert strategies | {TO_THREAD, "sleep(1ms) loop", "sleep(0) loop"} <= set(contenders)
    for name in contenders:
        for scenario in ("wake_latency", "wake_latency_short_work"):
            wake = summary[scenario][name]
            assert 0 < wake["p50_us"] <= wake["p99_us"] <= wake["max_us"]
        assert summary["cpu_while_waiting"][name]["cpu_per_wall"] >= 0
        rates = summary["throughput"][name]
        assert rates["1_tasks_per_s"] > 0
        assert len([k for k in rates if k.endswith("_per_s")]) == 2
        assert set(summary["scale"][name]) == {"10", "1000"}
        for figures in summary["scale"][name].values():
            assert figures["lag_p99_s"] >= 0
    assert summary["scale"]["asyncfence poll"]["10"]["tick_mean_s"] > 0
    assert summary["wake_latency"][TO_THREAD]["p50_vs_to_thread"] == pytest.approx(1.0)
    for table in ("wake latency", "short work", "CPU while waiting", "throughput", "scale"):
        assert table in result.stdout
    assert summary["signal_hold"] == {}  # a CUDA-only scenario
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
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[1/" in result.stderr  # progress


def test_quick_bench_on_the_emulated_cuda_driver(tmp_path: Path, cuda_mode: str) -> None:
    if cuda_mode != "emulated":
        pytest.skip("the GPU check runs the CUDA benchmark on a real driver")
    from .cuda_emulator import build

    report_path = tmp_path / "bench.json"
    result = run_quick_bench(
        "cuda",
        "--json",
        str(report_path),
        "--quiet",
        env={"LD_LIBRARY_PATH": str(build().parent)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["meta"]["backend"] == "cuda"
    assert report["meta"]["device"] == "asyncfence emulated device 0"
    hold = report["summary"]["signal_hold"]
    assert set(hold) == {
        "asyncfence: native host function (shim), cuLaunchHostFunc v2",
        "Python callback: cuLaunchHostFunc",
    }
    for figures in hold.values():
        assert 0 <= figures["p50_us"] <= figures["max_us"]
    assert "holds its stream" in result.stdout
