"""The wake-latency scenarios: from the release of a gate to the waiter's resumption.

A gate holds a stream (:class:`asyncfence.testing.StreamGate`); the waiter
records its token behind it and waits; the gate is released, the instant
stamped right at the release; the latency is from that stamp to the instant
the waiting coroutine resumes. Every trial is bounded by a timeout, so that a
contender that starves cannot hang the run: such a trial counts as infinite.
Contenders take turns in a random order within each round, so that drift on a
noisy machine hits all alike. The first round of the unloaded scenarios is
untimed: it starts threads and loads the runtime's callback entry points.
"""

from __future__ import annotations

import math
import random
import threading
import time
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel

import asyncfence
from asyncfence.testing import StreamGate

from ..measure import hold_gil
from .base import TO_THREAD, Releaser, bounded, gather, latency

if TYPE_CHECKING:
    from .targets import Contender, Context

__all__ = [
    "OUT_OF_ORDER_RECHECK_S",
    "many_queues",
    "out_of_order",
    "saturated_loop",
    "wake_beside_cpu_thread",
    "wake_fresh_queue",
    "wake_latency",
    "wake_latency_short_work",
]

#: ``recheck_interval`` during out-of-order parking: a signal that is not
#: armed shows as a timeout rather than hiding behind a re-check.
OUT_OF_ORDER_RECHECK_S = 30.0
# A stream's fence is waited on with the gate released this long into the wait.
_DELAYS_S = (0.0005, 0.003)
# Before the release on the saturated loop.
_SATURATED_DELAY_S = 0.002
# Per task of the ring on the saturated loop: Python run between yields.
_SATURATED_SLICE_S = 200e-6
# A contender that timed out this many times running is not tried again in the scenario.
_GIVE_UP_AFTER = 3


def _samples(ctx: Context, key: str) -> dict[str, list[float]]:
    return ctx.results.latency.setdefault(key, {})


async def _one_waiter(
    ctx: Context,
    key: str,
    *,
    delays: tuple[float, float],
    seed: int,
    trials: int,
    fresh_queue: bool = False,
    warm_up: bool = True,
    limit_s: float | None = None,
) -> None:
    """One waiter per trial, the gate released ``delays`` into the wait by a releaser thread."""
    target, samples = ctx.target, _samples(ctx, key)
    limit_s = ctx.config.trial_timeout_s if limit_s is None else limit_s
    rng = random.Random(seed)
    shared = None if fresh_queue else target.new_stream()
    timed = ctx.timed
    with Releaser() as releaser:
        for trial in range(trials + warm_up):
            for contender in rng.sample(timed, len(timed)):
                stream = target.device.new_stream() if shared is None else shared
                gate = StreamGate(stream)
                token = contender.record(stream)
                stamps = releaser.release_after(rng.uniform(*delays), gate)
                resumed = await bounded(contender.wait(token), limit_s)
                ended = contender.latency_end(token, resumed)
                if math.isfinite(resumed):
                    contender.done(token)
                if shared is None:
                    gate.release()  # a no-op unless it timed out before the releaser ran
                    target.device.close_stream(stream)
                if trial or not warm_up:
                    samples.setdefault(contender.name, []).append(latency(ended, stamps))
            ctx.progress((trial + 1) / (trials + warm_up))


async def wake_latency(ctx: Context) -> None:
    """One waiter on a reused queue, the gate released 0.5 to 3 ms into the wait."""
    await _one_waiter(ctx, "wake_latency", delays=_DELAYS_S, seed=1, trials=ctx.config.wake_trials)


async def wake_latency_short_work(ctx: Context) -> None:
    """One waiter on a reused queue, the gate released at once."""
    await _one_waiter(
        ctx, "wake_latency_short_work", delays=(0.0, 0.0), seed=2, trials=ctx.config.wake_trials
    )


async def wake_fresh_queue(ctx: Context) -> None:
    """One waiter on a queue created for that wait, released 0.5 to 3 ms in."""
    await _one_waiter(
        ctx,
        "wake_fresh_queue",
        delays=_DELAYS_S,
        seed=3,
        trials=ctx.config.fresh_trials,
        fresh_queue=True,
    )


async def many_queues(ctx: Context) -> None:
    """64 waiters on 64 held queues, the gates released one by one in a random order.

    The releaser thread starts 2 ms in and releases a gate every 0 to 200 µs,
    stamping each; each waiter's latency runs from its own gate's release.
    """
    config, target, samples = ctx.config, ctx.target, _samples(ctx, "wake_64_queues")
    rng = random.Random(4)
    streams = [target.new_stream() for _ in range(config.many_queues)]
    timed = ctx.timed
    with Releaser() as releaser:
        for trial in range(config.many_rounds + 1):
            for contender in rng.sample(timed, len(timed)):
                gates = [StreamGate(stream) for stream in streams]
                tokens = [contender.record(stream) for stream in streams]
                order = rng.sample(range(len(streams)), len(streams))
                steps = [
                    (_SATURATED_DELAY_S if turn == 0 else rng.uniform(0, 200e-6), gates[index])
                    for turn, index in enumerate(order)
                ]
                stamps = releaser.release_in_turn(steps)
                resumed = await gather(
                    *(bounded(contender.wait(t), config.many_timeout_s) for t in tokens)
                )
                ended = [contender.latency_end(t, r) for t, r in zip(tokens, resumed, strict=True)]
                for index, token in enumerate(tokens):
                    if math.isfinite(resumed[index]):
                        contender.done(token)
                if trial:
                    sample = samples.setdefault(contender.name, [])
                    for turn, index in enumerate(order):
                        sample.append(latency(ended[index], stamps, turn))
                for gate in gates:
                    gate.release()  # no-ops, unless a wait timed out before its release
            ctx.progress((trial + 1) / (config.many_rounds + 1))


