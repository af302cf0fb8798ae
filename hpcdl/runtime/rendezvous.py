"""torch.distributed's process group: where the ranks meet, and the store they meet at.

Two ways in. A job that MPI started (mpirun, srun --mpi=pmix) agrees over MPI_COMM_WORLD: rank 0 names
an address the others reach it at and a free TCP port, and broadcasts both (:func:`init_process_group`),
or takes MASTER_ADDR and MASTER_PORT where a site's recipe sets them. A job that torchrun, plain srun
or a site's recipe started has no MPI: hpcdl.runtime.launch_env reads its place from the environment
and :func:`open_store` meets the others at MASTER_ADDR:MASTER_PORT (torchrun's agent's store, or one
rank 0 starts). Both check, before any wait, what would otherwise fail late and under another name: a
MASTER_ADDR that does not resolve, a MASTER_PORT another program holds; and no rank waits for the
others longer than the rendezvous timeout. Gloo carries the collectives on CPUs, NCCL on GPUs.

Gloo binds each rank to the address its hostname resolves to, which on virtual nodes (a network
namespace with a hostname of its own) is none: unless GLOO_SOCKET_IFNAME is set (``--iface`` sets it),
each rank names the interface its packets to rank 0 leave through.
"""

from __future__ import annotations

import array
import atexit
import fcntl
import ipaddress
import os
import pickle
import socket
import struct
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch

from hpcdl.runtime.errors import UsageError
from hpcdl.runtime.launch_env import rendezvous_timeout

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


def iface_address(iface: str, addresses: Mapping[str, str] | None = None) -> str | None:
    """This host's address on ``iface`` (an interface's name, or a subnet such as 10.1.2.0/24), or None."""
    addresses = interface_addresses() if addresses is None else addresses
    for item in filter(None, (part.strip() for part in iface.split(","))):
        if "/" not in item:
            if item in addresses:
                return addresses[item]
            continue
        network = ipaddress.ip_network(item, strict=False)
        for address in addresses.values():
            if ipaddress.ip_address(address) in network:
                return address
    return None


def chosen_iface(env: Mapping[str, str] | None = None) -> str:
    """The network ``--iface`` named (HPCDL_IFACE; GLOO_SOCKET_IFNAME set by hand counts too), or ''."""
    env = os.environ if env is None else env
    return env.get("HPCDL_IFACE", "").strip() or env.get("GLOO_SOCKET_IFNAME", "").strip()


def root_address(hosts: Sequence[str], rank0_host: str, env: Mapping[str, str] | None = None) -> str:
    """Where the other ranks reach rank 0 (run on rank 0): loopback when the job is on one host, else its address
    on the network ``--iface`` named, else rank 0's hostname if it resolves to an address of this host, else the
    first non-loopback address of its interfaces."""
    if all(host == rank0_host for host in hosts):
        return "127.0.0.1"
    if iface := chosen_iface(env):
        if (address := iface_address(iface)) is None:
            raise UsageError(f"--iface {iface}: rank 0 on {rank0_host} has no address on that network")
        return address
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
            chosen = (root_address(hosts, hosts[0], env), free_port())
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
    agreed(lambda: check_resolves(address), comm)
    wait = rendezvous_timeout()
    # Rank 0 starts the store first and says how that went, so that no rank waits for a store that never came up.
    store = agreed(lambda: open_store(address, port, 0, size, wait, agent_store=False), comm, rank0_only=True)
    if rank != 0:
        store = open_store(address, port, rank, size, wait, agent_store=False)
    return start_group(store, rank, size, device, address, timeout_seconds)


