"""Running the benchmark: the scenarios in order, progress, and a report after each one.

The JSON report (``--json``) is rewritten after every scenario, so a failure
or a timeout late in a run keeps everything measured before it; a run that
stopped early says so in ``meta.incomplete``.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

import asyncfence
from asyncfence.testing import open_default_device

from . import blocking, cross_process, drop, latency, load, relay, signal_hold
from .base import BenchConfig, Results
from .report import build_report, describe, plot, render, require_matplotlib, write_json
from .targets import Context, contenders, device_finish_row, make_target, probe_contenders

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from rich.console import Console
    from rich.progress import TaskID

    from asyncfence.testing import Device

__all__ = ["SCENARIOS", "Progress", "Scenario", "estimate_seconds", "run_bench"]


@dataclass(frozen=True)
class Scenario:
    """One step of the run.

    Attributes:
        key: Its key in the report's summary.
        title: As the progress lines name it.
        run: Measures, writing into the context's results.
        estimate_s: Rough seconds it takes, from the settings and the number
            of contenders (on a 2-core machine).
        backends: The backends it runs on (``None``: every one); elsewhere it
            is left out of the run and of its estimate.
        times_device_row: Times the device's own row beside the contenders
            (:attr:`.targets.Context.timed`).
    """

    key: str
    title: str
    run: Callable[[Context], Awaitable[None]]
    estimate_s: Callable[[BenchConfig, int], float]
    backends: frozenset[str] | None = None
    times_device_row: bool = False

    def runs_on(self, backend: str) -> bool:
        """Whether it runs on ``backend`` (``"cuda"``, ``"opencl"``)."""
        return self.backends is None or backend in self.backends


SCENARIOS: list[Scenario] = [
    Scenario(
        "wake_latency",
        "wake latency, one waiter, reused queue",
        latency.wake_latency,
        lambda c, n: (c.wake_trials + 1) * n * 0.003,
        times_device_row=True,
    ),
    Scenario(
        "wake_latency_short_work",
        "wake latency, short work",
        latency.wake_latency_short_work,
        lambda c, n: (c.wake_trials + 1) * n * 0.0012,
        times_device_row=True,
    ),
    Scenario(
        "wake_fresh_queue",
        "wake latency, a fresh queue per wait",
        latency.wake_fresh_queue,
        lambda c, n: (c.fresh_trials + 1) * n * 0.004,
        times_device_row=True,
    ),
    Scenario(
        "wake_64_queues",
        "wake latency, 64 waiters released in random order",
        latency.many_queues,
        # Polling from 64 tasks may starve the releaser: such rounds run to the bound.
        lambda c, n: (
            (c.many_rounds + 1) * (n * (0.005 + c.many_queues * 0.0005) + c.many_timeout_s)
        ),
        times_device_row=True,
    ),
    Scenario(
        "wake_saturated_loop",
        "wake latency on a saturated loop",
        latency.saturated_loop,
        lambda c, n: c.saturated_trials * n * 0.006 + 3 * c.saturated_timeout_s,
        times_device_row=True,
    ),
    Scenario(
        "wake_cpu_thread",
        "wake latency beside a CPU-bound thread",
        latency.wake_beside_cpu_thread,
        lambda c, n: c.cpu_thread_trials * n * 0.015,
        times_device_row=True,
    ),
    Scenario(
        "wake_cross_process",
        "wake latency across processes, beside the usual workarounds",
        cross_process.cross_process,
        # Three ways per round, each 0.5-3 ms of held work, a 10 ms poll at worst.
        lambda c, n: (c.cross_process_trials + 1) * 3 * 0.008,
    ),
    Scenario(
        "wait_sync",
        "a synchronous wait beside the runtime's own blocking wait",
        blocking.blocking_waits,
        # Two ways per round, each 0.5-3 ms of held work; then held seconds.
        lambda c, n: (c.wait_sync_trials + 1) * 2 * 0.005 + c.wait_sync_cpu_trials * 2 * 1.05,
        times_device_row=False,
    ),
    Scenario(
        "failure_cross_process",
        "a failure across processes, the producer idle or awaiting it",
        relay.relay_failure,
        # Two ways per round, each 0.5-3 ms of held work, and 20 ms held after one.
        lambda c, n: (c.relay_failure_trials + 1) * 2 * 0.03,
        backends=frozenset({"opencl"}),  # the host fails an OpenCL gate, never a CUDA stream
    ),
    Scenario(
        "relay_floods",
        "the exporting loop's lag beside floods of its relay",
        relay.relay_floods,
        lambda c, n: 4 * (0.6 + c.relay_flood_connections * 4e-4),
        # The relay is the same code on every backend.
        backends=frozenset({"opencl"}),
    ),
    Scenario(
        "out_of_order_park",
        "out-of-order parking",
        latency.out_of_order,
        lambda c, n: (c.out_of_order_trials + 1) * 4 * 0.008,
    ),
    Scenario(
        "parked_queues",
        "threads and memory with parked waits",
        load.parked_queues,
        lambda c, n: n * (0.05 + c.parked_queues * 0.0003),
    ),
    Scenario(
        "cpu_while_parked",
        "CPU while 64 waits are parked",
        load.cpu_while_parked,
        lambda c, n: c.parked_cpu_trials * n * (c.parked_cpu_window_s + 0.1),
    ),
    Scenario(
        "cpu_while_waiting",
        "CPU while waiting on long work",
        load.cpu_while_waiting,
        lambda c, n: c.cpu_trials * n * (c.cpu_work_s + 0.02),
    ),
    Scenario(
        "throughput",
        "round trips per second, 1 task and one per stream",
        load.throughput,
        lambda c, n: 2 * c.throughput_rounds * n * c.throughput_window_s,
    ),
    Scenario(
        "scale",
        "loop lag and tick cost with many pending fences",
        load.scale,
        lambda c, n: sum(n * (c.scale_window_s + 0.03 + s * 5e-5) for s in c.scale_sizes),
    ),
    Scenario(
        "parked_one_by_one",
        "parked fences completing one by one, in-order and out-of-order queue",
        load.parked_one_by_one,
        # PoCL's own out-of-order dependency tracking grows with the square.
        # Twice: the runtime alone, then the fences.
        lambda c, n: 2 * (c.one_by_one_fences * 3e-4 + c.one_by_one_fences**2 * 5e-6),
        backends=frozenset({"opencl"}),  # out-of-order queues are OpenCL's
    ),
    Scenario(
        "parked_at_scale",
        "parked fences on 1,024 to 16,384 queues, a few released one by one",
        load.parked_at_scale,
        lambda c, n: sum(
            s * 1.5e-4 + c.scaling_rounds * c.scaling_released * (c.scaling_gap_s + 1e-3)
            for s in c.scaling_sizes
        ),
        # The re-check it measures is the same code on every backend; 16,384
        # CUDA streams and their gates would take most of the GPU check's time.
        backends=frozenset({"opencl"}),
    ),
    Scenario(
        "drop_queue",
        "the drop queue beside a lazy free-at-next-allocation pool",
        drop.drop_queue,
        lambda c, n: 2 * (max(5, c.wake_trials // 4) * 0.002 + c.drop_objects * 8e-6 + 0.3),
    ),
    Scenario(
        "signal_hold",
        "how long a completion signal holds its stream (CUDA only)",
        signal_hold.signal_hold,
        lambda c, n: max(3, c.wake_trials // 4) * 2 * 0.006,
        backends=frozenset({"cuda"}),
    ),
]


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min"


def estimate_seconds(config: BenchConfig, contenders: int, *, backend: str) -> float:
    """Rough length of a whole run on ``backend``, as ``--help`` and the first line state it."""
    return sum(s.estimate_s(config, contenders) for s in SCENARIOS if s.runs_on(backend))


class Progress:
    """The run's progress on stderr.

    A line per scenario as it ends, with the time left, corrected as the run
    goes (in logs too); and, on a terminal, a bar for the scenario under way,
    which the scenario moves between its trials (:attr:`.targets.Context.progress`).
    The bar is redrawn only then, on the loop's thread: no thread of rich's
    wakes up while a trial is timed.
    """

    def __init__(self, estimates: Sequence[float], quiet: bool, console: Console | None = None):
        # rich (the bench extra) only once a run starts: --help needs none of it.
        from rich.console import Console
        from rich.progress import BarColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self._estimates = list(estimates)
        self._done = 0
        self._spent = 0.0
        self._quiet = quiet
        self._console = console or Console(stderr=True)
        self._bars = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            console=self._console,
            auto_refresh=False,
            transient=True,
            disable=quiet or not self._console.is_terminal,
        )
        self._task: TaskID | None = None

    def _say(self, line: str) -> None:
        if not self._quiet:
            self._console.print(line, highlight=False, markup=False, soft_wrap=True)

    def start(self, text: str) -> None:
        """Say what is about to run, and how long it should take."""
        self._say(f"{text}: about {_duration(sum(self._estimates))} (estimate)")
        self._bars.start()

    def begin(self, title: str) -> Callable[[float], None]:
        """A scenario starts; returns what moves its bar (how much of it is done, 0 to 1)."""
        number = f"[{self._done + 1}/{len(self._estimates)}]"
        task = self._task = self._bars.add_task(f"{number} {title}", total=1.0)

        def advance(done: float) -> None:
            self._bars.update(task, completed=min(1.0, max(0.0, done)))
            self._bars.refresh()

        return advance

    def step(self, title: str, seconds: float) -> None:
        """One scenario finished, in ``seconds``."""
        if self._task is not None:
            self._bars.remove_task(self._task)
            self._task = None
        self._spent += seconds
        self._done += 1
        estimated_so_far = sum(self._estimates[: self._done]) or 1e-9
        pace = min(4.0, max(0.25, self._spent / estimated_so_far))
        left = sum(self._estimates[self._done :]) * pace
        tail = f"~{_duration(left)} left" if self._done < len(self._estimates) else "done"
        self._say(f"[{self._done}/{len(self._estimates)}] {title}: {seconds:.1f} s; {tail}")

    def stop(self) -> None:
        """Take the bar off the terminal."""
        self._bars.stop()


def _note_wake_path(results: Results) -> None:
    results.meta["wake_path"] = asyncfence.current_statistics().wake_path
    paths = {stats.backend: stats.signal_path for stats in asyncfence.backend_statistics()}
    results.meta["cuda_signal"] = paths.get("cuda")


async def _run(
    device: Device,
    config: BenchConfig,
    results: Results,
    plan: list[Scenario],
    json_path: str | None,
    quiet: bool,
) -> None:
    target = make_target(device)
    meta = results.meta
    context = Context(target, [], config, results)
    context.fresh_default_executor()
    try:
        device.chunks_for(config.cpu_work_s)  # calibrate before anything is timed
        context.entrants, meta["left_out"] = await probe_contenders(
            target, contenders(target), config.probe_timeout_s, quiet=quiet
        )
        meta["contenders"] = [c.name for c in context.entrants]
        plan = [s for s in plan if s.runs_on(target.device.backend)]
        meta["scenarios"] = [s.key for s in plan]
        row = device_finish_row(target)
        if row is not None and any(s.times_device_row for s in plan):
            admitted, left_out = await probe_contenders(
                target, [row], config.probe_timeout_s, quiet=quiet
            )
            context.device_row = admitted[0] if admitted else None
            meta["left_out"].update(left_out)
        meta["device_row"] = context.device_row is not None
        if json_path:
            write_json(json_path, build_report(results))
        progress = Progress(
            [
                s.estimate_s(config, len(context.timed if s.times_device_row else context.entrants))
                for s in plan
            ],
            quiet,
        )
        progress.start(
            f"asyncfence bench: {len(plan)} scenarios, {len(context.entrants)} contenders"
        )
        try:
            for scenario in plan:
                await _run_one(scenario, context, progress, json_path)
        finally:
            progress.stop()
    finally:
        target.close()


async def _run_one(
    scenario: Scenario, context: Context, progress: Progress, json_path: str | None
) -> None:
    """Run one scenario, its bar moving; the report rewritten after it, whatever happens."""
    results, meta = context.results, context.results.meta
    started = time.perf_counter()
    context.progress = progress.begin(scenario.title)
    try:
        await scenario.run(context)
    except BaseException as error:
        meta["incomplete"] = (
            f"{scenario.key} raised {type(error).__name__}: {error}; "
            "the scenarios before it are complete"
        )
        raise
    else:
        results.completed.append(scenario.key)
        meta["completed"] = list(results.completed)
    finally:
        _note_wake_path(results)
        if json_path:
            write_json(json_path, build_report(results))
    progress.step(scenario.title, time.perf_counter() - started)


def _loop_backend(loop: str) -> tuple[str, dict[str, Any]]:
    """The anyio backend and options for ``loop``; SystemExit if it is not installed."""
    if loop not in ("asyncio", "uvloop", "trio"):
        raise ValueError(f"loop must be 'asyncio', 'uvloop' or 'trio', not {loop!r}")
    if loop == "asyncio":
        return "asyncio", {}
    try:
        __import__(loop)
    except ImportError:
        raise SystemExit(f"bench --loop {loop} needs {loop}: pip install {loop}") from None
    if loop == "uvloop":
        return "asyncio", {"use_uvloop": True}
    return "trio", {}


def _open_device(backend: str | None) -> Device:
    """The device to measure on; SystemExit with one line if there is none.

    A missing driver or device is the user's machine, not a bug: its cause
    chain (the driver's loader, say) would bury the one line that matters.
    """
    try:
        return open_default_device(backend)
    except RuntimeError as unavailable:
        asked = f" --device {backend}" if backend else ""
        reason = " ".join(str(unavailable).split())  # one line, whatever the message
        raise SystemExit(f"bench{asked}: {reason}") from unavailable


def run_bench(
    *,
    device: str | None = None,
    quick: bool = False,
    json_path: str | None = None,
    plot_path: str | None = None,
    loop: str = "asyncio",
    quiet: bool = False,
    config: BenchConfig | None = None,
    scenarios: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run the benchmark, print its tables, and write JSON or a plot if asked.

    Args:
        device: ``"cuda"``, ``"opencl"``, or ``None`` for the default device.
        quick: The smoke run: every scenario, tiny counts.
        json_path: Where to write the report; rewritten after every scenario.
        plot_path: Where to draw the plot (needs matplotlib, checked first).
        loop: ``"asyncio"``, ``"uvloop"`` or ``"trio"``.
        quiet: No progress lines.
        config: Settings to run with instead of those ``quick`` picks.
        scenarios: Keys of the scenarios to run (default: all), in run order.

    Returns:
        The report: ``{"meta": ..., "summary": ..., "samples": ...}``.

    Raises:
        SystemExit: ``plot_path`` is given and matplotlib is missing,
            ``loop`` is not installed, or there is no such device (one line
            saying why, before anything is measured).
        ValueError: ``scenarios`` names one that does not exist, or ``loop``
            is not one of the three.
    """
    if plot_path:
        require_matplotlib()
    backend, backend_options = _loop_backend(loop)
    known = {s.key: s for s in SCENARIOS}
    unknown = [key for key in scenarios or () if key not in known]
    if unknown:
        raise ValueError(f"no such scenarios: {', '.join(unknown)}; known: {', '.join(known)}")
    plan = [known[key] for key in scenarios] if scenarios is not None else list(SCENARIOS)
    config = config or (BenchConfig.smoke() if quick else BenchConfig())
    opened = _open_device(device)
    results = Results(describe(opened, config, loop))
    main = functools.partial(_run, opened, config, results, plan, json_path, quiet)
    try:
        anyio.run(main, backend=backend, backend_options=backend_options)
    except BaseException:
        render(results.meta, build_report(results)["summary"])  # what was measured
        raise
    report = build_report(results)
    render(results.meta, report["summary"])
    if json_path:
        print(f"wrote the report (JSON) to {Path(json_path).resolve()}")
    if plot_path:
        plot(results, results.meta, plot_path)
        print(f"wrote the plot to {Path(plot_path).resolve()}")
    return report
