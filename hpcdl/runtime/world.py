"""Rank and world: the one place that knows how this process fits into the job.

Every other module asks here for its rank, the world size, its local rank, the device it owns and
the job's communicator (hpcdl.runtime.coordination). Initialisation happens once, in one of two ways:

* MPI started the job (mpirun, srun --mpi=pmix): mpi4py initialises MPI (thread level MULTIPLE,
  which Horovod needs), then Horovod or torch.distributed (``--backend torch``) starts on that same
  MPI_COMM_WORLD, so hpcdl's coordination and the gradients' allreduce share one set of ranks;
* ``--backend torch`` in a job that torchrun, plain srun or a site's MASTER_ADDR/MASTER_PORT started
  (hpcdl.runtime.launch_env): no MPI at all; the ranks meet at the rendezvous store, check their
  placement there, start the process group, and coordinate over a Gloo group of their own.

Horovod sees MPI's ranks only: a launcher whose ranks MPI cannot see is refused before MPI starts.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from hpcdl.launching.cores import threads_per_rank
from hpcdl.runtime import allocator, coordination, launch_env, placement, rendezvous
from hpcdl.runtime.errors import UsageError
from hpcdl.runtime.launcher import local_rank_from_env, local_size_from_env
from hpcdl.runtime.placement import WorldError, choose_device

__all__ = ["World", "WorldError", "choose_device", "comm", "fix_reduction_order", "get", "init"]


@dataclass(frozen=True)
class World:
    """Where this process sits in the job."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    hostname: str
    device: torch.device
    threads: int
    horovod: bool
    torch_distributed: bool = False  # torch.distributed's process group is up on these ranks

    @property
    def is_root(self) -> bool:
        return self.rank == 0


_world: World | None = None
_gloo_comm: coordination.GlooComm | None = None  # the coordination of a job started without MPI


# Open MPI spins while a call waits, and yields the core to other threads only where it counts more processes than
# slots on a node. A rank's torch threads fill its share of the cores and a Horovod rank has one more thread that
# always waits in MPI (its background thread's negotiation every cycle), so with no spare core per rank the spinning
# thread takes the computation's core: on 2 virtual nodes x 1 rank a step took 1.5-1.8x as long (docs/training.md).
# Yielding costs a waiting call a system call: about a microsecond on a small allreduce where a core is free.
YIELD_WHEN_IDLE = "OMPI_MCA_mpi_yield_when_idle"


def yield_when_idle(env: MutableMapping[str, str]) -> None:
    """Ask Open MPI to yield while it waits, unless the user chose (``OMPI_MCA_mpi_yield_when_idle=0`` spins);
    read when MPI starts, so called before. Other MPIs ignore the variable."""
    env.setdefault(YIELD_WHEN_IDLE, "1")


def _mpi():
    yield_when_idle(os.environ)  # a no-op once MPI has started: mpi4py's import below is what starts it
    from mpi4py import MPI  # importing initialises MPI at thread level MULTIPLE

    return MPI


def fix_reduction_order() -> None:
    """Make Horovod sum every gradient element in the same order, run after run (before :func:`init`).

    Horovod fuses the tensors that are ready within one cycle into one buffer, so where a tensor
    lands in that buffer depends on timing; MPI's allreduce (ring, recursive halving) adds the ranks'
    values in an order that depends on an element's offset in the buffer. On two ranks a + b = b + a,
    but from three ranks on (a + b) + c != a + (b + c) in floating point, and two runs drift apart.
    Without fusion each tensor is reduced alone at a fixed size and offset: the order is fixed.
    """
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"
    os.environ["HOROVOD_AUTOTUNE"] = "0"  # the autotuner would turn fusion back on


def init(use_horovod: bool = True, torch_distributed: bool = False, timeout_seconds: float | None = None) -> World:
    """Start the world once, pin the device and thread count, and return the World. ``torch_distributed``: start
    torch.distributed's process group (``--backend torch``); ``timeout_seconds``: how long one of its collectives
    waits for a peer.

    Safe to call many times; later calls return the first result (a torch.distributed group asked for later is
    started then, on MPI's ranks).
    """
    global _world
    if _world is not None:
        if torch_distributed and not _world.torch_distributed:
            rendezvous.init_process_group(_mpi().COMM_WORLD, _world.device, timeout_seconds)
            _world = replace(_world, torch_distributed=True)
        return _world
    if torch_distributed and not launch_env.mpi_launched():
        _world = _init_without_mpi(timeout_seconds)
    else:
        refuse_unseen_world(use_horovod)
        _world = _init_with_mpi(use_horovod, torch_distributed, timeout_seconds)
    coordination.install(comm())
    return _world


