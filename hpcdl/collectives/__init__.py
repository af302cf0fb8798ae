"""Allreduce algorithms written with mpi4py point-to-point calls, for learning and for comparison.

Every algorithm has the same signature, ``name(buf, comm=MPI.COMM_WORLD, op=MPI.SUM, *, average=False)``:
it takes a numpy array or a CPU torch tensor and returns a new one of the same type, shape and
dtype, reduced over all ranks of ``comm`` with MPI.SUM, MPI.PROD, MPI.MAX or MPI.MIN. Arguments
that differ across ranks raise CollectiveArgumentError on every rank instead of hanging.

In real training use MPI.Allreduce or Horovod: these exist to show how the algorithms work
and what they cost (``python -m hpcdl.bench.allreduce`` measures them side by side).
"""

from hpcdl.collectives.arguments import SUPPORTED_DTYPES, SUPPORTED_OPS, CollectiveArgumentError
from hpcdl.collectives.butterfly import rabenseifner_allreduce, recursive_doubling_allreduce
from hpcdl.collectives.naive import naive_allreduce
from hpcdl.collectives.ring import ring_allreduce

# name -> function, in the order tables and plots list them.
ALGORITHMS = {
    "naive": naive_allreduce,
    "ring": ring_allreduce,
    "recursive_doubling": recursive_doubling_allreduce,
    "rabenseifner": rabenseifner_allreduce,
}

__all__ = [
    "ALGORITHMS",
    "SUPPORTED_DTYPES",
    "SUPPORTED_OPS",
    "CollectiveArgumentError",
    "naive_allreduce",
    "rabenseifner_allreduce",
    "recursive_doubling_allreduce",
    "ring_allreduce",
]
