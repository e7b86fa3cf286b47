"""Type and range checks for config fields, shared by every public config of the lab (engine, sampling, simulator,
workloads): each raises the caller's ``ValueError`` subclass naming the owner, the field, the value and what is
allowed."""
from __future__ import annotations

import math
import numbers

from .errors import InputError
from .user_files import shown


def check_int(owner: str, name: str, value, low: int, high: int | None = None, optional: bool = False,
              error: type[ValueError] = InputError) -> None:
    """An integer (not a bool) in ``[low, high]``; None too when ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or \
            (high is not None and value > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise error(f"{owner}.{name}={shown(value)}: expected {allowed}" + (" or None" if optional else ""))


def check_real(owner: str, name: str, value, low: float, high: float = math.inf, low_open: bool = False,
               allow_inf: bool = False, error: type[ValueError] = InputError) -> None:
    """A real number (not a bool, not NaN; finite unless ``allow_inf``) in ``[low, high]`` (``(low, high]`` when
    ``low_open``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or \
            (math.isinf(value) and not allow_inf) or value < low or value > high or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise error(f"{owner}.{name}={shown(value)}: expected a{'' if allow_inf else ' finite'} number in {interval}")


def check_choice(owner: str, name: str, value, choices, error: type[ValueError] = InputError) -> None:
    """One of ``choices`` (compared only when ``value`` is a string)."""
    if not isinstance(value, str) or value not in choices:
        raise error(f"{owner}.{name}={shown(value)}: expected one of {', '.join(map(str, choices))}")


def check_bool(owner: str, name: str, value, error: type[ValueError] = InputError) -> None:
    if not isinstance(value, bool):
        raise error(f"{owner}.{name}={shown(value)}: expected True or False")
