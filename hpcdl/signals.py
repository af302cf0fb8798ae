"""Graceful stop on SIGTERM/SIGUSR1: checkpoint at the next step boundary, then exit cleanly.

Slurm sends a signal before the time limit (``--signal=USR1@120``) and on preemption (SIGTERM).
The handler only sets a flag; the training loop asks :meth:`GracefulStop.requested` after each
step, which combines the flags of all ranks (MPI MAX), so every rank stops at the same step even
when the signal reached only one of them, or reached them at different moments.

Under ``mpirun``: Open MPI forwards SIGUSR1 to every rank, so ``kill -USR1 <mpirun pid>`` is the
way to ask a running job to checkpoint and stop. SIGTERM to mpirun itself is different: mpirun
passes it on and SIGKILLs the ranks one second later (MCA ``odls_base_sigkill_timeout``), which
is enough for a small checkpoint only; the atomic write keeps the previous one safe otherwise.
"""

from __future__ import annotations

import signal
from types import FrameType


class GracefulStop:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, comm) -> None:
        self.comm = comm
        self.received: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def requested(self) -> str | None:
        """The signal name if any rank received one (a collective call: every rank must make it)."""
        from mpi4py import MPI

        signum = self.comm.allreduce(self.received or 0, op=MPI.MAX)
        return signal.Signals(signum).name if signum else None

    def close(self) -> None:
        """Put the previous handlers back (for callers that train several times in one process)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
