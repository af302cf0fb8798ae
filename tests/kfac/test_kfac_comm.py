"""K-FAC's collectives on a single process (the multi-rank side is in test_kfac_mpi.py)."""

from __future__ import annotations

import random

import pytest
import torch

from kfac.comm import SingleProcess, buffer_to_tensors, chunk_overlaps, default_communicator, tensors_to_buffer


def test_without_an_initialised_horovod_job_there_is_nothing_to_communicate() -> None:
    comm = default_communicator()
    assert isinstance(comm, SingleProcess) and (comm.rank, comm.size) == (0, 1)
    t = torch.arange(3.0)
    assert comm.wait(comm.allreduce_sum_async(t, "x")) is t
    group = comm.groups([(0,)])
    parts = group.wait_gathered(group.allgather_async(t, [3], "y"))
    assert len(parts) == 1 and parts[0].tolist() == [0.0, 1.0, 2.0]


def test_buffers_round_trip_several_tensors() -> None:
    tensors = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1)]
    buffer = tensors_to_buffer(tensors, torch.float64, torch.device("cpu"))
    assert buffer.dtype == torch.float64 and buffer.numel() == 11
    for got, want in zip(buffer_to_tensors(buffer, [t.shape for t in tensors]), tensors, strict=False):
        torch.testing.assert_close(got.float(), want)
    assert tensors_to_buffer([], torch.float32, torch.device("cpu")).numel() == 0
    with pytest.raises(ValueError, match="buffer holds"):
        buffer_to_tensors(buffer, [(2, 2)])


def _overlaps_by_slicing(sizes: list[int]) -> tuple[list[list[int]], int]:
    """The reference: number every element of the concatenated parts, pad to W equal chunks, and count which
    member's elements land in which chunk."""
    width, total = len(sizes), sum(sizes)
    chunk = -(-total // width)
    padding = torch.full((width * chunk - total,), -1)
    owner = torch.cat([torch.full((n,), member) for member, n in enumerate(sizes)] + [padding])
    chunks = owner.split(chunk) if chunk else [owner] * width
    return [[int((piece == member).sum()) for piece in chunks] for member in range(width)], chunk


def test_chunk_overlaps_cut_the_parts_as_slicing_does() -> None:
    generator = random.Random(0)
    cases = [[0], [5], [0, 0, 0], [1, 0, 0, 0], [0, 0, 3], [7, 0, 2, 0, 9], [3, 3, 3, 3], [1, 1], [2, 0, 0, 0, 0, 0, 0]]
    for _ in range(300):
        width = generator.randint(1, 9)
        cases.append([generator.choice([0, 0, 1, 2, generator.randint(0, 40)]) for _ in range(width)])
    for sizes in cases:
        overlaps, chunk = chunk_overlaps(sizes)
        assert (overlaps, chunk) == _overlaps_by_slicing(sizes), sizes
        assert [sum(row) for row in overlaps] == sizes  # every member sends its whole part
        assert all(sum(column) <= chunk for column in zip(*overlaps, strict=True))  # no chunk overflows


def test_a_group_of_one_exchanges_with_itself() -> None:
    group = SingleProcess().groups([(0,)])
    t = torch.arange(4, dtype=torch.bfloat16)
    assert torch.equal(group.wait_alltoall(group.alltoall_async(t, [4], [4], "x")), t)
