"""Command-line helpers for MPI programs: argument parsing that speaks once, and byte sizes.

Under mpirun every rank parses the same command line. A plain argparse parser would print
its usage or error N times; this one prints help on rank 0 only and turns errors into
hpcdl.errors.UsageError, which hpcdl.errors.run_main reports in one line from rank 0 while
every rank exits by itself: a typo ends the job quickly and quietly, without MPI_Abort.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, NoReturn

from mpi4py import MPI

from hpcdl.errors import UsageError

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


class RankZeroParser(argparse.ArgumentParser):
    """An ArgumentParser for MPI programs: help and errors are printed by rank 0 only."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see --help)")
