"""Per-node facts and a reachability check between nodes, for ``hpcdl.doctor`` across nodes.

A node that cannot open a TCP connection to the others (a firewall, a wrong interface, a dead
link) makes MPI or Horovod hang at their first collective, with nothing said. So before anything
else starts (no MPI collective, no Horovod): one rank per node listens on the address of the
interface the job uses, the addresses travel to rank 0 and back with point-to-point messages
only (rank 0 must reach everyone in any case), every such rank tries to connect to every other
node, and rank 0 reports the pairs that failed in one line each. Every wait has a deadline.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from hpcdl.launching.cores import usable_cores

TAG = 7021
SIOCGIFADDR = 0x8915
CONNECT_TIMEOUT = 3.0
EXCHANGE_TIMEOUT = 30.0


@dataclass
class NodeFacts:
    host: str
    interface: str
    address: str
    cores: int
    gpus: int
    ranks: list[int] = field(default_factory=list)
    port: int = 0


def interface_addresses() -> dict[str, str]:
    """IPv4 address of every interface that has one (name -> address)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            found[name] = socket.inet_ntoa(raw[20:24])
    return found


def chosen_interface(addresses: dict[str, str], wanted: str | None) -> tuple[str, str]:
    """The (interface, address) the job uses: the first match of ``wanted`` (Open MPI's
    btl_tcp_if_include: names or subnets, comma separated), else the first one that is not loopback."""
    for item in filter(None, (wanted or "").split(",")):
        for name, address in addresses.items():
            if name == item:
                return name, address
            if "/" in item and ipaddress.ip_address(address) in ipaddress.ip_network(item, strict=False):
                return name, address
    for name, address in addresses.items():
        if not address.startswith("127."):
            return name, address
    return "lo", "127.0.0.1"


def my_facts(rank: int) -> NodeFacts:
    wanted = os.environ.get("OMPI_MCA_btl_tcp_if_include") or os.environ.get("HOROVOD_GLOO_IFACE")  # noqa: SIM112 (Open MPI spells it so)
    interface, address = chosen_interface(interface_addresses(), wanted)
    cores = usable_cores()
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        gpus = 0
    return NodeFacts(host=socket.gethostname(), interface=interface, address=address, cores=cores, gpus=gpus,
                     ranks=[rank])


class ExchangeTimeout(RuntimeError):
    pass


def _wait(request, what: str, deadline: float):
    while True:
        done, value = request.test()
        if done:
            return value
        if time.monotonic() > deadline:
            raise ExchangeTimeout(what)
        time.sleep(0.01)


def _to_root(comm, value, deadline: float) -> list | None:
    """Gather to rank 0 by point-to-point only, with a deadline."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank != 0:
        _wait(comm.isend(value, dest=0, tag=TAG), "sending to rank 0", deadline)
        return None
    values = [value]
    for source in range(1, size):
        values.append(_wait(comm.irecv(source=source, tag=TAG), f"hearing from rank {source}", deadline))
    return values


def from_root(comm, value, deadline: float):
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        requests = [comm.isend(value, dest=r, tag=TAG) for r in range(1, size)]
        for r, request in enumerate(requests, 1):
            _wait(request, f"sending to rank {r}", deadline)
        return value
    return _wait(comm.irecv(source=0, tag=TAG), "hearing from rank 0", deadline)


def _accept_all(server: socket.socket, stop: threading.Event) -> None:
    server.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = server.accept()
            conn.close()
        except OSError:
            continue


def check(comm) -> tuple[list[NodeFacts], list[str]]:
    """Every rank calls this. Returns (one NodeFacts per node, one line per failed connection);
    both are complete on rank 0 only. Raises ExchangeTimeout when a rank cannot talk to rank 0."""
    rank = comm.Get_rank()
    facts = my_facts(rank)
    deadline = time.monotonic() + EXCHANGE_TIMEOUT
    everyone = _to_root(comm, facts, deadline)
    nodes: dict[str, NodeFacts] = {}
    if rank == 0:
        assert everyone is not None
        for item in everyone:
            nodes.setdefault(item.host, NodeFacts(item.host, item.interface, item.address, item.cores, item.gpus))
            nodes[item.host].ranks.extend(item.ranks)
    leaders = from_root(comm, {h: n.ranks[0] for h, n in nodes.items()} if rank == 0 else None, deadline)
    leader = leaders.get(facts.host) == rank
    server = None
    stop = threading.Event()
    if leader:
        server = socket.create_server((facts.address, 0))
        facts.port = server.getsockname()[1]
        threading.Thread(target=_accept_all, args=(server, stop), daemon=True).start()
    ports = _to_root(comm, (facts.host, facts.address, facts.port) if leader else None, deadline)
    targets = from_root(comm, [p for p in ports or [] if p is not None] if rank == 0 else None, deadline)
    failures = []
    if leader:
        for host, address, port in targets:
            if host == facts.host:
                continue
            try:
                socket.create_connection((address, port), timeout=CONNECT_TIMEOUT).close()
            except OSError as err:
                reason = "timed out" if isinstance(err, TimeoutError) else (err.strerror or type(err).__name__)
                failures.append(f"node {facts.host} ({facts.address}) cannot reach node {host} ({address}:{port}): "
                                f"{reason}")
    deadline = time.monotonic() + EXCHANGE_TIMEOUT
    gathered = _to_root(comm, failures, deadline)
    from_root(comm, None, deadline)  # everyone has tried before any listener closes
    stop.set()
    if server is not None:
        server.close()
    lines = [line for part in gathered or [] for line in part]
    return list(nodes.values()), lines
