"""The native wake shim, built as a plain shared library: ``asyncfence/_shim.so``.

``asyncfence/_native.c`` uses no Python C-API, and ``asyncfence._native``
loads it with ctypes. So it is compiled with setuptools' C compiler driver but
named without a Python ABI tag, exports nothing of Python's, and the wheel is
tagged ``py3-none-<platform>``: one wheel serves every Python version of a
platform. Where no C compiler exists the install goes on without it, and parked
waits are re-checked on the loop instead.
"""

from __future__ import annotations

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1: wheel's own
    from wheel.bdist_wheel import bdist_wheel


class BuildSharedLibrary(build_ext):
    """Compiles each extension as a plain shared library: ``<name>.so``, no ``PyInit_``."""

    def get_ext_filename(self, fullname: str) -> str:
        """``asyncfence/_shim.so``: no Python ABI tag in the name."""
        return os.path.join(*fullname.split(".")) + ".so"

    def get_export_symbols(self, ext: Extension) -> list[str]:
        """None to add: the source marks its own symbols visible (no ``PyInit_``)."""
        return []


class WheelForEveryPython(bdist_wheel):
    """Tags the wheel ``py3-none-<platform>``: the shim ties it to a platform, not a Python."""

    def get_tag(self) -> tuple[str, str, str]:
        """The platform's tag, for any Python 3 and any ABI."""
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(
    ext_modules=[
        Extension(
            "asyncfence._shim",
            sources=["asyncfence/_native.c"],
            extra_compile_args=["-std=c11", "-O2", "-fvisibility=hidden"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildSharedLibrary, "bdist_wheel": WheelForEveryPython},
)
