"""Number arguments every command-line tool checks the same way: finite, in range, one line otherwise.

``float("nan")`` and ``float("inf")`` parse, and NaN fails every comparison, so a check written as
``if x <= 0: error`` lets NaN through to a traceback (or an endless sleep) much later. These argparse
types refuse it where the flag is read: ``argument --seconds: must be a finite number > 0 (got nan)``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _range_text(low: float | None, low_open: bool, high: float | None) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        parts.append(f"<= {high:g}")
    return " and ".join(parts)


def real(low: float | None = None, *, low_open: bool = False, high: float | None = None) -> Callable[[str], float]:
    """An argparse type: a finite float within the bounds."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        bounds = _range_text(low, low_open, high)
        if (not math.isfinite(value) or (low is not None and (value < low or (low_open and value == low)))
                or (high is not None and value > high)):
            raise argparse.ArgumentTypeError(f"must be a finite number{' ' + bounds if bounds else ''} (got {text})")
        return value
    parse.__name__ = "number"
    return parse


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer within the bounds."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {_range_text(low, False, high)} (got {text})")
        return value
    parse.__name__ = "integer"
    return parse
