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


def naive_allreduce(
    buf: Buffer, comm: MPI.Comm = MPI.COMM_WORLD, op: MPI.Op = MPI.SUM, *, average: bool = False
) -> Buffer:
    """Allreduce ``buf`` (numpy array or CPU tensor) by reduce-to-root then broadcast; returns a new buffer."""
    call = prepare("naive_allreduce", buf, comm, op, average)
    reduce_then_broadcast(call.source, call.result, p2p.private_comm(comm), call.combine)
    return call.finish()


def reduce_then_broadcast(source: np.ndarray, result: np.ndarray, comm: MPI.Comm, combine: Combine) -> None:
    """Every rank's ``result`` becomes the reduction of all ranks' ``source``."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or source.size == 0:
        np.copyto(result, source)
        return
    if rank == ROOT:
        incoming = np.empty_like(source)
        mine = source
        for sender in range(size):  # in rank order, so the result does not depend on arrival order
            if sender != ROOT:
                p2p.receive(comm, incoming, sender)
                combine(mine, incoming, out=result)
                mine = result
        requests = [p2p.isend(comm, result, dest) for dest in range(size) if dest != ROOT]
        MPI.Request.Waitall(requests)
    else:
        p2p.send(comm, source, ROOT)
        p2p.receive(comm, result, ROOT)
