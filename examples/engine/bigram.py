"""The engine's model: a tiny bigram language model, greedy-sampled on the device.

Each step takes, for every row of the batch, the row's last token, looks up
its embedding (``EMBED``, vocabulary x width), multiplies it by the output
projection (``PROJECT``, width x vocabulary) and picks the highest logit
(the lowest index among equals). The weights are small integers held as
float32, so every sum is exact in any order: the device's tokens match
:func:`reference_tokens` on the host bit for bit, which is how the tests
check that every stream got its own tokens, in order.

Two runners queue that step without waiting for it:

* :class:`OpenCLRunner`: one OpenCL kernel on a queue of the default device
  (PoCL on the CPU), where the device can build kernels.
* :class:`TorchRunner`: PyTorch on CUDA, or on the CPU, where the work is
  done when it is called and every fence is done when recorded.

Each copies the step's tokens into a slot of the host ring without blocking
and returns the fence of that copy.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

import asyncfence

if TYPE_CHECKING:
    from numpy.typing import NDArray

__all__ = [
    "VOCABULARY",
    "OpenCLRunner",
    "Runner",
    "TorchRunner",
    "open_runner",
    "prompt_token",
    "reference_tokens",
]

VOCABULARY = 256
WIDTH = 16
_rng = np.random.default_rng(2026)
EMBED = _rng.integers(-4, 5, size=(VOCABULARY, WIDTH)).astype(np.float32)
PROJECT = _rng.integers(-4, 5, size=(WIDTH, VOCABULARY)).astype(np.float32)


def prompt_token(prompt: str) -> int:
    """The token a prompt starts its request from."""
    return zlib.crc32(prompt.encode()) % VOCABULARY


def reference_tokens(prompt: str, count: int) -> list[int]:
    """The ``count`` tokens the model generates for ``prompt``, computed on the host."""
    token, tokens = prompt_token(prompt), []
    for _ in range(count):
        token = int(np.argmax(EMBED[token] @ PROJECT))
        tokens.append(token)
    return tokens


class Runner(Protocol):
    """Queues the model's steps on a device; never waits for one."""

    description: str
    #: Whether a fence is done when recorded (CPU PyTorch): the output says so.
    done_when_recorded: bool

    def set_token(self, row: int, token: int) -> None:
        """Make ``token`` the last token of ``row`` before the next step."""

    def step(
        self, slot: NDArray[np.int32], *, fail: bool = False, stall: bool = False
    ) -> tuple[asyncfence.Fence, object]:
        """Queue one step for every row, and its tokens' copy into ``slot``.

        ``fail`` and ``stall`` are fault injection, for the tests: the copy
        fails on the device, or waits for an event never set.

        Returns:
            The copy's fence, and what must stay alive until it is done (the
            uploads' events: pyopencl blocks, GIL held, collecting one early).
        """

    def synchronize(self) -> None:
        """Block until everything queued so far is done (the old way)."""


_KERNEL = """
__kernel void bigram_step(__global const int *last, __global int *next,
                          __global const float *embed, __global const float *project,
                          const int vocabulary, const int width) {
    const int row = get_global_id(0);
    __global const float *e = embed + last[row] * width;
    float best = -INFINITY;
    int best_token = 0;
    for (int token = 0; token < vocabulary; ++token) {
        float logit = 0.0f;
        for (int k = 0; k < width; ++k) logit += e[k] * project[k * vocabulary + token];
        if (logit > best) { best = logit; best_token = token; }
    }
    next[row] = best_token;
}
"""


