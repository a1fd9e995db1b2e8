"""Process-wide tuning of how fences are waited for."""

from __future__ import annotations

import math
import numbers
import sys
import threading
from dataclasses import dataclass, replace
from typing import Literal, get_args

from ._fork import renew_after_fork

__all__ = [
    "STRATEGIES",
    "Config",
    "Strategy",
    "check_seconds",
    "check_strategy",
    "check_timeout",
    "configure",
    "current_config",
]

Strategy = Literal["auto", "poll", "park"]
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)


@dataclass(frozen=True, slots=True)
class Config:
    """The settings every wait uses unless it says otherwise.

    Attributes:
        strategy: How waits wait, unless a wait names its own. What each
            does and when it fits: ``docs/waiting.md``
            ([How waiting works][how-waiting-works]).

            * ``"auto"`` (the default): re-check for the spin budget, then park.
            * ``"poll"``: re-check for the spin budget, then poll on the loop.
            * ``"park"``: park at once, until the completion signal.
        spin_budget: Seconds after a wait begins during which the poller
            re-checks at once, yielding to the loop between checks. Short
            device work is seen within microseconds.
        poll_cap: The longest sleep, in seconds, between two checks once the
            spin budget is spent under ``"poll"``. Sleeps grow exponentially
            up to it. It bounds wake latency for long work, against the CPU
            the checks cost. Parked fences that have no completion signal
            (where the native wake shim is not built, or the runtime cannot
            arm one) are re-checked the same way: sleeps growing up to it.
        recheck_interval: How often, in seconds, each parked stream is
            re-queried by the loop's own timer, whatever the signals say. It
            is a safety net for a device fault, which sends no signal. Each
            stream is on its own schedule: while its re-checks find nothing
            settled and no new wait parks on it, its interval doubles, up
            to 8 times this (0.4 s by default): a parked waiter sees a fault
            within ``recheck_interval`` of parking, and within 8 times it
            however long it has waited, plus its turn: a loop turn
            re-checks at most 16 of the due streams, 10,000 a second, so the
            cost follows what is due, not what is parked, and a stream may
            wait ``due streams / 10,000`` seconds more (0.1 s when 1,000 park
            at once). With more than 4,000 streams parked, each is
            re-checked every ``streams / 10,000`` seconds instead.
    """

    strategy: Strategy = "auto"
    spin_budget: float = 200e-6
    poll_cap: float = 1e-3
    recheck_interval: float = 0.05


_current = Config()
# Serialises configure()'s read-modify-write; readers need no lock.
_configure_lock = threading.Lock()
renew_after_fork(sys.modules[__name__], "_configure_lock")


def current_config() -> Config:
    """Return the settings in effect. Thread-safe."""
    return _current


def configure(
    *,
    strategy: Strategy | None = None,
    spin_budget: float | None = None,
    poll_cap: float | None = None,
    recheck_interval: float | None = None,
) -> Config:
    """Change the process-wide wait settings; omitted ones stay as they are.

    Waits already under way pick up the new values at their next check.

    Thread-safety: safe to call from any thread; each call replaces the whole
    settings object at once.

    Args:
        strategy: See :attr:`Config.strategy`: ``"auto"``, ``"poll"`` or
            ``"park"``.
        spin_budget: See :attr:`Config.spin_budget`; zero or more seconds.
        poll_cap: See :attr:`Config.poll_cap`; more than zero seconds.
        recheck_interval: See :attr:`Config.recheck_interval`; more than zero
            seconds.

    Returns:
        The settings now in effect.

    Raises:
        TypeError: A value is not a real number, or the strategy not a string.
        ValueError: A value is negative, NaN or infinite, ``poll_cap`` or
            ``recheck_interval`` is 0, or the strategy is unknown.
    """
    global _current
    changes: dict[str, object] = {}
    if strategy is not None:
        changes["strategy"] = check_strategy(strategy)
    if spin_budget is not None:
        changes["spin_budget"] = _finite_seconds("spin_budget", spin_budget, allow_zero=True)
    if poll_cap is not None:
        changes["poll_cap"] = _finite_seconds("poll_cap", poll_cap, allow_zero=False)
    if recheck_interval is not None:
        changes["recheck_interval"] = _finite_seconds(
            "recheck_interval", recheck_interval, allow_zero=False
        )
    with _configure_lock:
        _current = replace(_current, **changes)  # type: ignore[arg-type]
        return _current


def _is_real(value: object) -> bool:
    """A real number of seconds: int, float, NumPy scalars, Fraction; not bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _seconds(value: numbers.Real) -> float:
    """``value`` as a float; beyond a float's range, infinite (with its sign)."""
    try:
        return float(value)
    except OverflowError:  # an int (or Fraction) too large for a float
        return math.inf if value > 0 else -math.inf  # type: ignore[operator]


def _finite_seconds(name: str, value: object, *, allow_zero: bool) -> float:
    if not _is_real(value):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__qualname__}")
    seconds = _seconds(value)  # type: ignore[arg-type]
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return seconds


def check_seconds(name: str, value: object) -> float:
    """Validate ``name``, a finite number of seconds, zero or more.

    Raises:
        TypeError: Not a real number.
        ValueError: Negative, NaN or infinite.
    """
    return _finite_seconds(name, value, allow_zero=True)


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
    if not _is_real(timeout):
        raise TypeError(
            f"timeout must be None or a number of seconds, got {type(timeout).__qualname__}"
        )
    seconds = _seconds(timeout)  # type: ignore[arg-type]  # beyond a float: no limit
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
    return seconds


def check_strategy(strategy: object) -> Strategy:
    """Validate a strategy name.

    Raises:
        TypeError: Not a string.
        ValueError: Not one of ``"auto"``, ``"poll"``, ``"park"``.
    """
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be a string, got {type(strategy).__qualname__}")
    for known in STRATEGIES:
        if strategy == known:
            return known
    raise ValueError(
        f"strategy must be one of {', '.join(map(repr, STRATEGIES))}; got {strategy!r}"
    )