def agreed(attempt: Any, comm: Any, rank0_only: bool = False) -> Any:
    """``attempt()`` on every rank (or on rank 0 only), its UsageError raised on every rank alike (collective)."""
    error, result = None, None
    if not rank0_only or comm.Get_rank() == 0:
        try:
            result = attempt()
        except UsageError as exc:
            error = str(exc)
    errors = comm.allgather(error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise UsageError(first)
    return result


def check_resolves(address: str) -> None:
    """MASTER_ADDR must name a host (checked before any wait: an unknown name would otherwise time out)."""
    try:
        socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise UsageError(f"MASTER_ADDR={address} does not resolve ({reason}): set MASTER_ADDR to rank 0's host "
                         "name or address") from None


def open_store(address: str, port: int, rank: int, size: int, wait: float, agent_store: bool) -> Any:
    """The rendezvous store at ``address:port``: rank 0 starts it (unless torchrun's agent holds it), the others
    connect, waiting at most ``wait`` seconds. A port already taken, or no store within the wait, is one line."""
    from torch.distributed import TCPStore

    serve = rank == 0 and not agent_store
    try:
        return TCPStore(address, port, world_size=None, is_master=serve, timeout=timedelta(seconds=wait),
                        wait_for_workers=False)
    except (RuntimeError, OSError) as exc:  # torch's DistNetworkError and DistStoreError are RuntimeErrors
        text = str(exc)
        if serve and ("EADDRINUSE" in text or "address already in use" in text.lower()):
            raise UsageError(f"MASTER_PORT={port} is in use on {socket.gethostname()} (rank 0's rendezvous "
                             "listens there): set MASTER_PORT to a free port") from None
        if serve:
            raise UsageError(f"rank 0 cannot listen on MASTER_PORT={port} for the rendezvous "
                             f"({text.strip().splitlines()[0]})") from None
        raise UsageError(f"rank {rank} found no rendezvous at MASTER_ADDR={address} MASTER_PORT={port} within "
                         f"{wait:g} s: is rank 0 running, and are MASTER_ADDR and MASTER_PORT rank 0's? (wait: "
                         f"HPCDL_RENDEZVOUS_TIMEOUT)") from None


def store_allgather(store: Any, name: str, rank: int, size: int, value: Any, wait: float) -> list[Any]:
    """Every rank's ``value`` through the store, before any process group exists (collective)."""
    store.set(f"hpcdl/{name}/{rank}", pickle.dumps(value))
    keys = [f"hpcdl/{name}/{r}" for r in range(size)]
    try:
        store.wait(keys, timedelta(seconds=wait))
    except (RuntimeError, OSError):
        arrived = [r for r, key in enumerate(keys) if store.check([key])]
        missing = [r for r in range(size) if r not in arrived]
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise UsageError(f"only {len(arrived)} of {size} ranks reached the rendezvous within {wait:g} s (missing: "
                         f"rank {shown}); check that the launcher started every rank and WORLD_SIZE is theirs "
                         "(wait: HPCDL_RENDEZVOUS_TIMEOUT)") from None
    return [pickle.loads(store.get(key)) for key in keys]


def use_interface_towards(address: str) -> None:
    """Gloo's interface: the one ``--iface`` named, else loopback for a job on one host, else the one this host's
    packets to rank 0's ``address`` leave through."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    if address.startswith("127.") or address == "localhost":
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
        return
    try:
        resolved = socket.gethostbyname(address)
    except OSError:
        return
    interface = interface_towards(resolved)
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def start_group(store: Any, rank: int, size: int, device: torch.device, address: str,
                timeout_seconds: float | None) -> str:
    """init_process_group on ``store`` (collective); returns the backend's name. NCCL's communicators are made
    eagerly, bound to this rank's GPU, once the placement check has passed (hpcdl.runtime.world)."""
    import torch.distributed as dist

    backend = backend_for(device)
    use_interface_towards(address)
    options: dict[str, Any] = {}
    if timeout_seconds:
        options["timeout"] = timedelta(seconds=timeout_seconds)
    if device.type == "cuda":
        options["device_id"] = device
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, **options)
    atexit.register(_destroy)  # before mpi4py finalizes MPI, where there is MPI (atexit runs newest first)
    return backend


def coordination_group(timeout_seconds: float | None) -> Any:
    """A Gloo group of every rank for hpcdl's own coordination (collective), apart from the gradients' group."""
    import torch.distributed as dist

    options: dict[str, Any] = {}
    if timeout_seconds:
        options["timeout"] = timedelta(seconds=timeout_seconds)
    return dist.new_group(backend="gloo", **options)


def loopback_interface() -> str:
    """The loopback interface's name ('lo' on Linux), for a job on one host."""
    return next((name for name, ip in interface_addresses().items() if ip.startswith("127.")), "lo")


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
