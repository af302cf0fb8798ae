"""How long one collective call takes, measured the way the OSU micro-benchmarks do.

Each rank runs some warm-up calls, waits at a barrier, then times a loop of calls; the
latency is the loop time divided by the iteration count, averaged over the ranks. Small
messages are repeated many times, large ones a few, so every size costs a similar time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mpi4py import MPI

FLOAT32_BYTES = 4
BYTES_PER_MEASUREMENT = 64 << 20  # aim to move about this much per timed loop
MAX_ITERATIONS = 1000
MIN_ITERATIONS = 4


def message_sizes(smallest: int, largest: int) -> list[int]:
    """Powers of two from ``smallest`` to ``largest`` bytes (at least one float32)."""
    size, sizes = FLOAT32_BYTES, []
    while size <= largest:
        if size >= smallest:
            sizes.append(size)
        size *= 2
    return sizes


def iterations(nbytes: int) -> tuple[int, int]:
    """(warm-up, timed) iterations for a message of ``nbytes``."""
    timed = max(MIN_ITERATIONS, min(MAX_ITERATIONS, BYTES_PER_MEASUREMENT // max(1, nbytes)))
    return max(2, timed // 10), timed


@dataclass(frozen=True)
class Latency:
    """Seconds per call: the average over ranks (what tables report), and the spread."""

    mean: float
    low: float
    high: float


def measure(call: Callable[[], Any], comm: MPI.Comm, warmup: int, timed: int) -> Latency:
    """Time ``call`` on every rank of ``comm`` (collective); every rank gets the same Latency."""
    for _ in range(warmup):
        call()
    comm.Barrier()
    start = MPI.Wtime()
    for _ in range(timed):
        call()
    mine = (MPI.Wtime() - start) / timed
    everyone = comm.allgather(mine)
    return Latency(sum(everyone) / len(everyone), min(everyone), max(everyone))
