"""hpcdl.runtime.numbers: the one range rule behind hpcdl.train's flags, the tools' argparse types and
kfac's arguments, checked against a plain comparison written out here."""

from __future__ import annotations

import argparse
import itertools
import math

import pytest

from hpcdl.runtime.numbers import FRACTION, POSITIVE, Range, integer, real

VALUES = [-1.0, 0.0, 0.5, 1.0, 2.0, math.nan, math.inf, -math.inf]


def reference(value: float, low: float | None, high: float | None, low_open: bool, high_open: bool) -> bool:
    if math.isnan(value) or math.isinf(value):
        return False
    above = low is None or (value > low if low_open else value >= low)
    below = high is None or (value < high if high_open else value <= high)
    return above and below


@pytest.mark.parametrize(("low", "high", "low_open", "high_open"),
                         list(itertools.product([None, 0.0], [None, 1.0], [False, True], [False, True])))
def test_contains_agrees_with_plain_comparisons(low, high, low_open, high_open) -> None:
    accepted = Range(low, high, low_open=low_open, high_open=high_open)
    for value in VALUES:
        assert accepted.contains(value) == reference(value, low, high, low_open, high_open), (accepted, value)


def test_the_range_says_itself_as_the_messages_need() -> None:
    assert (str(POSITIVE), str(Range(1)), str(Range(0, 1, high_open=True)), str(FRACTION)) == (
        "> 0", ">= 1", "[0, 1)", "a fraction in (0, 1]")
    assert str(Range(high=3)) == "<= 3" and Range(1, 5).bounds_text() == ">= 1 and <= 5"


def test_the_argparse_types_refuse_through_the_same_rule() -> None:
    assert real(0, low_open=True)("0.5") == 0.5 and integer(1, 3)("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be a finite number > 0 \(got nan\)"):
        real(0, low_open=True)("nan")
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be an integer >= 1 and <= 3 \(got 4\)"):
        integer(1, 3)("4")
    with pytest.raises(argparse.ArgumentTypeError, match="not an integer"):
        integer()("1.5")
