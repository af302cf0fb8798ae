"""Speaking once under MPI: rank 0 prints, every rank parses the same flags.

Under mpirun every rank runs the same program; a plain ``print`` or argparse error would appear N
times. These are the only ways hpcdl's programs print to the user.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn, TextIO

from hpcdl.runtime.errors import UsageError
from hpcdl.runtime.launcher import current_rank


def print0(*args: Any, sep: str = " ", end: str = "\n", file: TextIO | None = None) -> None:
    """print() on rank 0 only, as one flushed write: a line written in pieces can run into another rank's."""
    if current_rank() == 0:
        out = sys.stdout if file is None else file
        out.write(sep.join(map(str, args)) + end)
        out.flush()


class RankZeroParser(argparse.ArgumentParser):
    """An ArgumentParser for MPI programs: help on rank 0 only, errors as one UsageError line."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if current_rank() == 0:
            super()._print_message(message, file)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see --help)")
