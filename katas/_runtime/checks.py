"""Argument checks the references share: each error names the parameter it refuses."""

from __future__ import annotations


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1; else TypeError (not an int, or a bool) or ValueError."""
    if type(value) is not int:  # bool is an int subclass, and never a count or a size
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


__all__ = ["positive_int"]
