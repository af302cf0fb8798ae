"""Byte sizes on the command line and in tables, as OSU benchmarks write them."""

from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from '4', '4B', '64K', '4MB', '256MiB', '1G' (K, M and G are powers of 1024, as in OSU tables)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4, 64K, 4MB, 256M)")
    return int(match.group(1)) * _UNITS[match.group(2)]


def format_size(nbytes: int) -> str:
    """'4 B', '64 KiB', '256 MiB': the largest unit that divides the size exactly."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"
