"""The watchdog's heartbeats in a job without MPI (UDP datagrams; hpcdl.runtime.watchdog.UdpHeartbeats), and the
Gloo communicator that job coordinates over (hpcdl.runtime.coordination.GlooComm)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from hpcdl.runtime import coordination
from hpcdl.runtime.watchdog import UdpHeartbeats


class Bcast:
    """Rank ``rank`` of a job on one host whose rank 0's broadcast value is ``box[0]`` (set by rank 0's turn)."""

    def __init__(self, rank: int, box: list[Any]) -> None:
        self.rank, self.box = rank, box

    def Get_rank(self) -> int:
        return self.rank

    def bcast(self, value: Any, root: int = 0) -> Any:
        if self.rank == root:
            self.box.append(value)
        return self.box[0]


def test_heartbeats_reach_rank_0_and_its_answers_reach_the_others() -> None:
    box: list[Any] = []
    root = UdpHeartbeats(Bcast(0, box), ["h", "h", "h"])
    peers = [UdpHeartbeats(Bcast(r, box), ["h", "h", "h"]) for r in (1, 2)]
    assert root.root[0] == "127.0.0.1"  # one host: loopback
    assert root.exchange((0, "starting")) == {}  # nobody has spoken yet
    for r, peer in enumerate(peers, start=1):
        assert peer.exchange((r * 10, "compute")) == {}
    heard: dict[int, Any] = {}
    for _ in range(50):  # datagrams on loopback arrive at once; a loaded machine may take a moment
        heard |= root.exchange((7, "collective"))
        if len(heard) == 2:
            break
        time.sleep(0.05)
    assert heard == {1: (10, "compute"), 2: (20, "compute")}
    answers: dict[int, Any] = {}
    for _ in range(50):
        answers |= peers[0].exchange((11, "data"))
        if answers:
            break
        time.sleep(0.05)
    assert answers == {0: (7, "collective")}


def test_a_silent_peer_costs_nothing() -> None:
    box: list[Any] = []
    root = UdpHeartbeats(Bcast(0, box), ["h", "h"])
    peer = UdpHeartbeats(Bcast(1, box), ["h", "h"])
    peer.exchange((1, "compute"))
    time.sleep(0.1)
    assert root.exchange((1, "compute")) == {1: (1, "compute")}
    peer.sock.close()  # the peer is gone: rank 0's datagrams to it go nowhere, and nothing blocks
    start = time.monotonic()
    for _ in range(5):
        assert root.exchange((2, "collective")) == {}
    assert time.monotonic() - start < 1


def test_the_gloo_communicator_adds_in_rank_order_and_speaks_mpi4pys_words(monkeypatch: pytest.MonkeyPatch) -> None:
    comm = coordination.GlooComm(group=None, rank=1, size=3)
    monkeypatch.setattr(comm, "allgather", lambda value: [np.array([1e16]), value, np.array([-1e16])])
    total = np.empty(1)
    comm.Allreduce(np.array([1.0]), total)
    assert total[0] == (1e16 + 1.0) - 1e16  # rank order, the same bits on every rank
    assert comm.allreduce(np.array([1.0]))[0] == total[0]
    assert comm.gather(5, root=0) is None and comm.Dup() is comm
    assert (comm.Get_rank(), comm.Get_size()) == (1, 3)


def test_one_process_alone_needs_no_group() -> None:
    comm = coordination.GlooComm(group=None, rank=0, size=1)
    assert comm.allgather("x") == ["x"] and comm.bcast(3) == 3 and comm.allreduce(2.5) == 2.5
    comm.Barrier()
