"""Hello from every rank: check that a job's layout is what you asked the scheduler for.

    mpirun -np 4 python -m hpcdl.demos.hello

Each rank reports its rank, the world size, its local rank on its host, the host and the
device it was given; rank 0 gathers the reports and prints them in rank order (output from
many ranks printing at once would interleave). With Horovod, it also checks that Horovod sees
the same ranks as MPI, since explicit mpi4py collectives and Horovod share MPI_COMM_WORLD.
"""

from __future__ import annotations

from collections.abc import Sequence

from mpi4py import MPI

from hpcdl.runtime import world
from hpcdl.runtime.console import RankZeroParser
from hpcdl.runtime.errors import UsageError, run_main


def report_line(me: world.World, horovod_rank: int | None) -> str:
    line = (
        f"rank {me.rank:>4} of {me.size}  local rank {me.local_rank} of {me.local_size}  "
        f"host {me.hostname}  device {me.device}  threads {me.threads}"
    )
    if horovod_rank is not None:
        line += f"  horovod rank {horovod_rank}"
    return line


def main(argv: Sequence[str] | None = None) -> int:
    parser = RankZeroParser(prog="python -m hpcdl.demos.hello", description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-horovod", action="store_true", help="do not start Horovod (MPI only)")
    args = parser.parse_args(argv)
    try:
        me = world.init(use_horovod=not args.no_horovod)
    except world.WorldError as error:
        raise UsageError(f"{error} (or run with --no-horovod)") from None  # every rank sees it alike
    horovod_rank = None
    if me.horovod:
        import horovod.torch as hvd

        horovod_rank = hvd.rank()
    comm = world.comm()
    reports = comm.gather((me.hostname, report_line(me, horovod_rank)), root=0)
    # Horovod was started on MPI_COMM_WORLD, so its rank numbers must be MPI's.
    mismatched = comm.allreduce(int(horovod_rank is not None and horovod_rank != me.rank))
    if me.rank == 0:
        hosts = sorted({host for host, _ in reports})
        print(f"{me.size} rank(s) on {len(hosts)} host(s); {MPI.Get_library_version().splitlines()[0].strip()}")
        print("\n".join(line for _, line in reports), flush=True)
    if mismatched:
        raise UsageError(f"Horovod's rank numbers differ from MPI's on {mismatched} rank(s)")
    return 0


if __name__ == "__main__":
    run_main(main, "hpcdl.demos.hello")
