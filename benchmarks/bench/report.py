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
import textwrap
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, NamedTuple

import asyncfence

from ..measure import percentile, plural
from .base import (
    AUTO,
    CONTENDER_ORDER,
    DEVICE_FINISH,
    LATE_AFTER_S,
    LOCAL_WAITER,
    NUMBA,
    PARK,
    POLL,
    POLLED_10MS,
    RUNTIME_BLOCKING,
    SLEEP_0,
    SLEEP_1MS,
    TO_THREAD,
    BenchConfig,
    Results,
    ordered,
    thread_pool_size,
)

if TYPE_CHECKING:
    from asyncfence.testing import Device

__all__ = [
    "BELOW_FLOOR",
    "FLOOR",
    "LATENCY_SCENARIOS",
    "Table",
    "build_report",
    "describe",
    "latency_figures",
    "plot",
    "quick_note",
    "render",
    "require_matplotlib",
    "results_from_report",
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
    "wake_cross_process": (
        "across processes: the producer's gate released 0.5-3 ms in; the consumer imports "
        "the fence, or reads a message a producer thread sends after a blocking sync, or "
        "polls for that message every 10 ms"
    ),
    "wait_sync": (
        "a thread blocked in a synchronous wait: asyncfence's wait_sync, or the runtime's "
        "own blocking wait on a raw event at the same point; gate released 0.5-3 ms in"
    ),
    "failure_cross_process": (
        "a failure across processes: the producer's gate failed 0.5-3 ms in; nothing there "
        "awaits the fence, or a task of its own does and then holds the loop 20 ms (its "
        "own wake is the local waiter's row)"
    ),
    "out_of_order_park": (
        "out-of-order parking: the older fence, the newer one parked first (recheck_interval 30 s)"
    ),
}
_CPU_SCENARIOS = {
    "wait_sync_cpu": (
        "CPU of a thread blocked a second in a synchronous wait, its own CPU s per wall s"
    ),
    "cpu_while_parked": "CPU while 64 waits are parked, Python threads' CPU s per wall s",
    "cpu_while_waiting": "CPU while waiting on long work, Python threads' CPU s per wall s",
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
    if RUNTIME_BLOCKING in figures:  # a synchronous wait: the runtime's own is the bound
        runtime = figures[RUNTIME_BLOCKING]["p50_us"]
        for entry in figures.values():
            entry["p50_vs_runtime"] = _ratio(entry["p50_us"], runtime)
    if LOCAL_WAITER in figures:  # a failure across processes: the local bound
        local = figures[LOCAL_WAITER]["p50_us"]
        for entry in figures.values():
            entry["p50_vs_local_waiter"] = _ratio(entry["p50_us"], local)
    if POLLED_10MS in figures:  # across processes, the workaround to beat
        polled = figures[POLLED_10MS]["p50_us"]
        for entry in figures.values():
            entry["p50_vs_polled"] = _ratio(entry["p50_us"], polled)
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
    if results.parked_scaling:
        summary["parked_at_scale"] = {
            str(size): figures for size, figures in sorted(results.parked_scaling.items())
        }
    if results.relay:
        summary["relay_floods"] = dict(results.relay)
    if results.per_wait:
        summary["heap_per_wait"] = dict(results.per_wait)
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


class Table(NamedTuple):
    """One table of the report: its columns, its rows, and the notes printed below it."""

    columns: list[str]
    rows: list[list[str]]
    notes: list[str]


#: What a latency table shows in an overhead cell under the floor, and in the floor's own.
BELOW_FLOOR = "below floor"
FLOOR = "floor"


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def _signed(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:+,.0f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _over_floor(value: float | None, *, is_floor: bool) -> str:
    """An overhead cell: ``+N`` µs above the floor, never a negative number."""
    if value is None or math.isnan(value):
        return "-"
    if is_floor:
        return FLOOR
    if value < 0:
        return BELOW_FLOOR
    return f"+{value:,.0f}"


def _latency_cell(value: float | None, timeouts: int, timeout_s: float) -> str:
    if value is None and timeouts:
        return f"> {timeout_s:g} s"
    return _number(value)


def _timeout_for(meta: dict[str, Any], key: str) -> float:
    config = meta.get("config", {})
    default = float(config.get("trial_timeout_s", 5.0))
    if key == "wake_saturated_loop":
        return float(config.get("saturated_timeout_s", default))
    if key == "wake_64_queues":
        return float(config.get("many_timeout_s", default))
    return default


def _latency_table(key: str, figures: dict[str, Any], meta: dict[str, Any]) -> Table:
    timeout_s = _timeout_for(meta, key)
    late = key == "wake_cpu_thread"
    any_timeouts = any(f["timeouts"] for f in figures.values())
    # The out-of-order scenario has no busy polling to measure a floor by.
    has_floor = SLEEP_0 in figures
    columns = ["contender", "p50", "p99", "max"]
    columns += ["p50 over floor", "p99 over floor"] if has_floor else []
    # Across processes there is no to_thread: the polled workaround is the
    # reference, or for a failure, a local waiter on it.
    versus = "to_thread" if TO_THREAD in figures or POLLED_10MS not in figures else "polled"
    if LOCAL_WAITER in figures:
        versus = "local waiter"
    if RUNTIME_BLOCKING in figures:
        versus = "runtime"
    columns += [f"p50 vs {versus}"]
    columns += ["late (> 11 ms)"] if late else []
    columns += ["timeouts"] if any_timeouts else []
    rows = []
    for name, f in figures.items():
        row = [
            name,
            _latency_cell(f["p50_us"], f["timeouts"], timeout_s),
            _latency_cell(f["p99_us"], f["timeouts"], timeout_s),
            _latency_cell(f["max_us"], f["timeouts"], timeout_s),
        ]
        if has_floor:
            row += [
                _over_floor(f["p50_over_floor_us"], is_floor=name == SLEEP_0),
                _over_floor(f["p99_over_floor_us"], is_floor=name == SLEEP_0),
            ]
        row.append(_times(f[f"p50_vs_{versus.replace(' ', '_')}"]))
        if late:
            row.append(f"{f['late_share']:.0%}")
        if any_timeouts:
            row.append(f"{f['timeouts']} of {f['trials']}")
        rows.append(row)
    notes = ["µs from the gate's release to the waiter's resumption: lower is better."]
    if has_floor:
        notes.append(
            "over floor: µs above the sleep(0) loop's p50 (or p99) in this run, the "
            "busy-poll floor."
        )
        if any(BELOW_FLOOR in row for row in rows):
            notes.append(
                f"{BELOW_FLOOR}: under the sleep(0) loop's figure at that percentile (busy "
                "polling is the floor only while it has the loop and the GIL to itself)."
            )
        if DEVICE_FINISH in figures:
            notes.append(f"{DEVICE_FINISH}: not a way to wait, so no overhead.")
    if versus == "polled":
        notes.append(f"vs polled: the p50 as a multiple of {POLLED_10MS}'s.")
    elif versus == "runtime":
        notes.append("vs runtime: the p50 as a multiple of the runtime's own blocking wait's.")
    elif versus == "local waiter":
        notes.append("vs local waiter: the p50 as a multiple of the producer's own wake's.")
    else:
        notes.append("vs to_thread: the p50 as a multiple of to_thread's.")
    if late:
        notes.append("late: the share of wakes after 11 ms (two 5 ms GIL switch intervals).")
    if any_timeouts:
        notes.append(f"> {timeout_s:g} s: the percentile lands on a trial that timed out.")
    return Table(columns, rows, notes)


def _cpu_table(figures: dict[str, Any]) -> Table:
    return Table(
        ["contender", "cpu/wall", "vs sleep(0) loop"],
        [[n, _number(f["cpu_per_wall"], 3), _times(f["vs_busy_poll"])] for n, f in figures.items()],
        [
            "cpu/wall: CPU seconds of the process's Python threads per wall second (1.000 is "
            "a whole core): lower is better. The device runtime's own threads are left out.",
            "vs sleep(0) loop: as a multiple of busy polling's.",
        ],
    )


def tables(summary: dict[str, Any], meta: dict[str, Any]) -> dict[str, Table]:
    """Every table of the report, titled, for the scenarios in ``summary``."""
    config = {**asdict(BenchConfig()), **meta.get("config", {})}
    result: dict[str, Table] = {}
    for key, what in LATENCY_SCENARIOS.items():
        if key in summary:
            title = f"wake latency, µs (lower is better): {what.format(**config)}"
            result[title] = _latency_table(key, summary[key], meta)
    if "parked_queues" in summary:
        queues = int(next(iter(summary["parked_queues"].values()))["queues"])
        result[f"threads and memory with {plural(queues, 'parked wait')}, one per held queue"] = (
            Table(
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
                ["What the waits added to the process: lower is better."],
            )
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
                _number(f.get("runtime_alone_wall_s"), 3),
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
                    "",
                ]
            )
        result["parked fences completing one by one (asyncfence park)"] = Table(
            [
                "queue",
                "fences",
                "wall s",
                "loop CPU s",
                "loop CPU per fence µs",
                "queries per fence",
                "signals per fence",
                "runtime alone wall s",
            ],
            rows,
            [
                "Time, loop CPU and device queries: lower is better. runtime alone: the same "
                "gates and markers released the same way, each marker waited for with the "
                "runtime's own blocking wait, no fence: the wall time the fences cannot beat."
            ],
        )
    for key, title in _CPU_SCENARIOS.items():
        if key in summary:
            result[f"{title} (lower is better)"] = _cpu_table(summary[key])
    if "throughput" in summary:
        rates = summary["throughput"]
        counts = sorted(
            {int(k.split("_")[0]) for f in rates.values() for k in f if k.endswith("_per_s")}
        )
        result["throughput: record-and-await round trips per second (higher is better)"] = Table(
            ["contender"]
            + [plural(n, "task") for n in counts]
            + [f"{plural(n, 'task')} vs to_thread" for n in counts],
            [
                [n]
                + [_number(f.get(f"{c}_tasks_per_s")) for c in counts]
                + [_times(f.get(f"{c}_tasks_vs_to_thread")) for c in counts]
                for n, f in rates.items()
            ],
            ["On short work, one stream per task; vs to_thread: as a multiple of to_thread's."],
        )
    if "parked_at_scale" in summary:
        per_size = summary["parked_at_scale"]
        result["parked fences at scale (asyncfence park): gates released one by one"] = Table(
            [
                "queues",
                "wakes",
                "wake p50 µs",
                "wake p99 µs",
                "loop lag p99 µs",
                "loop lag max µs",
                "runtime alone: lag p99 µs",
                "runtime alone: lag max µs",
                "re-checks",
                "queries per wake",
            ],
            [
                [
                    f"{int(f['queues']):,}",
                    f"{int(f['wakes']):,}",
                    _number(f["wake_p50_s"] * 1e6),
                    _number(f["wake_p99_s"] * 1e6),
                    _number(f["lag_p99_s"] * 1e6),
                    _number(f["lag_max_s"] * 1e6),
                    _number(f["alone_lag_p99_s"] * 1e6),
                    _number(f["alone_lag_max_s"] * 1e6),
                    _number(f["rechecks"]),
                    _number(f["queries_per_wake"], 2),
                ]
                for f in per_size.values()
            ],
            [
                "One parked fence per held queue; the gates released 2 ms apart by a thread. "
                "Flat from the fewest queues to the most is the aim: lower is better.",
                "runtime alone: the same queues, gates, markers and releases, with no fence "
                "and no wait: the device runtime's own share of the lag.",
            ],
        )
    if "heap_per_wait" in summary:
        result["Python heap per parked wait, with a timeout (bytes)"] = Table(
            ["wait", "bytes"],
            [[name, _number(value)] for name, value in summary["heap_per_wait"].items()],
            [
                "tracemalloc over the same number of waits, each in a task of its own; "
                "the fence's share is its row less the plain future's: what asyncfence adds."
            ],
        )
    if "relay_floods" in summary:
        result["the exporting loop beside floods of its relay (asyncfence's relay)"] = Table(
            ["flood", "loop lag p99 ms", "loop lag max ms", "owner's import µs", "answered"],
            [
                [
                    name,
                    _number(f["lag_p99_ms"], 2),
                    _number(f["lag_max_ms"], 2),
                    _number(f["import_us"]) if f["import_us"] is not None else "> 30 s",
                    "" if f["answered"] is None else f"{int(f['answered']):,}",
                ]
                for name, f in summary["relay_floods"].items()
            ],
            [
                "loop lag: how much later than asked a 1 ms sleep of the producer's ends, "
                "while a forked process floods its relay: lower is better.",
                "owner's import: from the producer's release to this process's wake, the "
                "import made during the flood.",
                "answered: flooding connections that got a refusal or were cut off, and closed.",
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

        title = "scale (pending fences on held streams): loop lag p99 µs / poller tick µs"
        result[title] = Table(
            ["contender"] + [f"{s:,} pending" for s in sizes],
            [[n] + [cell(per, s) for s in sizes] for n, per in scale.items()],
            [
                "loop lag: how long a task that yields once waits to run again, p99; "
                "poller tick: asyncfence's mean cost per tick. Lower is better."
            ],
        )
    if "drop_queue" in summary:
        drop = summary["drop_queue"]
        objects = int(next(iter(drop.values()))["objects"])
        title = f"drop queue: {objects:,} objects on 16 streams, one stream stuck, then all done"
        result[title] = Table(
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
            [
                "Lower is better, but for released, 1 stuck: the objects freed while one "
                "of the 16 streams is stuck (higher is better)."
            ],
        )
    if "signal_hold" in summary:
        result["how long a completion signal holds its stream (µs, CUDA timing events)"] = Table(
            ["signal", "p50", "max"],
            [
                [n, _number(f["p50_us"], 1), _number(f["max_us"], 1)]
                for n, f in summary["signal_hold"].items()
            ],
            ["The stream waits this long for each signal: lower is better."],
        )
    return result


# Where ``to_thread`` runs, per loop (``meta.default_executor_workers`` is its size).
_POOL_NAMES = {"trio": "default thread limiter"}


def quick_note(meta: dict[str, Any]) -> str | None:
    """What a ``--quick`` run's report says of its figures; ``None`` for a full run."""
    if not meta.get("quick"):
        return None
    trials = meta.get("config", {}).get("wake_trials")
    few = f" ({trials} trials per contender of one waiter's wake latency)" if trials else ""
    return (
        f"QUICK RUN: a smoke run with few samples{few}, too few for figures to quote; "
        "run without --quick for figures"
    )


def _heading(meta: dict[str, Any]) -> list[str]:
    lines = [
        f"asyncfence bench on {meta['backend']}: {meta['device']}",
        f"{plural(meta['cpu_count'] or 0, 'core')} | Python {meta['python']} | {meta['loop']} | "
        f"asyncfence {meta['asyncfence']}",
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
    note = quick_note(meta)
    if note:
        lines.append(note)
    if meta.get("incomplete"):
        lines.append(f"INCOMPLETE: {meta['incomplete']}")
    return lines


def _notes(table: Table) -> str:
    """A table's notes, one paragraph indented below it."""
    return textwrap.fill(
        " ".join(table.notes), width=100, initial_indent="  ", subsequent_indent="  "
    )


def render(meta: dict[str, Any], summary: dict[str, Any], *, plain: bool = False) -> None:
    """Print the tables, each with its notes, with rich where it is installed (unless ``plain``).

    Args:
        meta: The report's ``meta``.
        summary: The report's ``summary`` (:func:`summarize`).
        plain: Plain text even where rich is installed.
    """
    heading, found = _heading(meta), tables(summary, meta)
    try:
        if plain:
            raise ImportError("plain text asked for")
        from rich.console import Console
        from rich.table import Table as RichTable
    except ImportError:
        print("\n".join(heading))
        for title, table in found.items():
            cells = [table.columns, *table.rows]
            widths = [max(len(c) for c in column) for column in zip(*cells, strict=True)]
            print(f"\n{title}")
            for row in cells:
                print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
            print(_notes(table))
        if quick_note(meta):
            print(f"\n{quick_note(meta)}")
        return
    console = Console(width=None if sys.stdout.isatty() else 120)
    for index, text in enumerate(heading):
        # soft_wrap: a long line is never broken by rich, so none ends on a separator.
        style = "bold" if index == 0 else None
        console.print(text, style=style, highlight=False, markup=False, soft_wrap=True)
    for title, table in found.items():
        console.print()
        console.print(title, style="bold", highlight=False, markup=False, soft_wrap=True)
        shown = RichTable()
        for index, column in enumerate(table.columns):
            shown.add_column(column, justify="left" if index == 0 else "right")
        for row in table.rows:
            shown.add_row(*row)
        console.print(shown)
        console.print(_notes(table), style="dim", highlight=False, markup=False, soft_wrap=True)
    if quick_note(meta):  # at the end too, beside the figures it is about
        console.print()
        console.print(quick_note(meta), style="bold", highlight=False, markup=False, soft_wrap=True)


# -- the plot -----------------------------------------------------------------------------

_MATPLOTLIB_MISSING = "--plot needs matplotlib: pip install -e '.[bench]' in the checkout"


def require_matplotlib() -> None:
    """Fail now, before anything is measured, if ``--plot`` cannot be honoured.

    Raises:
        SystemExit: matplotlib is not installed.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(_MATPLOTLIB_MISSING) from None


#: Each contender's line style and marker, the same in every panel (colours follow the order).
_STYLES = {
    AUTO: ("-", "o"),
    PARK: ("--", "s"),
    POLL: ("-.", "^"),
    TO_THREAD: (":", "D"),
    SLEEP_1MS: ((0, (5, 1.5)), "v"),
    SLEEP_0: ((0, (3, 1, 1, 1, 1, 1)), "P"),
    NUMBA: ((0, (1, 2)), "X"),
    DEVICE_FINISH: ("-", "*"),
}
_LATENCY_AXIS = "wake latency, µs (log scale): lower is better"


def _style(name: str) -> dict[str, Any]:
    rank = list(CONTENDER_ORDER).index(name) if name in CONTENDER_ORDER else len(CONTENDER_ORDER)
    linestyle, marker = _STYLES.get(name, ("-", "."))
    return {"color": f"C{rank % 10}", "linestyle": linestyle, "marker": marker}


def _log_limits(values: list[float], upper: float | None = None) -> tuple[float, float]:
    """Whole decades around ``values`` (µs, all positive), reaching ``upper`` if given."""
    low = 10 ** math.floor(math.log10(min(values)))
    high = 10 ** math.ceil(math.log10(max([*values, upper or 0.0])))
    return low, high if high > low else low * 10


def _finite_us(values: list[float]) -> list[float]:
    """The finite, positive samples in µs, sorted (a log axis shows nothing else)."""
    return sorted(v * 1e6 for v in values if math.isfinite(v) and v > 0)


def _not_measured(axis: Any, title: str) -> None:
    axis.set_title(title)
    axis.text(0.5, 0.5, "not measured in this run", ha="center", va="center")
    axis.set_axis_off()


def _cumulative(axis: Any, samples: dict[str, list[float]], title: str) -> None:
    """Each contender's distribution, with its p50 marked."""
    drawn = {name: _finite_us(values) for name, values in ordered(samples).items()}
    drawn = {name: finite for name, finite in drawn.items() if finite}
    if not drawn:
        _not_measured(axis, title)
        return
    for name, finite in drawn.items():
        count = len(samples[name])
        fractions = [(i + 1) / count for i in range(len(finite))]
        style = _style(name)
        median = max(0, math.ceil(count * 0.5) - 1)  # nearest rank, as the tables take it
        axis.step(
            finite,
            fractions,
            where="post",
            label=name,
            color=style["color"],
            linestyle=style["linestyle"],
            marker=style["marker"],
            markevery=[median] if median < len(finite) else [],  # not on a timeout
            markersize=7,
        )
    axis.set_xscale("log")
    axis.set_xlim(*_log_limits([v for finite in drawn.values() for v in finite]))
    axis.set_ylim(0, 1.02)
    axis.set_xlabel(_LATENCY_AXIS)
    axis.set_ylabel("share of waits woken by then (marker: p50)")
    axis.set_title(title)
    axis.grid(True, which="major", alpha=0.3)


def _strip(axis: Any, samples: dict[str, list[float]], timeout_s: float, title: str) -> None:
    """One row per contender: each wait a dot, its p50 a bar, its timeouts at the bound."""
    rows = {name: values for name, values in ordered(samples).items() if values}
    if not rows:
        _not_measured(axis, title)
        return
    bound_us = timeout_s * 1e6
    finite = [v for values in rows.values() for v in _finite_us(values)]
    low, high = _log_limits(finite or [bound_us], bound_us * 1.5)
    labels = []
    for row, (name, values) in enumerate(rows.items()):
        style = _style(name)
        points = _finite_us(values)
        # Spread a row's dots over its height, in order, so that equal values stay apart.
        offsets = [0.25 * ((i % 5) / 2 - 1) for i in range(len(points))]
        axis.scatter(
            points,
            [row + o for o in offsets],
            s=30,
            color=style["color"],
            marker=style["marker"],
            alpha=0.7,
            linewidths=0,
            zorder=3,
        )
        timeouts = sum(not math.isfinite(v) for v in values)
        labels.append(f"{name}\n{timeouts} of {len(values)} timed out" if timeouts else name)
        if points:
            p50 = percentile([v * 1e6 for v in values], 0.5)
            if math.isfinite(p50):
                axis.plot([p50, p50], [row - 0.42, row + 0.42], color="black", linewidth=1.2)
        if timeouts:  # at the bound, where they were given up
            axis.scatter([bound_us], [row], s=70, color=style["color"], marker="x")
    axis.axvline(bound_us, color="grey", linestyle="--", linewidth=1)
    axis.text(
        bound_us,
        -0.45,
        f"each trial's bound, {timeout_s:g} s ",
        ha="right",
        va="top",
        fontsize="small",
        color="grey",
    )
    axis.set_xscale("log")
    axis.set_xlim(low, high)
    axis.set_ylim(len(rows) - 0.5, -0.5)  # the first contender on top
    axis.set_yticks(range(len(rows)))
    axis.set_yticklabels(labels, fontsize="small")
    axis.set_xlabel(_LATENCY_AXIS)
    axis.set_title(title)
    axis.grid(True, axis="x", which="major", alpha=0.3)


def _throughput(axis: Any, throughput: dict[str, dict[int, list[float]]]) -> None:
    names = list(ordered(throughput))
    title = "throughput on short work"
    if not names:
        _not_measured(axis, title)
        return
    task_counts = sorted({t for per in throughput.values() for t in per})
    width = 0.8 / max(1, len(task_counts))
    tallest = 0.0
    for offset, tasks in enumerate(task_counts):
        values = [statistics.median(throughput[n].get(tasks, [0.0])) for n in names]
        tallest = max(tallest, *values)
        axis.bar(
            [i + offset * width for i in range(len(names))],
            values,
            width,
            label=plural(tasks, "task"),
            color=f"C{offset % 10}",
            hatch=["", "//", "..", "xx"][offset % 4],
            edgecolor="white",
        )
    axis.set_xticks([i + width * (len(task_counts) - 1) / 2 for i in range(len(names))])
    axis.set_xticklabels(names, rotation=20, ha="right", fontsize="small")
    axis.set_ylim(0, tallest * 1.2 or 1)  # room for the legend above the bars
    axis.set_ylabel("round trips per second: higher is better")
    axis.set_title(title)
    axis.legend(fontsize="small", loc="upper left", ncol=len(task_counts), frameon=False)


def results_from_report(report: dict[str, Any]) -> Results:
    """The samples of a ``--json`` report, as the plot reads them (a timeout back to infinity).

    Args:
        report: A report as :func:`build_report` made it and ``--json`` wrote it.

    Returns:
        The latency and throughput samples and the meta; nothing else.
    """
    results = Results(meta=dict(report["meta"]))
    for key, per in report.get("samples", {}).items():
        scenario = key.removesuffix("_s")
        if scenario in LATENCY_SCENARIOS:
            results.latency[scenario] = {
                name: [math.inf if v is None else float(v) for v in values]
                for name, values in per.items()
            }
    for name, per in report.get("samples", {}).get("throughput_per_s", {}).items():
        results.throughput[name] = {int(tasks): list(rates) for tasks, rates in per.items()}
    return results


def plot(results: Results, meta: dict[str, Any], path: str) -> None:
    """Wake-latency distributions, unloaded and on a saturated loop, and throughput.

    Args:
        results: What was measured (only the latency and throughput samples are read).
        meta: The report's ``meta``.
        path: The image to write; its suffix picks the format (``.png``, ``.svg``).
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, middle, right) = plt.subplots(
        1, 3, figsize=(18, 5.5), gridspec_kw={"width_ratios": [1.1, 1.1, 0.9]}
    )
    unloaded = results.latency.get("wake_latency", {})
    _cumulative(left, unloaded, "wake latency, one waiter: the share of waits woken by then")
    _strip(
        middle,
        results.latency.get("wake_saturated_loop", {}),
        _timeout_for(meta, "wake_saturated_loop"),
        "on a saturated loop: each wait a dot, p50 a bar",
    )
    _throughput(right, results.throughput)
    handles, labels = left.get_legend_handles_labels()
    if handles:
        figure.legend(handles, labels, loc="lower center", ncol=len(handles), frameon=False)
    title = (
        f"asyncfence bench: {meta['backend']} on {meta['device']}, {meta['loop']} ({meta['date']})"
    )
    if meta.get("quick"):
        title += "; QUICK RUN: few samples, not figures to quote"
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0.07 if handles else 0, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)
