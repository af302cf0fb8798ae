"""kfac.torch_comm's collectives against MPI's own (mpi4py), on Gloo.

Run with ``timeout 600 mpiexec -n 4 .venv/bin/python -m pytest --with-mpi -m mpi tests/kfac/test_kfac_torch_comm.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.backends import HOROVOD
from tests.support.mpi_harness import assert_all_ranks

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def comm():
    from hpcdl.runtime import world
    from kfac.torch_comm import TorchCommunicator

    world.init(use_horovod=HOROVOD, torch_distributed=True)
    return TorchCommunicator()


def mpi():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def test_allreduce_sums_like_mpi(comm) -> None:
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        mine = torch.arange(7, dtype=torch.float64).mul(comm.rank + 1).to(dtype)
        want = mpi().allreduce(mine.double().numpy())
        got = comm.wait(comm.allreduce_sum_async(mine.clone(), "x"))
        assert_all_ranks(got.dtype == dtype and np.array_equal(got.double().numpy(), want), f"{dtype}: {got} != {want}")


def test_allgather_of_uneven_lengths_equals_mpi_allgatherv(comm) -> None:
    """Lengths differ by rank, one member sends nothing; every member gets every part, in group order."""
    sizes = [(3 * r + 1) % 5 for r in range(comm.size)]  # rank 1 of 4 (and 3 of 2) send 4, rank 3 of 4: 0
    sizes[-1] = 0
    group = comm.groups([tuple(range(comm.size))])
    mine = torch.arange(sizes[comm.rank], dtype=torch.float32) + 100 * comm.rank
    want = mpi().allgather(mine.numpy())
    got = group.wait_gathered(group.allgather_async(mine, sizes, "y"))
    ok = len(got) == comm.size and all(np.array_equal(g.numpy(), w) for g, w in zip(got, want, strict=True))
    assert_all_ranks(ok, f"{[g.tolist() for g in got]} != {[w.tolist() for w in want]}")


def test_subgroups_gather_only_their_members(comm) -> None:
    """A partition into pairs (every rank creates every pair's group): each rank gets its pair's tensors."""
    if comm.size % 2:
        pytest.skip("needs an even number of ranks")
    pairs = [(r, r + 1) for r in range(0, comm.size, 2)]
    group = comm.groups(pairs)
    mine = torch.full((2,), float(comm.rank))
    got = group.wait_gathered(group.allgather_async(mine, [2, 2], "z"))
    want = [torch.full((2,), float(r)) for r in group.ranks]
    ok = group.ranks == pairs[comm.rank // 2] and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert_all_ranks(ok, f"ranks {group.ranks}: {got}")


def test_nothing_to_gather_is_no_collective(comm) -> None:
    group = comm.groups([tuple(range(comm.size))])
    got = group.wait_gathered(group.allgather_async(torch.empty(0), [0] * comm.size, "none"))
    assert_all_ranks([g.numel() for g in got] == [0] * comm.size)


def test_alltoall_of_uneven_splits_equals_mpi_alltoallv(comm) -> None:
    """Splits differ by pair, some are zero and rank 1 sends nothing at all; bfloat16 too (Gloo's all_to_all)."""
    splits = [[0 if r == 1 else (r + 2 * j) % 3 for j in range(comm.size)] for r in range(comm.size)]
    send, recv = splits[comm.rank], [splits[k][comm.rank] for k in range(comm.size)]
    mine = torch.arange(sum(send), dtype=torch.float64) + 100 * comm.rank
    want = np.zeros(sum(recv))
    mpi().Alltoallv((mine.numpy(), send), (want, recv))
    group = comm.groups([tuple(range(comm.size))])
    problems = []
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        got = group.wait_alltoall(group.alltoall_async(mine.to(dtype), send, recv, "a"))
        if got.dtype != dtype or not torch.equal(got, torch.from_numpy(want).to(dtype)):
            problems.append(f"{dtype}: {got.tolist()} != {want.tolist()}")
    assert_all_ranks(not problems, "; ".join(problems))
