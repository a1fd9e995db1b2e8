"""The emulated CUDA driver compiles against the real ``cuda.h`` where it is present.

There a prototype, a resolver row, a typedef or a constant that drifts from the
toolkit's ``cuda.h`` and ``cudaTypedefs.h`` is a build error, not a silent ABI
mismatch; without the header the emulator builds alone, as on a CI machine
without the toolkit.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING

import pytest

from .cuda_emulator import (
    OLDEST_CUDA_H,
    SOURCE,
    Emulator,
    _private_cache,
    build,
    compiler,
    cuda_include_dir,
)

if TYPE_CHECKING:
    from pathlib import Path

NO_CUDA_H = (
    f"no cuda.h of CUDA {OLDEST_CUDA_H // 1000}.0 or newer with cudaTypedefs.h here "
    "(CUDA_HOME, CUDA_PATH, beside nvcc, /usr/local/cuda): nothing to check the emulator against"
)


@pytest.fixture
def include() -> Path:
    """The toolkit's include folder; skips where there is none."""
    found = cuda_include_dir()
    if found is None:
        pytest.skip(NO_CUDA_H)
    return found


@pytest.fixture
def cc() -> list[str]:
    """The C compiler's command; skips where there is none."""
    command = compiler()
    if shutil.which(command[0]) is None:
        pytest.skip(f"no C compiler ({command[0]}) to build the emulated CUDA driver")
    return command


