"""One MPI collective at one size, timed call by call: what a link really gives one exchange.

    mpirun -np 2 python -m hpcdl.bench.probe --size 16M --calls 10
    mpirun -np 2 python -m hpcdl.bench.probe --size 16M --pattern sendrecv

The allreduce benchmark reports the best loop of many; to find out *why* a loop is slow one needs
every call's time (a bimodal spread tells a protocol stall from a slow link) and the CPU time each
rank spent in it (a rank that computes or copies while the wire idles adds the two). Patterns:
``allreduce`` (MPI_Allreduce, whichever algorithm Open MPI picks or is told to pick with
``--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm N``), ``oneway``
(rank 0 sends the message to rank 1, which answers with 4 bytes) and ``sendrecv`` (ranks 0 and
1 exchange the message both ways at once, the step every 2-rank allreduce makes).
Rank 0 prints one JSON line: seconds and CPU seconds per call (slowest rank), bus bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
from collections.abc import Callable, Sequence

import numpy as np
from mpi4py import MPI

from hpcdl.bench.sizes import parse_size
from hpcdl.persistence import outputs
from hpcdl.runtime.console import RankZeroParser
from hpcdl.runtime.errors import UsageError, run_main
from hpcdl.runtime.numbers import integer

PROGRAM = "hpcdl.bench.probe"
PATTERNS = ("allreduce", "oneway", "sendrecv")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = RankZeroParser(prog=f"python -m {PROGRAM}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=16 << 20, help="message bytes, e.g. 16M (default 16 MiB)")
    parser.add_argument("--calls", type=integer(1), default=10, help="timed calls (default 10)")
    parser.add_argument("--pattern", choices=PATTERNS, default="allreduce", help="what to time (default allreduce)")
    parser.add_argument("--label", default="", help="copied into the JSON line (the driver's name for this run)")
    args = parser.parse_args(argv)
    if args.size < 4:
        parser.error("--size must be at least 4 bytes (one float32)")
    return args


def exchange(pattern: str, comm: MPI.Comm, message: np.ndarray, result: np.ndarray) -> Callable[[], None]:
    """One call of the pattern; point-to-point patterns use ranks 0 and 1 and leave the others idle."""
    rank = comm.Get_rank()
    if pattern == "allreduce":
        return lambda: comm.Allreduce(message, result, op=MPI.SUM)
    if comm.Get_size() != 2:
        raise UsageError(f"--pattern {pattern} needs exactly 2 ranks, got {comm.Get_size()}")
    peer = 1 - rank
    if pattern == "sendrecv":
        return lambda: comm.Sendrecv(message, peer, recvbuf=result, source=peer)

    def oneway() -> None:  # the 4-byte answer makes the sender's clock include the delivery
        if rank == 0:
            comm.Send(message, 1)
            comm.Recv(result[:1], 1)
        else:
            comm.Recv(result, 0)
            comm.Send(message[:1], 0)

    return oneway


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    outputs.require_launcher(2, PROGRAM, comm)
    message = np.ones(args.size // 4, dtype=np.float32)
    result = np.empty_like(message)
    call = exchange(args.pattern, comm, message, result)
    call()  # connections and buffers are set up by the first call
    walls, cpus = [], []
    for _ in range(args.calls):
        comm.Barrier()
        start_cpu, start = cpu_seconds(), MPI.Wtime()
        call()
        walls.append(MPI.Wtime() - start)
        cpus.append(cpu_seconds() - start_cpu)
    slowest = np.empty(2 * args.calls)
    comm.Allreduce(np.array(walls + cpus), slowest, op=MPI.MAX)  # a call lasts until its slowest rank is done
    if comm.Get_rank() != 0:
        return
    ranks = comm.Get_size()
    wall, cpu = slowest[: args.calls], slowest[args.calls:]
    factor = 2 * (ranks - 1) / ranks if args.pattern == "allreduce" else 1.0  # bus bandwidth; per direction for p2p
    print(json.dumps({
        "label": args.label, "pattern": args.pattern, "ranks": ranks, "bytes": args.size,
        "seconds": [round(t, 6) for t in wall], "cpu_seconds": [round(t, 6) for t in cpu],
        "median_seconds": float(np.median(wall)), "median_cpu_seconds": float(np.median(cpu)),
        "median_busbw_GBps": args.size * factor / float(np.median(wall)) / 1e9,
        "best_busbw_GBps": args.size * factor / float(np.min(wall)) / 1e9,
        "load_1min": round(os.getloadavg()[0], 2),
    }), flush=True)


if __name__ == "__main__":
    run_main(main, PROGRAM)
