"""Ring allreduce: a reduce-scatter followed by an allgather around a logical ring.

The buffer is cut into N chunks. In the reduce-scatter, at each of N-1 steps every rank
sends one chunk to its right neighbour and adds the chunk arriving from its left one; after
it, rank r holds the complete sum of chunk r+1. The allgather then passes the finished chunks
round the ring in N-1 more steps. Each rank sends 2(N-1)/N of the buffer in 2(N-1) steps,
whatever N is: this is why the ring's bandwidth term does not grow with the number of ranks.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
from mpi4py import MPI

from hpcdl.collectives import pointtopoint as p2p
from hpcdl.collectives.arguments import Combine, prepare

Buffer = TypeVar("Buffer")


def ring_allreduce(
    buf: Buffer, comm: MPI.Comm = MPI.COMM_WORLD, op: MPI.Op = MPI.SUM, *, average: bool = False
) -> Buffer:
    """Allreduce ``buf`` (numpy array or CPU tensor) around a ring; returns a new buffer."""
    call = prepare("ring_allreduce", buf, comm, op, average)
    reduce_scatter_allgather(call.source, call.result, p2p.private_comm(comm), call.combine)
    return call.finish()


def reduce_scatter_allgather(source: np.ndarray, result: np.ndarray, comm: MPI.Comm, combine: Combine) -> None:
    """Every rank's ``result`` becomes the reduction of all ranks' ``source``."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or source.size == 0:
        np.copyto(result, source)
        return
    bounds = p2p.chunk_bounds(source.size, size)  # chunk 0 is the longest
    right, left = (rank + 1) % size, (rank - 1) % size

    def chunk(array: np.ndarray, index: int) -> np.ndarray:
        index %= size
        return array[bounds[index] : bounds[index + 1]]

    # Chunks differ in length by at most one element, so one segment count fits every message.
    segments = p2p.segment_count(int(bounds[1] - bounds[0]), source.itemsize)
    # Reduce-scatter. Each chunk arrives here once, and is then combined with our own data
    # straight into `result`; at step 0 we send our own data, later the sums made a step before.
    # Afterwards chunk rank+1 is complete here.
    for step in range(size - 1):
        outgoing = chunk(source if step == 0 else result, rank - step)
        arriving = rank - step - 1
        p2p.sendrecv_reduce(
            comm, outgoing, right, chunk(source, arriving), chunk(result, arriving), left, combine, segments
        )
    # Allgather: pass the complete chunks on round the ring.
    for step in range(size - 1):
        p2p.sendrecv(comm, chunk(result, rank + 1 - step), right, chunk(result, rank - step), left)
