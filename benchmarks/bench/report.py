"""From samples to figures, tables, JSON and a plot.

:func:`summarize` turns the samples into the figures the tables and the JSON
show: percentiles, the overhead above the busy-poll floor (the ``sleep(0)
loop`` of the same scenario, in the same run), and ratios to ``to_thread``
or to busy polling. Only scenarios that ran appear, so a report written after
each scenario is complete as far as it goes.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import asyncfence

from ..measure import percentile, plural
from .base import (
    DEVICE_FINISH,
    LATE_AFTER_S,
    SLEEP_0,
    TO_THREAD,
    BenchConfig,
    Results,
    ordered,
    thread_pool_size,
)

if TYPE_CHECKING:
    from asyncfence.testing import Device

__all__ = [
    "LATENCY_SCENARIOS",
    "build_report",
    "describe",
    "latency_figures",
    "plot",
    "render",
    "require_matplotlib",
    "summarize",
    "tables",
    "write_json",
]

#: The latency scenarios, in report order, and what their tables say.
LATENCY_SCENARIOS = {
    "wake_latency": "one waiter, reused queue, gate released 0.5-3 ms in",
    "wake_latency_short_work": "one waiter, reused queue, gate released at once (short work)",
    "wake_fresh_queue": "one waiter, a fresh queue per wait, gate released 0.5-3 ms in",
    "wake_64_queues": "{many_queues} waiters on {many_queues} queues, released in random order",
    "wake_saturated_loop": (
        "saturated loop: {saturated_tasks} tasks of 200 µs Python in a ring, gate released 2 ms in"
    ),
    "wake_cpu_thread": "beside a CPU-bound Python thread, gate released 0.5-3 ms in",
    "out_of_order_park": (
        "out-of-order parking: the older fence, the newer one parked first (recheck_interval 30 s)"
    ),
}
_CPU_SCENARIOS = {
    "cpu_while_parked": "CPU while 64 waits are parked (Python threads' CPU s per wall s)",
    "cpu_while_waiting": "CPU while waiting on long work (Python threads' CPU s per wall s)",
}


def _us(seconds: float) -> float | None:
    """Microseconds; ``None`` for a timed-out (infinite) or missing value."""
    return seconds * 1e6 if math.isfinite(seconds) else None


def _minus(value: float | None, floor: float | None) -> float | None:
    return None if value is None or floor is None else value - floor


def _ratio(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else value / reference


def latency_figures(
    samples: dict[str, list[float]], *, late_after_s: float | None = None
) -> dict[str, dict[str, Any]]:
    """Percentiles in µs, the overhead above the floor, and the ratio to ``to_thread``.

    A timed-out trial is an infinite sample: a percentile that lands on one
    is ``None`` (shown as "> timeout"). The floor is the ``sleep(0) loop``'s
    p50 and p99 in the same samples; without it the overheads are ``None``.
    """
    figures: dict[str, dict[str, Any]] = {}
    for name, values in samples.items():
        if not values:
            continue
        entry: dict[str, Any] = {
            "p50_us": _us(percentile(values, 0.5)),
            "p99_us": _us(percentile(values, 0.99)),
            "max_us": _us(max(values)),
            "trials": len(values),
            "timeouts": sum(not math.isfinite(v) for v in values),
        }
        if late_after_s is not None:
            entry["late_share"] = sum(v > late_after_s for v in values) / len(values)
        figures[name] = entry
    floor = figures.get(SLEEP_0, {})
    reference = figures.get(TO_THREAD, {}).get("p50_us")
    for name, entry in figures.items():
        # The device's row is under the floor by its nature: no overhead to show.
        below = name == DEVICE_FINISH
        entry["p50_over_floor_us"] = None if below else _minus(entry["p50_us"], floor.get("p50_us"))
        entry["p99_over_floor_us"] = None if below else _minus(entry["p99_us"], floor.get("p99_us"))
        entry["p50_vs_to_thread"] = _ratio(entry["p50_us"], reference)
    return ordered(figures)


def _cpu_figures(samples: dict[str, list[float]]) -> dict[str, dict[str, float | None]]:
    figures: dict[str, dict[str, float | None]] = {
        name: {"cpu_per_wall": statistics.median(values)}
        for name, values in samples.items()
        if values
    }
    reference = figures.get(SLEEP_0, {}).get("cpu_per_wall")
    for entry in figures.values():
        entry["vs_busy_poll"] = _ratio(entry["cpu_per_wall"], reference)
    return ordered(figures)


def summarize(results: Results) -> dict[str, Any]:
    """The figures of every scenario that ran, as the tables and the JSON show them."""
    summary: dict[str, Any] = {}
    for key in LATENCY_SCENARIOS:
        if key in results.latency:
            late = LATE_AFTER_S if key == "wake_cpu_thread" else None
            summary[key] = latency_figures(results.latency[key], late_after_s=late)
    if results.footprint:
        summary["parked_queues"] = ordered(dict(results.footprint))
    for key in _CPU_SCENARIOS:
        if key in results.cpu:
            summary[key] = _cpu_figures(results.cpu[key])
    if results.throughput:
        rates: dict[str, dict[str, float | None]] = {
            name: {f"{tasks}_tasks_per_s": statistics.median(r) for tasks, r in per.items()}
            for name, per in results.throughput.items()
        }
        for entry in rates.values():
            for key in [k for k in entry if k.endswith("_per_s")]:
                reference = rates.get(TO_THREAD, {}).get(key)
                entry[key.replace("_per_s", "_vs_to_thread")] = _ratio(entry[key], reference)
        summary["throughput"] = ordered(rates)
    if results.scale:
        summary["scale"] = ordered(
            {
                name: {str(size): figures for size, figures in per.items()}
                for name, per in results.scale.items()
            }
        )
    if results.drop:
        summary["drop_queue"] = dict(results.drop)
    if results.one_by_one:
        kinds: dict[str, dict[str, float | None]] = {
            kind: {
                **figures,
                "loop_cpu_per_fence_us": figures["loop_cpu_s"] / figures["fences"] * 1e6,
            }
            for kind, figures in results.one_by_one.items()
        }
        ordered_kind = results.one_by_one.get("in-order")
        unordered = results.one_by_one.get("out-of-order")
        if ordered_kind and unordered:
            kinds["out-of-order vs in-order"] = {
                "wall": _ratio(unordered["wall_s"], ordered_kind["wall_s"]),
                "loop_cpu": _ratio(unordered["loop_cpu_s"], ordered_kind["loop_cpu_s"]),
                "queries": _ratio(
                    unordered["queries_per_fence"], ordered_kind["queries_per_fence"]
                ),
            }
        summary["parked_one_by_one"] = kinds
    if results.signal_hold:
        summary["signal_hold"] = {
            name: {"p50_us": percentile(s, 0.5) * 1e6, "max_us": max(s) * 1e6, "trials": len(s)}
            for name, s in results.signal_hold.items()
        }
    return summary


def _finite_or_none(samples: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    return {
        key: {
            name: [v if math.isfinite(v) else None for v in values]
            for name, values in ordered(per).items()
        }
        for key, per in samples.items()
    }


def build_report(results: Results) -> dict[str, Any]:
    """``{"meta", "summary", "samples"}``, ready for ``json.dump`` (no NaN, no infinity)."""
    samples: dict[str, Any] = {
        f"{key}_s": per for key, per in _finite_or_none(results.latency).items()
    }
    samples.update({key: ordered(per) for key, per in results.cpu.items()})
    if results.throughput:
        samples["throughput_per_s"] = {
            name: {str(tasks): rates for tasks, rates in per.items()}
            for name, per in ordered(results.throughput).items()
        }
    if results.signal_hold:
        samples["signal_hold_s"] = results.signal_hold
    return {"meta": results.meta, "summary": _no_nan(summarize(results)), "samples": samples}


def _no_nan(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _no_nan(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_no_nan(item) for item in value]
    return value


def write_json(path: str, report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` atomically: a reader sees the old file or the new one."""
    partial = f"{path}.partial"
    with open(partial, "w") as file:
        json.dump(report, file, indent=1, allow_nan=False)
        file.write("\n")
    os.replace(partial, path)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe(device: Device, config: BenchConfig, loop_name: str) -> dict[str, Any]:
    """Device, backend, versions, machine and settings, as a report needs them."""
    packages = (
        "anyio",
        "uvloop",
        "pyopencl",
        "pocl-binary-distribution",
        "cuda-bindings",
        "numba-cuda",
    )
    versions = {name: _version(name) for name in packages}
    return {
        "date": time.strftime("%Y-%m-%d"),
        "device": device.name,
        "backend": device.backend,
        "asyncfence": asyncfence.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "default_executor_workers": thread_pool_size(loop_name),
        "loop": loop_name,
        "quick": config.quick,
        "spin_budget_s": asyncfence.configure().spin_budget,
        "versions": {name: version for name, version in versions.items() if version},
        "config": asdict(config),
        "contenders": [],
        "device_row": False,
        "left_out": {},
        "scenarios": [],
        "completed": [],
    }


