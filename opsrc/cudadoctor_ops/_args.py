"""Argument checks shared by the Python layers of the ops."""

from __future__ import annotations

from collections.abc import Sequence


def int_pair(value: int | Sequence[int], name: str, op: str, error: type[Exception] = ValueError) -> list[int]:
    """``value`` (an int, or a sequence of one or two ints) as ``[h, w]``; anything else (a bool,
    a float, three values) raises ``error`` naming ``op`` and the argument ``name``."""
    if isinstance(value, bool):
        raise error(f"{op}: {name} must be an int or a pair of ints, got {value!r}")
    if isinstance(value, int):
        return [value, value]
    try:
        vals = list(value)
    except TypeError:
        raise error(f"{op}: {name} must be an int or a pair of ints, got {value!r}") from None
    if len(vals) == 1:
        vals = vals * 2
    if len(vals) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        raise error(f"{op}: {name} must be an int or a pair of ints, got {value!r}")
    return vals
