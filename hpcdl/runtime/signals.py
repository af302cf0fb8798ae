"""Graceful stop on SIGINT, SIGTERM and SIGUSR1: checkpoint at the next check, name the rank, exit.

Slurm sends a signal before the time limit (``--signal=USR1@120``) and on preemption (SIGTERM); a
user presses Ctrl-C (SIGINT). The handler only sets a flag; the training loop asks
:meth:`GracefulStop.requested`, a collective that gathers every rank's flag, so every rank stops
at the same step even when the signal reached only one of them, and the line printed can name
the ranks that received it.

Exit codes (:data:`EXIT_CODES`, docs/reliability.md): 0 after SIGTERM or SIGUSR1 -- the scheduler
asked for a checkpoint and got one, and a batch script that requeues on success must not see a
failure -- and 130 (128 + SIGINT, the shell's convention) after SIGINT, so that ``train && next``
does not carry on as if training had finished when a person interrupted it.

A second SIGINT on the same rank is not a request: the first one put the default action back, so
the second ends the process at once, even inside a C call (a blocked collective, a stuck file
system), without a checkpoint; the previous checkpoint is intact and the run directory's lock
is taken over by the next run (its pid is gone).

Under ``mpirun`` (Open MPI 4.1.4, measured): Ctrl-C reaches mpirun only (each rank has its own
process group), and mpirun does not forward SIGINT: it sends the ranks SIGCONT at once, SIGTERM
one second later and SIGKILL one second after that (MCA ``odls_base_sigkill_timeout``), and
exits 1. A rank that checks within that second stops as for SIGTERM. ``kill -USR1 <mpirun pid>``
is forwarded to every rank and gives them all the time they need.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from types import FrameType
from typing import Any

EXIT_CODES: dict[signal.Signals, int] = {signal.SIGTERM: 0, signal.SIGUSR1: 0, signal.SIGINT: 130}
# When ranks received different signals, the first of these names the stop (and its exit code):
# a person's Ctrl-C outranks the scheduler's notice.
PRIORITY = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def _ranks(ranks: list[int], world_size: int) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) == world_size:
        return f"all {world_size} ranks"
    return "ranks " + ", ".join(str(r) for r in ranks)


@dataclass(frozen=True)
class StopRequest:
    """Which signal stops the run and which ranks received one (by rank: the signal's name, or None)."""

    signal: signal.Signals
    by_rank: tuple[str | None, ...]

    @property
    def name(self) -> str:
        return self.signal.name

    @property
    def ranks(self) -> list[int]:
        """The ranks that received any of the stop signals."""
        return [rank for rank, name in enumerate(self.by_rank) if name is not None]

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.signal]

    def describe(self) -> str:
        """E.g. ``SIGINT received by rank 1`` or ``SIGTERM received by all 4 ranks``."""
        names = [n for n in self.by_rank if n is not None]
        size = len(self.by_rank)
        if len(set(names)) == 1:
            return f"{names[0]} received by {_ranks(self.ranks, size)}"
        parts = [f"{sig.name} by {_ranks([r for r, n in enumerate(self.by_rank) if n == sig.name], size)}"
                 for sig in PRIORITY if sig.name in names]
        return "signals received: " + ", ".join(parts)

    def __str__(self) -> str:  # what earlier callers printed ("SIGTERM received: ...")
        return self.name


class GracefulStop:
    """Install the handlers; ask :meth:`requested` (every rank) whether to stop; :meth:`close` to undo."""

    SIGNALS = PRIORITY

    def __init__(self, comm: Any = None) -> None:
        self.comm = comm
        self.received: set[signal.Signals] = set()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        self.received.add(sig)
        if sig == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends the process at once

    def mine(self) -> signal.Signals | None:
        """The signal this rank received that names a stop (no communication)."""
        return next((sig for sig in PRIORITY if sig in self.received), None)

    def requested(self) -> StopRequest | None:
        """Whether any rank received a stop signal, and which ranks (a collective: every rank must call it)."""
        mine = self.mine()
        if self.comm is None or self.comm.Get_size() == 1:
            everyone = [int(mine) if mine else 0]
        else:
            everyone = self.comm.allgather(int(mine) if mine else 0)
        if not any(everyone):
            return None
        by_rank = tuple(signal.Signals(s).name if s else None for s in everyone)
        deciding = next(sig for sig in PRIORITY if int(sig) in everyone)
        return StopRequest(deciding, by_rank)

    @staticmethod
    def exit_code(sig: signal.Signals | str) -> int:
        """The documented exit status after a graceful stop by ``sig``."""
        return EXIT_CODES[signal.Signals[sig] if isinstance(sig, str) else sig]

    def close(self) -> None:
        """Put the previous handlers back (for callers that train several times in one process)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
