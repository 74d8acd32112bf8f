"""Learned policy state as JSON: what `Policy.state_dict` writes and how a saved value is
checked against the shape of the attribute it replaces (numbers and nested lists only)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from specdraft.learning.goodput import is_number


def _numeric(value: Any) -> bool:
    """Numbers, or (nested) lists of numbers: the only shapes learned state takes."""
    if isinstance(value, list):
        return all(_numeric(v) for v in value)
    return is_number(value) or value is None


def restored(key: str, current: Any, value: Any) -> Any:
    """`value` from JSON in the shape of the attribute it replaces, or ValueError."""
    if not _numeric(value):
        raise ValueError(f"state field {key}: expected numbers, got {value!r}"[:200])
    if is_number(current):
        if not is_number(value):
            raise ValueError(f"state field {key}: expected a number")
        return value
    if not isinstance(value, list):
        raise ValueError(f"state field {key}: expected a list")
    if isinstance(current, deque):  # JSON has no deque: keep the window's maxlen, entries as tuples
        return deque((tuple(v) if isinstance(v, list) else v for v in value), maxlen=current.maxlen)
    return type(current)(value)


def jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)) or hasattr(value, "__iter__") and not isinstance(value, (str, dict)):
        return [jsonable(v) for v in value]
    return value
