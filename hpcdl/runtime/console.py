"""Speaking once under MPI: rank 0 prints, every rank parses the same flags.

Under mpirun every rank runs the same program; a plain ``print`` or argparse error would appear N
times. These are the only ways hpcdl's programs print to the user.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from hpcdl.runtime.errors import UsageError, current_rank


def print0(*args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only, flushed so that output interleaves sensibly under mpirun."""
    if current_rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


class RankZeroParser(argparse.ArgumentParser):
    """An ArgumentParser for MPI programs: help on rank 0 only, errors as one UsageError line."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if current_rank() == 0:
            super()._print_message(message, file)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see --help)")
