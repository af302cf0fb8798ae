"""hpcdl's own coordination between ranks, over MPI or over a Gloo group of torch.distributed.

Errors agreed on every rank, the stop flag, metrics, checkpoint broadcasts and the placement
check speak the few words of mpi4py's communicator listed in :class:`GlooComm`. A job that MPI
started (mpirun, srun --mpi=pmix) uses MPI_COMM_WORLD itself; a ``--backend torch`` job that torchrun,
plain srun or a site's MASTER_ADDR/MASTER_PORT started has no MPI, and uses a Gloo group of its own
(never the gradients' group, so that its messages never interleave with DDP's buckets).

:func:`install` records the job's communicator once the world is up; :func:`current` is what code
below the training layer asks for (hpcdl.runtime.errors, hpcdl.runtime.launcher), so that it needs
no import of the world.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_installed: Any = None


def install(comm: Any) -> None:
    """Make ``comm`` the job's communicator (hpcdl.runtime.world does, once the world is up)."""
    global _installed
    _installed = comm


def current() -> Any:
    """The job's communicator: the installed one, else MPI_COMM_WORLD where mpi4py has initialised MPI, else None
    (one process, nothing started)."""
    if _installed is not None:
        return _installed
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        return mpi.COMM_WORLD
    return None


def several() -> Any:
    """The job's communicator when the job has more than one rank, else None."""
    comm = current()
    return comm if comm is not None and comm.Get_size() > 1 else None


class GlooComm:
    """The part of mpi4py's communicator that hpcdl's coordination uses, over a Gloo process group.

    Reductions add the ranks' values in rank order, so that every rank gets the same bits, as MPI's
    do. ``Abort`` ends this process at once: the launcher (torchrun's agent, srun --kill-on-bad-exit)
    ends the others, and so do their next collectives, whose peer is gone.
    """

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group = group
        self.rank = rank
        self.size = size

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names, so that either communicator fits
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def allgather(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        if self.size == 1:
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def bcast(self, value: Any, root: int = 0) -> Any:
        import torch.distributed as dist

        if self.size == 1:
            return value
        box = [value if self.rank == root else None]
        dist.broadcast_object_list(box, src=root, group=self.group)
        return box[0]

    def gather(self, value: Any, root: int = 0) -> list[Any] | None:
        gathered = self.allgather(value)  # small objects (RNG states): the simplest correct way over Gloo
        return gathered if self.rank == root else None

    def allreduce(self, value: Any, op: Any = None) -> Any:
        """The sum of every rank's ``value`` in rank order (``op``: only a sum; MPI.SUM and None both mean it)."""
        parts = self.allgather(value)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> None:  # noqa: N802
        """Sum numpy arrays over the ranks into ``recvbuf``."""
        recvbuf[...] = self.allreduce(sendbuf.copy())

    def Barrier(self) -> None:  # noqa: N802
        import torch.distributed as dist

        if self.size > 1:
            dist.barrier(group=self.group)

    def Dup(self) -> GlooComm:  # noqa: N802
        return self  # the watchdog's heartbeats do not travel here (hpcdl.runtime.watchdog)

    def Abort(self, code: int = 1) -> None:  # noqa: N802
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
