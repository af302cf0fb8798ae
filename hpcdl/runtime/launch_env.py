"""Where a process sits in a job that torchrun, plain srun or a site's recipe started: read from the environment.

torch.distributed's users start jobs without MPI. Each way names a rank's place in variables of its own:

* torchrun (``--standalone``, c10d rendezvous, several nodes): RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT of its agent's store (TORCHELASTIC_USE_AGENT_STORE=True:
  every rank connects to that store, none starts one);
* a site's recipe (OLCF, NERSC, ALCF): RANK and WORLD_SIZE (often copied from the launcher's own),
  MASTER_ADDR and MASTER_PORT; rank 0 starts the store;
* plain ``srun`` (no MPI plugin): SLURM_PROCID, SLURM_STEP_NUM_TASKS and SLURM_LOCALID; rank 0's
  address is the first host of SLURM_STEP_NODELIST and the port follows from the job's id
  (:func:`slurm_port`), unless MASTER_ADDR or MASTER_PORT say otherwise.

An MPI launcher (mpirun, srun --mpi=pmix, mpiexec) is recognised by its own variables
(:data:`MPI_LAUNCHER_VARS`): such a job meets over MPI instead (hpcdl.runtime.rendezvous).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from hpcdl.runtime.errors import UsageError

# Set in a process that an MPI launcher started (mpirun, mpiexec, srun --mpi=pmix or pmi2, Cray's PALS).
MPI_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "PMI_FD", "MV2_COMM_WORLD_SIZE",
                     "PALS_RANKID")
RENDEZVOUS_TIMEOUT_VAR = "HPCDL_RENDEZVOUS_TIMEOUT"
RENDEZVOUS_TIMEOUT = 300.0  # seconds the ranks wait for each other to start (nodes start tens of seconds apart)


@dataclass(frozen=True)
class Place:
    """This process's place in the job and where the ranks meet."""

    rank: int
    size: int
    local_rank: int | None  # None: not announced (worked out from the ranks' host names)
    local_size: int | None
    address: str  # MASTER_ADDR: where the rendezvous store listens
    port: int
    agent_store: bool  # torchrun's agent holds the store: rank 0 does not start one
    source: str  # which launcher's variables said so, for messages


def mpi_launched(env: Mapping[str, str] | None = None) -> bool:
    """True in a process an MPI launcher started."""
    env = os.environ if env is None else env
    return any(env.get(name, "").strip() for name in MPI_LAUNCHER_VARS)


def _number(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise UsageError(f"{name} must be a whole number (got {value!r})")
    return int(value)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise UsageError(f"cannot read the first host of the node list {nodelist!r}; set MASTER_ADDR")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def slurm_port(env: Mapping[str, str]) -> int:
    """The rendezvous port of a Slurm step without MASTER_PORT: 20000 + 10 x (SLURM_JOB_ID mod 2000) +
    (SLURM_STEP_ID mod 10), so that two jobs sharing a node, or two steps of one job, meet at different ports."""
    job = _number(env, "SLURM_JOB_ID") or 0
    step = _number(env, "SLURM_STEP_ID") or 0
    return 20000 + 10 * (job % 2000) + step % 10


def rendezvous_timeout(env: Mapping[str, str] | None = None) -> float:
    """Seconds a rank waits for the others at the rendezvous (HPCDL_RENDEZVOUS_TIMEOUT, default 300)."""
    env = os.environ if env is None else env
    value = env.get(RENDEZVOUS_TIMEOUT_VAR, "").strip()
    if not value:
        return RENDEZVOUS_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise UsageError(f"{RENDEZVOUS_TIMEOUT_VAR} must be a number of seconds above 0 (got {value!r})")
    return seconds


def _port(env: Mapping[str, str], default: int | None) -> int | None:
    value = env.get("MASTER_PORT", "").strip()
    if not value:
        return default
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise UsageError(f"MASTER_PORT must be a port number, 1 to 65535 (got {value!r})")
    return int(value)


def place_from_env(env: Mapping[str, str] | None = None) -> Place | None:
    """This process's place from torchrun's, a site's or Slurm's variables; None when none says it is in a job
    (one process on its own)."""
    env = os.environ if env is None else env
    size = _number(env, "WORLD_SIZE")
    if size is not None:  # torchrun, or a site's recipe
        rank = _number(env, "RANK")
        if rank is None or size < 1 or rank >= size:
            raise UsageError(f"WORLD_SIZE={size} needs RANK between 0 and {max(size - 1, 0)} "
                             f"(got {env.get('RANK', 'none')!r})")
        torchrun = bool(env.get("TORCHELASTIC_RUN_ID"))
        address = env.get("MASTER_ADDR", "").strip() or ("127.0.0.1" if size == 1 else "")
        port = _port(env, None if size > 1 else 0)
        if size > 1 and (not address or port is None):
            raise UsageError(f"WORLD_SIZE={size} but {'MASTER_ADDR' if not address else 'MASTER_PORT'} is not set: "
                             "set MASTER_ADDR to rank 0's host and MASTER_PORT to a free port, or start with torchrun")
        return Place(rank, size, _number(env, "LOCAL_RANK"), _number(env, "LOCAL_WORLD_SIZE"), address, port or 0,
                     env.get("TORCHELASTIC_USE_AGENT_STORE") == "True", "torchrun" if torchrun else "WORLD_SIZE")
    size = _number(env, "SLURM_STEP_NUM_TASKS")
    rank = _number(env, "SLURM_PROCID")
    if size is not None and rank is not None:  # a task of `srun` without an MPI plugin
        nodes = env.get("SLURM_STEP_NODELIST", "").strip() or env.get("SLURM_JOB_NODELIST", "").strip()
        address = env.get("MASTER_ADDR", "").strip() or (first_host(nodes) if nodes else "")
        if not address:
            raise UsageError("srun: neither MASTER_ADDR nor SLURM_STEP_NODELIST names rank 0's host; set MASTER_ADDR")
        port = _port(env, slurm_port(env))
        assert port is not None
        return Place(rank, size, _number(env, "SLURM_LOCALID"), None, address, port, False, "srun")
    return None
