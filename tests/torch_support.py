"""PyTorch for the tests that need it: skipped where it is not installed, unless CI says not.

CI installs CPU PyTorch (``pip install torch==2.13.0``, from a local file: never
a CUDA build of several GB) and sets ``ASYNCFENCE_REQUIRE_TORCH=1``, which turns
the skip into a failure. A PyTorch that is installed but fails to import fails
the test either way: only a missing ``torch`` package skips.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest

__all__ = ["REQUIRE_TORCH", "import_torch"]

#: Set by CI: a missing PyTorch fails the tests that need it.
REQUIRE_TORCH = os.environ.get("ASYNCFENCE_REQUIRE_TORCH") == "1"


def import_torch() -> Any:
    """``torch``; skips the calling test, or module, where it is not installed (see the module doc).

    At a module's top level it skips (or fails) the whole module.
    """
    try:
        return importlib.import_module("torch")
    except ModuleNotFoundError as missing:
        if missing.name != "torch":
            raise
        if REQUIRE_TORCH:
            pytest.fail("ASYNCFENCE_REQUIRE_TORCH=1, but PyTorch is not installed", pytrace=False)
        pytest.skip(
            "needs PyTorch (CI installs torch==2.13.0, the CPU build)", allow_module_level=True
        )
