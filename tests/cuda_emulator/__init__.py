"""Build and load the emulated CUDA driver (a test double; never shipped).

``load()`` compiles ``emulated_cuda.c`` with the system C compiler and loads it
as ``libcuda.so.1`` into this process, before cuda.bindings looks for a driver.
cuda.pathfinder finds an already loaded ``libcuda.so.1`` by its soname and uses
it. Once loaded, the real driver cannot be loaded into the same process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("emulated_cuda.c")


class EmulatorUnavailable(RuntimeError):
    """The emulator cannot be built here (no C compiler, or it failed to compile)."""


def build(directory: Path | None = None) -> Path:
    """Compile the emulator (once per source version) and return the library's path.

    The cache key is the source and ``ASYNCFENCE_EMULATOR_CFLAGS`` (extra
    compiler flags: a sanitizer build, say): the emulator reads its settings
    (``ASYNCFENCE_EMULATED_DRIVER_VERSION``, ``ASYNCFENCE_EMULATED_DEVICES``,
    ``ASYNCFENCE_EMULATED_HIDE``) from the environment at run time, so one
    build serves every setting.
    """
    extra_flags = os.environ.get("ASYNCFENCE_EMULATOR_CFLAGS", "").split()
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(extra_flags).encode()).hexdigest()[:16]
    directory = directory or Path(tempfile.gettempdir()) / f"asyncfence-emulated-cuda-{digest}"
    library = directory / "libcuda.so.1"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    partial = directory / f"libcuda.so.1.{os.getpid()}"
    command = [
        *compiler.split(),
        "-shared",
        "-fPIC",
        "-O2",
        "-Wall",
        "-pthread",
        "-Wl,-soname,libcuda.so.1",
        *extra_flags,
        "-o",
        str(partial),
        str(SOURCE),
    ]
    if shutil.which(command[0]) is None:
        raise EmulatorUnavailable(f"no C compiler ({command[0]}) to build the emulated CUDA driver")
    compiled = subprocess.run(command, capture_output=True, text=True, check=False)
    if compiled.returncode != 0:
        raise EmulatorUnavailable(f"compiling the emulated CUDA driver failed: {compiled.stderr}")
    partial.replace(library)  # atomic: concurrent builds never load a partial file
    return library


class Emulator:
    """The emulator's test hooks, through ctypes."""

    def __init__(self, library: Path) -> None:
        self.path = library
        lib = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        lib.emu_hold.restype = ctypes.c_void_p
        lib.emu_hold.argtypes = [ctypes.c_void_p]
        lib.emu_release.argtypes = [ctypes.c_void_p]
        lib.emu_launch_fault.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.emu_inject_fault.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.emu_clear_fault.argtypes = [ctypes.c_void_p]
        lib.emu_event_flags.argtypes = [ctypes.c_void_p]
        lib.emu_last_host_fn.restype = ctypes.c_void_p
        for counter in (
            "live_events",
            "live_streams",
            "pending_host_funcs",
            "events_created",
            "live_host_allocs",
            "host_funcs_v1",
            "host_funcs_v2",
        ):
            getattr(lib, f"emu_{counter}").restype = ctypes.c_long
        self._lib = lib

    def hold(self, stream: int) -> int:
        """Hold ``stream`` until :meth:`release`; returns the gate."""
        gate = self._lib.emu_hold(stream)
        if not gate:
            raise RuntimeError("emu_hold failed: bad stream or faulted context")
        return int(gate)

    def release(self, gate: int) -> None:
        self._lib.emu_release(gate)

    def launch_fault(self, stream: int, code: int) -> None:
        """Queue a fault: the context turns sticky when the stream reaches it."""
        if self._lib.emu_launch_fault(stream, code):
            raise RuntimeError("emu_launch_fault failed")

    def inject_fault(self, context: int, code: int) -> None:
        if self._lib.emu_inject_fault(context, code):
            raise RuntimeError("emu_inject_fault failed")

    def clear_fault(self, context: int) -> None:
        if self._lib.emu_clear_fault(context):
            raise RuntimeError("emu_clear_fault failed")

    def event_flags(self, event: int) -> int:
        """The flags ``event`` was created with."""
        return int(self._lib.emu_event_flags(event))

    def live_events(self) -> int:
        return int(self._lib.emu_live_events())

    def live_streams(self) -> int:
        return int(self._lib.emu_live_streams())

    def pending_host_funcs(self) -> int:
        return int(self._lib.emu_pending_host_funcs())

    def events_created(self) -> int:
        return int(self._lib.emu_events_created())

    def live_host_allocs(self) -> int:
        return int(self._lib.emu_live_host_allocs())

    def last_host_fn(self) -> int:
        """The function pointer the latest host-function launch handed the driver."""
        return int(self._lib.emu_last_host_fn() or 0)

    def host_funcs_launched(self) -> tuple[int, int]:
        """Host functions launched so far through ``cuLaunchHostFunc`` and its ``_v2``."""
        return int(self._lib.emu_host_funcs_v1()), int(self._lib.emu_host_funcs_v2())


def load() -> Emulator:
    """Build the emulator and load it as this process's CUDA driver."""
    return Emulator(build())
