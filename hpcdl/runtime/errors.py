"""How hpcdl programs fail: one line for bad input, a whole-job abort for a crashed rank.

Two kinds of failure need two behaviours under MPI:

* UsageError -- bad flags, paths, data or world sizes. Every rank reaches the same verdict
  (checks run on every rank, or through :func:`agree`), so rank 0 prints one line and every
  rank exits with status 2 by itself: no traceback wall, no MPI_Abort noise.
* Anything else raised on one rank -- a bug, a failing disk, a fault injected on purpose.
  The other ranks would wait for it forever in the next collective, so the failing rank
  prints one line naming itself and the cause (after the traceback, for what may be a bug) and
  calls MPI_Abort, which ends every rank of the job. Running out of memory and I/O errors
  (a corrupt image file, a vanished mount) are not bugs: their message is the whole story, so
  they get the line without the traceback (HPCDL_TRACEBACK=1 shows it anyway).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

EXIT_USAGE = 2
EXIT_CRASH = 1


class UsageError(Exception):
    """Bad input the user can fix; the message is the whole story."""


# Launchers announce the global rank before MPI is initialised (flags are checked before that).
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


def current_rank() -> int:
    """This process's global rank: MPI's once initialised, else the launcher's variable, else 0."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and mpi.COMM_WORLD.Get_size() > 1:
        return mpi.COMM_WORLD.Get_rank()
    for name in RANK_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def agree(check: Callable[[], T]) -> T:
    """Run ``check`` on every rank and make its UsageError everyone's.

    For checks whose outcome can differ between ranks (a file only one node cannot read):
    every rank raises the same UsageError, naming the first rank that failed, so none is
    left waiting in a later collective.
    """
    from mpi4py import MPI

    error: str | None = None
    result: T | None = None
    try:
        result = check()
    except UsageError as exc:
        error = str(exc)
    errors = MPI.COMM_WORLD.allgather(error)
    for rank, message in enumerate(errors):
        if message is not None:
            prefix = f"rank {rank}: " if MPI.COMM_WORLD.Get_size() > 1 and rank != 0 else ""
            raise UsageError(prefix + message)
    return result  # type: ignore[return-value]


def is_environmental(exc: BaseException) -> bool:
    """Out of memory (host or GPU) or an I/O error: the machine's doing, not a bug in the code."""
    return isinstance(exc, (MemoryError, OSError)) or type(exc).__name__ == "OutOfMemoryError"


def describe(exc: BaseException) -> str:
    """``Type: message`` on one line. DataLoader workers re-raise with the worker's whole traceback
    in the message; its last line is the actual error."""
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if "Original Traceback" in text and lines:
        return lines[-1]
    kind = "out of memory" if type(exc).__name__ in ("MemoryError", "OutOfMemoryError") else type(exc).__name__
    return f"{kind}: {lines[0]}" if lines else kind


def run_main(main: Callable[[], int | None], program: str = "hpcdl") -> None:
    """Call ``main`` and exit with the right behaviour for each kind of failure."""
    try:
        code = main() or 0
    except UsageError as exc:
        if current_rank() == 0:
            print(f"{program}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    except KeyboardInterrupt:
        sys.exit(130)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - any crash on one rank must end the whole job
        rank = current_rank()
        if not is_environmental(exc) or os.environ.get("HPCDL_TRACEBACK") == "1":
            traceback.print_exc()
        print(
            f"{program}: rank {rank} failed with {describe(exc)}; aborting the whole job", file=sys.stderr, flush=True
        )
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and mpi.COMM_WORLD.Get_size() > 1:
            mpi.COMM_WORLD.Abort(EXIT_CRASH)
        sys.exit(EXIT_CRASH)
    sys.exit(code)
