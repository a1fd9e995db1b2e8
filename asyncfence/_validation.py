"""Checks of the caller's input, written once: each names the parameter and what it takes."""

from __future__ import annotations

__all__ = ["check_callable", "check_int", "type_name"]


def check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``[minimum, maximum]``.

    Raises:
        TypeError: Not an int.
        ValueError: Out of range; the message gives the range.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__qualname__}")
    if value < minimum or (maximum is not None and value > maximum):
        accepted = f"at least {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {accepted}, got {value}")
    return value


def check_callable(name: str, value: object, *, optional: bool = False) -> None:
    """Refuse ``value`` unless it is callable (or ``None``, where ``optional``).

    Raises:
        TypeError: Not callable.
    """
    if optional and value is None:
        return
    if not callable(value):
        accepted = "None or callable" if optional else "callable"
        raise TypeError(f"{name} must be {accepted}, got {type(value).__qualname__}")


def type_name(value: object) -> str:
    """The full name of ``value``'s type for messages: ``module.qualname``.

    Builtins keep their bare name (``int``, ``str``): ``torch.cpu.Stream`` and
    ``torch.Stream`` read as different types, where ``Stream`` alone would not.
    """
    kind = type(value)
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
