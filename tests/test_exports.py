"""The public API: what __all__ names exists, reads as public, and is typed."""

from __future__ import annotations

from pathlib import Path

import asyncfence
import asyncfence.testing


def test_every_public_name_exists_and_reads_as_public() -> None:
    for module in (asyncfence, asyncfence.testing):
        assert isinstance(module.__all__, tuple)
        for name in module.__all__:
            value = getattr(module, name)
            assert value.__module__ == module.__name__, name
    assert sorted(asyncfence.__all__) == list(asyncfence.__all__)


def test_private_modules_stay_private() -> None:
    # (pytest rewrites the modules of plugin packages, adding "@py_..." names)
    public = {name for name in dir(asyncfence) if not name.startswith(("_", "@"))}
    modules = {"testing", "pytest_plugin"}
    assert public - modules == set(asyncfence.__all__)


def test_the_package_is_typed() -> None:
    assert (Path(asyncfence.__file__).parent / "py.typed").exists()
