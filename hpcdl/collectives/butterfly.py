"""Butterfly allreduces: recursive doubling (small messages) and Rabenseifner's (large messages).

Both pair rank v with rank v XOR 2^k at step k, so they finish in log2(N) steps instead of the
ring's 2(N-1): what matters when per-message latency dominates.

- Recursive doubling exchanges the whole buffer at every step: log2(N) latencies but
  log2(N) full buffers sent. Best for small messages.
- Rabenseifner's algorithm halves the data at every step instead (recursive-halving
  reduce-scatter, then recursive-doubling allgather): 2 log2(N) latencies and, like the
  ring, 2(N-1)/N of the buffer sent.

Butterflies need a power-of-two number of ranks. With N = 2^k + r, the first 2r ranks pair up
first: each even one hands its buffer to its odd neighbour and sits out, the remaining 2^k ranks
run the butterfly, and the odd ranks hand the result back at the end (``Fold``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from mpi4py import MPI

from hpcdl.collectives import pointtopoint as p2p
from hpcdl.collectives.arguments import Combine, prepare

Buffer = TypeVar("Buffer")


def recursive_doubling_allreduce(
    buf: Buffer, comm: MPI.Comm = MPI.COMM_WORLD, op: MPI.Op = MPI.SUM, *, average: bool = False
) -> Buffer:
    """Allreduce ``buf`` (numpy array or CPU tensor) by recursive doubling; returns a new buffer."""
    call = prepare("recursive_doubling_allreduce", buf, comm, op, average)
    recursive_doubling_in_place(call.work, p2p.private_comm(comm), call.combine)
    return call.finish()


def rabenseifner_allreduce(
    buf: Buffer, comm: MPI.Comm = MPI.COMM_WORLD, op: MPI.Op = MPI.SUM, *, average: bool = False
) -> Buffer:
    """Allreduce ``buf`` (numpy array or CPU tensor) by Rabenseifner's algorithm; returns a new buffer."""
    call = prepare("rabenseifner_allreduce", buf, comm, op, average)
    rabenseifner_in_place(call.work, p2p.private_comm(comm), call.combine)
    return call.finish()


@dataclass(frozen=True)
class Fold:
    """How N ranks map onto the largest power of two ``members`` <= N that runs the butterfly."""

    size: int
    rank: int

    @property
    def members(self) -> int:
        return 1 << (self.size.bit_length() - 1)

    @property
    def folded(self) -> int:
        """The ranks below this one pair up (0 with 1, 2 with 3, ...) before the butterfly."""
        return 2 * (self.size - self.members)

    @property
    def sits_out(self) -> bool:
        return self.rank < self.folded and self.rank % 2 == 0

    @property
    def member_rank(self) -> int:
        """This rank's place among the butterfly's members (meaningless if it sits out)."""
        return self.rank // 2 if self.rank < self.folded else self.rank - self.folded // 2

    def real_rank(self, member_rank: int) -> int:
        """The communicator rank of a butterfly member."""
        return 2 * member_rank + 1 if member_rank < self.folded // 2 else member_rank + self.folded // 2

    def fold_in(self, comm: MPI.Comm, work: np.ndarray, combine: Combine) -> None:
        """Even ranks below ``folded`` give their buffer to their odd neighbour, which reduces it in."""
        if self.rank >= self.folded:
            return
        if self.sits_out:
            p2p.send(comm, work, self.rank + 1)
        else:
            incoming = np.empty_like(work)
            p2p.receive(comm, incoming, self.rank - 1)
            combine(work, incoming, out=work)

    def fold_out(self, comm: MPI.Comm, work: np.ndarray) -> None:
        """The odd neighbours hand the finished result back to the ranks that sat out."""
        if self.rank >= self.folded:
            return
        if self.sits_out:
            p2p.receive(comm, work, self.rank + 1)
        else:
            p2p.send(comm, work, self.rank - 1)


def recursive_doubling_in_place(work: np.ndarray, comm: MPI.Comm, combine: Combine) -> None:
    """In place: at each step exchange the whole buffer with the partner and reduce it in."""
    fold = Fold(comm.Get_size(), comm.Get_rank())
    if fold.size == 1 or work.size == 0:
        return
    fold.fold_in(comm, work, combine)
    if not fold.sits_out:
        incoming = np.empty_like(work)
        distance = 1
        while distance < fold.members:
            partner = fold.real_rank(fold.member_rank ^ distance)
            p2p.sendrecv(comm, work, partner, incoming, partner)
            combine(work, incoming, out=work)  # a+b on one side, b+a on the other: the same bits
            distance *= 2
    fold.fold_out(comm, work)


def rabenseifner_in_place(work: np.ndarray, comm: MPI.Comm, combine: Combine) -> None:
    """In place: recursive-halving reduce-scatter, then recursive-doubling allgather."""
    fold = Fold(comm.Get_size(), comm.Get_rank())
    if fold.size == 1 or work.size == 0:
        return
    fold.fold_in(comm, work, combine)
    if not fold.sits_out:
        bounds = p2p.chunk_bounds(work.size, fold.members)
        me = fold.member_rank

        def span(first: int, last: int) -> np.ndarray:
            """The elements of chunks first..last-1."""
            return work[bounds[first] : bounds[last]]

        # Reduce-scatter: halve the range of chunks this rank is responsible for at every step.
        # The partner whose bit `distance` differs keeps the other half; in the end we own chunk `me`.
        first, last = 0, fold.members
        distance = fold.members // 2
        while distance >= 1:
            partner = fold.real_rank(me ^ distance)
            middle = (first + last) // 2
            if me & distance:
                give, (first, last) = span(first, middle), (middle, last)
            else:
                give, (first, last) = span(middle, last), (first, middle)
            keep = span(first, last)
            segments = p2p.segment_count(max(give.size, keep.size), work.itemsize)  # same on both sides
            p2p.sendrecv_reduce(comm, give, partner, keep, partner, combine, segments)
            distance //= 2

        # Allgather: double the range at every step by swapping it for the partner's.
        distance = 1
        while distance < fold.members:
            partner = fold.real_rank(me ^ distance)
            if me & distance:
                theirs = (first - distance, first)
                p2p.sendrecv(comm, span(first, last), partner, span(*theirs), partner)
                first = theirs[0]
            else:
                theirs = (last, last + distance)
                p2p.sendrecv(comm, span(first, last), partner, span(*theirs), partner)
                last = theirs[1]
            distance *= 2
    fold.fold_out(comm, work)
