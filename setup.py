"""The native wake shim, built as an optional extension (see pyproject.toml).

``asyncfence/_native.c`` uses no Python C-API: it is a plain shared library
that ``asyncfence._native`` loads with ctypes. Where it cannot be built (no C
compiler), the install goes on and asyncfence uses its thread-based fallback.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "asyncfence._shim",
            sources=["asyncfence/_native.c"],
            extra_compile_args=["-std=c11", "-O2", "-fvisibility=hidden"],
            optional=True,
        )
    ]
)
