"""How signals reach your job: a training-shaped loop that stops gracefully, as hpcdl.train does.

    mpirun -np 2 python -m hpcdl.demos.stop          # then press Ctrl-C, or kill -USR1 <mpirun pid>
    srun -n 2 python -m hpcdl.demos.stop             # scancel --signal=USR1 <job>

Every rank runs steps of ``--step-seconds`` (fed by a DataLoader with ``--workers`` worker
processes, as training is) and asks :class:`hpcdl.runtime.signals.GracefulStop` after each step whether
any rank received SIGINT, SIGTERM or SIGUSR1. Then rank 0 writes a checkpoint (to
``--output-dir``, if given), prints one line naming the signal and the ranks that received it,
and every rank exits with the documented code (0 for SIGTERM/SIGUSR1, 130 for SIGINT). Each rank
prints one line when it starts (with its pid, to send it signals) and one when it exits, so you
see what your launcher delivers to whom.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mpi4py import MPI

from hpcdl.runtime.console import RankZeroParser
from hpcdl.runtime.errors import run_main
from hpcdl.runtime.numbers import integer, real
from hpcdl.runtime.signals import GracefulStop

PROGRAM = "hpcdl.demos.stop"


def say(line: str) -> None:
    """One write per line: under PYTHONUNBUFFERED print() writes text and newline apart, and the launcher
    may put another rank's output between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def batches(workers: int) -> Iterator[Any]:
    """Batches from DataLoader workers (forked after the handlers are installed, as in training), or plain numbers.

    torch is imported only when asked for: on a loaded login node its import alone takes seconds.
    """
    if workers == 0:
        return itertools.count()
    import torch

    data = torch.utils.data.TensorDataset(torch.arange(1 << 16, dtype=torch.float32))
    loader = torch.utils.data.DataLoader(data, batch_size=8, num_workers=workers, persistent_workers=True)
    return itertools.chain.from_iterable(itertools.repeat(loader))


def write_checkpoint(directory: Path, step: int, size: int) -> Path:
    import torch

    from hpcdl.persistence import checkpoint_files

    state = {"model": {"w": torch.zeros(4)}, "optimizer": {}, "epoch": 0, "step_in_epoch": step, "global_step": step,
             "config": {}, "world_size": size}
    return checkpoint_files.save(directory, state, keep=1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = RankZeroParser(prog=f"python -m {PROGRAM}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=integer(1), default=1000, help="steps before finishing normally (default 1000)")
    parser.add_argument("--step-seconds", type=real(0, high=3600), default=0.1,
                        help="simulated work per step (default 0.1 s)")
    parser.add_argument("--workers", type=integer(0, 64), default=0,
                        help="DataLoader worker processes per rank (default 0)")
    parser.add_argument("--output-dir", type=Path, default=None, help="where rank 0 writes its checkpoint on a stop")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    stop = GracefulStop(comm)
    loader = batches(args.workers)
    next(loader)  # the workers are up
    say(f"rank {rank} pid {os.getpid()} ready")
    comm.barrier()
    code = 0
    for step in range(1, args.steps + 1):
        next(loader)
        time.sleep(args.step_seconds)
        request = stop.requested()
        if request is None:
            continue
        if rank == 0:
            where = ""
            if args.output_dir is not None:
                where = f": checkpoint {write_checkpoint(args.output_dir, step, comm.Get_size())} written"
            say(f"{PROGRAM}: {request.describe()} at step {step}{where}; exiting {request.exit_code}")
        code = request.exit_code
        break
    stop.close()
    say(f"rank {rank} exits {code}")
    return code


if __name__ == "__main__":
    run_main(main, PROGRAM)