async def _release_stamped_after(delay: float, gate: StreamGate, stamps: list[float]) -> None:
    await anyio.sleep(delay)
    stamps.append(time.perf_counter())
    gate.release()


async def saturated_loop(ctx: Context) -> None:
    """One waiter while a ring of tasks keeps the loop always busy with Python.

    Each task of the ring runs about 200 µs of Python, then yields with
    ``sleep(0)``. The gate is released 2 ms in from the loop itself (a task
    that sleeps, then releases): a releaser thread would starve for the GIL
    like any other second thread. Each trial is bounded by
    ``saturated_timeout_s``; a contender that times out three times running
    is not tried again.
    """
    config = ctx.config
    running = True

    async def spin() -> None:
        while running:
            hold_gil(_SATURATED_SLICE_S)
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as ring:
        for _ in range(config.saturated_tasks):
            ring.start_soon(spin)
        try:
            await _saturated_trials(ctx)
        finally:
            running = False


async def _saturated_trials(ctx: Context) -> None:
    config, target, samples = ctx.config, ctx.target, _samples(ctx, "wake_saturated_loop")
    rng = random.Random(5)
    stream = target.new_stream()
    active = list(ctx.timed)
    timeouts_running = dict.fromkeys((c.name for c in active), 0)
    for _ in range(config.saturated_trials):
        for contender in rng.sample(active, len(active)):
            gate = StreamGate(stream)
            token = contender.record(stream)
            stamps: list[float] = []
            async with anyio.create_task_group() as release:
                release.start_soon(_release_stamped_after, _SATURATED_DELAY_S, gate, stamps)
                resumed = await bounded(contender.wait(token), config.saturated_timeout_s)
                release.cancel_scope.cancel()
            gate.release()  # a no-op once released
            sample = latency(contender.latency_end(token, resumed), stamps)
            samples.setdefault(contender.name, []).append(sample)
            if math.isfinite(resumed):
                contender.done(token)
                timeouts_running[contender.name] = 0
            else:
                timeouts_running[contender.name] += 1
                if timeouts_running[contender.name] >= _GIVE_UP_AFTER:
                    active.remove(contender)


async def wake_beside_cpu_thread(ctx: Context) -> None:
    """One waiter while another Python thread runs a CPU-bound loop.

    The thread spins in pure Python (``while not stop: pass``), taking the GIL
    whenever CPython hands it over; the loop gets it back at the next switch
    interval (5 ms). The report counts wakes later than 11 ms as late.
    """
    stop = False

    def burn() -> None:
        while not stop:
            pass

    thread = threading.Thread(target=burn, name="bench CPU-bound thread", daemon=True)
    thread.start()
    try:
        await _one_waiter(
            ctx,
            "wake_cpu_thread",
            delays=_DELAYS_S,
            seed=6,
            trials=ctx.config.cpu_thread_trials,
            warm_up=False,
        )
    finally:
        stop = True
        thread.join()


def out_of_order_entrants(entrants: list[Contender]) -> list[Contender]:
    """The contenders that park: asyncfence's strategies, and ``to_thread``."""
    return [c for c in entrants if c.is_asyncfence or c.name == TO_THREAD]


async def out_of_order(ctx: Context) -> None:
    """On one queue, a newer fence parked first, then the older one; the older's latency.

    With ``recheck_interval`` at 30 s for the duration: an older fence whose
    signal is not armed (because the newer one's already is) would wait for
    the re-check, and shows as a timeout. Only contenders that park apply.
    """
    config, target = ctx.config, ctx.target
    samples = _samples(ctx, "out_of_order_park")
    entrants = out_of_order_entrants(ctx.entrants)
    rng = random.Random(7)
    stream = target.new_stream()
    previous = asyncfence.configure()
    settle = max(0.002, 4 * previous.spin_budget)  # past the spin: auto has parked
    asyncfence.configure(recheck_interval=OUT_OF_ORDER_RECHECK_S)
    try:
        with Releaser() as releaser:
            for trial in range(config.out_of_order_trials + 1):
                for contender in rng.sample(entrants, len(entrants)):
                    gate = StreamGate(stream)
                    older = contender.record(stream)
                    newer = contender.record(stream)
                    tokens = (older, newer)
                    resumed = [math.inf, math.inf]  # the older's, the newer's

                    async def wait(
                        index: int,
                        token: object,
                        c: Contender = contender,
                        into: list[float] = resumed,
                    ) -> None:
                        into[index] = await bounded(c.wait(token), config.trial_timeout_s)

                    async with anyio.create_task_group() as waits:
                        waits.start_soon(wait, 1, newer)
                        await anyio.sleep(settle)
                        waits.start_soon(wait, 0, older)
                        await anyio.sleep(settle)
                        stamps = releaser.release_after(0.0, gate)
                    for token, instant in zip(tokens, resumed, strict=True):
                        if math.isfinite(instant):
                            contender.done(token)
                    if trial:
                        samples.setdefault(contender.name, []).append(latency(resumed[0], stamps))
    finally:
        asyncfence.configure(recheck_interval=previous.recheck_interval)
