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
    recursive_doubling(call.source, call.result, p2p.private_comm(comm), call.combine)
    return call.finish()


def rabenseifner_allreduce(
    buf: Buffer, comm: MPI.Comm = MPI.COMM_WORLD, op: MPI.Op = MPI.SUM, *, average: bool = False
) -> Buffer:
    """Allreduce ``buf`` (numpy array or CPU tensor) by Rabenseifner's algorithm; returns a new buffer."""
    call = prepare("rabenseifner_allreduce", buf, comm, op, average)
    halving_doubling(call.source, call.result, p2p.private_comm(comm), call.combine)
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

    def fold_in(self, comm: MPI.Comm, source: np.ndarray, result: np.ndarray, combine: Combine) -> np.ndarray | None:
        """Even ranks below ``folded`` give their data to their odd neighbour, which reduces it into ``result``.

        Returns what this rank brings to the butterfly: ``result`` if it took in a neighbour's
        data, its own ``source`` if it was not paired, None if it sits out.
        """
        if self.rank >= self.folded:
            return source
        if self.sits_out:
            p2p.send(comm, source, self.rank + 1)
            return None
        incoming = np.empty_like(source)
        p2p.receive(comm, incoming, self.rank - 1)
        combine(source, incoming, out=result)
        return result

    def fold_out(self, comm: MPI.Comm, result: np.ndarray) -> None:
        """The odd neighbours hand the finished result back to the ranks that sat out."""
        if self.rank >= self.folded:
            return
        if self.sits_out:
            p2p.receive(comm, result, self.rank + 1)
        else:
            p2p.send(comm, result, self.rank - 1)


def recursive_doubling(source: np.ndarray, result: np.ndarray, comm: MPI.Comm, combine: Combine) -> None:
    """At each step exchange the whole buffer with the partner and reduce it in."""
    fold = Fold(comm.Get_size(), comm.Get_rank())
    if fold.size == 1 or source.size == 0:
        np.copyto(result, source)
        return
    mine = fold.fold_in(comm, source, result, combine)
    if mine is not None:
        incoming = np.empty_like(source)
        distance = 1
        while distance < fold.members:  # at least one step: members >= 2 when size >= 2
            partner = fold.real_rank(fold.member_rank ^ distance)
            p2p.sendrecv(comm, mine, partner, incoming, partner)
            combine(mine, incoming, out=result)  # a+b on one side, b+a on the other: the same bits
            mine = result
            distance *= 2
    fold.fold_out(comm, result)


def halving_doubling(source: np.ndarray, result: np.ndarray, comm: MPI.Comm, combine: Combine) -> None:
    """Rabenseifner: recursive-halving reduce-scatter, then recursive-doubling allgather."""
    fold = Fold(comm.Get_size(), comm.Get_rank())
    if fold.size == 1 or source.size == 0:
        np.copyto(result, source)
        return
    mine = fold.fold_in(comm, source, result, combine)
    if mine is not None:
        bounds = p2p.chunk_bounds(source.size, fold.members)
        me = fold.member_rank

        def span(array: np.ndarray, first: int, last: int) -> np.ndarray:
            """The elements of chunks first..last-1."""
            return array[bounds[first] : bounds[last]]

        # Reduce-scatter: halve the range of chunks this rank is responsible for at every step.
        # The partner whose bit `distance` differs keeps the other half; in the end we own chunk `me`.
        first, last = 0, fold.members
        distance = fold.members // 2
        while distance >= 1:
            partner = fold.real_rank(me ^ distance)
            middle = (first + last) // 2
            give, keep = ((first, middle), (middle, last)) if me & distance else ((middle, last), (first, middle))
            outgoing, kept = span(mine, *give), span(mine, *keep)
            segments = p2p.segment_count(max(outgoing.size, kept.size), source.itemsize)  # the same on both sides
            p2p.sendrecv_reduce(comm, outgoing, partner, kept, span(result, *keep), partner, combine, segments)
            mine = result  # from now on our partial sums live in `result`
            first, last = keep
            distance //= 2

        # Allgather: double the range at every step by swapping it for the partner's.
        distance = 1
        while distance < fold.members:
            partner = fold.real_rank(me ^ distance)
            theirs = (first - distance, first) if me & distance else (last, last + distance)
            p2p.sendrecv(comm, span(result, first, last), partner, span(result, *theirs), partner)
            first, last = min(first, theirs[0]), max(last, theirs[1])
            distance *= 2
    fold.fold_out(comm, result)
