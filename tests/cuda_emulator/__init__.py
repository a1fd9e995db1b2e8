"""Build and load the emulated CUDA driver (a test double; never shipped).

``load()`` compiles ``emulated_cuda.c`` with the system C compiler and loads it
as ``libcuda.so.1`` into this process, before cuda.bindings looks for a driver.
cuda.pathfinder finds an already loaded ``libcuda.so.1`` by its soname and uses
it. Once loaded, the real driver cannot be loaded into the same process.

Where a CUDA toolkit's headers are present (``cuda.h`` of CUDA 13.0 or newer
and ``cudaTypedefs.h``, found by :func:`cuda_include_dir`), the emulator is
compiled against them (``-I<include> -DASYNCFENCE_WITH_CUDA_H``), so a drift
from the real driver's ABI is a build error, not a silent mismatch: every
exported function must match its ``cuda.h`` prototype, every row of the
resolver's table its ``PFN_<name>_v<version>`` type (and the per-thread
``_ptsz`` and later types it is also handed out as), every typedef and
constant ``cuda.h``'s. Without them it builds alone, with its own typedefs of
the same types, as on a CI machine without the toolkit.
``emu_built_with_cuda_h()`` says which build it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import stat
import subprocess
import sysconfig
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("emulated_cuda.c")


#: The oldest ``cuda.h`` the emulator is compiled against: it models CUDA 13.0's API.
OLDEST_CUDA_H = 13000


class EmulatorUnavailable(RuntimeError):
    """The emulator cannot be built here (no C compiler, or it failed to compile)."""


def compiler() -> list[str]:
    """The C compiler's command: ``$CC``, else the one Python was built with, else ``cc``."""
    return (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()


def cuda_h_version(include: Path) -> int | None:
    """The ``CUDA_VERSION`` that ``include/cuda.h`` defines, or None."""
    try:
        text = (include / "cuda.h").read_text(errors="replace")
    except OSError:
        return None
    found = re.search(r"^\s*#\s*define\s+CUDA_VERSION\s+(\d+)", text, re.MULTILINE)
    return int(found.group(1)) if found else None


def cuda_include_dir() -> Path | None:
    """The CUDA toolkit's include folder to compile the emulator against, or None.

    The first of ``$CUDA_HOME/include``, ``$CUDA_PATH/include``, the folder
    beside ``nvcc`` on ``PATH`` (``$(dirname nvcc)/../include``, then the same
    for the file it links to) and ``/usr/local/cuda/include`` that holds
    ``cudaTypedefs.h`` and a ``cuda.h`` of CUDA 13.0 or newer.
    """
    candidates = [
        Path(os.environ[name]) / "include"
        for name in ("CUDA_HOME", "CUDA_PATH")
        if os.environ.get(name)
    ]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates += [
            Path(nvcc).parent.parent / "include",
            Path(nvcc).resolve().parent.parent / "include",
        ]
    candidates.append(Path("/usr/local/cuda/include"))
    for include in candidates:
        version = cuda_h_version(include)
        if (
            version is not None
            and version >= OLDEST_CUDA_H
            and (include / "cudaTypedefs.h").is_file()
        ):
            return include
    return None


def build(directory: Path | None = None, *, cuda_h: bool | None = None) -> Path:
    """Compile the emulator (once per source version) and return the library's path.

    ``cuda_h``: compile against the toolkit's ``cuda.h`` where
    :func:`cuda_include_dir` finds one (None), always (True: without one it is
    :class:`EmulatorUnavailable`) or never (False).

    The cache key is the source, ``ASYNCFENCE_EMULATOR_CFLAGS`` (extra
    compiler flags: a sanitizer build, say) and the headers it is compiled
    against, if any (their folder and contents): the emulator reads its settings
    (``ASYNCFENCE_EMULATED_DRIVER_VERSION``, ``ASYNCFENCE_EMULATED_DEVICES``,
    ``ASYNCFENCE_EMULATED_HIDE``) from the environment at run time, so one
    build serves every setting.
    """
    extra_flags = os.environ.get("ASYNCFENCE_EMULATOR_CFLAGS", "").split()
    include = None if cuda_h is False else cuda_include_dir()
    if cuda_h and include is None:
        raise EmulatorUnavailable(
            f"no cuda.h (CUDA {OLDEST_CUDA_H // 1000}.0 or newer) with cudaTypedefs.h to compile "
            "the emulated CUDA driver against (CUDA_HOME, CUDA_PATH, nvcc, /usr/local/cuda)"
        )
    header_flags = [] if include is None else [f"-I{include}", "-DASYNCFENCE_WITH_CUDA_H"]
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(" ".join(extra_flags + header_flags).encode())
    if include is not None:
        for header in ("cuda.h", "cudaTypedefs.h"):
            key.update((include / header).read_bytes())
    digest = key.hexdigest()[:16]
    directory = directory or _private_cache(f"asyncfence-emulated-cuda-{os.geteuid()}-{digest}")
    library = directory / "libcuda.so.1"
    if library.exists() and _ours_alone(library, directory=False):
        return library
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f"libcuda.so.1.{os.getpid()}"
    command = [
        *compiler(),
        "-shared",
        "-fPIC",
        "-O2",
        "-Wall",
        "-pthread",
        "-Wl,-soname,libcuda.so.1",
        *header_flags,
        *extra_flags,
        "-o",
        str(partial),
        str(SOURCE),
    ]
    if shutil.which(command[0]) is None:
        raise EmulatorUnavailable(f"no C compiler ({command[0]}) to build the emulated CUDA driver")
    compiled = subprocess.run(command, capture_output=True, text=True, check=False)
    if compiled.returncode != 0:
        # A compiler that fails silently (CC=/bin/false) still gets a reason.
        output = (compiled.stderr or compiled.stdout).strip() or "no output"
        raise EmulatorUnavailable(
            f"compiling the emulated CUDA driver failed: {command[0]} exited "
            f"{compiled.returncode}: {output}"
        )
    partial.replace(library)  # atomic: concurrent builds never load a partial file
    return library


def _ours_alone(path: Path, *, directory: bool) -> bool:
    """Whether ``path`` is this user's own, of its kind, and no one else may write to it.

    Checked without following a link: a link another user planted is not ours.
    """
    try:
        status = path.lstat()
    except OSError:
        return False
    kind = stat.S_ISDIR if directory else stat.S_ISREG
    others_write = stat.S_IWGRP | stat.S_IWOTH
    if directory:
        others_write |= stat.S_IRWXG | stat.S_IRWXO  # and may not list or enter it
    return (
        kind(status.st_mode) and status.st_uid == os.geteuid() and not status.st_mode & others_write
    )


def _private_cache(name: str) -> Path:
    """A cache folder in the shared temporary folder that only this user can write.

    Another user can create the name first (the temporary folder is shared):
    then, or if it is not this user's alone for any other reason, the build
    goes into a fresh folder of its own instead, and is not cached.
    """
    cache = Path(tempfile.gettempdir()) / name
    with contextlib.suppress(FileExistsError):
        cache.mkdir(mode=0o700)
    if _ours_alone(cache, directory=True):
        return cache
    return Path(tempfile.mkdtemp(prefix="asyncfence-emulated-cuda-"))


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
        lib.emu_built_with_cuda_h.restype = ctypes.c_int
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

    def built_with_cuda_h(self) -> bool:
        """Whether it was compiled against the toolkit's ``cuda.h`` (see the module)."""
        return bool(self._lib.emu_built_with_cuda_h())

    def host_funcs_launched(self) -> tuple[int, int]:
        """Host functions launched so far through ``cuLaunchHostFunc`` and its ``_v2``."""
        return int(self._lib.emu_host_funcs_v1()), int(self._lib.emu_host_funcs_v2())


def load() -> Emulator:
    """Build the emulator and load it as this process's CUDA driver."""
    return Emulator(build())
