"""Number ranges, written once: which values a numeric flag or argument accepts, and how to say so.

``float("nan")`` and ``float("inf")`` parse, and NaN fails every comparison, so a check written as
``if x <= 0: error`` lets NaN through to a traceback (or an endless sleep) much later. A
:class:`Range` refuses non-finite values; hpcdl.train's configuration (``valid=`` on each field),
the argparse types below (``argument --seconds: must be a finite number > 0 (got nan)``) and
kfac's constructor arguments all check through it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """An accepted interval (always finite), phrased for the error message."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    label: str = ""  # how the message names the range, when the interval alone would not say enough

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return not (self.high is not None and (value > self.high or (self.high_open and value == self.high)))

    def __str__(self) -> str:
        if self.label:
            return self.label
        if self.low is None and self.high is None:
            return "finite"
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{left}{self.low:g}, {self.high:g}{right}"

    def bounds_text(self) -> str:
        """'>= 1 and <= 5': the range as comparisons (argparse messages)."""
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return " and ".join(parts)


AT_LEAST_1 = Range(1)
NON_NEGATIVE = Range(0)
POSITIVE = Range(0, low_open=True)
FRACTION = Range(0, 1, low_open=True, label="a fraction in (0, 1]")
UNIT_INTERVAL_OPEN_TOP = Range(0, 1, high_open=True)


def real(low: float | None = None, *, low_open: bool = False, high: float | None = None) -> Callable[[str], float]:
    """An argparse type: a finite float within the bounds."""
    accepted = Range(low, high, low_open=low_open)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not accepted.contains(value):
            bounds = accepted.bounds_text()
            raise argparse.ArgumentTypeError(f"must be a finite number{' ' + bounds if bounds else ''} (got {text})")
        return value
    parse.__name__ = "number"
    return parse


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer within the bounds."""
    accepted = Range(low, high)

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not accepted.contains(value):
            raise argparse.ArgumentTypeError(f"must be an integer {accepted.bounds_text()} (got {text})")
        return value
    parse.__name__ = "integer"
    return parse
