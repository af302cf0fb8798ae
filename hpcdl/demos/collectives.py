"""A tour of MPI collectives with mpi4py, on numpy arrays and on torch tensors.

    mpirun -np 4 python -m hpcdl.demos.collectives

Runs bcast, scatter, gather, reduce, allreduce, allgather, alltoall and reduce_scatter with
mpi4py's buffer (upper-case) API, which sends the array's memory directly: the lower-case
methods pickle any Python object, which is convenient for a config dict and slow for data.
Every result is checked against the value worked out by hand, and rank 0 prints one line per
collective. The exit status is non-zero if any check failed on any rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from mpi4py import MPI

from hpcdl.runtime import world
from hpcdl.runtime.console import RankZeroParser, print0
from hpcdl.runtime.errors import run_main

# A tour runs once per array library: `make` builds an array of that library from a numpy array.
Make = Callable[[np.ndarray], object]


def as_numpy(buffer: object) -> np.ndarray:
    return buffer.numpy() if isinstance(buffer, torch.Tensor) else np.asarray(buffer)


def tour(comm: MPI.Comm, make: Make) -> list[tuple[str, bool, str]]:
    """Run each collective once; return (name, correct here, what rank 0 shows) per collective."""
    size, rank = comm.Get_size(), comm.Get_rank()
    ranks = np.arange(size)
    steps = []

    def record(name: str, got: object, expected: np.ndarray, shown: str) -> None:
        steps.append((name, bool(np.array_equal(as_numpy(got), expected)), shown))

    # bcast: rank 0's array overwrites everyone's.
    data = make(np.arange(4, dtype=np.int64) * 10 if rank == 0 else np.zeros(4, dtype=np.int64))
    comm.Bcast(data, root=0)
    record("Bcast", data, np.arange(4) * 10, f"rank 0's {as_numpy(data)} is now on every rank")

    # scatter: row i of rank 0's matrix goes to rank i.
    matrix = make(np.arange(size * 3, dtype=np.float64).reshape(size, 3)) if rank == 0 else None
    row = make(np.empty(3, dtype=np.float64))
    comm.Scatter(matrix, row, root=0)
    record("Scatter", row, np.arange(3, dtype=np.float64) + 3 * rank, f"rank 0 kept row 0 = {as_numpy(row)}")

    # gather: every rank's [rank, rank^2] lands in row `rank` of rank 0's matrix.
    mine = make(np.array([rank, rank * rank], dtype=np.int32))
    gathered = make(np.empty((size, 2), dtype=np.int32)) if rank == 0 else None
    comm.Gather(mine, gathered, root=0)
    if rank == 0:
        record(
            "Gather",
            gathered,
            np.stack([ranks, ranks**2], axis=1),
            f"rows [rank, rank^2]: {as_numpy(gathered).tolist()}",
        )
    else:
        steps.append(("Gather", True, ""))  # only the root receives anything

    # reduce: the sum of (rank + 1) over all ranks, on rank 0 only.
    contribution = make(np.full(3, rank + 1, dtype=np.float32))
    total = make(np.empty(3, dtype=np.float32)) if rank == 0 else None
    comm.Reduce(contribution, total, op=MPI.SUM, root=0)
    expected_sum = np.full(3, size * (size + 1) // 2, dtype=np.float32)
    if rank == 0:
        record("Reduce", total, expected_sum, f"1 + ... + {size} = {as_numpy(total)} on rank 0")
    else:
        steps.append(("Reduce", True, ""))

    # allreduce: the same sum, on every rank (what data-parallel training does with gradients).
    everywhere = make(np.empty(3, dtype=np.float32))
    comm.Allreduce(contribution, everywhere, op=MPI.SUM)
    record("Allreduce", everywhere, expected_sum, f"{as_numpy(everywhere)} on every rank")

    # allgather: everyone gets everyone's [rank, -rank].
    mine = make(np.array([rank, -rank], dtype=np.int64))
    everyone = make(np.empty((size, 2), dtype=np.int64))
    comm.Allgather(mine, everyone)
    record("Allgather", everyone, np.stack([ranks, -ranks], axis=1), f"{as_numpy(everyone).tolist()} on every rank")

    # alltoall: rank r sends 100 r + j to rank j, so rank r receives 100 j + r from each rank j.
    outgoing = make((100 * rank + ranks).astype(np.int64))
    incoming = make(np.empty(size, dtype=np.int64))
    comm.Alltoall(outgoing, incoming)
    record("Alltoall", incoming, 100 * ranks + rank, f"rank 0 received {as_numpy(incoming)} (100 j + 0 from rank j)")

    # reduce_scatter: sum element-wise over ranks, then rank j keeps block j (2 elements each).
    spread = make((rank + np.arange(2 * size)).astype(np.int64))
    block = make(np.empty(2, dtype=np.int64))
    comm.Reduce_scatter_block(spread, block, op=MPI.SUM)
    expected_block = size * (size - 1) // 2 + size * (2 * rank + np.arange(2))
    record("Reduce_scatter", block, expected_block, f"rank 0 kept block 0 of the sum = {as_numpy(block)}")
    return steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = RankZeroParser(prog="python -m hpcdl.demos.collectives", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    me = world.init(use_horovod=False)  # plain MPI is all this tour needs
    comm = world.comm()
    print0(f"MPI collectives on {me.size} ranks (buffer API; every result checked on every rank)")

    config = comm.bcast({"lr": 0.1, "epochs": 90} if me.rank == 0 else None, root=0)  # lower-case: pickled
    pickled_ok = config == {"lr": 0.1, "epochs": 90}
    print0(f"  bcast (pickled dict)  {'ok' if all(comm.allgather(pickled_ok)) else 'WRONG'}  {config}")

    failures = 0 if all(comm.allgather(pickled_ok)) else 1
    for library, make in (("numpy", lambda a: a), ("torch", torch.from_numpy)):
        print0(f"{library}:")
        for name, ok, shown in tour(comm, make):
            verdicts = comm.allgather(ok)
            bad = [rank for rank, good in enumerate(verdicts) if not good]
            failures += bool(bad)
            status = "ok" if not bad else f"WRONG on ranks {bad}"
            print0(f"  {name:<15} {status:<5} {shown}")
    print0("all collectives correct" if failures == 0 else f"{failures} collective(s) gave wrong results")
    return 1 if failures else 0


if __name__ == "__main__":
    run_main(main, "hpcdl.demos.collectives")
