"""How long one collective call takes, measured the way the OSU micro-benchmarks do.

Each rank waits at a barrier, then times a loop of calls; the latency is the loop time
divided by the iteration count, averaged over the ranks. The loop length is calibrated once
per message from a few warm-up calls so that every loop takes about the same time:
thousands of calls for 4 bytes, a couple for 256 MB. All ranks agree on the count (they
must: each call is collective).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

FLOAT32_BYTES = 4
WARMUP = 3  # the first call pays one-time costs (Horovod's negotiation, page faults)
MIN_ITERATIONS = 2
MAX_ITERATIONS = 2000


def message_sizes(smallest: int, largest: int) -> list[int]:
    """Powers of two from ``smallest`` to ``largest`` bytes (at least one float32)."""
    size, sizes = FLOAT32_BYTES, []
    while size <= largest:
        if size >= smallest:
            sizes.append(size)
        size *= 2
    return sizes


def iterations(seconds_per_call: float, budget_seconds: float) -> int:
    """Timed iterations that fill about ``budget_seconds``, within [MIN_ITERATIONS, MAX_ITERATIONS]."""
    wanted = int(budget_seconds / max(seconds_per_call, 1e-9))
    return max(MIN_ITERATIONS, min(MAX_ITERATIONS, wanted))


@dataclass(frozen=True)
class Latency:
    """Seconds per call: the average over ranks (what tables report), the spread, and the loop length."""

    mean: float
    low: float
    high: float
    iterations: int


def calibrate(call: Callable[[], Any], comm: MPI.Comm, budget_seconds: float) -> int:
    """Warm ``call`` up and choose the timed loop's length (collective: all ranks get the same count)."""
    fastest = float("inf")
    for _ in range(WARMUP):
        start = MPI.Wtime()
        call()
        fastest = min(fastest, MPI.Wtime() - start)
    return iterations(comm.allreduce(fastest, op=MPI.MAX), budget_seconds)


def measure(call: Callable[[], Any], comm: MPI.Comm, timed: int) -> Latency:
    """Time ``timed`` calls on every rank of ``comm`` (collective); every rank gets the same Latency.

    One untimed call first, so a contender that was just started (Horovod negotiates a tensor's
    first allreduce) or whose memory went cold while others ran is measured warm.
    """
    call()
    comm.Barrier()
    start = MPI.Wtime()
    for _ in range(timed):
        call()
    mine = (MPI.Wtime() - start) / timed
    everyone = comm.allgather(mine)
    return Latency(sum(everyone) / len(everyone), min(everyone), max(everyone), timed)
