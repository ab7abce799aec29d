"""Checks shared by the records' readers: what a field must be, said in one phrase when it is
not. JSON lets outside hands write anything (``NaN``, ``-5``, ``true`` where a count belongs), so
each reader takes a parsed value through these and keeps the first problem it finds."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TypeGuard

from hpc_train.errors import show


class Bad(ValueError):
    """A field that is not what its record says it is; the message names the field."""


def is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def count(d: Mapping[str, object], key: str, default: int | None = None, lo: int = 0, hi: int = 2**31 - 1) -> int:
    """An integer in ``lo..hi`` (a count, a rank, a step)."""
    v = d.get(key, default)
    if not is_int(v) or not lo <= v <= hi:
        raise Bad(f"{key} is {show(v, 40)}, not an integer from {lo} to {hi}")
    return v


def opt_count(d: Mapping[str, object], key: str, lo: int = 0) -> int | None:
    return None if d.get(key) is None else count(d, key, lo=lo)


def finite(v: object) -> TypeGuard[int | float]:
    """A number that is finite as a float: not a bool, NaN or an infinity, nor an integer too
    big for a float (JSON's integers have no size limit, and ``math.isfinite(10**400)`` raises)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


# A time (seconds since 1970) that time.localtime, a strftime and every duration between two of
# them can take; a record holding one beyond it was written by other hands (1e300 is "finite").
TIME_MAX = 2**34      # the year 2514


def is_time(v: object) -> TypeGuard[int | float]:
    """A time since the epoch, or a duration, in the range any record's time can hold."""
    return finite(v) and 0 <= v < TIME_MAX


def time(d: Mapping[str, object], key: str, default: float | None = None) -> float:
    """A time since the epoch (see :data:`TIME_MAX`)."""
    v = d.get(key, default)
    if not is_time(v):
        raise Bad(f"{key} is {show(v, 40)}, not a time (seconds since 1970)")
    return float(v)


def opt_time(d: Mapping[str, object], key: str) -> float | None:
    return None if d.get(key) is None else time(d, key)


def text(d: Mapping[str, object], key: str, default: str | None = None, choices: tuple[str, ...] = ()) -> str:
    v = d.get(key, default)
    if not isinstance(v, str) or (choices and v not in choices):
        raise Bad(f"{key} is {v!r}, not " + (f"one of {', '.join(choices)}" if choices else "a string"))
    return v


def opt_text(d: Mapping[str, object], key: str) -> str | None:
    return None if d.get(key) is None else text(d, key)


def names(d: Mapping[str, object], key: str) -> tuple[str, ...]:
    """A list of strings (node names)."""
    v = d.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise Bad(f"{key} is {v!r}, not a list of names")
    return tuple(v)


def flag(d: Mapping[str, object], key: str, default: bool = False) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise Bad(f"{key} is {v!r}, not true or false")
    return v
