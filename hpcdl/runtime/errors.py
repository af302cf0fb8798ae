"""How hpcdl programs fail: a class per kind of failure, each with its own exit behaviour.

Two behaviours are needed under MPI:

* :class:`JobError` -- a failure every rank agrees on: bad input (:class:`UsageError`), a run
  that diverged (:class:`DivergenceError`), a write that failed (:class:`StorageError`), an
  output directory held by another run (:class:`LockHeldError`). Every rank reaches the same
  verdict (checks run on every rank, or through :func:`agree` or :func:`rank0_then_all`), so
  rank 0 prints one line and every rank exits with status 2 by itself: no traceback wall, no
  MPI_Abort noise.
* Anything else raised on one rank -- a bug, a failing disk, a fault injected on purpose, a rank
  that lost the others (:class:`LostRankError`). The other ranks would wait for it forever in the
  next collective, so the failing rank prints one line naming itself and the cause (after the
  traceback, for what may be a bug) and calls MPI_Abort, which ends every rank of the job (in a job
  without MPI it exits at once; torchrun or srun --kill-on-bad-exit ends the others, and so do their
  next collectives).
  Running out of memory, I/O errors (a corrupt image file, a vanished mount) and a lost rank are
  not bugs: their message is the whole story, so they get the line without the traceback
  (HPCDL_TRACEBACK=1 shows it anyway).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from hpcdl.runtime import coordination
from hpcdl.runtime.launcher import current_rank, launched
from hpcdl.runtime.shutdown import end_process

T = TypeVar("T")

EXIT_USAGE = 2
EXIT_CRASH = 1


class JobError(Exception):
    """A failure every rank agrees on: rank 0 prints the message as one line, each rank exits with ``exit_code``."""

    exit_code = EXIT_USAGE


class UsageError(JobError):
    """Bad input the user can fix (flags, paths, data, world sizes); the message is the whole story."""


class DivergenceError(JobError):
    """Training diverged: loss, gradients or metrics stayed non-finite. Checkpoints are not overwritten."""


class StorageError(JobError):
    """A checkpoint or results file could not be written (full disk, quota, permissions); earlier files are intact."""


class LockHeldError(JobError):
    """The output directory belongs to another live run."""


class LostRankError(Exception):
    """Another rank of the job is gone (killed, crashed, shut Horovod down): this rank ends the job, one line."""


def agree(check: Callable[[], T]) -> T:
    """Run ``check`` on every rank and make its JobError everyone's.

    For checks whose outcome can differ between ranks (a file only one node cannot read):
    every rank raises the same error, of the same class, naming the first rank that failed, so
    none is left waiting in a later collective.
    """
    error: tuple[type[JobError], str] | None = None
    result: T | None = None
    try:
        result = check()
    except JobError as exc:
        error = (type(exc), str(exc))
    comm = coordination.several()
    errors = comm.allgather(error) if comm is not None else [error]
    for rank, found in enumerate(errors):
        if found is not None:
            kind, message = found
            prefix = f"rank {rank}: " if rank != 0 else ""
            raise kind(prefix + message)
    return result  # type: ignore[return-value]


def rank0_then_all(attempt: Callable[[], T], comm: Any) -> T:
    """Run ``attempt`` on rank 0 only; every rank returns its result or raises its JobError (same class and line).

    For work that only rank 0 does (writing a file, reading a checkpoint, taking a lock) while the
    other ranks must not run on without knowing how it went. ``comm`` None: this process alone.
    """
    outcome: tuple[Any, tuple[type[JobError], str] | None] = (None, None)
    if comm is None or comm.Get_rank() == 0:
        try:
            outcome = (attempt(), None)
        except JobError as exc:
            outcome = (None, (type(exc), str(exc)))
    if comm is not None and comm.Get_size() > 1:
        outcome = comm.bcast(outcome, root=0)
    result, error = outcome
    if error is not None:
        kind, message = error
        raise kind(message)
    return result


def is_environmental(exc: BaseException) -> bool:
    """Out of memory (host or GPU), an I/O error or a lost rank: the machine's doing, not a bug in the code."""
    return isinstance(exc, (MemoryError, OSError, LostRankError)) or type(exc).__name__ == "OutOfMemoryError"


def describe(exc: BaseException) -> str:
    """``Type: message`` on one line. DataLoader workers re-raise with the worker's whole traceback
    in the message; its last line is the actual error."""
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if "Original Traceback" in text and lines:
        return lines[-1]
    kind = "out of memory" if type(exc).__name__ in ("MemoryError", "OutOfMemoryError") else type(exc).__name__
    return f"{kind}: {lines[0]}" if lines else kind


def run_main(main: Callable[[], int | None], program: str = "hpcdl", whole_program: bool = False) -> NoReturn:
    """Call ``main`` and exit with the right behaviour for each kind of failure. ``whole_program``: this call is
    the process's last (an entry point), so a process that ran torch.distributed's collectives leaves without
    interpreter finalization (:mod:`hpcdl.runtime.shutdown`); otherwise SystemExit, which a caller may catch."""

    def leave(code: int) -> NoReturn:
        if whole_program:
            end_process(code)
        sys.exit(code)

    try:
        code = main() or 0
    except JobError as exc:
        if current_rank() == 0:
            print(f"{program}: error: {exc}", file=sys.stderr, flush=True)
        leave(exc.exit_code)
    except KeyboardInterrupt:
        leave(130)
    except SystemExit as exc:
        if whole_program and (exc.code is None or isinstance(exc.code, int)):
            leave(exc.code or 0)
        raise
    except BaseException as exc:  # noqa: BLE001 - any crash on one rank must end the whole job
        rank = current_rank()
        if not is_environmental(exc) or os.environ.get("HPCDL_TRACEBACK") == "1":
            traceback.print_exc()
        what = f"stops: {exc}" if isinstance(exc, LostRankError) else f"failed with {describe(exc)}"
        comm = coordination.several()
        if not launched() and comm is None:
            print(f"{program}: {what}", file=sys.stderr, flush=True)  # one process: no ranks, no job to abort
            leave(EXIT_CRASH)
        print(f"{program}: rank {rank} {what}; aborting the whole job", file=sys.stderr, flush=True)
        if comm is not None:
            comm.Abort(EXIT_CRASH)
        leave(EXIT_CRASH)
    leave(code)
