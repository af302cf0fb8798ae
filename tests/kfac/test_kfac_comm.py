"""K-FAC's collectives on a single process (the multi-rank side is in test_kfac_mpi.py)."""

from __future__ import annotations

import pytest
import torch

from kfac.comm import SingleProcess, buffer_to_tensors, default_communicator, tensors_to_buffer


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
