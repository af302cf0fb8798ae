"""hpcdl.runtime.rendezvous: where rank 0's store is, agreed without the environment; torchrun's refused."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from hpcdl.runtime import rendezvous
from hpcdl.runtime.errors import UsageError


class FakeComm:
    """An mpi4py communicator of ``size`` ranks as seen from ``rank``: rank 0's broadcast value is given."""

    def __init__(self, rank: int = 0, size: int = 1, hosts: list[str] | None = None, from_root: Any = None) -> None:
        self.rank, self.size = rank, size
        self.hosts = hosts or [socket.gethostname()] * size
        self.from_root = from_root

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def allgather(self, value: Any) -> list[Any]:
        return list(self.hosts)

    def bcast(self, value: Any, root: int = 0) -> Any:
        return value if self.rank == root else self.from_root


def test_one_host_meets_on_loopback_at_a_free_port() -> None:
    address, port = rendezvous.agreed_endpoint(FakeComm(size=4), env={})
    assert address == "127.0.0.1" and 1024 <= port < 65536
    with socket.socket() as listener:  # free: rank 0's store can bind it
        listener.bind(("127.0.0.1", port))


def test_other_ranks_take_rank_0s_choice() -> None:
    assert rendezvous.agreed_endpoint(FakeComm(rank=2, size=4, from_root=("10.0.0.1", 29500)), env={}) == \
        ("10.0.0.1", 29500)


def test_master_addr_and_port_win_when_set() -> None:
    env = {"MASTER_ADDR": "node7", "MASTER_PORT": "29400"}
    assert rendezvous.agreed_endpoint(FakeComm(size=2), env=env) == ("node7", 29400)
    with pytest.raises(UsageError, match="MASTER_PORT must be a port number"):
        rendezvous.agreed_endpoint(FakeComm(size=2), env={"MASTER_ADDR": "x", "MASTER_PORT": "http"})


def test_several_hosts_meet_at_an_address_of_rank_0s_interfaces() -> None:
    """A hostname nobody resolves (a virtual node's): one of rank 0's own non-loopback addresses."""
    outside = [a for a in rendezvous.interface_addresses().values() if not a.startswith("127.")]
    if not outside:
        with pytest.raises(UsageError, match="only loopback"):
            rendezvous.root_address(["no-such-host.invalid", "other"], "no-such-host.invalid")
        return
    assert rendezvous.root_address(["no-such-host.invalid", "other"], "no-such-host.invalid") in outside


def test_the_interface_towards_loopback_is_loopback() -> None:
    assert rendezvous.interface_towards("127.0.0.1") == rendezvous.loopback_interface()
    assert rendezvous.interface_addresses()[rendezvous.loopback_interface()].startswith("127.")


def test_torchrun_started_processes_that_mpi_sees_alone_are_refused() -> None:
    with pytest.raises(UsageError, match=r"WORLD_SIZE=4 \(torchrun's\) but MPI sees 1 rank.*mpirun or srun"):
        rendezvous.check_torchrun(0, 1, env={"WORLD_SIZE": "4", "RANK": "0"})
    with pytest.raises(UsageError, match="RANK=1 but MPI calls this process rank 0"):
        rendezvous.check_torchrun(0, 2, env={"WORLD_SIZE": "2", "RANK": "1"})
    rendezvous.check_torchrun(1, 2, env={"WORLD_SIZE": "2", "RANK": "1"})  # the same ranks: fine


def test_gloo_between_cpus_nccl_between_gpus() -> None:
    import torch

    assert rendezvous.backend_for(torch.device("cpu")) == "gloo"
    assert rendezvous.backend_for(torch.device("cuda", 0)) == "nccl"
