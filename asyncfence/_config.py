"""Process-wide tuning of how fences are waited for."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["Config", "check_timeout", "configure", "current_config"]


@dataclass(frozen=True, slots=True)
class Config:
    """The settings every wait uses unless it says otherwise.

    Attributes:
        spin_budget: Seconds after a wait begins during which the poller
            re-checks at once, yielding to the loop between checks. Short
            device work is seen within microseconds.
        poll_cap: The longest sleep, in seconds, between two checks once the
            spin budget is spent. Sleeps grow exponentially up to it. It
            bounds wake latency for long work, against the CPU the checks
            cost.
    """

    spin_budget: float = 20e-6
    poll_cap: float = 1e-3


_current = Config()


def current_config() -> Config:
    """Return the settings in effect. Thread-safe."""
    return _current


def configure(*, spin_budget: float | None = None, poll_cap: float | None = None) -> Config:
    """Change the process-wide wait settings; omitted ones stay as they are.

    Waits already under way pick up the new values at their next check.

    Thread-safety: safe to call from any thread; each call replaces the whole
    settings object at once.

    Args:
        spin_budget: See :attr:`Config.spin_budget`; zero or more seconds.
        poll_cap: See :attr:`Config.poll_cap`; more than zero seconds.

    Returns:
        The settings now in effect.

    Raises:
        TypeError: A value is not a real number.
        ValueError: A value is negative, NaN or infinite, or ``poll_cap`` is 0.
    """
    global _current
    changes: dict[str, float] = {}
    if spin_budget is not None:
        changes["spin_budget"] = _finite_seconds("spin_budget", spin_budget, allow_zero=True)
    if poll_cap is not None:
        changes["poll_cap"] = _finite_seconds("poll_cap", poll_cap, allow_zero=False)
    _current = replace(_current, **changes)
    return _current


def _finite_seconds(name: str, value: object, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__qualname__}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return seconds


def check_timeout(timeout: object) -> float:
    """Validate a ``timeout`` argument; ``None`` and ``math.inf`` mean no limit.

    Returns:
        The timeout in seconds, ``math.inf`` for no limit.

    Raises:
        TypeError: Not ``None`` or a real number.
        ValueError: Negative or NaN.
    """
    if timeout is None:
        return math.inf
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"timeout must be None or a number of seconds, got {type(timeout).__qualname__}"
        )
    seconds = float(timeout)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
    return seconds