class OpenCLRunner:
    """The step as one OpenCL kernel on an in-order queue; fences from the copies' events."""

    done_when_recorded = False

    def __init__(self, rows: int) -> None:
        import pyopencl as cl

        from asyncfence.testing import open_default_device

        self._cl = cl
        self.queue: Any = open_default_device("opencl").new_stream()
        context = self.queue.context
        self.description = f"OpenCL: {self.queue.device.name.strip()}"
        program = cl.Program(context, _KERNEL).build()  # RuntimeError where it cannot
        self._kernel = cl.Kernel(program, "bigram_step")
        flags = cl.mem_flags
        self._embed = cl.Buffer(context, flags.READ_ONLY | flags.COPY_HOST_PTR, hostbuf=EMBED)
        self._project = cl.Buffer(context, flags.READ_ONLY | flags.COPY_HOST_PTR, hostbuf=PROJECT)
        self._rows = rows
        zeros = np.zeros(rows, np.int32)
        self._last = cl.Buffer(context, flags.READ_WRITE | flags.COPY_HOST_PTR, hostbuf=zeros)
        self._next = cl.Buffer(context, flags.READ_WRITE | flags.COPY_HOST_PTR, hostbuf=zeros)
        # Host arrays of queued uploads: kept until a step's fence is done.
        self._uploads: list[Any] = []

    def set_token(self, row: int, token: int) -> None:
        value = np.array([token], np.int32)
        uploaded = self._cl.enqueue_copy(
            self.queue, self._last, value, dst_offset=row * value.itemsize, is_blocking=False
        )
        self._uploads.append(uploaded)  # its event keeps ``value`` until the copy is done

    def step(
        self, slot: NDArray[np.int32], *, fail: bool = False, stall: bool = False
    ) -> tuple[asyncfence.Fence, object]:
        cl = self._cl
        self._kernel(
            self.queue,
            (self._rows,),
            None,
            self._last,
            self._next,
            self._embed,
            self._project,
            np.int32(VOCABULARY),
            np.int32(WIDTH),
        )
        gate = None
        if fail or stall:
            # PoCL has been seen to run the queue's pending commands out of
            # order around a user event that fails: the fault waits for them.
            self.queue.finish()
            gate = cl.UserEvent(self.queue.context)
        copied = cl.enqueue_copy(
            self.queue, slot, self._next, is_blocking=False, wait_for=[gate] if gate else None
        )
        if gate is not None and fail:
            gate.set_status(-1)  # a failed dependency: the copy fails on the device
        self.queue.flush()
        # The copy's own event is the fence, which keeps the event (and so the
        # slot it writes) alive until the copy is done.
        fence = asyncfence.from_event(copied)
        keep, self._uploads = (self._uploads, gate), []
        self._last, self._next = self._next, self._last
        return fence, keep

    def synchronize(self) -> None:
        self.queue.finish()


class TorchRunner:
    """The step in PyTorch, on CUDA where PyTorch sees a GPU, else on the CPU."""

    def __init__(self, rows: int, device: str = "auto") -> None:
        import torch

        self._torch = torch
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.done_when_recorded = self.device.type == "cpu"
        name = torch.cuda.get_device_name(self.device) if device == "cuda" else "CPU"
        self.description = f"PyTorch {torch.__version__} on {name}"
        self._embed = torch.from_numpy(EMBED).to(self.device)
        self._project = torch.from_numpy(PROJECT).to(self.device)
        self._last = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self._registered: set[int] = set()

    def set_token(self, row: int, token: int) -> None:
        self._last[row] = token

    def step(
        self, slot: NDArray[np.int32], *, fail: bool = False, stall: bool = False
    ) -> tuple[asyncfence.Fence, object]:
        if fail or stall:
            raise ValueError("fault injection needs the OpenCL runner")
        torch = self._torch
        logits = self._embed[self._last] @ self._project
        self._last = logits.argmax(dim=-1)
        out = torch.from_numpy(slot)
        if self.device.type == "cuda":
            self._pin(slot)
            out.copy_(self._last.to(torch.int32), non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return asyncfence.from_event(done), self._last
        out.copy_(self._last.to(torch.int32))
        return asyncfence.record(torch.get_device_module("cpu").current_stream()), None

    def _pin(self, slot: NDArray[np.int32]) -> None:
        """Page-lock the ring once, so that copies into it are asynchronous."""
        ring = slot
        while isinstance(ring.base, np.ndarray):  # the whole ring, which the slot is a row of
            ring = ring.base
        address = ring.__array_interface__["data"][0]
        if address not in self._registered:
            cudart = self._torch.cuda.cudart()  # type: ignore[no-untyped-call]
            error = cudart.cudaHostRegister(address, ring.nbytes, 0)
            if int(error) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {error}")
            self._registered.add(address)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            self._torch.cuda.current_stream().synchronize()


def open_runner(device: str, rows: int) -> Runner:
    """The runner for ``device``: ``opencl``, ``torch``, ``cuda``, ``cpu``, or ``auto``.

    ``auto`` takes PyTorch on a CUDA GPU where there is one, else OpenCL
    where the default device builds kernels, else PyTorch on the CPU.

    Raises:
        RuntimeError: The device asked for cannot run the model.
    """
    if device == "opencl":
        return OpenCLRunner(rows)
    if device in ("torch", "cuda", "cpu"):
        return TorchRunner(rows, "auto" if device == "torch" else device)
    if device != "auto":
        raise ValueError(f"device must be auto, opencl, torch, cuda or cpu; got {device!r}")
    try:
        import torch
    except ImportError:
        has_torch = False
    else:
        has_torch = True
        if torch.cuda.is_available():
            return TorchRunner(rows, "cuda")
    try:
        return OpenCLRunner(rows)
    except Exception:  # no OpenCL, or a device that cannot build the kernel
        if not has_torch:
            raise
        return TorchRunner(rows, "cpu")
