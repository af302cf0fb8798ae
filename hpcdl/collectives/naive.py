"""The naive allreduce of the course material: sum everything on one rank, then copy it back.

Rank 0 receives every other rank's buffer in turn and adds it to its own, then sends the
total to everyone. Simple and correct, but rank 0 moves 2(N-1) full buffers while the others
idle, so its time grows linearly with the number of ranks: the baseline the ring improves on.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
from mpi4py import MPI

from hpcdl.collectives import pointtopoint as p2p
from hpcdl.collectives.arguments import Combine, prepare

Buffer = TypeVar("Buffer")
ROOT = 0


def naive_allreduce(buf: Buffer, comm: MPI.Comm = MPI.COMM_WORLD, op: MPI.Op = MPI.SUM, *, average: bool = False) -> Buffer:
    """Allreduce ``buf`` (numpy array or CPU tensor) by reduce-to-root then broadcast; returns a new buffer."""
    call = prepare("naive_allreduce", buf, comm, op, average)
    reduce_then_broadcast(call.work, p2p.private_comm(comm), call.combine)
    return call.finish()


def reduce_then_broadcast(work: np.ndarray, comm: MPI.Comm, combine: Combine) -> None:
    """In place: every rank's ``work`` becomes the reduction of all ranks' ``work``."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or work.size == 0:
        return
    if rank == ROOT:
        incoming = np.empty_like(work)
        for source in range(size):  # in rank order, so the result does not depend on arrival order
            if source != ROOT:
                p2p.receive(comm, incoming, source)
                combine(work, incoming, out=work)
        requests = [p2p.isend(comm, work, dest) for dest in range(size) if dest != ROOT]
        MPI.Request.Waitall(requests)
    else:
        p2p.send(comm, work, ROOT)
        p2p.receive(comm, work, ROOT)
