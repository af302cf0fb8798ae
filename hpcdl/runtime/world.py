"""Rank and world: the one place that knows how this process fits into the job.

Every other module asks here for its rank, the world size, its local rank, the device it
owns and the MPI communicator. Initialisation happens once: mpi4py initialises MPI (thread
level MULTIPLE, which Horovod needs), then Horovod or torch.distributed (``--backend torch``,
hpcdl.runtime.rendezvous) is started on that same MPI_COMM_WORLD, so explicit mpi4py collectives
and the gradients' allreduce share one set of ranks.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from hpcdl.runtime import allocator
from hpcdl.runtime.launcher import local_rank_from_env, local_size_from_env


class WorldError(RuntimeError):
    """The job's layout cannot work (for example more ranks on a host than GPUs)."""


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


def choose_device(local_rank: int, cuda_devices: int) -> torch.device:
    """The device a rank should use.

    With one visible GPU (Slurm's --gpus-per-task=1 or a CUDA_VISIBLE_DEVICES per rank) that GPU
    is ours; with several visible (--gres=gpu:4) we take the one at our local rank.
    """
    if cuda_devices <= 0:
        return torch.device("cpu")
    if cuda_devices == 1:
        return torch.device("cuda", 0)
    if local_rank >= cuda_devices:
        raise WorldError(
            f"local rank {local_rank} has no GPU: only {cuda_devices} visible on this host; "
            "start at most one rank per GPU (e.g. --ntasks-per-node equal to the GPUs per node)"
        )
    return torch.device("cuda", local_rank)


def threads_per_rank(local_size: int, cores: int | None = None, env: Mapping[str, str] | None = None) -> int:
    """Intra-op threads for one rank so that the ranks on a host do not oversubscribe its cores.

    An explicit OMP_NUM_THREADS (what launch scripts and Slurm's --cpus-per-task set) wins.
    """
    env = os.environ if env is None else env
    explicit = env.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_size))


def _mpi():
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
    """Initialise MPI (and Horovod, or torch.distributed's process group) once, pin the device and thread count,
    and return the World. ``timeout_seconds``: how long a torch.distributed collective waits for a peer.

    Safe to call many times; later calls return the first result (a torch.distributed group asked for later is
    started then).
    """
    global _world
    if _world is not None:
        if torch_distributed and not _world.torch_distributed:
            from hpcdl.runtime import rendezvous

            rendezvous.init_process_group(_mpi().COMM_WORLD, _world.device, timeout_seconds)
            _world = replace(_world, torch_distributed=True)
        return _world
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

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        device = choose_device(local_rank, cuda)
    except WorldError:
        # This rank has no GPU of its own. Raising here would end one rank with a traceback while the
        # others wait; hpcdl.runtime.placement.verify reports it instead, the same line on every rank.
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    threads = threads_per_rank(local_size)
    torch.set_num_threads(threads)
    allocator.keep_freed_memory()
    # Every rank decides alike (a collective follows): no group where a rank lacks its GPU.
    start_group = torch_distributed and not comm.allreduce(int(placement_broken(device, local_rank, cuda)))
    if start_group:
        from hpcdl.runtime import rendezvous

        rendezvous.init_process_group(comm, device, timeout_seconds)

    _world = World(
        rank=comm.Get_rank(),
        size=comm.Get_size(),
        local_rank=local_rank,
        local_size=local_size,
        hostname=socket.gethostname(),
        device=device,
        threads=threads,
        horovod=horovod_up,
        torch_distributed=start_group,
    )
    return _world


def placement_broken(device: torch.device, local_rank: int, cuda_devices: int) -> bool:
    """True for a rank left without the GPU it should have (placement.verify says so on every rank, in one line):
    a process group is not started on it, so that the error comes first."""
    return device.type == "cpu" and 0 < cuda_devices <= local_rank


def get() -> World:
    """The World, initialising it on first use."""
    return _world if _world is not None else init()


def comm():
    """mpi4py's COMM_WORLD (the same ranks Horovod uses)."""
    return _mpi().COMM_WORLD
