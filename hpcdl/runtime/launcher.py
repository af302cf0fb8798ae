"""What a launcher tells a process before MPI starts: the one list of the variables it sets.

mpirun (Open MPI), srun (Slurm), mpiexec (MPICH, Intel MPI) and MVAPICH's launchers announce a
rank's place in the job under their own names. Flags are checked, and errors printed by rank 0
only, before MPI is initialised, so these are read from the environment. The shell scripts in
launch/ and scripts/ read none of them (they pass ranks on through the launcher itself); a script
that needs one takes its name from this list.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from hpcdl.runtime import coordination

RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")
# SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: an sbatch script itself has the latter and is no rank of a step.
SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")
# The MPI launcher's own variable comes first: under `mpirun` inside an sbatch job every rank sees SLURM_LOCALID=0.
LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE")
# Set only in a process a launcher started (SLURM_PROCID is also set inside an sbatch script itself; torchrun and
# a site's recipe set WORLD_SIZE).
LAUNCHED_VARS = (*SIZE_VARS, "PMIX_RANK", "PMI_RANK", "WORLD_SIZE")


def first_number(names: Sequence[str], env: Mapping[str, str] | None = None) -> int | None:
    """The value of the first of ``names`` that holds a non-negative integer, or None."""
    env = os.environ if env is None else env
    for name in names:
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def local_rank_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """The node-local rank a launcher announced, or None when no launcher variable is set."""
    return first_number(LOCAL_RANK_VARS, env)


def local_size_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """The number of ranks on this node as the MPI launcher announced it, or None."""
    return first_number(LOCAL_SIZE_VARS, env)


def launched(env: Mapping[str, str] | None = None) -> bool:
    """True in a process that a launcher started (not a plain ``python -m ...``)."""
    env = os.environ if env is None else env
    return any(env.get(name) for name in LAUNCHED_VARS)


SAME_MPI_FIX = ("launch with the MPI that mpi4py and Horovod were built against (srun needs --mpi=pmix for "
                "Open MPI; an image's MPI must be of the host launcher's family)")


def started_alone(world_size: int, env: Mapping[str, str] | None = None) -> str | None:
    """Why MPI's world of 1 is wrong for this process (the launcher started more tasks), or None.

    The classic symptom of a launcher whose MPI does not match the one mpi4py was built against (srun
    without --mpi=pmix, an MPICH launcher for an Open MPI image): every task initialises MPI alone and
    would train as "rank 0 of 1", N copies of one run.
    """
    env = os.environ if env is None else env
    if world_size != 1:
        return None
    for name in SIZE_VARS:
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 1:
            return f"the launcher started {value} tasks ({name}) but MPI sees a world of 1: every rank runs alone"
    return None


def current_rank() -> int:
    """This process's global rank: the job's communicator's once the world is up, else the launcher's variable
    (torchrun's RANK included), else 0."""
    comm = coordination.several()
    if comm is not None:
        return int(comm.Get_rank())
    rank = first_number((*RANK_VARS, "RANK"))
    return 0 if rank is None else rank
