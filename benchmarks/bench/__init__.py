"""``python -m asyncfence bench``: every waiting strategy beside what users do today.

All contenders run in one process, on one device, interleaved trial by trial
so that drift on a noisy machine hits them alike: asyncfence's ``auto``,
``park`` and ``poll``; ``to_thread`` (a blocking wait on asyncio's default
executor); hand-written ``sleep(1ms)`` and ``sleep(0)`` polling loops (the
latter is the busy-poll *floor*); numba-cuda's ``async_done`` on CUDA. The
latency tables add the device's own row where its events carry stamps on a
host clock (OpenCL profiling): when the device finished, which no wait can
beat (:func:`.targets.device_finish_row`). Each
contender is probed once at setup; one that fails is left out, with the
reason in the report (``meta.left_out``). Figures are percentiles over trials;
ratios and overheads are taken within the run.

Scenarios (the report's summary keys):

* ``wake_latency``: one waiter on a reused queue; a gate holds the queue and
  a releaser thread lets it go 0.5 to 3 ms into the wait, stamping the
  instant; from that instant to the waiter's resumption. p50, p99, max, and
  the overhead above the floor (a contender's p50 minus the ``sleep(0)
  loop``'s, and the same for p99).
* ``wake_latency_short_work``: the same, the gate released at once.
* ``wake_fresh_queue``: the same, with a queue created for every wait.
* ``wake_64_queues``: 64 waiters on 64 held queues; the gates released one by
  one in a random order; each waiter's latency from its own gate's release.
  ``to_thread`` runs on the default executor, whose size is in the meta.
* ``wake_saturated_loop``: one waiter while a ring of tasks, each running
  about 200 µs of Python between ``sleep(0)`` yields, keeps the loop always
  busy; p99 and max, each trial bounded by a timeout ("> timeout" when a
  contender starves: a wake through a second Python thread can).
* ``wake_cpu_thread``: one waiter beside a CPU-bound Python thread; the share
  of wakes later than 11 ms, with p50 and p99.
* ``out_of_order_park``: on one queue, a newer fence parked first, then the
  older; the older's latency, with ``recheck_interval`` at 30 s so that a
  signal that is not armed shows. asyncfence's strategies and ``to_thread``.
* ``parked_queues``: one wait parked on each of 1,000 held queues: the
  change in Python threads, OS threads and RSS.
* ``cpu_while_parked``: CPU seconds of the process's Python threads per wall
  second while 64 waits are parked on held queues (about 0.5 s). The device
  runtime's own threads are left out: on PoCL they *are* the device.
* ``cpu_while_waiting``: the same while awaiting one long piece of work.
* ``throughput``: record-and-await round trips per second on short work, with
  1 task and with 64 (one stream each).
* ``scale``: 10, 1,000 and 10,000 pending fences over 64 held streams: the
  loop's lag (the wait of a task that yields once, p99) and, for asyncfence,
  the poller's cost per tick.
* ``drop_queue``: the cost of a ``defer``, memory per pending object, release
  latency after completion, and releases while one of 16 streams is stuck,
  beside a lazy free-at-next-allocation pool.
* ``signal_hold`` (CUDA): how long each completion signal holds the stream it
  runs on, by timing events.

Modules: :mod:`.base` (settings, results, the releaser), :mod:`.targets`
(raw events for the baselines, the contenders and their probe),
:mod:`.latency`, :mod:`.load`, :mod:`.drop` and :mod:`.signal_hold` (the
scenarios), :mod:`.report` (figures, tables, JSON, plot), :mod:`.runner`
(order, progress, the report written after each scenario).
"""

from .base import BenchConfig
from .runner import SCENARIOS, estimate_seconds, run_bench

__all__ = ["SCENARIOS", "BenchConfig", "estimate_seconds", "run_bench"]