def built_with_cuda_h(library: Path) -> int:
    """``emu_built_with_cuda_h()`` of ``library``, loaded in a process of its own."""
    probe = "import ctypes, sys; print(ctypes.CDLL(sys.argv[1]).emu_built_with_cuda_h())"
    result = subprocess.run(
        [sys.executable, "-c", probe, str(library)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return int(result.stdout)


def test_the_emulator_compiles_against_cuda_h(include: Path, cc: list[str], tmp_path: Path) -> None:
    library = build(tmp_path, cuda_h=True)
    assert built_with_cuda_h(library) == 1


def test_without_cuda_h_it_builds_alone(cc: list[str], tmp_path: Path) -> None:
    library = build(tmp_path, cuda_h=False)
    assert built_with_cuda_h(library) == 0


def test_the_suites_emulator_is_the_one_checked_against_cuda_h(
    include: Path, emulator: Emulator
) -> None:
    """Where the header is, the CUDA tests run on an emulator compiled against it."""
    assert emulator.built_with_cuda_h()


#: Drifts from cuda.h, each an edit of the source: (its text, the drift, the build error).
DRIFTS = [
    pytest.param(
        "CUresult cuEventQuery(CUevent handle) {",
        "CUresult cuEventQuery(CUstream handle) {",
        "conflicting types for",
        id="a-handle-type",
    ),
    pytest.param(
        "CUresult cuMemAlloc_v2(CUdeviceptr *pdptr, size_t bytes) {",
        "CUresult cuMemAlloc_v2(CUdeviceptr *pdptr, unsigned int bytes) {",
        "conflicting types for",
        id="a-size-type",
    ),
    pytest.param(
        "X(cuEventQuery, 2000, cuEventQuery)",
        "X(cuEventQuery, 2000, cuStreamQuery)",
        "cuStreamQuery does not match PFN_cuEventQuery_v2000 of cudaTypedefs.h",
        id="a-resolver-row",
    ),
    pytest.param(
        "typedef unsigned long long CUdeviceptr;",
        "typedef unsigned int CUdeviceptr;",
        "conflicting types for",
        id="a-typedef",
    ),
    pytest.param(
        "#define NOT_READY 600\n",
        "#define NOT_READY 601\n",
        "NOT_READY differs from CUDA_ERROR_NOT_READY of cuda.h",
        id="a-constant",
    ),
]


@pytest.mark.parametrize(("text", "drifted", "error"), DRIFTS)
def test_a_drift_from_cuda_h_fails_to_build(
    include: Path, cc: list[str], tmp_path: Path, text: str, drifted: str, error: str
) -> None:
    source = SOURCE.read_text()
    assert source.count(text) == 1, f"the emulator's source no longer has {text!r}"
    copy = tmp_path / "emulated_cuda.c"
    copy.write_text(source.replace(text, drifted))
    command = [*cc, "-fsyntax-only", "-Wall", str(copy)]
    env = {**os.environ, "LC_ALL": "C"}  # plain quotes in the compiler's messages

    def compile_(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, *flags], capture_output=True, text=True, env=env, timeout=120, check=False
        )

    alone = compile_()
    assert alone.returncode == 0, f"the drifted copy should build alone:\n{alone.stderr}"
    checked = compile_(f"-I{include}", "-DASYNCFENCE_WITH_CUDA_H")
    assert checked.returncode != 0, f"{drifted!r} built against {include}/cuda.h"
    assert error in checked.stderr, checked.stderr


def test_every_type_an_entry_point_is_called_through_is_checked(include: Path) -> None:
    """Each PFN type of cudaTypedefs.h that a caller may cast a resolved function to.

    cuGetProcAddress hands out, for a name and version, the function of the
    highest row at or below that version, for the per-thread (``_ptsz``) lookups
    too: so every PFN type of an emulated name, from its first row on, must be
    checked against the function handed out for it, as a row or in
    ``OTHER_TYPES``; and every check in ``OTHER_TYPES`` is of such a function.
    """
    source = SOURCE.read_text()
    table_at = source.index("#define ENTRY_POINTS(X)")
    table = source[table_at : source.index("static const struct", table_at)]
    rows = [
        (name, int(version), fn)
        for name, version, fn in re.findall(r"X\((\w+), (\d+), (\w+)\)", table)
    ]
    assert len(rows) > 50
    others_at = source.index("#define OTHER_TYPES(X)")
    others = source[others_at : source.index("#define CHECK_TYPE", others_at)]
    other_checks = set(re.findall(r"X\((PFN_\w+), (\w+)\)", others))
    checked = {(f"PFN_{name}_v{version}", fn) for name, version, fn in rows} | other_checks

    typedefs = (include / "cudaTypedefs.h").read_text(errors="replace")
    pfn_types = set(re.findall(r"\*\s*PFN_(\w+?)_v(\d+)(_ptsz)?\)", typedefs))
    expected = set()
    for name, version, ptsz in pfn_types:
        versions = sorted((v, fn) for n, v, fn in rows if n == name)
        handed_out = [fn for v, fn in versions if v <= int(version)]
        if handed_out:  # from the name's first row on
            expected.add((f"PFN_{name}_v{version}{ptsz}", handed_out[-1]))
    assert expected - checked == set(), (
        "PFN types the emulator's functions are never checked against"
    )
    assert other_checks - expected == set(), "checks of functions the resolver does not hand out so"


def test_a_compiler_that_fails_silently_still_gives_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from .cuda_emulator import EmulatorUnavailable

    false = shutil.which("false")
    if false is None:
        pytest.skip("no false(1) to stand in for a failing compiler")
    monkeypatch.setenv("CC", false)
    with pytest.raises(EmulatorUnavailable) as caught:
        build(tmp_path / "emulator")
    message = str(caught.value)
    assert message.startswith("compiling the emulated CUDA driver failed: ")
    assert message.endswith(": no output")
    assert "exited 1" in message


# -- the cache: a driver library another user could plant is never loaded -----------


def test_the_cache_folder_is_made_for_this_user_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cache = _private_cache("cache")
    assert cache == tmp_path / "cache"
    status = cache.lstat()
    assert status.st_uid == os.geteuid()
    assert stat.S_IMODE(status.st_mode) & 0o077 == 0
    assert _private_cache("cache") == cache  # found again, and kept


@pytest.mark.parametrize("planted", ["open to all", "a link", "another user's"])
def test_a_cache_folder_someone_else_could_write_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    squatted = tmp_path / "cache"
    if planted == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        squatted.symlink_to(tmp_path / "elsewhere")
    else:
        squatted.mkdir()
        squatted.chmod(0o777)
        if planted == "another user's":
            if os.geteuid() != 0:
                pytest.skip("giving a folder to another user needs root")
            squatted.chmod(0o700)
            os.chown(squatted, 65534, 65534)
    cache = _private_cache("cache")
    assert cache != squatted
    assert cache.parent == tmp_path
    assert cache.name.startswith("asyncfence-emulated-cuda-")
    assert stat.S_IMODE(cache.lstat().st_mode) == 0o700


def test_a_cached_library_others_could_write_is_built_again(cc: list[str], tmp_path: Path) -> None:
    planted = tmp_path / "libcuda.so.1"
    planted.write_bytes(b"not a driver")
    planted.chmod(0o666)
    library = build(tmp_path, cuda_h=False)
    assert library == planted
    assert library.read_bytes() != b"not a driver"  # replaced by a build of ours
    assert built_with_cuda_h(library) == 0