# -- tables -------------------------------------------------------------------------------

Table = tuple[list[str], list[list[str]]]


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def _signed(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:+,.0f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _latency_cell(value: float | None, timeouts: int, timeout_s: float) -> str:
    if value is None and timeouts:
        return f"> {timeout_s:g} s"
    return _number(value)


def _timeout_for(meta: dict[str, Any], key: str) -> float:
    config = meta.get("config", {})
    default = float(config.get("trial_timeout_s", 5.0))
    if key == "wake_saturated_loop":
        return float(config.get("saturated_timeout_s", default))
    return default


def _latency_table(key: str, figures: dict[str, Any], meta: dict[str, Any]) -> Table:
    timeout_s = _timeout_for(meta, key)
    late = key == "wake_cpu_thread"
    any_timeouts = any(f["timeouts"] for f in figures.values())
    columns = ["contender", "p50", "p99", "max", "p50 over floor", "p99 over floor"]
    columns += ["p50 vs to_thread"]
    columns += ["late (> 11 ms)"] if late else []
    columns += ["timeouts"] if any_timeouts else []
    rows = []
    for name, f in figures.items():
        row = [
            name,
            _latency_cell(f["p50_us"], f["timeouts"], timeout_s),
            _latency_cell(f["p99_us"], f["timeouts"], timeout_s),
            _latency_cell(f["max_us"], f["timeouts"], timeout_s),
            _signed(f["p50_over_floor_us"]),
            _signed(f["p99_over_floor_us"]),
            _times(f["p50_vs_to_thread"]),
        ]
        if late:
            row.append(f"{f['late_share']:.0%}")
        if any_timeouts:
            row.append(f"{f['timeouts']} of {f['trials']}")
        rows.append(row)
    return columns, rows


def tables(summary: dict[str, Any], meta: dict[str, Any]) -> dict[str, Table]:
    """Every table of the report, titled, for the scenarios in ``summary``."""
    config = {**asdict(BenchConfig()), **meta.get("config", {})}
    result: dict[str, Table] = {}
    for key, what in LATENCY_SCENARIOS.items():
        if key in summary:
            title = f"wake latency, µs: {what.format(**config)}"
            result[title] = _latency_table(key, summary[key], meta)
    if "parked_queues" in summary:
        queues = int(next(iter(summary["parked_queues"].values()))["queues"])
        result[f"threads and memory with {plural(queues, 'parked wait')}, one per held queue"] = (
            ["contender", "Python threads +", "OS threads +", "RSS + MB", "Python heap MB"],
            [
                [
                    n,
                    _signed(f["python_threads_delta"]),
                    _signed(f["os_threads_delta"]),
                    _number(f["rss_delta_mb"], 1),
                    _number(f["python_heap_mb"], 2),
                ]
                for n, f in summary["parked_queues"].items()
            ],
        )
    if "parked_one_by_one" in summary:
        figures = summary["parked_one_by_one"]
        rows = [
            [
                kind,
                f"{int(f['fences']):,}",
                _number(f["wall_s"], 3),
                _number(f["loop_cpu_s"], 3),
                _number(f["loop_cpu_per_fence_us"], 1),
                _number(f["queries_per_fence"], 2),
                _number(f["signals_per_fence"], 2),
            ]
            for kind, f in figures.items()
            if "fences" in f
        ]
        ratio = figures.get("out-of-order vs in-order")
        if ratio:
            rows.append(
                [
                    "out-of-order vs in-order",
                    "",
                    _times(ratio["wall"]),
                    _times(ratio["loop_cpu"]),
                    "",
                    _times(ratio["queries"]),
                    "",
                ]
            )
        result["parked fences completing one by one (asyncfence park)"] = (
            [
                "queue",
                "fences",
                "wall s",
                "loop CPU s",
                "loop CPU per fence µs",
                "queries per fence",
                "signals per fence",
            ],
            rows,
        )
    for key, title in _CPU_SCENARIOS.items():
        if key in summary:
            result[title] = (
                ["contender", "cpu/wall", "vs sleep(0) loop"],
                [
                    [n, _number(f["cpu_per_wall"], 3), _times(f["vs_busy_poll"])]
                    for n, f in summary[key].items()
                ],
            )
    if "throughput" in summary:
        rates = summary["throughput"]
        counts = sorted(
            {int(k.split("_")[0]) for f in rates.values() for k in f if k.endswith("_per_s")}
        )
        result["throughput (record-and-await round trips per second)"] = (
            ["contender"]
            + [plural(n, "task") for n in counts]
            + [f"{plural(n, 'task')} vs to_thread" for n in counts],
            [
                [n]
                + [_number(f.get(f"{c}_tasks_per_s")) for c in counts]
                + [_times(f.get(f"{c}_tasks_vs_to_thread")) for c in counts]
                for n, f in rates.items()
            ],
        )
    if "scale" in summary:
        scale = summary["scale"]
        sizes = sorted({int(s) for per in scale.values() for s in per})

        def cell(per: dict[str, Any], size: int) -> str:
            figures = per.get(str(size))
            if figures is None:
                return "-"
            text = _number(figures["lag_p99_s"] * 1e6)
            if "tick_mean_s" in figures:
                text += f" / {_number(figures['tick_mean_s'] * 1e6, 1)}"
            return text

        result["scale (pending fences on held streams): loop lag p99 µs / poller tick µs"] = (
            ["contender"] + [f"{s:,} pending" for s in sizes],
            [[n] + [cell(per, s) for s in sizes] for n, per in scale.items()],
        )
    if "drop_queue" in summary:
        drop = summary["drop_queue"]
        objects = int(next(iter(drop.values()))["objects"])
        title = f"drop queue: {objects:,} objects on 16 streams, one stream stuck, then all done"
        result[title] = (
            [
                "contender",
                "defer µs",
                "bytes/object",
                "release p50 µs",
                "release p99 µs",
                "released, 1 stuck",
                "the rest, ms",
            ],
            [
                [
                    n,
                    _number(f["defer_us"], 2),
                    _number(f["bytes_per_pending_object"]),
                    _number(f["release_latency_p50_us"]),
                    _number(f["release_latency_p99_us"]),
                    _number(f["released_with_one_stream_stuck"]),
                    _number(f["release_rest_ms"], 1),
                ]
                for n, f in drop.items()
            ],
        )
    if "signal_hold" in summary:
        result["how long a completion signal holds its stream (µs, CUDA timing events)"] = (
            ["signal", "p50", "max"],
            [
                [n, _number(f["p50_us"], 1), _number(f["max_us"], 1)]
                for n, f in summary["signal_hold"].items()
            ],
        )
    return result


# Where ``to_thread`` runs, per loop (``meta.default_executor_workers`` is its size).
_POOL_NAMES = {"trio": "default thread limiter"}


def _heading(meta: dict[str, Any]) -> list[str]:
    lines = [
        f"asyncfence bench on {meta['backend']}: {meta['device']} | "
        f"{plural(meta['cpu_count'] or 0, 'core')} | Python {meta['python']} | {meta['loop']} | "
        f"asyncfence {meta['asyncfence']}" + (" | quick" if meta["quick"] else ""),
        f"to_thread's {_POOL_NAMES.get(meta['loop'], 'default executor')}: "
        f"{plural(meta['default_executor_workers'], 'thread')}"
        + (f" | wake path: {meta['wake_path']}" if meta.get("wake_path") else "")
        + (f" | CUDA signal: {meta['cuda_signal']}" if meta.get("cuda_signal") else ""),
    ]
    if meta.get("device_row"):
        lines.append(
            f"{DEVICE_FINISH}: the instant the device stamped each wait's event done, "
            "which no wait can beat"
        )
    lines += [f"left out {name}: {reason}" for name, reason in meta.get("left_out", {}).items()]
    if meta.get("incomplete"):
        lines.append(f"INCOMPLETE: {meta['incomplete']}")
    return lines


def render(meta: dict[str, Any], summary: dict[str, Any], *, plain: bool = False) -> None:
    """Print the tables, with rich where it is installed (unless ``plain``)."""
    heading, found = _heading(meta), tables(summary, meta)
    try:
        if plain:
            raise ImportError("plain text asked for")
        from rich.console import Console
        from rich.table import Table as RichTable
    except ImportError:
        print("\n".join(heading))
        for title, (columns, rows) in found.items():
            widths = [max(len(c) for c in column) for column in zip(columns, *rows, strict=True)]
            print(f"\n{title}")
            for cells in [columns, *rows]:
                print("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
        return
    console = Console(width=None if sys.stdout.isatty() else 120)
    for index, text in enumerate(heading):
        console.print(text, style="bold" if index == 0 else None, highlight=False)
    for title, (columns, rows) in found.items():
        table = RichTable(title=title, title_justify="left")
        for index, column in enumerate(columns):
            table.add_column(column, justify="left" if index == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)


# -- the plot -----------------------------------------------------------------------------

_MATPLOTLIB_MISSING = "--plot needs matplotlib: pip install 'asyncfence[bench]'"


def require_matplotlib() -> None:
    """Fail now, before anything is measured, if ``--plot`` cannot be honoured.

    Raises:
        SystemExit: matplotlib is not installed.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(_MATPLOTLIB_MISSING) from None


def _cumulative(axis: Any, samples: dict[str, list[float]], title: str) -> None:
    for name, values in ordered(samples).items():
        finite = sorted(v * 1e6 for v in values if math.isfinite(v))
        if not finite:
            continue
        fractions = [(i + 1) / len(values) for i in range(len(finite))]
        axis.step(finite, fractions, where="post", label=name)
    axis.set_xscale("log")
    axis.set_xlabel("wake latency (µs, log scale)")
    axis.set_ylabel("fraction of waits")
    axis.set_title(title)
    axis.legend(fontsize="small")


def plot(results: Results, meta: dict[str, Any], path: str) -> None:
    """Wake-latency distributions, unloaded and on a saturated loop, and throughput."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 4.5))
    _cumulative(left, results.latency.get("wake_latency", {}), "wake latency, cumulative")
    _cumulative(
        middle,
        results.latency.get("wake_saturated_loop", {}),
        "on a saturated loop, cumulative",
    )
    names = list(ordered(results.throughput))
    task_counts = sorted({t for per in results.throughput.values() for t in per})
    width = 0.8 / max(1, len(task_counts))
    for offset, tasks in enumerate(task_counts):
        values = [statistics.median(results.throughput[n].get(tasks, [0.0])) for n in names]
        right.bar(
            [i + offset * width for i in range(len(names))],
            values,
            width,
            label=plural(tasks, "task"),
        )
    right.set_xticks([i + width * (len(task_counts) - 1) / 2 for i in range(len(names))])
    right.set_xticklabels(names, rotation=20, ha="right", fontsize="small")
    right.set_ylabel("round trips per second")
    right.set_title("throughput on short work")
    right.legend(fontsize="small")
    figure.suptitle(f"asyncfence bench: {meta['backend']} on {meta['device']} ({meta['date']})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
