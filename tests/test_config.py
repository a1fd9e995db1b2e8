"""Settings (``asyncfence.configure``) and the validation of seconds and strategies."""

from __future__ import annotations

import fractions
import sys
from typing import Any

import numpy as np
import pytest

import asyncfence

if sys.version_info < (3, 11):
    pass


@pytest.mark.parametrize(
    "seconds", [np.float32(0.25), np.int64(2), fractions.Fraction(1, 4)], ids=repr
)
def test_timeouts_and_settings_take_any_real_number(seconds: object) -> None:
    previous = asyncfence.configure()
    try:
        assert asyncfence.configure(poll_cap=seconds).poll_cap == float(seconds)  # type: ignore[arg-type]
    finally:
        asyncfence.configure(poll_cap=previous.poll_cap)
    from asyncfence._config import check_timeout

    assert check_timeout(seconds) == float(seconds)  # type: ignore[arg-type]


def test_booleans_are_not_seconds() -> None:
    with pytest.raises(TypeError, match="poll_cap"):
        asyncfence.configure(poll_cap=np.bool_(True))  # type: ignore[arg-type]


async def test_unknown_strategies_are_refused(queue: Any) -> None:
    fence = asyncfence.record(queue)
    with pytest.raises(ValueError, match="'auto', 'poll', 'park'"):
        await fence.wait(strategy="spin")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="strategy"):
        await fence.wait(strategy=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy"):
        asyncfence.configure(strategy="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["spin_budget", "poll_cap", "recheck_interval"])
def test_settings_beyond_a_float_are_refused_by_name(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a finite number of seconds"):
        asyncfence.configure(**{name: 10**400})  # type: ignore[arg-type]


def test_configure_sets_the_default_strategy() -> None:
    previous = asyncfence.configure()
    try:
        assert previous.strategy == "auto"
        assert asyncfence.configure(strategy="park").strategy == "park"
        assert asyncfence.configure(recheck_interval=0.2).recheck_interval == 0.2
        with pytest.raises(ValueError, match="recheck_interval"):
            asyncfence.configure(recheck_interval=0)
    finally:
        asyncfence.configure(strategy=previous.strategy, recheck_interval=previous.recheck_interval)
