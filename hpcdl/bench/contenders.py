"""The allreduce implementations the benchmark compares, behind one interface.

A Contender turns a float32 numpy message into a zero-argument callable that performs one
sum-allreduce of it and returns the result (as numpy), so the timing loop and the
correctness check treat MPI, Horovod, torch.distributed and our own algorithms alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from hpcdl.collectives import ALGORITHMS

Call = Callable[[], np.ndarray]


@dataclass(frozen=True)
class Contender:
    name: str
    # Builds the call for one message; `timed=True` may trade the data for zeros when the call
    # works in place (repeated in-place sums would overflow float32 over many iterations).
    prepare: Callable[[np.ndarray, bool], Call]
    # Run around each of its measurements: a contender with a background thread (Horovod) is
    # only running while it is measured, so that it does not slow the others down.
    start: Callable[[], None] | None = None
    stop: Callable[[], None] | None = None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        if self.start:
            self.start()
        try:
            yield
        finally:
            if self.stop:
                self.stop()


def mpi_allreduce(comm: MPI.Comm) -> Contender:
    """The MPI library's own MPI_Allreduce (out of place, into a preallocated buffer)."""

    def prepare(message: np.ndarray, timed: bool) -> Call:
        result = np.empty_like(message)

        def call() -> np.ndarray:
            comm.Allreduce(message, result, op=MPI.SUM)
            return result

        return call

    return Contender("MPI.Allreduce", prepare)


def ours(name: str, comm: MPI.Comm) -> Contender:
    """One of hpcdl.collectives' algorithms, called as a user would (it returns a new array)."""
    algorithm = ALGORITHMS[name]
    return Contender(name, lambda message, timed: lambda: algorithm(message, comm, MPI.SUM))


def horovod_allreduce(comm: MPI.Comm) -> Contender:
    """horovod.torch.allreduce_ (in place, op=Sum) on a CPU tensor: what DistributedOptimizer does to gradients.

    Horovod is started (on the same communicator) only while it is being measured: its
    background thread coordinates the ranks every cycle even when idle, and on a machine with
    one core per rank it would otherwise slow every other contender down. A restart costs ms.
    """
    import horovod.torch as hvd

    def prepare(message: np.ndarray, timed: bool) -> Call:
        # In place, like gradients in training; timed on zeros so repeated sums cannot overflow.
        tensor = torch.zeros(message.size) if timed else torch.from_numpy(message.copy())
        name = f"bench.allreduce.{message.nbytes}"
        return lambda: hvd.allreduce_(tensor, op=hvd.Sum, name=name).numpy()

    return Contender("horovod", prepare, start=lambda: hvd.init(comm=comm), stop=hvd.shutdown)


def gloo_allreduce(comm: MPI.Comm) -> Contender | None:
    """torch.distributed.all_reduce with the gloo backend (what ``hpcdl.train --backend torch`` uses on CPUs), or None
    if it cannot start here.

    Started as the training starts it (hpcdl.runtime.rendezvous): rank 0's address and a free TCP port agreed
    through MPI, so no MASTER_ADDR/MASTER_PORT needs to be set by hand.
    """
    import torch.distributed as dist

    from hpcdl.runtime import rendezvous

    if not dist.is_available() or not dist.is_gloo_available():
        return None
    if not dist.is_initialized():
        error = None
        try:
            rendezvous.init_process_group(comm, torch.device("cpu"), timeout_seconds=60)
        except Exception as exc:  # noqa: BLE001 - any failure means: leave gloo out of the table
            error = f"{type(exc).__name__}: {exc}"
        if any(comm.allgather(error is not None)):
            return None

    def prepare(message: np.ndarray, timed: bool) -> Call:
        # all_reduce works in place: time it on zeros so thousands of repeats cannot overflow.
        tensor = torch.zeros(message.size) if timed else torch.from_numpy(message.copy())

        def call() -> np.ndarray:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            return tensor.numpy()

        return call

    return Contender("torch.distributed (gloo)", prepare)
