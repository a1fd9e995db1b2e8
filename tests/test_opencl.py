"""The OpenCL backend's own behaviour (PoCL): what the generic fence tests cannot see."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

import asyncfence
from asyncfence.testing import hold

if TYPE_CHECKING:
    import pyopencl as cl

    from asyncfence.testing import OpenCLDevice


async def test_fence_waits_for_work_queued_before_it(
    device: OpenCLDevice, queue: cl.CommandQueue
) -> None:
    import numpy as np
    import pyopencl as cl

    size = 8 << 20
    buffer = cl.Buffer(device.context, cl.mem_flags.READ_WRITE, size=size)
    result = np.zeros(size, dtype=np.uint8)
    with hold(queue) as gate:
        cl.enqueue_fill_buffer(queue, buffer, np.full(1, 7, dtype=np.uint8), 0, size)
        # Kept: pyopencl's transfer event, dropped before its transfer ends,
        # waits for it with the GIL held (behind this gate, for ever).
        download = cl.enqueue_copy(queue, result, buffer, is_blocking=False)
        fence = asyncfence.record(queue)
        assert not result.any()  # held: nothing was written yet
        gate.release()
        await fence
    assert (result == 7).all()
    del download


def test_dropping_a_pending_fence_keeps_its_marker_until_it_settles(
    queue: cl.CommandQueue,
) -> None:
    import gc

    def held() -> int:
        (stats,) = [s for s in asyncfence.backend_statistics() if s.backend == "opencl"]
        return stats.held_markers

    held_before = held()
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        del fence
        gc.collect()
        assert held() == held_before + 1
        # Failing the gate with the marker released would abort on PoCL 3.0.
        gate.fail()
    survivor = asyncfence.record(queue)
    survivor.wait_sync(timeout=30)


@pytest.mark.parametrize("state", ["pending", "done"])
def test_enqueue_wait_refuses_a_queue_of_another_context(device: OpenCLDevice, state: str) -> None:
    import pyopencl as cl

    queue = device.new_stream()
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        if state == "done":
            gate.release()
            fence.wait_sync(timeout=30)
        other_context = cl.CommandQueue(cl.Context(device.context.devices))
        with pytest.raises(ValueError, match="context"):
            fence.enqueue_wait(other_context)
