"""torch.distributed's process group, started from the MPI job hpcdl already runs: no torchrun needed.

The launcher (mpirun, srun --mpi=pmix, mpiexec) gives every rank its place; MPI_COMM_WORLD then
agrees on the rest: rank 0 names an address the others reach it at and a free TCP port, and
broadcasts both, so ``init_process_group`` needs nothing from the environment. Where MASTER_ADDR
and MASTER_PORT are set (a site's recipe, torchrun's environment) they are used instead, once
checked against MPI's ranks. Gloo carries the collectives on CPUs, NCCL on GPUs.

Gloo binds each rank to the address its hostname resolves to, which on virtual nodes (a network
namespace with a hostname of its own) is none: unless GLOO_SOCKET_IFNAME is set, each rank names
the interface its packets to rank 0 leave through.
"""

from __future__ import annotations

import array
import atexit
import fcntl
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch

from hpcdl.runtime.errors import UsageError

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, Gloo between CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's choice); rank 0 binds it again moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def interface_addresses() -> dict[str, str]:
    """This host's IPv4 address per network interface (loopback included)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = array.array("B", struct.pack("256s", name.encode()[:15]))
            try:
                fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            found[name] = socket.inet_ntoa(request.tobytes()[20:24])
    return found


def root_address(hosts: Sequence[str], rank0_host: str) -> str:
    """Where the other ranks reach rank 0 (run on rank 0): loopback when the job is on one host, else rank 0's
    hostname if it resolves to an address of this host, else the first non-loopback address of its interfaces."""
    if all(host == rank0_host for host in hosts):
        return "127.0.0.1"
    mine = interface_addresses()
    outside = [address for address in mine.values() if not address.startswith("127.")]
    try:
        resolved = socket.gethostbyname(rank0_host)
        if resolved in outside:
            return resolved
    except OSError:
        pass
    if not outside:
        raise UsageError(f"--backend torch: rank 0 on {rank0_host} has no network address the other hosts can reach "
                         "(only loopback); set MASTER_ADDR to one")
    return outside[0]


def interface_towards(address: str) -> str | None:
    """The interface this host's packets to ``address`` leave through (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))
            local = probe.getsockname()[0]
        except OSError:
            return None
    return next((name for name, ip in interface_addresses().items() if ip == local), None)


def agreed_endpoint(comm: Any, env: Mapping[str, str] | None = None) -> tuple[str, int]:
    """(address, port) of rank 0's store, the same on every rank: MASTER_ADDR/MASTER_PORT when set, else
    rank 0's choice broadcast over MPI (collective)."""
    env = os.environ if env is None else env
    hosts = comm.allgather(socket.gethostname())
    given = (env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip())
    if all(given):
        if not given[1].isdigit():
            raise UsageError(f"MASTER_PORT must be a port number (got {given[1]!r})")
        return given[0], int(given[1])
    chosen: tuple[str, int] | str | None = None  # rank 0's endpoint, or its error's message for every rank
    if comm.Get_rank() == 0:
        try:
            chosen = (root_address(hosts, hosts[0]), free_port())
        except UsageError as exc:
            chosen = str(exc)
    chosen = comm.bcast(chosen, root=0)
    if isinstance(chosen, str):
        raise UsageError(chosen)
    assert chosen is not None
    return chosen


def check_torchrun(mpi_rank: int, mpi_size: int, env: Mapping[str, str] | None = None) -> None:
    """torchrun's RANK and WORLD_SIZE must be MPI's: hpcdl's own coordination (errors agreed on every rank, the
    stall watchdog, checkpoint broadcast) runs over MPI, which sees processes torchrun started each alone."""
    env = os.environ if env is None else env
    size, rank = env.get("WORLD_SIZE", "").strip(), env.get("RANK", "").strip()
    if size.isdigit() and int(size) != mpi_size:
        raise UsageError(f"WORLD_SIZE={size} (torchrun's) but MPI sees {mpi_size} rank(s): hpcdl coordinates its "
                         "ranks over MPI, so start them with mpirun or srun --mpi=pmix (--backend torch needs no "
                         "torchrun)")
    if rank.isdigit() and int(rank) != mpi_rank:
        raise UsageError(f"RANK={rank} but MPI calls this process rank {mpi_rank}: unset RANK or launch with "
                         "mpirun/srun alone")


def init_process_group(comm: Any, device: torch.device, timeout_seconds: float | None) -> str:
    """Start torch.distributed on MPI's ranks (collective; once per process); returns the backend's name.

    ``timeout_seconds``: how long a collective may wait for a peer before torch raises (None: torch's default).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return str(dist.get_backend())
    rank, size = comm.Get_rank(), comm.Get_size()
    check_torchrun(rank, size)
    address, port = agreed_endpoint(comm)
    backend = backend_for(device)
    if backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME") and address != "127.0.0.1":
        interface = interface_towards(address)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    if backend == "gloo" and address == "127.0.0.1":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    options: dict[str, Any] = {}
    if timeout_seconds:
        options["timeout"] = timedelta(seconds=timeout_seconds)
    if device.type == "cuda":
        options["device_id"] = device  # NCCL communicators made eagerly, bound to this rank's GPU
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=size, **options)
    atexit.register(_destroy)  # before mpi4py finalizes MPI (atexit runs newest first)
    return backend


def loopback_interface() -> str:
    """The loopback interface's name ('lo' on Linux), for a job on one host."""
    return next((name for name, ip in interface_addresses().items() if ip.startswith("127.")), "lo")


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
