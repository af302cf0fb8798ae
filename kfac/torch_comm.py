"""K-FAC's collectives over torch.distributed (Gloo on CPUs, NCCL on GPUs), beside Horovod's in kfac.comm.

Gloo and NCCL require every rank to issue the same collectives on a process group in the same
order. The preconditioner issues its own in a fixed order, but it starts the factor statistics'
allreduces from backward hooks, which interleave with the gradients' (DDP's buckets) in an order
that can differ between ranks (a branch only one rank runs). So K-FAC's collectives never share a
process group with the gradients': even the whole world is a group of its own, and the worker
groups are process groups of their own too (``dist.new_group``), which every rank creates, in the
same order, for every group of a partition, including those it is not in.
:meth:`TorchCommunicator.groups` does so and keeps them for later preconditioners of the job.

Gloo and NCCL gather equal lengths only, so an allgather of members' tensors of different sizes
pads each to the longest, gathers, and slices every member's own length back out. Their alltoall
(``all_to_all_single``) takes uneven splits, as an MPI alltoallv does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from kfac.comm import Communicator, Group, Handle, _SoloGroup

# Process groups by their ranks: created once per job, on every rank, whatever preconditioner asks first.
_PROCESS_GROUPS: dict[tuple[int, ...], Any] = {}


def _process_group(ranks: tuple[int, ...]) -> Any:
    """K-FAC's process group of ``ranks`` (collective on every rank the first time, then kept)."""
    if ranks not in _PROCESS_GROUPS:
        _PROCESS_GROUPS[ranks] = dist.new_group(list(ranks))
    return _PROCESS_GROUPS[ranks]


class _TorchGroup(Group):
    def __init__(self, ranks: Sequence[int], process_group: Any) -> None:
        super().__init__(ranks)
        self._group = process_group

    def allgather_async(self, tensor: Tensor, sizes: Sequence[int], name: str) -> Handle:
        longest = max(sizes, default=0)
        if longest == 0:  # every member knows the sizes: none of them gathers
            return None, [tensor.new_empty(0) for _ in sizes]
        padded = tensor.new_zeros(longest)
        padded[: tensor.numel()] = tensor.reshape(-1)
        parts = [torch.empty_like(padded) for _ in sizes]
        work = dist.all_gather(parts, padded, group=self._group, async_op=True)
        return work, [part[:size] for part, size in zip(parts, sizes, strict=True)]

    def wait_gathered(self, handle: Handle) -> list[Tensor]:
        work, parts = handle
        if work is not None:
            work.wait()
        return parts

    def allreduce_sum_async(self, tensor: Tensor, name: str) -> Handle:
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group, async_op=True), tensor

    def wait_sum(self, handle: Handle) -> Tensor:
        work, tensor = handle
        work.wait()
        return tensor

    def alltoall_async(self, tensor: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                       name: str) -> Handle:
        out = tensor.new_empty(sum(recv_splits))
        work = dist.all_to_all_single(out, tensor.reshape(-1).contiguous(), list(recv_splits), list(send_splits),
                                      group=self._group, async_op=True)
        return work, out

    def wait_alltoall(self, handle: Handle) -> Tensor:
        work, out = handle
        work.wait()
        return out


class TorchCommunicator(Communicator):
    """Collectives over torch.distributed (``init_process_group`` done), on process groups of K-FAC's own.

    Collective: every rank constructs it at the same point (the preconditioner's construction is).
    """

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TorchCommunicator needs torch.distributed.init_process_group first")
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self._world = _process_group(tuple(range(self.size)))

    def allreduce_sum_async(self, tensor: Tensor, name: str) -> Handle:
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._world, async_op=True), tensor

    def wait(self, handle: Handle) -> Tensor:
        work, tensor = handle
        work.wait()
        return tensor

    def groups(self, partition: Sequence[Sequence[int]]) -> Group:
        groups = [tuple(sorted(group)) for group in partition]
        mine = next(group for group in groups if self.rank in group)
        if all(len(group) == 1 for group in groups):
            return _SoloGroup(mine)
        if len(mine) == self.size:
            return _TorchGroup(mine, self._world)
        for group in groups:  # every rank, every group, in the partition's order: new_group is collective
            _process_group(group)
        return _TorchGroup(mine, _PROCESS_GROUPS[mine])