def refuse_unseen_world(use_horovod: bool, env: Mapping[str, str] | None = None) -> None:
    """Before MPI starts: a launcher whose ranks MPI cannot see (torchrun, a site's WORLD_SIZE, srun without an MPI
    plugin) would leave each process training alone as rank 0 of 1, or MPI failing to start under srun."""
    env = os.environ if env is None else env
    if launch_env.mpi_launched(env):
        return
    who = "Horovod (--backend horovod, the default)" if use_horovod else "this program"
    size = env.get("WORLD_SIZE", "").strip()
    if size.isdigit() and int(size) > 1:
        launcher = "torchrun's" if env.get("TORCHELASTIC_RUN_ID") else "the environment's"
        raise UsageError(f"WORLD_SIZE={size} ({launcher}) but no MPI launcher started this process, and {who} sees "
                         f"MPI's ranks only: add --backend torch, or start with mpirun -np {size}")
    tasks = env.get("SLURM_STEP_NUM_TASKS", "").strip()
    if tasks.isdigit() and int(tasks) > 1:
        raise UsageError(f"srun started {tasks} tasks without an MPI plugin (no PMIx variables), and {who} needs "
                         "MPI: run srun --mpi=pmix, or add --backend torch (no MPI needed)")


def _place(local_rank: int) -> torch.device:
    """This rank's device; a rank without a GPU of its own gets the CPU here, and placement.verify says so on every
    rank in one line (raising here would end one rank with a traceback while the others wait)."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        device = choose_device(local_rank, cuda)
    except WorldError:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _seat(rank: int, size: int, local_rank: int, local_size: int, hostname: str, horovod: bool) -> World:
    """The World before any process group: device, threads, allocator settings."""
    device = _place(local_rank)
    threads = threads_per_rank(local_size)  # the planner's rule: OMP_NUM_THREADS, else this host's core share
    torch.set_num_threads(threads)
    allocator.keep_freed_memory()
    return World(rank=rank, size=size, local_rank=local_rank, local_size=local_size, hostname=hostname,
                 device=device, threads=threads, horovod=horovod)


def placement_sound(rows: Sequence[placement.RankRow]) -> bool:
    """Whether a process group can start on these ranks (NCCL cannot where two share a GPU, or one has none): every
    rank decides alike from the same rows, and placement.verify later names the mistake on every rank."""
    return placement.placement_error(rows, gpu_requested=False) is None


def _init_with_mpi(use_horovod: bool, torch_distributed: bool, timeout_seconds: float | None) -> World:
    MPI = _mpi()
    comm = MPI.COMM_WORLD
    horovod_up = False
    if use_horovod:
        import horovod.torch as hvd

        if not hasattr(hvd, "init"):
            raise WorldError("Horovod's compiled extension is missing; run: bash scripts/setup.sh")
        hvd.init(comm=comm)
        horovod_up = True

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    env_local = local_rank_from_env()
    local_rank = env_local if env_local is not None else node.Get_rank()
    local_size = local_size_from_env() or node.Get_size()
    node.Free()

    me = _seat(comm.Get_rank(), comm.Get_size(), local_rank, local_size, socket.gethostname(), horovod_up)
    start_group = torch_distributed and placement_sound(placement.gather_rows(me, comm))
    if start_group:
        rendezvous.init_process_group(comm, me.device, timeout_seconds)
    return replace(me, torch_distributed=start_group)


def _init_without_mpi(timeout_seconds: float | None) -> World:
    """The world of a ``--backend torch`` job that torchrun, srun or the environment started, or of one process."""
    global _gloo_comm
    place = launch_env.place_from_env()
    if place is None or not place.port:  # one process on its own: it meets itself on loopback
        place = launch_env.Place(0, 1, 0, 1, "127.0.0.1", rendezvous.free_port(), False, "one process")
    rendezvous.check_resolves(place.address)
    wait = launch_env.rendezvous_timeout()
    store = rendezvous.open_store(place.address, place.port, place.rank, place.size, wait, place.agent_store)
    hosts = rendezvous.store_allgather(store, "hosts", place.rank, place.size, socket.gethostname(), wait)
    mine = [r for r, host in enumerate(hosts) if host == hosts[place.rank]]
    local_rank = place.local_rank if place.local_rank is not None else mine.index(place.rank)
    me = _seat(place.rank, place.size, local_rank, place.local_size or len(mine), hosts[place.rank], False)
    rows = rendezvous.store_allgather(store, "placement", place.rank, place.size, placement.local_row(me), wait)
    if not placement_sound(rows):  # before NCCL starts, the same line on every rank: the device, the ranks
        raise UsageError(placement.placement_error(rows, gpu_requested=False) or "")
    rendezvous.start_group(store, place.rank, place.size, me.device, place.address, timeout_seconds)
    _gloo_comm = coordination.GlooComm(rendezvous.coordination_group(timeout_seconds), place.rank, place.size)
    return replace(me, torch_distributed=True)


def get() -> World:
    """The World, initialising it on first use."""
    return _world if _world is not None else init()


def comm() -> Any:
    """The job's communicator for hpcdl's coordination: mpi4py's COMM_WORLD (the ranks Horovod uses), or the Gloo
    group of a job started without MPI."""
    return _gloo_comm if _gloo_comm is not None else _mpi().COMM_WORLD
